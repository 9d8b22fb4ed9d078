"""Which config keys hold secrets, and masking them (and credentials inside URLs) before a config is printed,
saved or handed to a metric backend.

A key is split into words (``hfAuthToken`` and ``hf_auth_token`` both give ``hf auth token``). It holds a secret
when it names a password, passphrase, secret, credential or authorization (``db_password``, ``client_secret``,
``hf_auth``), a token (``token``, ``hf_token``; not a tokenizer, a special token like ``pad_token``, an id or a
count of tokens), or a key that is a credential (``api_key``, ``private_key``, ``access_key_id``, ``wandb_key``;
not a field name like ``caption_key`` nor a model dimension like ``num_key_value_heads``).
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

_ALWAYS = re.compile(r"passw|passphrase|secret|credential|authori[sz]|authent|apikey|privatekey|accesskey|secretkey|"
                     r"authtoken")
_SECRET_WORDS = {"pwd", "auth", "token", "cookie", "bearer"}
# A key that mentions a token but is not a secret: tokenizers, special tokens, token ids and counts, weights.
_NOT_A_TOKEN_SECRET = re.compile(
    r"tokeniz|^(add_)?(pad|bos|eos|unk|sep|cls|mask|image|video|audio|start|end|stop)_tokens?$|(^|_)token_ids?(_|$)|_ids?$|"
    r"(^|_)(max|min|num|n)_.*tokens?|tokens?_(per|count|len|loss|weight)|^tokens$|new_tokens|token_len|"
    r"special_tokens?"
)
# Words before `key` that make it a field or column name, not a credential (`caption_key`, `sort_key`).
_FIELD_WORDS = {"caption", "image", "text", "label", "labels", "input", "output", "weight", "loader", "config",
                "sort", "column", "field", "answer", "question", "context", "query", "document", "doc", "video",
                "audio", "prompt", "completion", "target", "metric", "monitor", "group", "primary", "foreign",
                "cache", "dict", "map", "name", "data", "batch", "sample", "feature", "value", "hash", "split",
                "attention", "mask", "message", "messages", "role", "content", "conversation", "id", "index",
                "state", "checkpoint", "model", "module", "param", "result", "score", "reward", "time", "sequence"}
_URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<password>[^@/\s]+)(?=@)")


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def _credential_key(words: list[str]) -> bool:
    """``api_key``, ``private_key``, ``access_key_id``, ``wandb_key``: a last word ``key`` (or ``key id``) named
    after a service or a kind of credential, not after a field."""
    if words[-2:] == ["key", "id"] or words[-2:] == ["key", "ids"]:
        words = words[:-1]
    return len(words) >= 2 and words[-1] == "key" and words[-2] not in _FIELD_WORDS


def is_secret_key(key: str) -> bool:
    words = _words(key)
    if not words:
        return False
    joined = "".join(words)
    if _ALWAYS.search(joined) or _credential_key(words):
        return True
    if not _SECRET_WORDS.intersection(words):
        return False
    return "token" not in words or not _NOT_A_TOKEN_SECRET.search("_".join(words))


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${") and value.endswith("}")


def mask_url_credentials(text: str) -> str:
    """``https://user:pass@host/x`` -> ``https://user:***@host/x`` (a ``${VAR}`` password is kept)."""
    return _URL_CREDENTIALS.sub(lambda m: m.group(0) if _is_placeholder(m.group("password"))
                                else m.group("head") + MASK, text)


def mask_secrets(data: Any) -> Any:
    """A copy with every secret-looking key's value replaced by ``***`` and passwords in URLs masked; ``${X}``
    placeholders are kept as written (they say where the secret comes from, not what it is)."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if is_secret_key(str(k)) and not isinstance(v, (dict, bool)) and v is not None:
                out[k] = v if _is_placeholder(v) else MASK
            else:
                out[k] = mask_secrets(v)
        return out
    if isinstance(data, list):
        return [mask_secrets(v) for v in data]
    if isinstance(data, str):
        return mask_url_credentials(data)
    return data
