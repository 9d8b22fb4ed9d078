"""The run's parallel layout and precision from ``distributed.*`` and the world size: one place that validation,
the ``--dry-run`` plan and ``TrainRecipe.setup`` read, so the three agree.

The world size is the launch's: ``--nproc-per-node N --nnodes M`` when the CLI validates a run it is about to start,
else this process's ``WORLD_SIZE`` (1 outside torchrun) — see ``dist.expected_world_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from automodel.errors import ConfigIssue
from automodel.training.dist import expected_world_size, world_size_source
from automodel.training.parallel.mesh import MeshLayout, describe_mesh, mesh_issues, plan_mesh
from automodel.training.parallel.precision import Precision, parse_dtype_name, precision_issues, resolve_precision

if TYPE_CHECKING:
    from automodel.config import Config

# Parallelism another issue implements: refused here, with what to use instead (the mesh keeps their dimensions)
NOT_YET = {
    "tp_size": "tensor parallelism is not implemented yet; use tp_size: 1 (data parallelism: dp_size)",
    "pp_size": "pipeline parallelism is not implemented yet; use pp_size: 1 (data parallelism: dp_size)",
}


def shards_with_fsdp2(cfg: Config, implementation: str | None, world: int) -> bool:
    """Whether the sharding slot runs the core's FSDP2 (``implementation``: the recipe's choice for the slot)."""
    strategy = cfg.distributed.strategy if cfg.distributed is not None else None
    return world > 1 and (implementation or strategy) == "fsdp2"


def mesh_layout(cfg: Config, world: int) -> tuple[MeshLayout, list[ConfigIssue]]:
    """The mesh for ``world`` ranks and its problems (with problems: plain data parallelism over every rank)."""
    settings = cfg.distributed
    if settings is None:
        return MeshLayout(world, dp_shard=world), []
    issues = mesh_issues(world, settings.dp_size, settings.dp_replicate_size, settings.tp_size, settings.cp_size,
                         settings.pp_size)
    return (MeshLayout(world, dp_shard=world) if issues else parallel_layout(cfg, world)), issues


def parallel_layout(cfg: Config, world: int) -> MeshLayout:
    """The validated mesh for ``world`` ranks (a ``ConfigError`` naming every wrong key otherwise)."""
    settings = cfg.distributed
    if settings is None:
        return MeshLayout(world, dp_shard=world)
    return plan_mesh(world, settings.dp_size, settings.dp_replicate_size, settings.tp_size, settings.cp_size,
                     settings.pp_size)


def validation_device() -> torch.device:
    """The device a run would train on here (what the default precision depends on)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_precision(cfg: Config, device: torch.device, fsdp2: bool) -> tuple[Precision, list[ConfigIssue]]:
    """The precision ``distributed.mp_policy`` / ``autocast_dtype`` give on ``device``, and their problems."""
    settings = cfg.distributed
    if settings is None:
        return resolve_precision(None, device, fsdp2), []
    issues = precision_issues(settings.mp_policy, device, fsdp2, autocast_dtype=settings.autocast_dtype)
    if issues:
        return resolve_precision(None, device, fsdp2), issues
    return resolve_precision(settings.mp_policy, device, fsdp2, autocast_dtype=settings.autocast_dtype), []


def parallel_issues(cfg: Config, implementation: str | None) -> list[ConfigIssue]:
    """What ``distributed.*`` asks that this build or this world size cannot do, each under its key."""
    settings = cfg.distributed
    if settings is None:
        return []
    world = expected_world_size()
    issues = [ConfigIssue(f"distributed.{key}", f"{getattr(settings, key)}: {why}")
              for key, why in NOT_YET.items() if getattr(settings, key) > 1]
    if settings.sequence_parallel:
        issues.append(ConfigIssue("distributed.sequence_parallel", "true needs tensor parallelism (tp_size > 1), "
                                  "which is not implemented yet; set it to false"))
    if settings.ep_size is not None and settings.ep_size > 1:
        issues.append(ConfigIssue("distributed.ep_size", f"{settings.ep_size}: expert parallelism needs MoE model "
                                  "implementations this build does not have yet; use ep_size: 1 (or null)"))
    fsdp2 = shards_with_fsdp2(cfg, implementation, world)
    if settings.dp_replicate_size > 1 and not fsdp2:
        issues.append(ConfigIssue("distributed.dp_replicate_size", f"{settings.dp_replicate_size}: HSDP replicates "
                                  "FSDP2's shards, so it needs distributed.strategy: fsdp2 and more than one "
                                  f"process (this run: {world_size_source()}); use 1"))
    if settings.enable_fsdp2_prefetch and not fsdp2:
        issues.append(ConfigIssue("distributed.enable_fsdp2_prefetch", "true orders FSDP2's parameter gathers, so "
                                  "it needs distributed.strategy: fsdp2 and more than one process (this run: "
                                  f"{world_size_source()}); set it false"))
    issues += mesh_layout(cfg, world)[1]
    issues += run_precision(cfg, validation_device(), fsdp2)[1]
    return issues


def storage_dtype_name(cfg: Config) -> torch.dtype | None:
    """The dtype the model section asks for (``dtype`` / ``torch_dtype``), None when it names none."""
    model = cfg.model
    for key in ("dtype", "torch_dtype"):
        value = model.get(key) if model is not None else None
        if value is not None and value != "auto":
            return parse_dtype_name(value)
    return None


def plan_lines(cfg: Config, implementation: str | None) -> list[str]:
    """The ``--dry-run`` lines: the world size and where it comes from, the mesh and each rank's place, precision."""
    world = expected_world_size()
    layout, _ = mesh_layout(cfg, world)
    fsdp2 = shards_with_fsdp2(cfg, implementation, world)
    precision, _ = run_precision(cfg, validation_device(), fsdp2)
    stored = storage_dtype_name(cfg)
    line = precision.describe(stored or torch.float32, fsdp2)
    if stored is None:
        line += " (storage: the model's own dtype, fp32 assumed here)"
    return [f"world size: {world} ({world_size_source()})", *describe_mesh(layout), line]
