"""The HF-loadable ``model/`` directory, written from a sharded checkpoint without gathering the model anywhere.

At save time rank 0 records what the export needs beside the shards (:func:`write_export_files`): which saved
tensor becomes which HF name (a tied tensor once; for a peft model only the adapter, under peft's names) and the
config files (``config.json``, ``generation_config.json`` or ``adapter_config.json``) in ``hf/``. :func:`export_hf`
then streams: every output file is planned from the shard files' JSON headers alone, each rank writes its share of
the output files (file ``i`` by rank ``i % world``), assembling one whole tensor at a time from the slices the ranks
saved, and rank 0 writes ``model.safetensors.index.json``. One process without a process group writes them all
(``automodel export``). ``transformers.AutoModel*.from_pretrained`` / ``peft.PeftModel.from_pretrained`` load it.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.blocks import clean_name, tied_to
from automodel.training.parallel.shard_files import DTYPES, Slice, nbytes, read_slices

_Tensor = tuple[tuple[int, ...], list[Slice]]  # a saved tensor's full shape and its slices

EXPORT_FILE = "hf_export.json"
HF_FILES = "hf"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


def export_names(model: nn.Module, prefix: str = "") -> tuple[str, dict[str, str]]:
    """("model" | "adapter", saved key -> HF name) for ``model``'s ``state_dict`` keys (plus ``prefix``): a tied
    tensor once, under its first name (as ``save_pretrained`` writes it); a peft model's adapter under peft's names.
    """
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        if len(model.peft_config) != 1:
            raise AutomodelError(f"the model has {len(model.peft_config)} LoRA adapters "
                                 f"({', '.join(model.peft_config)}); the HF export writes one")
        state = model.state_dict(keep_vars=True)
        key_of = {id(tensor): key for key, tensor in reversed(state.items())}  # a tied tensor: its first key
        adapter = get_peft_model_state_dict(model, state_dict=state, adapter_name=next(iter(model.peft_config)))
        if any(id(tensor) not in key_of for tensor in adapter.values()):
            raise AutomodelError("peft's adapter state is not made of the model's own tensors; this adapter type "
                                 "cannot be exported from a sharded checkpoint")
        return "adapter", {prefix + clean_name(key_of[id(tensor)]): name for name, tensor in adapter.items()}
    return "model", {prefix + key: key for key, first in tied_to(model).items() if key == first}


def write_export_files(model: nn.Module, directory: Path, kind: str, names: dict[str, str]) -> None:
    """Beside the shards: ``hf_export.json`` (``kind`` and ``names`` from :func:`export_names`, merged over the
    model's parts) and the model's HF config files in ``hf/`` (rank 0 calls it)."""
    (directory / EXPORT_FILE).write_text(json.dumps({"kind": kind, "weights": names}, indent=1), encoding="utf-8")
    target = directory / HF_FILES
    target.mkdir(exist_ok=True)
    if kind == "adapter":
        config = copy.deepcopy(next(iter(model.peft_config.values())))
        config.inference_mode = True  # what PeftModel.save_pretrained writes
        config.save_pretrained(str(target))
        return
    for name in ("config", "generation_config"):
        config = getattr(model, name, None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(str(target))


def export_hf(directory: str | Path, out: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[Path]:
    """Write the HF directory ``out`` from the sharded checkpoint ``directory``; every rank calls it.

    Returns the weight files this rank wrote."""
    directory, out = Path(directory), Path(out)
    try:
        plan = json.loads((directory / EXPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise AutomodelError(f"'{directory}' is not an exportable sharded checkpoint ({EXPORT_FILE}: {err})") from None
    shapes, slices = read_slices(directory)
    missing = [key for key in plan["weights"] if key not in shapes]
    if missing:
        raise AutomodelError(f"'{directory}' lacks saved tensors the export needs: {', '.join(missing[:8])}")
    chunks = {key: (shapes[key], slices[key]) for key in plan["weights"]}
    files = _plan_files(plan, chunks, max_file_bytes)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() \
        else (0, 1)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for number, (name, entries) in enumerate(files.items()):
        if number % world == rank:
            with _Reader() as reader:  # the shard files' mapped pages leave memory after each output file
                _write_file(out / name, entries, chunks, reader)
            written.append(out / name)
    if rank == 0:
        if len(files) > 1:
            _write_index(out / INDEX_FILE, files, chunks)
        for config in sorted((directory / HF_FILES).glob("*")):
            shutil.copyfile(config, out / config.name)
    if world > 1:
        dist.barrier()
    return written


def _plan_files(plan: dict[str, Any], chunks: dict[str, _Tensor], max_file_bytes: int
                ) -> dict[str, list[tuple[str, str]]]:
    """Output file name -> its (saved key, HF name) entries: one adapter file, or model files of bounded size."""
    entries = sorted(plan["weights"].items(), key=lambda item: item[1])
    if plan["kind"] == "adapter":
        return {ADAPTER_WEIGHTS: entries}
    buckets: list[list[tuple[str, str]]] = [[]]
    used = 0
    for key, name in entries:
        size = _size(chunks[key])
        if buckets[-1] and used + size > max_file_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((key, name))
        used += size
    if len(buckets) == 1:
        return {"model.safetensors": buckets[0]}
    return {f"model-{i:05d}-of-{len(buckets):05d}.safetensors": bucket for i, bucket in enumerate(buckets, 1)}


class _Reader:
    """Open shard files, kept open while a file is written (a context manager)."""

    def __init__(self) -> None:
        self.handles: dict[Path, Any] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)

    def tensor(self, chunk: Slice, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if chunk.file not in self.handles:
            self.handles[chunk.file] = safe_open(str(chunk.file), framework="pt").__enter__()
        return self.handles[chunk.file].get_tensor(key)


def _assemble(key: str, tensor: _Tensor, reader: _Reader) -> torch.Tensor:
    """The whole tensor ``key`` from its saved slices (the only whole tensor held at a time)."""
    shape, parts = tensor
    full = torch.empty(shape, dtype=DTYPES[parts[0].dtype])
    for part in parts:
        full[tuple(slice(o, o + s) for o, s in zip(part.offsets, part.shape, strict=True))] = reader.tensor(part, key)
    return full


def _size(tensor: _Tensor) -> int:
    shape, parts = tensor
    return nbytes(parts, shape)


def _header(entries: list[tuple[str, str]], chunks: dict[str, _Tensor]) -> bytes:
    """The safetensors header of a file holding ``entries``, in order (JSON, padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, name in entries:
        shape, parts = chunks[key]
        size = _size(chunks[key])
        header[name] = {"dtype": parts[0].dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_file(path: Path, entries: list[tuple[str, str]], chunks: dict[str, _Tensor], reader: _Reader) -> None:
    header = _header(entries, chunks)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(header)))
        stream.write(header)
        for key, _name in entries:
            full = _assemble(key, chunks[key], reader)
            if full.numel():
                stream.write(full.reshape(-1).view(torch.uint8).numpy().data)


def _write_index(path: Path, files: dict[str, list[tuple[str, str]]], chunks: dict[str, _Tensor]) -> None:
    weight_map = {name: file for file, entries in files.items() for _key, name in entries}
    total = sum(_size(chunks[key]) for entries in files.values() for key, _ in entries)
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
                    encoding="utf-8")
