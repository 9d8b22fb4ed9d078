"""Slot ``peft``: LoRA adapters through peft when the config has a ``peft:`` section (implementation ``lora``)."""

from __future__ import annotations

import importlib.util

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.hf import apply_lora, lora_config, memory_efficient
from automodel.training.context import BuildContext


def select(cfg: Config) -> tuple[str, str] | None:
    return ("lora", "peft") if cfg.peft is not None else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    if cfg.peft is not None and importlib.util.find_spec("peft") is None:
        return [ConfigIssue("peft", "LoRA needs the peft package, which is not installed: pip install peft")]
    return []


def add_lora(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Wrap the model with LoRA adapters as ``peft:`` says; only adapter weights train."""
    built = ctx.instantiate("peft")
    return apply_lora(model, lora_config(built, model), memory_efficient=memory_efficient(built))
