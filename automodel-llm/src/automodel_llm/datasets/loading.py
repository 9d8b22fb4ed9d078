"""Loading tokenizers by name or path (data rows come from :func:`automodel.data.load_rows`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.data import load_rows
from automodel.errors import AutomodelError


def missing_local_path(name_or_path: Any) -> bool:
    """A value that is clearly a local path (absolute, ./ ../ ~, or a file name) and does not exist.

    Without this, transformers reports a missing directory as an invalid hub repository id.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        return False
    path = Path(name_or_path).expanduser()
    local = path.is_absolute() or name_or_path.startswith(("./", "../", "~")) or path.suffix in (".json", ".yaml")
    return local and not path.exists()


def load_tokenizer(name_or_path: str, key: str) -> Any:
    from transformers import AutoTokenizer

    if missing_local_path(str(name_or_path)):
        raise AutomodelError(f"{key}: '{name_or_path}' does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    except Exception as err:  # noqa: BLE001 - transformers raises OSError/ValueError/... for a bad path
        raise AutomodelError(f"{key}: cannot load a tokenizer from '{name_or_path}': {err}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


__all__ = ["load_rows", "load_tokenizer", "missing_local_path"]
