"""What a sharded checkpoint directory holds: ``tensors.json`` (every saved tensor's full shape, written at save
time) and the ranks' safetensors files, each slice with its offsets in the file's JSON header (DCP's
``DCP_SHARDING_INFO``). :func:`read_slices` checks that the files cover every tensor exactly, so a missing or
truncated file is an error instead of a silently uninitialised region; nothing here unpickles."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from automodel.errors import AutomodelError

TENSORS_FILE = "tensors.json"
_DCP_INFO = "DCP_SHARDING_INFO"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class ShardedCheckpointError(AutomodelError):
    pass


@dataclass(frozen=True)
class Slice:
    """One saved piece of a tensor: the file, where the piece sits in the full tensor, its shape and dtype code."""

    file: Path
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # the safetensors code: F32, BF16, ...


def mismatch_report(heading: str, groups: dict[str, list[str]]) -> str:
    """``heading`` and each non-empty group of mismatches (title -> items), a few items each."""
    lines = [heading]
    for title, items in groups.items():
        if items:
            lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
    return "\n".join(lines)


def write_tensor_shapes(directory: Path, shapes: dict[str, list[int]]) -> None:
    """``tensors.json``: each saved key's full shape (rank 0 writes it, for the tensors of every rank)."""
    (directory / TENSORS_FILE).write_text(json.dumps({"shapes": shapes}, indent=1), encoding="utf-8")


def read_slices(directory: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, list[Slice]]]:
    """(full shape of each saved tensor, its slices), checked to cover every tensor exactly."""
    from safetensors import safe_open

    try:
        shapes = {key: tuple(shape) for key, shape in
                  json.loads((directory / TENSORS_FILE).read_text(encoding="utf-8"))["shapes"].items()}
    except FileNotFoundError:
        raise ShardedCheckpointError(f"'{directory}' is not a sharded checkpoint ({TENSORS_FILE} is missing)") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ShardedCheckpointError(f"'{directory / TENSORS_FILE}' is corrupted: {err}") from None
    slices: dict[str, list[Slice]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                info = json.loads((handle.metadata() or {}).get(_DCP_INFO, "{}"))
                for key in handle.keys():
                    part = handle.get_slice(key)
                    shape = tuple(part.get_shape())
                    offsets = tuple(info.get(key, {}).get("saved_offsets", [0] * len(shape)))
                    slices.setdefault(key, []).append(Slice(file, offsets, shape, part.get_dtype()))
        except Exception as err:  # a truncated or foreign file: safetensors raises its own error type
            raise ShardedCheckpointError(f"cannot read '{file}' as a checkpoint shard: {err}") from None
    incomplete = [key for key, shape in shapes.items() if not _covers(slices.get(key, []), shape)]
    if incomplete:
        raise ShardedCheckpointError(f"the sharded checkpoint '{directory}' holds only part of "
                                     f"{', '.join(incomplete[:8])}: is a shard file missing?")
    return shapes, slices


def _covers(parts: list[Slice], shape: tuple[int, ...]) -> bool:
    """Whether non-overlapping slices (DCP writes each region once) fill ``shape``."""
    inside = all(len(p.offsets) == len(shape) and all(o + s <= n for o, s, n in zip(p.offsets, p.shape, shape,
                                                                                    strict=True)) for p in parts)
    return bool(parts) and inside and sum(math.prod(p.shape) for p in parts) == math.prod(shape)


def nbytes(parts: list[Slice], shape: tuple[int, ...]) -> int:
    if parts[0].dtype not in DTYPES:
        raise ShardedCheckpointError(f"'{parts[0].file}' holds a tensor of dtype {parts[0].dtype}, which is not "
                                     "read here")
    return math.prod(shape) * DTYPES[parts[0].dtype].itemsize
