"""torch.distributed plumbing: process group, token-weighted reductions, data sharding, sharding stages."""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from automodel.errors import ConfigIssue

if TYPE_CHECKING:
    from automodel.training.recipe import TrainRecipe


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_process_group(backend: str | None, timeout_minutes: int, log: Any) -> None:
    """Join the torchrun job (nccl on CUDA, gloo on CPU; a configured nccl without CUDA falls back to gloo)."""
    if world_size() <= 1 or dist.is_initialized():
        return
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl" and not torch.cuda.is_available():
        log("dist_env.backend: nccl needs CUDA; using gloo on this CPU machine")
        chosen = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(chosen, timeout=datetime.timedelta(minutes=timeout_minutes))


def all_reduce_sum(*values: float | int | torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Sum scalars over ranks in one collective (identity in a single process)."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if is_distributed():
        dist.all_reduce(tensor)
    return list(tensor.unbind())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (so all ranks stop at the same step)."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def distributed_sampler(dataset: Any, shuffle: bool, seed: int) -> Any:
    """Each rank reads its own shard; resumable (torchdata's stateful sampler)."""
    if not is_distributed():
        return None
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    return StatefulDistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                      shuffle=shuffle, seed=seed, drop_last=True)


# ---- sharding stages --------------------------------------------------------------------------------------


def wrap_ddp(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.nn.parallel import DistributedDataParallel

    model.to(recipe.device)
    device_ids = [recipe.device.index] if recipe.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids), f"DDP over {dist.get_world_size()} ranks"


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Repeated transformer blocks (a ModuleList of identical layer types): each becomes one FSDP unit."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            if len({type(m) for m in module}) == 1:
                best = list(module)
    return best


def wrap_fsdp2(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(recipe.device)
    mesh = init_device_mesh(recipe.device.type, (dist.get_world_size(),))
    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, f"FSDP2 over {dist.get_world_size()} ranks ({len(blocks)} blocks sharded)"


def wrap_megatron_fsdp(recipe: TrainRecipe, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    import megatron_fsdp  # validated present before anything is built

    model.to(recipe.device)
    return megatron_fsdp.fully_shard(model), f"Megatron-FSDP over {dist.get_world_size()} ranks"


def strategy_issues(strategy: str) -> list[ConfigIssue]:
    """What a strategy needs that this machine lacks (checked at validation)."""
    if strategy == "megatron_fsdp":
        missing = [what for what, ok in (("CUDA", torch.cuda.is_available()),
                                         ("the megatron_fsdp package", importlib.util.find_spec("megatron_fsdp")))
                   if not ok]
        if missing:
            return [ConfigIssue("distributed.strategy", f"megatron_fsdp needs {' and '.join(missing)}, which this "
                                                        "machine lacks; use fsdp2 or ddp")]
    return []


def is_fsdp2(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())
