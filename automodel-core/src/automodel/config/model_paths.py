"""Where a config says a model, tokenizer or processor comes from: a local path that exists or a Hugging Face hub
id. Anything else (upstream's ``<your_path>`` and ``/path/to/...`` placeholders, a folder that is not there) fails
when the run loads it, after the launch; validation names it first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from automodel.errors import ConfigIssue

# keys the loaders (transformers, diffusers, sentence-transformers, peft) read a model's location from (not a
# config's ``name_or_path``, the name it records)
MODEL_PATH_KEYS = ("pretrained_model_name_or_path", "model_name_or_path", "model_id", "model_path")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is spelled as a hub repository id (``name`` or ``organisation/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def missing_location(value: Any) -> bool:
    """Whether ``value``, a model / tokenizer location, names nothing that can be loaded: not an existing path, and
    either spelled as a local one (absolute, ``./``, ``../``, ``~``, a ``.json`` / ``.yaml`` file name) or not as a
    hub id. transformers would report such a value as an invalid hub repository id. A URL (``scheme://...``) is
    left to its loader."""
    if not isinstance(value, str) or not value or "://" in value:
        return False
    path = Path(value).expanduser()
    if path.exists():
        return False
    local = path.is_absolute() or value.startswith(("./", "../", "~")) or path.suffix in (".json", ".yaml")
    return local or not is_hub_id(value)


def model_path_issues(data: Any, key: str = "") -> list[ConfigIssue]:
    """Every model location in ``data`` (the resolved config) that :func:`missing_location` finds."""
    issues: list[ConfigIssue] = []
    if isinstance(data, dict):
        for name, value in data.items():
            child = f"{key}.{name}" if key else str(name)
            if name in MODEL_PATH_KEYS and missing_location(value):
                issues.append(ConfigIssue(child, f"'{value}' is neither an existing local path (a relative one is read "
                                                 f"from the working directory, {os.getcwd()}) nor a Hugging Face hub "
                                                 "id (name or organisation/name); give the model's folder or its hub "
                                                 "name"))
            issues += model_path_issues(value, child)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            issues += model_path_issues(value, f"{key}[{i}]")
    return issues
