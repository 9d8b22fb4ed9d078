"""Sharded checkpoints of model and optimizer state with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only its own shards; a restore reads, on any number of ranks (or one process without a process
group), exactly the slices each rank now holds, so N ranks resume on M. Reading never unpickles: the tensors are
safetensors files (torch's ``HuggingFaceStorageWriter`` / ``Reader``, whose metadata is each file's JSON header with
the shard's offsets), everything else is JSON. One directory holds::

    shard-<rank>-model-<k>-of-<n>.safetensors   tensors "model.<name>" and "optim.<name>.<state>" (rank's shards)
    tensors.json                                every saved tensor's full shape (see shard_files.py)
    optimizer.json                              param_groups, non-tensor state, which tensor is which state
    hf_export.json, hf/                         what the HF export of the weights needs (see hf_export.py)

Tensors are grouped into files of at most ``max_file_bytes`` (of the whole tensors), which also bounds what a rank
serialises at once. A peft model's weights are its adapter (the base is unchanged). Background saves run one after
the other on one writer thread (``run_in_background``) and talk over their own gloo group (``checkpoint_group``).
The caller writes into a staging directory and publishes it (rename, ``LATEST``) after the save finished.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.modules import unwrap
from automodel.training.parallel.blocks import tied_to
from automodel.training.parallel.checkpoint_metadata import Metadata, gather_metadata, merge_metadata
from automodel.training.parallel.hf_export import export_names, write_export_files
from automodel.training.parallel.pipeline_tied import head_copy_sources
from automodel.training.parallel.shard_files import (
    ShardedCheckpointError,
    mismatch_report,
    read_slices,
    write_tensor_shapes,
)
from automodel.training.parallel.writer import (
    PendingSave,
    checkpoint_group,
    distributed,
    run_in_background,
    single_process_is_intended,
)

OPTIMIZER_FILE = "optimizer.json"
MODEL, OPTIM = "model.", "optim."
# A restore maps one shard file at a time (DCP's reader): the file size bounds the pages it holds beside the state.
DEFAULT_MAX_FILE_BYTES = 256 * 1024**2

Parts = nn.Module | Sequence[nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def sharded_tensors(model: Parts, optimizer: Optimizers = None, weights: bool = True
                    ) -> tuple[dict[str, torch.Tensor], Metadata]:
    """(DCP key -> this rank's tensor, what the directory records beside the shards): the weights (a tied tensor
    once; of a peft model only the adapter, the rest is its unchanged base) when ``weights``, and the optimizer's
    state. ``model`` may be a list of parts holding disjoint parts of one model under its names (the stages a
    pipeline rank runs), ``optimizer`` then one optimizer per part. The record is merged over the parts and every
    rank (see checkpoint_metadata.py): a collective, every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    tensors: dict[str, torch.Tensor] = {}
    metadata: Metadata | None = None
    for part, part_optimizer in _parts(model, optimizer):
        # The model's state first, always: FSDP2's state_dict hook puts the sharded parameters back in place (a
        # no_grad forward, validation, can leave a module unsharded), and the optimizer's state is keyed by them.
        model_state = get_model_state_dict(part)
        mine: dict[str, torch.Tensor] = {}
        export = None
        if weights:
            export = list(export_names(part, MODEL))
            mine = {MODEL + name: t for name, t in model_state.items() if MODEL + name in export[1]}
        manifest = None
        if part_optimizer is not None:
            optim_tensors, manifest = _split_optimizer_state(get_optimizer_state_dict(part, part_optimizer))
            mine.update(optim_tensors)
        tensors.update(mine)
        part_metadata = {"shapes": {key: list(t.shape) for key, t in mine.items()},
                         "bytes": {key: math.prod(t.shape) * t.element_size() for key, t in mine.items()},
                         "optimizer": manifest, "export": export}
        metadata = part_metadata if metadata is None else merge_metadata(metadata, part_metadata)
    return tensors, gather_metadata(metadata)


def write_sharded_metadata(directory: Path, model: Parts, metadata: Metadata) -> None:
    """What a sharded directory holds beside the shards (rank 0): shapes, optimizer manifest, export plan (when
    the weights are saved; the HF config files from the first part)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tensor_shapes(directory, metadata["shapes"])
    if metadata["optimizer"] is not None:
        (directory / OPTIMIZER_FILE).write_text(json.dumps(metadata["optimizer"], indent=1), encoding="utf-8")
    if metadata["export"] is not None:
        write_export_files(_parts(model, None)[0][0], directory, *metadata["export"])


def write_sharded_tensors(directory: Path, tensors: dict[str, torch.Tensor], sizes: dict[str, int],
                          max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, group: Any = None) -> None:
    """Every rank of ``group`` writes its shards of ``tensors`` into ``directory`` (one DCP save); ``sizes``: every
    rank's keys and their sizes (the metadata's ``bytes``), so that all group the keys into the same files."""
    import torch.distributed.checkpoint as dcp

    from automodel.training.parallel.shard_writer import StreamingShardWriter

    directory.mkdir(parents=True, exist_ok=True)
    if not sizes:
        return
    writer = StreamingShardWriter(str(directory), fqn_to_index_mapping=_file_index(sizes, max_file_bytes),
                                  save_distributed=True)
    with single_process_is_intended():
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not distributed())


def stage_on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of this rank's ``tensors`` in host memory that training no longer changes (what a background save
    writes)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        return stager.stage(tensors)
    finally:
        stager.close()


def save_sharded_state(directory: str | Path, model: Parts, optimizer: Optimizers = None,
                       max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, async_save: bool = False,
                       weights: bool = True) -> PendingSave | None:
    """Write ``model``'s weights (when ``weights``) and ``optimizer``'s state into ``directory``; every rank
    calls it. Model parts and their optimizers as for :func:`sharded_tensors`.

    ``async_save``: the state is copied to host memory, then written in the background; the returned
    ``PendingSave`` says when the files are complete. Training may change the parameters meanwhile."""
    directory = Path(directory)
    tensors, metadata = sharded_tensors(model, optimizer, weights)
    if _rank() == 0:
        write_sharded_metadata(directory, model, metadata)
    _barrier()
    if not async_save:
        write_sharded_tensors(directory, tensors, metadata["bytes"], max_file_bytes)
        return None
    staged, group = stage_on_cpu(tensors), checkpoint_group()
    return run_in_background(lambda: write_sharded_tensors(directory, staged, metadata["bytes"], max_file_bytes,
                                                           group))


def load_sharded_state(directory: str | Path, model: Parts, optimizer: Optimizers = None, weights: bool = True
                       ) -> None:
    """Fill ``model``'s weights (when ``weights``) and ``optimizer`` from ``directory``, resharded to how they
    are sharded now; model parts and their optimizers as for :func:`sharded_tensors`, each part reading the
    tensors of the names it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    directory = Path(directory)
    saved = read_slices(directory)[0]
    parts = _parts(model, optimizer)
    manifest = _read_manifest(directory) if optimizer is not None else None
    targets: dict[str, torch.Tensor] = {}
    states = []
    for part, part_optimizer in parts:
        model_state = get_model_state_dict(part)
        tied = tied_to(unwrap(part))  # a tied tensor is saved and loaded once, under its first name
        # a pipeline stage's copy of a tied head, resumed from a checkpoint written tied: read as the embedding
        copies = {head: source for head, source in head_copy_sources(unwrap(part)).items() if MODEL + head not in saved}
        source = {name: MODEL + copies.get(tied[name], tied[name]) for name in model_state}
        if weights:
            names = export_names(part, MODEL)[1]
            targets.update({source[name]: t for name, t in model_state.items() if MODEL + name in names})
        optim_state = get_optimizer_state_dict(part, part_optimizer) if part_optimizer is not None else None
        part_manifest = manifest
        if optim_state is not None:
            part_manifest = _copies_state(manifest, head_copy_sources(unwrap(part)))
            # a tied tensor's state is under its first name (a pipeline run's untied head copy has its own, skipped)
            firsts = {name for name in model_state if tied.get(name, name) == name}
            targets.update(_optimizer_targets(optim_state, part_manifest, directory, firsts))
        states.append((model_state, source, optim_state, part_manifest))
    _check_sizes(targets, saved, directory)
    if targets:
        with single_process_is_intended():
            dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not distributed())
    for (part, part_optimizer), (model_state, source, optim_state, part_manifest) in zip(parts, states, strict=True):
        if weights:
            set_model_state_dict(part, {name: targets[source[name]] for name in model_state if source[name] in targets},
                                 options=StateDictOptions(strict=False))
        if optim_state is not None:
            restored = _join_optimizer_state(targets, part_manifest, optim_state)
            set_optimizer_state_dict(part, part_optimizer, restored, options=StateDictOptions(strict=False))


def _parts(model: Parts, optimizer: Optimizers) -> list[tuple[nn.Module, Any]]:
    """(module, its optimizer or None) for each model part."""
    models = list(model) if isinstance(model, Sequence) else [model]
    optimizers = list(optimizer) if isinstance(optimizer, Sequence) else [optimizer] * len(models)
    if len(optimizers) != len(models):
        raise AutomodelError(f"{len(models)} model parts but {len(optimizers)} optimizers: give one per part")
    return list(zip(models, optimizers, strict=True))


# ---- optimizer state: tensors to DCP, the rest to JSON -----------------------------------------------------------


def _split_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``get_optimizer_state_dict``'s form -> (tensors keyed for DCP, a JSON-able manifest of everything else).

    0-d tensors (Adam's ``step``) are the same on every rank and go to JSON with their dtype."""
    tensors: dict[str, torch.Tensor] = {}
    manifest: dict[str, Any] = {"tensors": {}, "scalars": {}, "param_groups": []}
    for fqn, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                key = f"{OPTIM}{fqn}.{name}"
                tensors[key] = value
                manifest["tensors"][key] = [fqn, name]
            elif isinstance(value, torch.Tensor):
                manifest["scalars"].setdefault(fqn, {})[name] = {"tensor": value.item(),
                                                                  "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                manifest["scalars"].setdefault(fqn, {})[name] = {"value": value}
    for group in state["param_groups"]:
        manifest["param_groups"].append({k: list(v) if isinstance(v, tuple) else v for k, v in group.items()})
    return tensors, manifest


def _read_manifest(directory: Path) -> dict[str, Any]:
    file = directory / OPTIMIZER_FILE
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardedCheckpointError(f"'{directory}' has no optimizer state ({OPTIMIZER_FILE} is missing)") from None
    except json.JSONDecodeError as err:
        raise ShardedCheckpointError(f"'{file}' is corrupted: {err}") from None


def _copies_state(manifest: dict[str, Any], copies: dict[str, str]) -> dict[str, Any]:
    """``manifest`` as a part holding untied head copies (``copies``: head -> embedding weight name) reads it: where
    it holds no state of a head copy (a checkpoint written with the weight tied), the embedding's state is the
    copy's (the part holds no embedding: a pipeline's last stage)."""
    saved = {fqn for fqn, _ in manifest["tensors"].values()} | set(manifest["scalars"])
    renames = {source: head for head, source in copies.items() if head not in saved and source in saved}
    if not renames:
        return manifest
    return {**manifest,
            "tensors": {key: [renames.get(fqn, fqn), name] for key, (fqn, name) in manifest["tensors"].items()},
            "scalars": {renames.get(fqn, fqn): entries for fqn, entries in manifest["scalars"].items()}}


def _optimizer_targets(current: dict[str, Any], manifest: dict[str, Any], directory: Path, held: set[str]
                       ) -> dict[str, torch.Tensor]:
    """Where each saved optimizer tensor of a parameter in ``held`` (the part's names) goes: the optimizer's own
    (sharded) state tensor of that name."""
    targets = {}
    for key, (fqn, name) in manifest["tensors"].items():
        if fqn not in held:
            continue
        tensor = current["state"].get(fqn, {}).get(name)
        if not isinstance(tensor, torch.Tensor):
            raise ShardedCheckpointError(f"'{directory}' holds optimizer state '{name}' of '{fqn}', which this "
                                         "model and optimizer do not have: is it the same model and optimizer?")
        targets[key] = tensor
    return targets


def _join_optimizer_state(loaded: dict[str, torch.Tensor], manifest: dict[str, Any], current: dict[str, Any]
                          ) -> dict[str, Any]:
    """The ``set_optimizer_state_dict`` form for the parameters of ``current`` (a part's optimizer). A parameter
    without saved state gets none (as before the save); the groups keep their parameters and get the saved
    hyperparameters."""
    held = {fqn for group in current["param_groups"] for fqn in group["params"]}
    state: dict[str, dict[str, Any]] = {}
    for key, (fqn, name) in manifest["tensors"].items():
        if fqn in held:
            state.setdefault(fqn, {})[name] = loaded[key]
    for fqn, entries in ((f, e) for f, e in manifest["scalars"].items() if f in held):
        for name, saved in entries.items():
            if "tensor" in saved:
                like = current["state"].get(fqn, {}).get(name)
                device = like.device if isinstance(like, torch.Tensor) else "cpu"
                value = torch.tensor(saved["tensor"], dtype=getattr(torch, saved["dtype"]), device=device)
            else:
                value = saved["value"]
            state.setdefault(fqn, {})[name] = value
    if len(manifest["param_groups"]) != len(current["param_groups"]):
        raise ShardedCheckpointError(f"the checkpoint's optimizer has {len(manifest['param_groups'])} parameter "
                                     f"groups, this one {len(current['param_groups'])}: is it the same optimizer?")
    groups = []
    for saved, now in zip(manifest["param_groups"], current["param_groups"], strict=True):
        groups.append({**{k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v
                          for k, v in saved.items()}, "params": now["params"]})
    return {"state": state, "param_groups": groups}


# ---- helpers ----------------------------------------------------------------------------------------------------


def _file_index(sizes: dict[str, int], max_file_bytes: int) -> dict[str, int]:
    """Key -> file number (1-based): consecutive keys (of every rank) fill a file up to ``max_file_bytes`` of whole
    tensors."""
    index, used, mapping = 1, 0, {}
    for key, size in sizes.items():
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        mapping[key] = index
        used += size
    return mapping


def _check_sizes(targets: dict[str, torch.Tensor], saved: dict[str, tuple[int, ...]], directory: Path) -> None:
    missing = [key for key in targets if key not in saved]
    wrong = [f"{key}: saved {tuple(saved[key])}, now {tuple(t.shape)}" for key, t in targets.items()
             if key in saved and tuple(saved[key]) != tuple(t.shape)]
    if missing or wrong:
        raise ShardedCheckpointError(mismatch_report(
            f"the sharded checkpoint '{directory}' does not match the model (same architecture and config?)",
            {"missing": missing, "shape mismatches": wrong}))


def _rank() -> int:
    return dist.get_rank() if distributed() else 0


def _barrier() -> None:
    if distributed():
        dist.barrier()
