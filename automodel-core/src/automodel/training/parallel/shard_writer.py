"""DCP's Hugging Face safetensors writer with each file streamed, one tensor at a time.

``torch.distributed.checkpoint.HuggingFaceStorageWriter`` builds every file in memory with
``safetensors.torch.save`` (a byte copy of each tensor, then the whole file as one ``bytes`` object) before writing
it: a save holds up to twice its largest file on top of the state being saved — for a 150M-parameter model's AdamW
state in one process, 2.4 GB more at the peak (docs/performance.md, row 9). :class:`StreamingShardWriter` writes
the same files (the same names, header and DCP sharding metadata, so DCP's ``HuggingFaceStorageReader`` and
:mod:`automodel.training.parallel.shard_files` read them unchanged) by writing the header, then each tensor's
bytes straight from its storage: nothing is copied but a non-contiguous tensor, one at a time.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    _gen_file_name,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from automodel.training.parallel.shard_files import DTYPES

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class StreamingShardWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter`` (the same constructor) whose files are written without an in-memory copy."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_data: dict[str, Any] = plan.storage_data
        storage_plan = storage_data.get("fqn_to_index_mapping")
        buckets = self._split_by_storage_plan(storage_plan, plan.items)
        highest_index = max(storage_plan.values()) if storage_plan is not None else 1
        results: list[WriteResult] = []
        for file_index, items in buckets.items():
            name = _gen_file_name(file_index, highest_index, storage_data.get("shard_index"))
            results += _write_file(Path(self.path) / name, name, items, planner, self.sync_files)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _write_file(path: Path, name: str, items: list[WriteItem], planner: SavePlanner, sync: bool
                ) -> list[WriteResult]:
    """One safetensors file of ``items``' tensors, as ``safetensors.torch.save`` lays it out plus DCP's sharding
    record (each chunk's offsets in its full tensor)."""
    if any(item.type == WriteItemType.BYTE_IO for item in items):
        raise ValueError("the Hugging Face checkpoint format holds tensors only")
    tensors = [(item, planner.resolve_data(item).detach()) for item in items]
    header: dict[str, Any] = {}
    offset = 0
    for item, tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"'{item.index.fqn}' is on {tensor.device}; DCP hands the writer host tensors")
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"'{item.index.fqn}' has dtype {tensor.dtype}, which this checkpoint format does not hold")
        size = tensor.numel() * tensor.element_size()
        header[item.index.fqn] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                  "data_offsets": [offset, offset + size]}
        offset += size
    sharding = {item.index.fqn: {"saved_offsets": list(item.tensor_data.chunk.offsets)} for item, _ in tensors}
    header["__metadata__"] = {CUSTOM_METADATA_KEY: json.dumps(sharding), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                              FORMAT_KEY: FORMAT_VALUE}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    results = []
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(raw)))
        stream.write(raw)
        for item, tensor in tensors:
            begin, end = header[item.index.fqn]["data_offsets"]
            if tensor.numel():
                stream.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            results.append(WriteResult(index=item.index, size_in_bytes=end - begin,
                                       storage_data=_StorageInfo(name, start + begin, end - begin)))
        stream.flush()
        if sync:
            os.fsync(stream.fileno())
    return results


__all__ = ["StreamingShardWriter"]
