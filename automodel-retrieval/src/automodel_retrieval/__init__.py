"""automodel retrieval domain: bi-encoders, cross-encoders and hard-negative mining.

Importing the package is light (no torch): the public names below load their modules on first use, so that
``automodel --help`` and route listing stay fast and config targets such as
``automodel_retrieval.BiEncoder.from_config`` resolve.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

try:  # pyproject.toml is the one place the version is written; the installed metadata carries it
    __version__ = metadata.version("automodel-retrieval")
except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "BiEncoder": "automodel_retrieval.models",
    "CrossEncoder": "automodel_retrieval.models",
    "pool": "automodel_retrieval.models",
    "RetrievalDataset": "automodel_retrieval.data",
    "InfoNCELoss": "automodel_retrieval.losses",
    "ListwiseCrossEntropy": "automodel_retrieval.losses",
    "BiEncoderRecipe": "automodel_retrieval.recipe",
    "CrossEncoderRecipe": "automodel_retrieval.recipe",
    "MineHardNegativesRecipe": "automodel_retrieval.mining",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'automodel_retrieval' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
