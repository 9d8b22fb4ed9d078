"""Slot ``compile``: ``torch.compile`` of the whole model (``compile.enabled``), of each transformer block in place
(``distributed.enable_compile``, upstream's per-layer compile) or of each block's attention module in place
(``model.backend.compile_attn``, upstream's: one graph, ``fullgraph``, fixed shapes); the eager model stays
reachable for saving.

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
from automodel.model_backend import backend_setting
from automodel.training.context import BuildContext
from automodel.training.parallel.blocks import attention_modules, transformer_blocks
from automodel.training.parallel.multimodal_fsdp import multimodal_modules
from automodel.training.sections import CompileConfig


def select(cfg: Config) -> tuple[str, str] | None:
    asked = _asked(cfg)
    return ("torch", asked[0]) if asked else None


def _asked(cfg: Config) -> list[str]:
    """The keys asking for a compile, in the order they are tried."""
    return [key for key, on in (("compile.enabled", cfg.compile is not None and cfg.compile.enabled),
                                ("distributed.enable_compile", per_block(cfg)),
                                ("model.backend.compile_attn", per_attention(cfg))) if on]


def per_block(cfg: Config) -> bool:
    """``distributed.enable_compile``: each transformer block is compiled, not the whole model."""
    return cfg.distributed is not None and cfg.distributed.enable_compile


def per_attention(cfg: Config) -> bool:
    """``model.backend.compile_attn``: each transformer block's attention module is compiled."""
    return backend_setting(cfg.model, "compile_attn") is True


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    found = []
    asked = _asked(cfg)
    if len(asked) > 1:
        found.append(ConfigIssue(asked[1], f"true compiles {_WHAT[asked[1]]} and {asked[0]}: true {_WHAT[asked[0]]}; "
                                 "a model is compiled one way: set one of them false (compile:'s backend and mode "
                                 "apply to any)"))
    tp = cfg.distributed.tp_size if cfg.distributed is not None else 1
    if asked[:1] == ["compile.enabled"] and tp > 1:
        found.append(ConfigIssue("compile.enabled", f"true with tp_size {tp}: torch.compile of the whole "
                                 "tensor-parallel model stops in dynamo (mixed fake tensor modes); compile each "
                                 "transformer block instead (distributed.enable_compile: true, compile:'s backend and "
                                 "mode apply) or set it false"))
    options = cfg.compile if cfg.compile is not None else CompileConfig()
    if select(cfg) is None or (options.backend or "inductor") != "inductor" or torch.cuda.is_available():
        return found
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return found
    return found + [ConfigIssue("compile.backend", "inductor on CPU needs a C++ compiler (gcc/clang) on PATH; "
                                                   "install one or use backend: aot_eager")]


_WHAT = {"compile.enabled": "the whole model", "distributed.enable_compile": "each transformer block",
         "model.backend.compile_attn": "each block's attention module"}


def compile_model(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``torch.compile`` with the configured backend and mode: the whole model, or each block in place."""
    options = ctx.cfg.compile if ctx.cfg.compile is not None else CompileConfig()
    kwargs = {"backend": options.backend or "inductor", "mode": options.mode, "fullgraph": options.fullgraph,
              "dynamic": options.dynamic}
    how = f"backend={kwargs['backend']} mode={options.mode or 'default'}"
    if per_attention(ctx.cfg):
        return model, _compile_attention(model, kwargs["backend"], options.mode)
    if not per_block(ctx.cfg):
        return torch.compile(model, **kwargs), f"torch.compile {how}"
    blocks = transformer_blocks(model, multimodal_modules(model, ctx.multimodal_names).values())  # the LM's
    if not blocks:
        raise AutomodelError(f"distributed.enable_compile: {type(model).__name__} has no repeated transformer blocks "
                             "(a ModuleList of layers of one type) to compile one by one; compile the whole model "
                             "with compile.enabled: true and set this false")
    for block in blocks:
        block.compile(**kwargs)
    return model, f"torch.compile of each of {len(blocks)} transformer blocks, in place, {how}"


def _compile_attention(model: torch.nn.Module, backend: str, mode: str | None) -> str:
    """Upstream's ``compile_attn``: each attention module's forward as one graph (``fullgraph``, shapes fixed)."""
    modules = attention_modules(model)
    if not modules:
        raise AutomodelError(f"model.backend.compile_attn: found no attention module in the transformer blocks of "
                             f"{type(model).__name__}; set it false")
    for module in modules:
        module.compile(backend=backend, mode=mode, fullgraph=True, dynamic=False)
    return (f"torch.compile of each of {len(modules)} attention modules ({type(modules[0]).__name__}), in place, "
            f"fullgraph, backend={backend} mode={mode or 'default'}")
