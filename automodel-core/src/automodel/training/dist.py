"""torch.distributed plumbing: the process group, reductions over ranks and each rank's data shard."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    """The number of processes of this run (torchrun's WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_process_group(backend: str | None, timeout_minutes: int, log: Callable[[str], None],
                       init_method: str | None = None) -> None:
    """Join the torchrun job (nccl on CUDA, gloo on CPU; a configured nccl without CUDA falls back to gloo) through
    ``init_method`` (torch's default: env://, the MASTER_ADDR / MASTER_PORT torchrun sets)."""
    if world_size() <= 1 or dist.is_initialized():
        return
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl" and not torch.cuda.is_available():
        log("dist_env.backend: nccl needs CUDA; using gloo on this CPU machine")
        chosen = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(chosen, init_method=init_method, rank=rank(), world_size=world_size(),
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    log(f"process group: {chosen}, {world_size()} processes, rendezvous {init_method or 'env://'}")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


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
    """Each rank reads its own shard; resumable (torchdata's stateful sampler). None in a single process."""
    if not is_distributed():
        return None
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    return StatefulDistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                      shuffle=shuffle, seed=seed, drop_last=True)
