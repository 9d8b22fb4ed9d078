"""Which config keys hold secrets, and masking them before a config is printed or saved."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

_SECRET = re.compile(r"password|passwd|api_?key|secret|authorization|credential|token", re.IGNORECASE)
# Keys that mention tokens but are not secrets: tokenizers, special tokens and counts of tokens. A bare `token`
# is a secret (the Hugging Face Hub argument ``from_pretrained(token=...)``).
_NOT_SECRET = re.compile(
    r"tokeniz|^(pad|bos|eos|unk|sep|cls|mask|image|video|audio|start|end)_token|_token_ids?$|_ids?$|"
    r"(^|_)(max|min|num|n)_.*tokens?|tokens?_(per|count|len)|^tokens$|new_tokens|token_len|special_tokens?",
    re.IGNORECASE,
)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET.search(key)) and not _NOT_SECRET.search(key)


def mask_secrets(data: Any) -> Any:
    """A copy with every secret-looking key's value replaced by ``***`` (placeholders like ``${X}`` are kept)."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if is_secret_key(str(k)) and not isinstance(v, dict) and v is not None:
                out[k] = v if isinstance(v, str) and v.startswith("${") and v.endswith("}") else MASK
            else:
                out[k] = mask_secrets(v)
        return out
    if isinstance(data, list):
        return [mask_secrets(v) for v in data]
    return data
