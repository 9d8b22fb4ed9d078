"""Slot ``checkpoint``: the weights of a checkpoint whose model/ a recipe wrote in its own layout.

It acts whenever a checkpoint is resumed (``TrainRecipe.runtime_selection``). The engine's own weights (the
Hugging Face ``model/`` or ``model_shards/``) are read after the pipeline instead, each rank only its slices of
the sharded model (``state.restore_weights``); optimizer, data and RNG follow once they are built.
"""

from __future__ import annotations

import torch

from automodel.config import Config
from automodel.errors import ConfigIssue
from automodel.training.context import BuildContext
from automodel.training.model_init import on_meta
from automodel.training.trainer_state import read_trainer_state


def select(cfg: Config) -> tuple[str, str] | None:
    return ("restore", "restore_from.path") if cfg.restore_from is not None and cfg.restore_from.path else None


def issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    return []  # a missing checkpoint is reported when setup resolves the path, before anything is built


def restore_checkpoint(ctx: BuildContext, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """Load ``<restore path>/model`` through the recipe's own reader when the recipe wrote it (adapters, renamed
    keys, pipelines); a model still on the meta device reads it when it is materialised (training/model_init.py),
    each rank its slices. The engine's own layouts are restored with the rest of the state (training/state.py)."""
    if read_trainer_state(ctx.restore_path)["weights"] != "recipe":
        return model, f"model weights from {ctx.restore_path}, each rank its own slices once the model is sharded"
    if on_meta(model):
        return model, f"model weights from {ctx.restore_path}, read when the model is materialised"
    ctx.load_model_weights(model, ctx.restore_path / "model")
    return model, f"model weights from {ctx.restore_path}"
