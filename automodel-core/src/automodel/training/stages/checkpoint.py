"""Slot ``checkpoint``: the model weights of ``restore_from.path`` (optimizer, data and RNG follow once built)."""

from __future__ import annotations

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.model_init import on_meta


def select(cfg: Config) -> tuple[str, str] | None:
    return ("restore", "restore_from.path") if cfg.restore_from is not None and cfg.restore_from.path else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    return []  # a missing checkpoint is reported when setup resolves the path, before anything is built


def restore_checkpoint(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Load ``<restore path>/model`` through the recipe's own reader (adapters, renamed keys, pipelines); a model
    still on the meta device reads it when it is materialised (training/model_init.py), each rank its slices."""
    if on_meta(model):
        return model, f"model weights from {ctx.restore_path}, read when the model is materialised"
    ctx.load_model_weights(model, ctx.restore_path / "model")
    return model, f"model weights from {ctx.restore_path}"
