"""Config keys that make a library run a model's own Python code or unpickle files: the command line decides.

``trust_remote_code: true`` makes transformers, diffusers and sentence-transformers import the ``*.py`` files a
model directory or hub repository ships; ``custom_pipeline`` makes diffusers import one; ``use_safetensors:
false``, ``weights_only: false`` and ``allow_pickle: true`` load pickles, and so does a model directory whose
weights exist only as pickle files (``*.bin``, ``*.pt``, ...). A config is untrusted data, so it may ask for
these only when the person running says ``--trust-remote-code`` on the command line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from automodel.config.model_paths import MODEL_PATH_KEYS
from automodel.config.trust import TRUST_REMOTE_CODE_FLAG
from automodel.errors import ConfigIssue

_DIRECTORY_KEYS = (*MODEL_PATH_KEYS, "name_or_path")  # a directory whose weight files are checked for pickles


def _set(value: Any) -> bool:  # how the libraries read these keys: `if trust_remote_code:`
    return bool(value)


def _unset(value: Any) -> bool:  # `weights_only: false` (None means the safe default)
    return value is not None and not value


# key -> (when its value is dangerous, what it then does)
_DANGEROUS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trust_remote_code": (_set, "runs the Python code a model ships (its configuration_*.py / modeling_*.py)"),
    "custom_pipeline": (_set, "imports and runs a pipeline's Python file"),
    "use_safetensors": (_unset, "loads the weights from pickle files, which can run code"),
    "weights_only": (_unset, "unpickles whatever the file holds, which can run code"),
    "allow_pickle": (_set, "unpickles whatever the file holds, which can run code"),
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_NOT_WEIGHTS = ("training_args.bin",)  # a Trainer's pickled arguments: no loader reads it as weights


def _refusal(key: str, what: str) -> ConfigIssue:
    return ConfigIssue(key, f"{what}; a config cannot ask for this: pass {TRUST_REMOTE_CODE_FLAG} on the command "
                            "line if you trust it")


def pickle_only_weights(directory: Path) -> list[str]:
    """Weight files of ``directory`` (or of a component sub-directory) that exist only in a pickle format."""
    found: list[str] = []
    try:
        folders = [directory, *(p for p in sorted(directory.iterdir()) if p.is_dir())]
    except OSError:  # unreadable: the loader will say so
        return found
    for folder in folders:
        try:
            files = [p for p in folder.iterdir() if p.is_file()]
        except OSError:
            continue
        pickles = [p for p in files if p.suffix in _PICKLE_SUFFIXES and p.name not in _NOT_WEIGHTS]
        if pickles and not any(p.suffix == ".safetensors" for p in files):
            found += [str(p.relative_to(directory)) for p in pickles]
    return found


def _check_value(key: str, name: str, value: Any, issues: list[ConfigIssue]) -> None:
    if name in _DANGEROUS and _DANGEROUS[name][0](value):
        issues.append(_refusal(key, f"{json.dumps(value, default=str)} {_DANGEROUS[name][1]}"))
    elif name in _DIRECTORY_KEYS and isinstance(value, str) and Path(value).is_dir():
        pickles = pickle_only_weights(Path(value))
        if pickles:
            issues.append(_refusal(key, f"'{value}' holds weights only as pickle files ({', '.join(pickles[:4])}), "
                                        "which can run code when loaded; convert them to safetensors"))


def code_loading_issues(data: Any, trusted: bool, key: str = "") -> list[ConfigIssue]:
    """Every key of ``data`` (the resolved config) that would run a model's code or unpickle, unless ``trusted``."""
    if trusted:
        return []
    issues: list[ConfigIssue] = []
    if isinstance(data, dict):
        for name, value in data.items():
            child = f"{key}.{name}" if key else str(name)
            _check_value(child, str(name), value, issues)
            issues += code_loading_issues(value, trusted, child)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            issues += code_loading_issues(value, trusted, f"{key}[{i}]")
    return issues
