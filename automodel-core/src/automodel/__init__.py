"""automodel: train PyTorch / Hugging Face models from YAML recipes.

``from automodel import hookimpl, BaseRecipe`` imports no torch; the training engine (``TrainRecipe``) is
imported on first use.
"""

from importlib import metadata
from typing import Any

from automodel.plugins.markers import hookimpl
from automodel.recipe import BaseRecipe

try:  # pyproject.toml is the one place the version is written; the installed metadata carries it
    __version__ = metadata.version("automodel-core")
except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
__all__ = ["BaseRecipe", "TrainRecipe", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "TrainRecipe":
        from automodel.training.recipe import TrainRecipe

        return TrainRecipe
    raise AttributeError(f"module 'automodel' has no attribute '{name}'")
