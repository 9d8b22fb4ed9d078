"""State dicts as JSON + safetensors: how every state besides the weights is saved, so reading one never unpickles.

``write_state(stem, state)`` writes ``<stem>.json`` (the nested structure) and, when the state holds tensors or
numpy arrays, ``<stem>.safetensors`` (the tensors, referenced from the JSON by key). Values JSON has no form for are
one-key objects: ``{"__tensor__": key}``, ``{"__ndarray__": key}``, ``{"__tuple__": [...]}``, ``{"__bytes__":
hex}`` and ``{"__dict__": [[key, value], ...]}`` (a dict whose keys are not all strings — an optimizer's parameter
ids — or that could be read as one of these forms). ``read_state`` accepts nothing else: a damaged or foreign file
raises ``StateFileError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from automodel.errors import AutomodelError
from automodel.training.durable import fsync_file, write_durable

_MARKERS = ("__tensor__", "__ndarray__", "__tuple__", "__bytes__", "__dict__")
_MAX_DEPTH = 64


class StateFileError(AutomodelError):
    pass


class _Encoder:
    def __init__(self, where: str):
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}

    def _store(self, tensor: torch.Tensor) -> str:
        key = str(len(self.tensors))
        self.tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
        return key

    def encode(self, value: Any, path: str = "", depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise StateFileError(f"cannot save the state of {self.where}: nested deeper than {_MAX_DEPTH} at '{path}'")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, torch.Tensor):
            return {"__tensor__": self._store(value)}
        if isinstance(value, np.ndarray):
            return {"__ndarray__": self._store(torch.from_numpy(np.ascontiguousarray(value)))}
        if isinstance(value, bytes):
            return {"__bytes__": value.hex()}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _MARKERS):
                return {k: self.encode(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
            return {"__dict__": [[self.encode(k, f"{path}<key>", depth + 1), self.encode(v, f"{path}.{k}", depth + 1)]
                                 for k, v in value.items()]}
        raise StateFileError(f"cannot save the state of {self.where}: '{path or '.'}' is a {type(value).__name__}; "
                             "a state holds dicts, lists, tuples, numbers, strings, bytes, tensors and numpy arrays")


def write_state(stem: Path, state: Any, where: str) -> list[Path]:
    """``<stem>.json`` (+ ``<stem>.safetensors``), each fsynced; returns the files written."""
    from safetensors.torch import save_file

    encoder = _Encoder(where)
    body = json.dumps({"format": 1, "state": encoder.encode(state)})
    files = []
    if encoder.tensors:
        tensors = stem.with_suffix(".safetensors")
        save_file(encoder.tensors, str(tensors))
        fsync_file(tensors)
        files.append(tensors)
    json_file = stem.with_suffix(".json")
    write_durable(json_file, body)
    return [json_file, *files]


class _Decoder:
    def __init__(self, file: Path, tensors: dict[str, torch.Tensor]):
        self.file = file
        self.tensors = tensors

    def fail(self, what: str) -> StateFileError:
        return StateFileError(f"'{self.file}' is corrupted ({what})")

    def tensor(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.tensors:
            raise self.fail(f"it refers to tensor {key!r}, which its .safetensors file does not hold")
        return self.tensors[key]

    def decode(self, value: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail(f"nested deeper than {_MAX_DEPTH}")
        if isinstance(value, list):
            return [self.decode(v, depth + 1) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1 and (marker := next(iter(value))) in _MARKERS:
            return self._marker(marker, value[marker], depth)
        return {k: self.decode(v, depth + 1) for k, v in value.items()}

    def _marker(self, marker: str, body: Any, depth: int) -> Any:
        if marker == "__tensor__":
            return self.tensor(body)
        if marker == "__ndarray__":
            return self.tensor(body).numpy()
        if marker == "__bytes__":
            if not isinstance(body, str):
                raise self.fail("a bytes value is not a hex string")
            try:
                return bytes.fromhex(body)
            except ValueError:
                raise self.fail("a bytes value is not a hex string") from None
        if not isinstance(body, list):
            raise self.fail(f"{marker} does not hold a list")
        if marker == "__tuple__":
            return tuple(self.decode(v, depth + 1) for v in body)
        if not all(isinstance(item, list) and len(item) == 2 for item in body):
            raise self.fail("a mapping is not a list of [key, value] pairs")
        try:
            return {self.decode(k, depth + 1): self.decode(v, depth + 1) for k, v in body}
        except TypeError:  # an unhashable key
            raise self.fail("a mapping has a key that cannot be a key") from None


def read_state(stem: Path) -> Any:
    """The state ``write_state`` wrote at ``stem``; ``StateFileError`` naming the file when it is missing or damaged."""
    from safetensors.torch import load_file

    json_file, tensor_file = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    try:
        data = json.loads(json_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateFileError(f"'{json_file}' is missing") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise StateFileError(f"'{json_file}' is corrupted ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != 1 or "state" not in data:
        raise StateFileError(f"'{json_file}' is not a state file written by automodel")
    tensors: dict[str, torch.Tensor] = {}
    if tensor_file.exists():
        try:
            tensors = load_file(str(tensor_file))
        except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
            raise StateFileError(f"'{tensor_file}' is corrupted ({err})") from None
    return _Decoder(json_file, tensors).decode(data["state"])
