"""Slot ``peft``: LoRA adapters through peft when the config has a ``peft:`` section (implementation ``lora``).

Under pipeline parallelism the slot adapts each stage on its own: the targets are resolved against the whole model
the stage was cut from (so each stage adapts exactly the layers one process would, and every stage's
``adapter_config.json`` names all of them), and the stage is wrapped in peft's plain ``PeftModel``, whose forward
passes the pipeline's arguments through. Parameter names are the one model's, so checkpoints and the adapter export
merge the stages' adapters under the names peft expects.
"""

from __future__ import annotations

import importlib.util

import torch

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.hf import apply_lora, lora_config, memory_efficient, skipped_note
from automodel.lora_targets import all_linear_targets
from automodel.training.context import BuildContext
from automodel.training.parallel.pipeline_stages import PipelineStageModel


def select(cfg: Config) -> tuple[str, str] | None:
    return ("lora", "peft") if cfg.peft is not None else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    if cfg.peft is not None and importlib.util.find_spec("peft") is None:
        return [ConfigIssue("peft", "LoRA needs the peft package, which is not installed: pip install peft")]
    return []


def notes(cfg: Config) -> list[str]:
    """The run-start note that upstream's ``peft.use_triton: true`` governs nothing here."""
    node = cfg.peft
    if node is None or not (node.to_dict() if hasattr(node, "to_dict") else {}).get("use_triton"):
        return []
    return ["note: peft.use_triton: true governs nothing: upstream's Triton LoRA kernels (CUDA) are not part of this "
            "build; peft's LoRA layers compute the same adapters (upstream too sets it aside for DoRA and Transformer "
            "Engine layers)"]


def add_lora(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Wrap the model (or one pipeline stage of it) with LoRA adapters as ``peft:`` says; only adapter weights
    train."""
    built = ctx.instantiate("peft")
    whole = model.whole_model if isinstance(model, PipelineStageModel) else None
    if whole is None:
        config = lora_config(built, model)
        wrapped, line = apply_lora(model, config, memory_efficient=memory_efficient(built))
        return wrapped, line + skipped_note(built)
    config = all_linear_targets(lora_config(built, whole), whole)
    config.base_model_name_or_path = getattr(whole, "name_or_path", None) or None
    try:
        wrapped, line = apply_lora(model, config, f" (pipeline stage {model.index})",
                                   memory_efficient=memory_efficient(built), plain=True)
        return wrapped, line + skipped_note(built)
    except AutomodelError as err:
        layers = model.layer_range
        raise AutomodelError(f"{err} (pipeline stage {model.index} holds layers {layers.start}-{layers.stop - 1}: "
                             "under pipeline parallelism every stage needs a module LoRA adapts; widen "
                             "peft.target_modules or set distributed.pp_size: 1)") from None
