"""Slot ``device``: the model onto the run's device (always acts)."""

from __future__ import annotations

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext


def select(cfg: Config) -> tuple[str, str] | None:
    return ("single", "dist_env")


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    return []


def place_on_device(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    model.to(ctx.device)
    return model, f"model on {ctx.device}"
