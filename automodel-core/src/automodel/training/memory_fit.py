"""Whether a model built on the meta device can be materialised here, checked before any value is made.

A model too large for the machine used to be killed by the kernel's out-of-memory killer part-way through
materialisation or the first step, with no message (a shell's ``Killed``, torchrun's exit status -9). On the meta
device the model's parameters already have their shapes, dtypes and (after sharding) their local shards, so what a
process will hold is known exactly before anything is allocated: its weights and buffers, and a gradient for each
trainable weight. That is a lower bound (the optimizer's state and the activations come on top); when it exceeds
the memory the device has, the run cannot fit and is stopped with the figures and what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from automodel.errors import AutomodelError
from automodel.training.host_memory import byte_size

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class ModelBytes:
    """What one process holds of a model, in bytes."""

    weights: int  # parameters and buffers (this rank's shards of sharded ones)
    gradients: int  # one gradient per trainable parameter, in its dtype

    @property
    def total(self) -> int:
        return self.weights + self.gradients


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard


def model_bytes(model: torch.nn.Module) -> ModelBytes:
    """The bytes of ``model``'s parameters, buffers and gradients on this process (a tied weight counted once)."""
    weights = gradients = 0
    for param in model.parameters():
        size = _local(param).numel() * param.element_size()
        weights += size
        gradients += size if param.requires_grad else 0
    weights += sum(_local(buffer).numel() * buffer.element_size() for buffer in model.buffers())
    return ModelBytes(weights, gradients)


def host_free_bytes() -> int | None:
    """The bytes this machine can still give processes: available memory and free swap (None: not on Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        return sum(int(fields[name].split()[0]) * 1024 for name in ("MemAvailable", "SwapFree") if name in fields)
    except (OSError, ValueError):
        return None


def device_memory(device: torch.device) -> tuple[int | None, int]:
    """The bytes free on ``device`` and how many processes of this machine share them (each CUDA rank its GPU,
    every rank of the host its memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], 1
    if device.type == "cpu":
        return host_free_bytes(), max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return None, 1


def check_fits(model: torch.nn.Module, device: torch.device) -> None:
    """Stop before materialising ``model`` on ``device`` when its weights and gradients alone exceed the memory
    there; an ``AutomodelError`` with the figures and what to change."""
    need = model_bytes(model)
    free, sharing = device_memory(device)
    if free is None or need.total * sharing <= free:
        return
    share = f", for each of the {sharing} processes of this machine" if sharing > 1 else ""
    raise AutomodelError(
        f"model: does not fit in the memory of {device}: its weights ({byte_size(need.weights)}) and their gradients "
        f"({byte_size(need.gradients)}) need {byte_size(need.total)}{share}, and {byte_size(free)} is free there "
        "(the optimizer's state and the activations would come on top); nothing was allocated. Shard it over more "
        "processes (distributed.strategy: fsdp2 with --nproc-per-node / --nnodes), train LoRA adapters (peft:) "
        "instead of every weight, load it in bf16 (model.dtype: bfloat16), or use a machine with more memory")
