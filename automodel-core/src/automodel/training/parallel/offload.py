"""``distributed.offload_policy``: FSDP2's CPU offload (upstream's ``{_target_: torch.distributed.fsdp.CPUOffloadPolicy,
pin_memory: ...}``).

Each rank keeps its parameter shards, their gradients and the optimizer state in host memory; FSDP2 copies a
unit's shards to the device for its all-gather and the reduced gradients back, and the optimizer steps on the CPU.
So the model is materialised on the CPU, and on CUDA the process group also gets a gloo backend for the collectives
over host tensors (the gradient norm), as TorchTitan does. ``pin_memory`` (upstream's default true) pins the host
copies for faster transfers; it needs CUDA, and a CPU run, whose parameters are host memory already, notes that it
governs nothing. Applied with FSDP2 (and HSDP), also over tensor-parallel shards; context, pipeline and expert
parallelism are refused with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from automodel.errors import ConfigIssue

if TYPE_CHECKING:  # torch is imported where a run needs it: the config section reads this module too
    import torch

    from automodel.config import Config

TARGET = "torch.distributed.fsdp.CPUOffloadPolicy"


def offload_problem(value: Any) -> str | None:
    """What is wrong with the section's value (None when it is upstream's form, or null)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"expected {{_target_: {TARGET}, pin_memory: true | false}}, found {value!r}"
    target = value.get("_target_", TARGET)
    if target != TARGET:
        return f"_target_ '{target}' is not FSDP2's CPU offload; name {TARGET} (or leave _target_ out)"
    unknown = sorted(set(value) - {"_target_", "pin_memory"})
    if unknown:
        return f"{', '.join(unknown)}: not an argument of CPUOffloadPolicy (it takes pin_memory)"
    if not isinstance(value.get("pin_memory", True), bool):
        return f"pin_memory: expected true or false, found {value['pin_memory']!r}"
    return None


def offloads(cfg: Config) -> bool:
    return cfg.distributed is not None and cfg.distributed.offload_policy is not None


def offload_issues(cfg: Config, implementation: str | None, fsdp2: bool, world: str) -> list[ConfigIssue]:
    """The layouts offloading is refused with (``implementation``: the recipe's own sharding, if any; ``world``: how
    the run's size was found, for the message)."""
    if not offloads(cfg):
        return []
    if implementation not in (None, "fsdp2"):
        return [ConfigIssue("distributed.offload_policy", f"this recipe shards with its own '{implementation}' "
                            "implementation, which has no CPU offload; remove it")]
    if not fsdp2:
        return [ConfigIssue("distributed.offload_policy", "offloads FSDP2's parameter shards, so it needs "
                            f"distributed.strategy: fsdp2 and more than one process (this run: {world}); remove it")]
    settings = cfg.distributed
    combined = [f"{key} {size}" for key, size in (("cp_size", settings.cp_size), ("pp_size", settings.pp_size),
                                                  ("ep_size", settings.ep_size or 1)) if size > 1]
    if combined:
        return [ConfigIssue("distributed.offload_policy", f"CPU offload is applied with FSDP2 data parallelism (and "
                            f"tensor parallelism) here, not with {', '.join(combined)}; remove one of them")]
    return []


def offload_notes(cfg: Config, fsdp2: bool) -> list[str]:
    import torch

    if not (fsdp2 and offloads(cfg)) or torch.cuda.is_available():
        return []
    if not cfg.distributed.offload_policy.get("pin_memory", True):
        return []
    return ["note: distributed.offload_policy.pin_memory: true governs nothing this run: pinned host memory speeds "
            "up copies to a CUDA device, and this run's parameters are in host memory already"]


def offload_policy(cfg: Config, device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for the run (pinned memory on CUDA only), or None when it does not offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if not offloads(cfg):
        return None
    pin = cfg.distributed.offload_policy.get("pin_memory", True) and device.type == "cuda"
    return CPUOffloadPolicy(pin_memory=pin)


def process_group_backend(cfg: Config) -> str | None:
    """``dist_env.backend``, with gloo beside nccl for host tensors when offloading on CUDA."""
    import torch

    backend = cfg.dist_env.backend
    if not (offloads(cfg) and torch.cuda.is_available()) or backend not in (None, "nccl"):
        return backend
    return "cpu:gloo,cuda:nccl"
