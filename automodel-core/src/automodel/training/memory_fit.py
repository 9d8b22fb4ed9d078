"""Whether a model built on the meta device can be materialised here, checked before any value is made.

A model too large for the machine used to be killed by the kernel's out-of-memory killer part-way through
materialisation or the first step, with no message (a shell's ``Killed``, torchrun's exit status -9). On the meta
device the model's parameters already have their shapes, dtypes and (after sharding) their local shards, so what a
process will hold is known exactly before anything is allocated: its weights and buffers, a gradient for each
trainable weight and, for torch's Adam / AdamW / SGD with momentum, the optimizer's per-weight buffers (each the
weight's shape and dtype). That is a lower bound (the activations come on top, and another optimizer's state); when
it exceeds the memory the device has, the run cannot fit and is stopped with the figures and what to change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.training.host_memory import byte_size

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class ModelBytes:
    """What one process holds of a model, in bytes."""

    weights: int  # parameters and buffers (this rank's shards of sharded ones)
    gradients: int  # one gradient per trainable parameter, in its dtype
    optimizer: int = 0  # the optimizer's per-parameter buffers, where known

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def optimizer_buffers(target: str | None, settings: Mapping[str, Any]) -> int:
    """How many buffers of each trainable parameter's size torch's optimizer ``target`` keeps (Adam / AdamW: two
    moments, a third with amsgrad; SGD: one with momentum); 0 for another optimizer (not counted)."""
    name = (target or "").rsplit(".", 1)[-1]
    if (target or "").startswith("torch.optim.") and name in ("Adam", "AdamW"):
        return 3 if settings.get("amsgrad") else 2
    if target == "torch.optim.SGD":
        return 1 if settings.get("momentum") else 0
    return 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard


def model_bytes(model: torch.nn.Module, state_buffers: int = 0) -> ModelBytes:
    """The bytes of ``model``'s parameters, buffers and gradients on this process (a tied weight counted once), and
    of the optimizer's ``state_buffers`` buffers the size of each gradient."""
    weights = gradients = 0
    for param in model.parameters():
        size = _local(param).numel() * param.element_size()
        weights += size
        gradients += size if param.requires_grad else 0
    weights += sum(_local(buffer).numel() * buffer.element_size() for buffer in model.buffers())
    return ModelBytes(weights, gradients, state_buffers * gradients)


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


def check_fits(model: torch.nn.Module, device: torch.device, optimizer: str | None = None,
               optimizer_settings: Mapping[str, Any] | None = None) -> None:
    """Stop before materialising ``model`` on ``device`` when its weights, gradients and the state of torch's
    ``optimizer`` (its dotted target, with its ``optimizer_settings``) exceed the memory there; an
    ``AutomodelError`` with the figures and what to change."""
    buffers = optimizer_buffers(optimizer, optimizer_settings or {})
    need = model_bytes(model, buffers)
    free, sharing = device_memory(device)
    if free is None or need.total * sharing <= free:
        return
    share = f", for each of the {sharing} processes of this machine" if sharing > 1 else ""
    state = f", {optimizer.rsplit('.', 1)[-1]}'s state ({byte_size(need.optimizer)})" if need.optimizer else ""
    rest = "the activations" if buffers else "the optimizer's state and the activations"
    raise AutomodelError(
        f"model: does not fit in the memory of {device}: its weights ({byte_size(need.weights)}), their gradients "
        f"({byte_size(need.gradients)}){state} need {byte_size(need.total)}{share}, and {byte_size(free)} is free "
        f"there ({rest} would come on top); nothing was allocated. Shard it over more processes "
        "(distributed.strategy: fsdp2 with --nproc-per-node / --nnodes), train LoRA adapters (peft:) instead of every "
        "weight, load it in bf16 (model.dtype: bfloat16), or use a machine with more memory")
