"""automodel: train PyTorch / Hugging Face models from YAML recipes.

``from automodel import hookimpl, BaseRecipe`` imports no torch; the training engine (``TrainRecipe``) is
imported on first use.
"""

from typing import Any

from automodel.plugins.markers import hookimpl
from automodel.recipe import BaseRecipe

__version__ = "0.1.0"
__all__ = ["BaseRecipe", "TrainRecipe", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "TrainRecipe":
        from automodel.training.recipe import TrainRecipe

        return TrainRecipe
    raise AttributeError(f"module 'automodel' has no attribute '{name}'")
