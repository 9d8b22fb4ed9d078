"""Slot ``compile``: ``torch.compile`` of the whole model (``compile.enabled``) or of each transformer block in place
(``distributed.enable_compile``, upstream's per-layer compile); the eager model stays reachable for saving.

Per-block compile runs here, after activation checkpointing and sharding, as upstream's does: each block is
compiled as it stands, its checkpoint wrapper included (torch traces the checkpoint, so backward recomputes what
the compiled forward discarded) and its FSDP2 hooks outside the graph (dynamo skips them). ``Module.compile`` keeps
the block where it is, so parameter and ``state_dict`` names are unchanged (no ``_orig_mod.`` part). The
``compile:`` section's backend, mode, fullgraph and dynamic apply to either form.
"""

from __future__ import annotations

import shutil

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.parallel.blocks import transformer_blocks
from automodel.training.sections import CompileConfig


def select(cfg: Config) -> tuple[str, str] | None:
    if cfg.compile is not None and cfg.compile.enabled:
        return ("torch", "compile.enabled")
    if per_block(cfg):
        return ("torch", "distributed.enable_compile")
    return None


def per_block(cfg: Config) -> bool:
    """``distributed.enable_compile``: each transformer block is compiled, not the whole model."""
    return cfg.distributed is not None and cfg.distributed.enable_compile


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    found = []
    if per_block(cfg) and cfg.compile is not None and cfg.compile.enabled:
        found.append(ConfigIssue("distributed.enable_compile", "true compiles each transformer block and "
                                 "compile.enabled: true the whole model; a model is compiled one way: set one of them "
                                 "false (compile:'s backend, mode, fullgraph and dynamic apply to either)"))
    tp = cfg.distributed.tp_size if cfg.distributed is not None else 1
    if select(cfg) is not None and tp > 1:
        found.append(ConfigIssue(select(cfg)[1], f"true with tp_size {tp}: torch.compile over tensor-parallel "
                                 "(DTensor) weights does not train right here (each block compiled: other losses "
                                 "than eager ones from the second step; the whole model: dynamo stops on mixed fake "
                                 "tensor modes), so the two are not combined; set it false or tp_size 1"))
    options = cfg.compile if cfg.compile is not None else CompileConfig()
    if select(cfg) is None or (options.backend or "inductor") != "inductor" or torch.cuda.is_available():
        return found
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return found
    return found + [ConfigIssue("compile.backend", "inductor on CPU needs a C++ compiler (gcc/clang) on PATH; "
                                                   "install one or use backend: aot_eager")]


def compile_model(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``torch.compile`` with the configured backend and mode: the whole model, or each block in place."""
    options = ctx.cfg.compile if ctx.cfg.compile is not None else CompileConfig()
    kwargs = {"backend": options.backend or "inductor", "mode": options.mode, "fullgraph": options.fullgraph,
              "dynamic": options.dynamic}
    how = f"backend={kwargs['backend']} mode={options.mode or 'default'}"
    if not per_block(ctx.cfg):
        return torch.compile(model, **kwargs), f"torch.compile {how}"
    blocks = transformer_blocks(model)
    if not blocks:
        raise AutomodelError(f"distributed.enable_compile: {type(model).__name__} has no repeated transformer blocks "
                             "(a ModuleList of layers of one type) to compile one by one; compile the whole model "
                             "with compile.enabled: true and set this false")
    for block in blocks:
        block.compile(**kwargs)
    return model, f"torch.compile of each of {len(blocks)} transformer blocks, in place, {how}"
