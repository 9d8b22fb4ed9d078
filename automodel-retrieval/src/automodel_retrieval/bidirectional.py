"""Bidirectional attention for decoder-only backbones (Llama, Qwen3, Mistral, ...) used as retrieval encoders.

transformers 5 makes a decoder's attention bidirectional when its config says ``is_causal: false``: the mask
builder then gives every token every other real token, and the attention kernels run without their causal flag.
The setting lives in the config, so a saved encoder's ``config.json`` carries it and ``AutoModel`` /
sentence-transformers load the same bidirectional model, no custom class or remote code needed.

Encoders (BERT, ...) attend both ways already: asking for bidirectional leaves them unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from automodel.errors import AutomodelError
from automodel.training.modules import is_decoder


def is_bidirectional(model: nn.Module) -> bool:
    """Whether ``model`` attends both ways: an encoder, or a decoder whose config says ``is_causal: false``."""
    return not is_decoder(model) or getattr(model.config, "is_causal", True) is False


def set_bidirectional(model: Any, bidirectional: bool | None, key: str = "model.bidirectional") -> Any:
    """``bidirectional``: true makes a decoder's attention bidirectional (``config.is_causal = False``), false makes
    it causal again; None keeps what the checkpoint's config says. Returns ``model``."""
    if bidirectional is None:
        return model
    if not isinstance(bidirectional, bool):
        raise AutomodelError(f"{key}: expected true or false, found {bidirectional!r}")
    if is_decoder(model):
        model.config.is_causal = not bidirectional
    elif not bidirectional:
        raise AutomodelError(f"{key}: false, but {type(model).__name__} is an encoder whose attention is always "
                             "bidirectional; remove the key")
    return model


# ---- upstream's own bidirectional model types --------------------------------------------------------------------

# Upstream saves its bidirectional backbones under model types of its own, with remote code on the hub (e.g.
# nvidia/llama-embed-nemotron-8b): each is the transformers model of the base type, attending both ways, so it
# loads here as that model with ``is_causal: false``, without the remote code.
UPSTREAM_TYPES = {"llama_bidirec": "llama", "ministral3_bidirec": "ministral3"}
_UPSTREAM_KEYS = ("model_type", "architectures", "auto_map", "pooling", "temperature")


def upstream_checkpoint(source: str, **hub: Any) -> tuple[Any, dict[str, Any]] | None:
    """For a checkpoint (directory or hub name) whose config.json says one of upstream's bidirectional model types:
    the base type's transformers config with ``is_causal: false``, and upstream's own keys (``architectures``,
    ``pooling``, ``temperature``). None for any other checkpoint."""
    import json

    from transformers import AutoConfig
    from transformers.utils import cached_file

    try:
        file = cached_file(source, "config.json", _raise_exceptions_for_missing_entries=False, **hub)
    except (OSError, ValueError):
        return None
    if file is None:
        return None
    with open(file, encoding="utf-8") as handle:
        data = json.load(handle)
    base = UPSTREAM_TYPES.get(data.get("model_type")) if isinstance(data, dict) else None
    if base is None:
        return None
    config = AutoConfig.for_model(base, **{k: v for k, v in data.items() if k not in _UPSTREAM_KEYS})
    config.is_causal = False
    return config, {k: data[k] for k in _UPSTREAM_KEYS if k in data}


def upstream_checkpoint_config(source: str, **hub: Any) -> Any | None:
    """The transformers config of :func:`upstream_checkpoint` (None for any other checkpoint)."""
    found = upstream_checkpoint(source, **hub)
    return None if found is None else found[0]
