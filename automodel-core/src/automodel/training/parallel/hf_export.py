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
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.model_files import saved_names
from automodel.training.modules import unwrap
from automodel.training.parallel.blocks import clean_name, tied_to
from automodel.training.parallel.pipeline_stages import is_stage, stage_models
from automodel.training.parallel.pipeline_tied import head_copy_sources
from automodel.training.parallel.shard_files import DTYPES, Slice, mismatch_report, nbytes, read_slices
from automodel.training.parallel.writer import all_ok, barrier, distributed, group_rank, single_process_is_intended

_Tensor = tuple[tuple[int, ...], list[Slice]]  # a saved tensor's full shape and its slices

EXPORT_FILE = "hf_export.json"
HF_FILES = "hf"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3


def export_names(model: nn.Module, prefix: str = "") -> tuple[str, dict[str, str]]:
    """("model" | "adapter", saved key -> HF name) for ``model``'s ``state_dict`` keys (plus ``prefix``): a tied
    tensor once, under the name ``save_pretrained`` writes it with; a peft model's adapter under peft's names.
    ``model`` may be wrapped (DDP, torch.compile): the names are the inner model's."""
    model = unwrap(model)
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
    hub = _hub_names(model)
    return "model", {prefix + key: hub.get(key, key) for key, first in tied_to(model).items() if key == first}


def _hub_names(model: nn.Module) -> dict[str, str]:
    """state_dict key -> the name ``save_pretrained`` writes it under, where transformers renames an architecture's
    keys back to their hub names (``model_files.saved_names``); a pipeline stage's are the whole model's (recorded
    when it was cut: transformers finds the renaming from the model's class, which a stage is not)."""
    if is_stage(model):
        return {key: name for stage in stage_models(model) for key, name in stage.hub_names.items()}
    return saved_names(model)


def write_export_files(model: nn.Module, directory: Path, kind: str, names: dict[str, str]) -> None:
    """Beside the shards: ``hf_export.json`` (``kind`` and ``names`` from :func:`export_names`, merged over the
    model's parts) and the model's HF config files in ``hf/`` (rank 0 calls it)."""
    model = unwrap(model)
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


def export_hf(directory: str | Path, out: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
              group: Any = None) -> list[Path]:
    """Write the HF directory ``out`` from the sharded checkpoint ``directory``; every rank of ``group`` (a gloo
    group; the checkpoint group when None) calls it. Returns the weight files this rank wrote, each fsynced."""
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
    rank, world = group_rank(group)
    written, failure = [], None
    try:
        out.mkdir(parents=True, exist_ok=True)
        for number, (name, entries) in enumerate(files.items()):
            if number % world == rank:
                _write_file(out / name, entries, chunks)
                written.append(out / name)
    except Exception as err:  # every rank must hear of it before anyone waits on the others
        failure = err
    if not all_ok(failure is None, group):
        raise failure or AutomodelError(f"another rank failed to write its part of '{out}'")
    if rank == 0:
        if len(files) > 1:
            _write_index(out / INDEX_FILE, files, chunks)
        for config in sorted((directory / HF_FILES).glob("*")):
            shutil.copyfile(config, out / config.name)
    barrier(group)
    return written


def load_hf_weights(directory: Path, model: nn.Module) -> None:
    """Fill ``model`` (sharded or not) from the HF directory ``directory`` that :func:`export_hf` wrote for a model
    like it, each rank reading only the slices it holds (``HuggingFaceStorageReader``); a peft model's adapter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    names = export_names(model)[1]
    state = get_model_state_dict(model)
    saved = _hf_shapes(directory)
    # a pipeline stage's copy of a tied head, resumed from a model/ written tied: read as the embedding
    hub = _hub_names(unwrap(model))
    names.update({head: hub.get(source, source) for head, source in head_copy_sources(unwrap(model)).items()
                  if names.get(head) not in saved})
    targets = {names[key]: tensor for key, tensor in state.items() if key in names}
    wrong = [f"{name}: checkpoint {saved[name]} vs model {tuple(t.shape)}" for name, t in targets.items()
             if name in saved and saved[name] != tuple(t.shape)]
    tied = tied_to(unwrap(model))
    # a tied head saved as a weight of its own (a pipeline run's untied copy, equal to the embedding) is read once
    aliases = {key for key, first in tied.items() if key != first}
    only_saved = [n for n in saved if n not in targets and n not in aliases]
    missing = [n for n in targets if n not in saved]
    if is_stage(unwrap(model)):
        only_saved = []  # a pipeline stage holds only its own layers of the whole model
    if wrong or only_saved or missing:
        raise AutomodelError(mismatch_report(
            f"checkpoint '{directory}' does not match the model (is restore_from.path the same architecture, with "
            "the same peft settings?)", {"shape mismatches": wrong, "keys only in the checkpoint": only_saved,
                                         "keys missing from the checkpoint": missing}))
    with single_process_is_intended():
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not distributed())
    set_model_state_dict(model, {key: targets[names[tied[key]]] for key in state if tied[key] in names},
                         options=StateDictOptions(strict=False))


def _hf_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the headers of ``directory``'s safetensors files (a damaged file is named)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise AutomodelError(f"'{directory}' holds no *.safetensors weights")
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
        except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
            raise AutomodelError(f"'{file}' is corrupted ({err})") from None
    return shapes


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


def _read_slice(chunk: Slice, key: str) -> torch.Tensor:
    """One saved slice. Its file is opened for this slice only: a file kept open keeps every page read from it
    mapped into the process, and the rank writing an output file would end up holding all of it that way."""
    from safetensors import safe_open

    with safe_open(str(chunk.file), framework="pt") as handle:
        return handle.get_tensor(key)


def _assemble(key: str, tensor: _Tensor) -> torch.Tensor:
    """The whole tensor ``key`` from its saved slices (the only whole tensor held at a time)."""
    shape, parts = tensor
    full = torch.empty(shape, dtype=DTYPES[parts[0].dtype])
    for part in parts:
        full[tuple(slice(o, o + s) for o, s in zip(part.offsets, part.shape, strict=True))] = _read_slice(part, key)
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


def _write_file(path: Path, entries: list[tuple[str, str]], chunks: dict[str, _Tensor]) -> None:
    header = _header(entries, chunks)
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(header)))
        stream.write(header)
        for key, _name in entries:
            full = _assemble(key, chunks[key])
            if full.numel():
                stream.write(full.reshape(-1).view(torch.uint8).numpy().data)
        stream.flush()
        os.fsync(stream.fileno())


def _write_index(path: Path, files: dict[str, list[tuple[str, str]]], chunks: dict[str, _Tensor]) -> None:
    weight_map = {name: file for file, entries in files.items() for _key, name in entries}
    total = sum(_size(chunks[key]) for entries in files.values() for key, _ in entries)
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
                    encoding="utf-8")
