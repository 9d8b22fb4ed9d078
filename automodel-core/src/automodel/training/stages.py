"""The core's implementations of pipeline slots: checkpoint restore, parameter freezing, device placement."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def restore_checkpoint(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    """Load the model weights of ``restore_from.path`` (optimizer, data and RNG follow once they are built)."""
    path = recipe.checkpointer.resolve(recipe.cfg.restore_from.path)
    recipe.restore_path = path
    recipe.load_model_weights(model, path / "model")
    return f"model weights from {path}"


def freeze_parameters(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    """Freeze parameters matching ``freeze.patterns`` (and embeddings), except ``freeze.unfreeze_modules``."""
    cfg = recipe.cfg.freeze
    patterns = list(cfg.patterns)
    if cfg.embeddings and hasattr(model, "get_input_embeddings"):
        embeddings = model.get_input_embeddings()
        names = {f"{name}.weight" for name, module in model.named_modules() if module is embeddings}
        patterns += sorted(names)
    frozen = 0
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatch(name, p) for p in patterns) and not any(
                fnmatch.fnmatch(name, u) or name.startswith(u + ".") for u in cfg.unfreeze_modules):
            param.requires_grad_(False)
            frozen += 1
    total = sum(1 for _ in model.parameters())
    return f"froze {frozen} of {total} parameter tensors"


def place_on_device(recipe: TrainRecipe, model: torch.nn.Module) -> str:
    model.to(recipe.device)
    return f"model on {recipe.device}"
