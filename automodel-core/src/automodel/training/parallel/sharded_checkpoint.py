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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.training.modules import unwrap
from automodel.training.parallel.blocks import tied_to
from automodel.training.parallel.hf_export import export_names, write_export_files
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
DEFAULT_MAX_FILE_BYTES = 2 * 1024**3

def sharded_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, weights: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(DCP key -> this rank's tensor, the optimizer's JSON manifest): the weights (a tied tensor once; of a peft
    model only the adapter, the rest is its unchanged base) when ``weights``, and the optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # The model's state first, always: FSDP2's state_dict hook puts the sharded parameters back in place (a no_grad
    # forward, validation, can leave a module unsharded), and the optimizer's state is keyed by them.
    model_state = get_model_state_dict(model)
    tensors: dict[str, torch.Tensor] = {}
    if weights:
        saved = export_names(model, MODEL)[1]
        tensors = {MODEL + name: t for name, t in model_state.items() if MODEL + name in saved}
    manifest = None
    if optimizer is not None:
        optim_tensors, manifest = _split_optimizer_state(get_optimizer_state_dict(model, optimizer))
        tensors.update(optim_tensors)
    return tensors, manifest


def write_sharded_metadata(directory: Path, model: nn.Module, tensors: dict[str, torch.Tensor],
                           manifest: dict[str, Any] | None, weights: bool = True) -> None:
    """What a sharded directory holds beside the shards (rank 0): shapes, optimizer manifest, export plan."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tensor_shapes(directory, tensors)
    if manifest is not None:
        (directory / OPTIMIZER_FILE).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    if weights:
        write_export_files(model, directory, MODEL)


def write_sharded_tensors(directory: Path, tensors: dict[str, torch.Tensor],
                          max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, group: Any = None) -> None:
    """Every rank of ``group`` writes its shards of ``tensors`` into ``directory`` (one DCP save)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    directory.mkdir(parents=True, exist_ok=True)
    if not tensors:
        return
    writer = HuggingFaceStorageWriter(str(directory), fqn_to_index_mapping=_file_index(tensors, max_file_bytes),
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


def save_sharded_state(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                       max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, async_save: bool = False,
                       weights: bool = True) -> PendingSave | None:
    """Write ``model``'s weights (when ``weights``) and ``optimizer``'s state into ``directory``; every rank
    calls it.

    ``async_save``: the state is copied to host memory, then written in the background; the returned
    ``PendingSave`` says when the files are complete. Training may change the parameters meanwhile."""
    directory = Path(directory)
    tensors, manifest = sharded_tensors(model, optimizer, weights)
    if _rank() == 0:
        write_sharded_metadata(directory, model, tensors, manifest, weights)
    _barrier()
    if not async_save:
        write_sharded_tensors(directory, tensors, max_file_bytes)
        return None
    staged, group = stage_on_cpu(tensors), checkpoint_group()
    return run_in_background(lambda: write_sharded_tensors(directory, staged, max_file_bytes, group))


def load_sharded_state(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                       weights: bool = True) -> None:
    """Fill ``model``'s weights (when ``weights``) and ``optimizer`` from ``directory``, resharded to how they
    are sharded now."""
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
    model_state = get_model_state_dict(model)
    tied = tied_to(unwrap(model))  # a tied tensor is saved and loaded once, under its first name
    targets = {}
    if weights:
        names = export_names(model, MODEL)[1]
        targets = {MODEL + name: tensor for name, tensor in model_state.items() if MODEL + name in names}
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer)
        manifest = _read_manifest(directory)
        targets.update(_optimizer_targets(optim_state, manifest, directory))
    _check_sizes(targets, saved, directory)
    if targets:
        with single_process_is_intended():
            dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not distributed())
    if weights:
        set_model_state_dict(model, {name: targets[MODEL + tied[name]] for name in model_state
                                     if MODEL + tied[name] in targets}, options=StateDictOptions(strict=False))
    if optimizer is not None:
        restored = _join_optimizer_state(targets, manifest, optim_state)
        set_optimizer_state_dict(model, optimizer, restored, options=StateDictOptions(strict=False))


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


def _optimizer_targets(current: dict[str, Any], manifest: dict[str, Any], directory: Path
                       ) -> dict[str, torch.Tensor]:
    """Where each saved optimizer tensor goes: the optimizer's own (sharded) state tensor of that name."""
    targets = {}
    for key, (fqn, name) in manifest["tensors"].items():
        tensor = current["state"].get(fqn, {}).get(name)
        if not isinstance(tensor, torch.Tensor):
            raise ShardedCheckpointError(f"'{directory}' holds optimizer state '{name}' of '{fqn}', which this "
                                         "model and optimizer do not have: is it the same model and optimizer?")
        targets[key] = tensor
    return targets


def _join_optimizer_state(loaded: dict[str, torch.Tensor], manifest: dict[str, Any], current: dict[str, Any]
                          ) -> dict[str, Any]:
    """The ``set_optimizer_state_dict`` form. A parameter without saved state gets none (as before the save)."""
    state: dict[str, dict[str, Any]] = {}
    for key, (fqn, name) in manifest["tensors"].items():
        state.setdefault(fqn, {})[name] = loaded[key]
    for fqn, entries in manifest["scalars"].items():
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
        groups.append({k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v
                       for k, v in saved.items()})
    return {"state": state, "param_groups": groups}


# ---- helpers ----------------------------------------------------------------------------------------------------


def _file_index(tensors: dict[str, torch.Tensor], max_file_bytes: int) -> dict[str, int]:
    """Key -> file number (1-based): consecutive keys fill a file up to ``max_file_bytes`` of whole tensors."""
    index, used, mapping = 1, 0, {}
    for key, tensor in tensors.items():
        size = math.prod(tensor.shape) * tensor.element_size()
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
