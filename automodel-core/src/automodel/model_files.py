"""Small helpers every domain's model entry points share: dtype names and "does this folder hold weights"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def parse_dtype(value: Any, key: str = "model.dtype") -> Any:
    """``"bfloat16"`` / ``"torch.float16"`` -> the torch dtype; None, ``"auto"`` and dtypes pass through."""
    if value is None or value == "auto" or not isinstance(value, str):
        return value
    import torch

    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise AutomodelError(f"{key}: '{value}' is not a torch dtype (float32, bfloat16, float16)")
    return dtype


def has_weights(directory: str | Path) -> bool:
    """Whether a local directory holds weight files (else it is a config-only, freshly initialised model)."""
    directory = Path(directory)
    return directory.is_dir() and any(any(directory.glob(p)) for p in WEIGHT_PATTERNS)
