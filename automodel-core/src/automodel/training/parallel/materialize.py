"""Build a model on the meta device and give each rank only its own shards, read from files or freshly initialised.

1. :func:`parameters_on_meta` around the model's construction: parameters are created on the meta device (no
   memory), buffers are real, so rotary caches and other non-persistent buffers are computed as usual.
2. LoRA (``peft.get_peft_model``), activation checkpointing and FSDP2 are applied to the meta model.
3. :func:`materialize` allocates each rank's shards and fills them: from safetensors files, each rank reading only
   its slices (``safe_open(...).get_slice``) of each tensor at the offsets its ``DTensor`` placement gives (any
   ``Shard(dim)`` / ``Replicate`` placement, so tensor parallelism plugs in); and whatever the files lack (all of it
   for a fresh model; LoRA adapters) by :func:`init_module_by_module`.

Fresh initialisation is :mod:`automodel.training.parallel.module_init`'s.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError
from automodel.training.parallel.blocks import clean_name, tied_to
from automodel.training.parallel.module_init import init_module_by_module, local_slices

INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block every registered parameter is moved to the meta device; buffers stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@dataclass
class MaterializeReport:
    """What filled the parameters (clean names): read from the files, freshly initialised; file keys not used."""

    loaded: list[str] = field(default_factory=list)
    initialised: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def hf_checkpoint_key(name: str) -> str:
    """The key of a model's tensor in its HF base checkpoint (a peft model's names without its wrapping)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


WeightSource = tuple[str | Path, Callable[[str], str]]  # a safetensors directory, model key -> key in its files


def materialize(model: nn.Module, device: torch.device | str, seed: int,
                weights: str | Path | Sequence[WeightSource] | None = None,
                checkpoint_key: Callable[[str], str] = hf_checkpoint_key) -> MaterializeReport:
    """Allocate ``model``'s (sharded) parameters on ``device`` and fill them; every rank calls it.

    ``weights``: a directory of safetensors files (one file, or several with ``model.safetensors.index.json``),
    its tensors named ``checkpoint_key(name)``; or several ``(directory, checkpoint_key)`` sources, the first
    holding a tensor wins (a LoRA checkpoint's adapters before the base model's files). Parameters and persistent
    buffers found there are read slice by slice, the rest are initialised from ``seed`` by
    :func:`init_module_by_module`. No ``weights``: all are initialised.
    """
    device = torch.device(device)
    buffers = [(module, name, buffer) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None and not buffer.is_meta]
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for module, name, buffer in buffers:  # to_empty replaced them with uninitialised memory
        module._buffers[name] = buffer.to(device)
    for (first, first_name), *others in (group for group in holders.values() if len(group) > 1):
        for module, name in others:  # to_empty gives each holder of a tied parameter its own copy
            module._parameters[name] = first._parameters[first_name]
    report = MaterializeReport()
    done: set[int] = set()
    sources = [(weights, checkpoint_key)] if isinstance(weights, (str, Path)) else list(weights or ())
    unused: set[str] = set()
    for directory, key_of in sources:
        unused |= _read_files(model, Path(directory), key_of, done, report)
    report.unused = sorted(unused)
    report.initialised = init_module_by_module(model, seed, skip=done)
    return report


def _read_files(model: nn.Module, directory: Path, checkpoint_key: Callable[[str], str], done: set[int],
                report: MaterializeReport) -> set[str]:
    """Read the tensors not in ``done`` (ids) that ``directory`` holds; returns its keys no tensor maps to."""
    files = weight_files(directory)
    todo: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    matched = {checkpoint_key(clean_name(name)) for name in model.state_dict(keep_vars=True)} & set(files)
    for name, tensor in _unique_tensors(model):
        key = checkpoint_key(name)
        if key in files and id(tensor) not in done:
            todo.setdefault(files[key], []).append((name, key, tensor))
    for file, entries in sorted(todo.items()):  # one file mapped at a time: its pages leave memory after it
        with _open(file) as handle:
            for name, key, tensor in entries:
                _read_slice(handle, key, tensor, file)
                done.add(id(tensor))
                report.loaded.append(name)
    return set(files) - matched


def compare_keys(model: nn.Module, directory: Path, checkpoint_key: Callable[[str], str] = hf_checkpoint_key,
                 include: Callable[[str], bool] = lambda name: True) -> tuple[list[str], list[str], list[str]]:
    """The model's tensors (those ``include`` accepts, a tied tensor once) that the safetensors files under
    ``directory`` lack, the file keys no tensor of the model maps to, and the tensors whose shapes differ
    (``key: checkpoint (...) vs model (...)``); reads the files' headers only."""
    files = weight_files(directory)
    wanted = [(name, tensor) for name, tensor in _unique_tensors(model) if include(name)]
    missing = [name for name, _ in wanted if checkpoint_key(name) not in files]
    mapped = {checkpoint_key(clean_name(name)) for name in model.state_dict(keep_vars=True)}  # tied aliases too
    shapes = _file_shapes({key: files[key] for key in (checkpoint_key(name) for name, _ in wanted) if key in files})
    mismatched = [f"{checkpoint_key(name)}: checkpoint {shapes[checkpoint_key(name)]} vs model {tuple(tensor.shape)}"
                  for name, tensor in wanted
                  if checkpoint_key(name) in shapes and shapes[checkpoint_key(name)] != tuple(tensor.shape)]
    return missing, sorted(set(files) - mapped), mismatched


def _file_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each key's shape from the header of the file holding it (each file opened once)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in set(files.values()):
        with _open(file) as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key, f in files.items() if f == file})
    return shapes


def _unique_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers under their ``state_dict`` names, a tied tensor once (its first name)."""
    tied = tied_to(model)
    return [(name, tensor) for name, tensor in model.state_dict(keep_vars=True).items()
            if tied[clean_name(name)] == clean_name(name)]


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor key -> the safetensors file holding it (``model.safetensors.index.json``, else every file's keys)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise AutomodelError(f"'{index}' is not a safetensors index (no readable weight_map: {err})") from None
        files = {key: directory / name for key, name in weight_map.items()}
        for file in set(files.values()) - {p for p in files.values() if p.is_file()}:
            raise AutomodelError(f"'{index}' names '{file.name}', which is missing from '{directory}'")
        return files
    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        with _open(file) as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    if not files:
        raise AutomodelError(f"'{directory}' holds no safetensors weights (no {INDEX_FILE}, no *.safetensors)")
    return files


def _read_slice(handle: Any, key: str, tensor: torch.Tensor, file: Path) -> None:
    """Copy this rank's slice of ``key`` into ``tensor``'s local part (a dtype cast where they differ)."""
    part = handle.get_slice(key)
    if tuple(part.get_shape()) != tuple(tensor.shape):
        raise AutomodelError(f"'{key}' in '{file}' has shape {tuple(part.get_shape())}, the model's is "
                             f"{tuple(tensor.shape)}: is the checkpoint for this architecture and config?")
    local, slices = local_slices(tensor)
    if local.numel() == 0:
        return
    with torch.no_grad():
        local.copy_(part[slices] if slices else handle.get_tensor(key))


def _open(file: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
        raise AutomodelError(f"'{file}' is corrupted: it is not a complete safetensors file ({err}); replace "
                             "it with an intact copy, or point the config at another checkpoint or model") from None


# ---- fresh initialisation ---------------------------------------------------------------------------------------
