"""Small helpers every domain's model entry points share: dtype names and "does this folder hold weights"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.errors import AutomodelError

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")

# ``from_pretrained`` keyword arguments that say how to fetch a model (a token among them), never what the model is.
# A constructor must not copy them into the model's config, where ``save_pretrained`` would write them.
HUB_ARGUMENTS = ("token", "use_auth_token", "cache_dir", "revision", "local_files_only", "force_download",
                 "proxies", "subfolder", "resume_download", "trust_remote_code")


def pop_hub_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the hub arguments in ``kwargs``: they go to ``AutoConfig.from_pretrained`` (a hub name or
    directory) and nowhere else; a config file or mapping has nothing to fetch."""
    return {name: kwargs.pop(name) for name in HUB_ARGUMENTS if name in kwargs}


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
