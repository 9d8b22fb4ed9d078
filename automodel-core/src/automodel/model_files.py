"""What every domain's model entry points share: dtype names, "does this folder hold weights", and loading a
transformers Auto class from a checkpoint or a config. Torch and transformers are imported on first use."""

from __future__ import annotations

from collections.abc import Callable
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


# Keyword arguments of a model's construction, not of its config (``from_config`` passes them to the Auto class).
MODEL_KWARGS = ("attn_implementation", "trust_remote_code")


def pretrained_or_fresh(auto_class: Any, path: str | None, dtype: Any, from_config: Callable[..., Any],
                        kwargs: dict[str, Any], errors: tuple[type[Exception], ...] = (OSError,),
                        what: str = "") -> Any:
    """``auto_class.from_pretrained(path)``; a local directory holding only config.json gives a fresh, randomly
    initialised model of that architecture (``from_config``). Errors name the config key."""
    if not path:
        raise AutomodelError("model.pretrained_model_name_or_path: missing (a hub name or a local directory)")
    local = Path(str(path))
    if local.is_dir() and (local / "config.json").is_file() and not has_weights(local):
        return from_config(str(local), dtype=dtype, **kwargs)
    try:
        return auto_class.from_pretrained(str(path), dtype=parse_dtype(dtype), **kwargs)
    except errors as err:
        raise AutomodelError(f"model: cannot load '{path}'{what}: {err}") from None


def fresh_model(build: Callable[..., Any], hf_config: Any, model_kwargs: dict[str, Any], dtype: Any,
                seed: int | None) -> Any:
    """``build(hf_config, **model_kwargs)`` (an Auto class's ``from_config``) after seeding torch with ``seed``
    (a reproducible initialisation), cast to ``dtype`` when one is given."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    model = build(hf_config, **model_kwargs)
    chosen = parse_dtype(dtype)
    return model.to(chosen) if isinstance(chosen, torch.dtype) else model
