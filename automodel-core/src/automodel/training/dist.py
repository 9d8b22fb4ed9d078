"""torch.distributed plumbing: the process group, reductions over ranks, each rank's data shard, the world size
validation plans for, and errors that name the step where a collective stalled."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from automodel.errors import AutomodelError

# (world size, where it comes from, nodes) while the CLI validates a run it is about to launch (planned_world_size)
_PLANNED: ContextVar[tuple[int, str, int] | None] = ContextVar("automodel_planned_world", default=None)
# What gloo / nccl / the store say when a peer stalled past the timeout or went away
_PEER_FAILURES = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe",
                  "socket closed", "wait timeout")


def world_size() -> int:
    """The number of processes of this run (torchrun's WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def planned_world_size(size: int, source: str, nodes: int = 1) -> Iterator[None]:
    """Within the block, validation and ``--dry-run`` plan for ``size`` processes on ``nodes`` machines (``source``
    says why: the CLI's ``--nproc-per-node`` x ``--nnodes`` before it launches them)."""
    token = _PLANNED.set((size, source, nodes))
    try:
        yield
    finally:
        _PLANNED.reset(token)


def expected_world_size() -> int:
    """The world size a config is validated and planned for: the launch being prepared, else this process's."""
    planned = _PLANNED.get()
    return planned[0] if planned is not None else world_size()


def expected_node_count() -> int:
    """The machines of the run validated: the launch being prepared (``--nnodes``), else torchrun's (WORLD_SIZE /
    LOCAL_WORLD_SIZE), else one."""
    planned = _PLANNED.get()
    if planned is not None:
        return planned[2]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    return max(1, world_size() // max(local, 1))


def world_size_source() -> str:
    """Where ``expected_world_size`` comes from, for the messages that report it."""
    planned = _PLANNED.get()
    if planned is not None:
        return planned[1]
    if "WORLD_SIZE" in os.environ:
        return f"WORLD_SIZE={world_size()}"
    return "WORLD_SIZE is not set; --nproc-per-node N --nnodes M plan for N x M"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_process_group(backend: str | None, timeout_minutes: float, log: Callable[[str], None],
                       init_method: str | None = None, store: Any = None) -> None:
    """Join the torchrun job (nccl on CUDA, gloo on CPU; a configured nccl without CUDA falls back to gloo) through
    ``init_method`` (torch's default: env://, the MASTER_ADDR / MASTER_PORT torchrun sets), or through ``store``, a
    rendezvous store the recipe already holds (then ``init_method`` is how that store was reached)."""
    if world_size() <= 1 or dist.is_initialized():
        return
    chosen = chosen_backend(backend, log)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(chosen, init_method=None if store is not None else init_method, store=store, rank=rank(),
                            world_size=world_size(), timeout=datetime.timedelta(minutes=timeout_minutes))
    log(f"process group: {chosen}, {world_size()} processes, rendezvous {init_method or 'env://'}")


def chosen_backend(backend: str | None, log: Callable[[str], None]) -> str:
    """``dist_env.backend``, or nccl on CUDA and gloo on CPU when unset (a configured nccl without CUDA: gloo)."""
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl" and not torch.cuda.is_available():
        log("dist_env.backend: nccl needs CUDA; using gloo on this CPU machine")
        chosen = "gloo"
    return chosen


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(*values: float | int | torch.Tensor, device: torch.device, group: Any = None
                   ) -> list[torch.Tensor]:
    """Sum scalars over ranks in one collective (identity in a single process); ``group``: only these ranks (the
    data-parallel group under tensor parallelism), None: every rank."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if is_distributed():
        dist.all_reduce(tensor, group=group)
    return list(tensor.unbind())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (so all ranks stop at the same step)."""
    if not is_distributed():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


class EpochPositionSampler(StatefulDistributedSampler):
    """torchdata's resumable distributed sampler, whose saved position also names its epoch: a position saved at the
    end of an epoch's pass (the checkpoint after the epoch's last, shorter step) is not applied to the next epoch,
    of which torchdata's would skip as many samples (a resume there found no batch left)."""

    position_epoch: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.position_epoch = state_dict.get("epoch")

    def __iter__(self) -> Iterator[int]:
        if self.next_yielded is not None and self.position_epoch not in (None, self.epoch):
            self.next_yielded = None  # the saved position was another epoch's: this one starts at its beginning
        return super().__iter__()


def distributed_sampler(dataset: Any, shuffle: bool, seed: int, replicas: int, replica: int) -> Any:
    """Data-parallel replica ``replica`` of ``replicas`` reads its own shard of each epoch's order; resumable
    (torchdata's stateful sampler). A shuffled epoch ``e`` is the permutation of ``seed + e`` for any number of
    replicas, so one process (one replica) reads the samples in the order a data-parallel run's ranks read them
    together: a run sees the same steps on any number of ranks, in every epoch (a checkpoint resumed on another
    number of ranks, one process with the accumulation of several ranks), and nothing is drawn from a generator a
    resume would have to replay. None where there is nothing to shard or shuffle."""
    if not is_distributed() or replicas <= 1:
        if not shuffle:
            return None
        replicas, replica = 1, 0
    return EpochPositionSampler(dataset, num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed,
                                drop_last=True)


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank stalled past the timeout or died."""
    if not isinstance(err, (RuntimeError, dist.DistError)):
        return False
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(part in text for part in _PEER_FAILURES)


@contextlib.contextmanager
def naming_stalls(where: Callable[[], str], timeout_minutes: float) -> Iterator[None]:
    """A collective inside the block that another rank never joined (``dist_env.timeout_minutes``) or left: an
    ``AutomodelError`` naming ``where()`` (the step) instead of a backend traceback."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if not is_distributed() or not is_peer_failure(err):
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise AutomodelError(
            f"{where()}: a collective across the {dist.get_world_size()} ranks did not complete: another rank "
            f"stalled for longer than dist_env.timeout_minutes ({timeout_minutes:g}) or stopped ({first}). Every "
            "rank must run the same forwards and collectives; see the other ranks' output for the first error, "
            "and raise dist_env.timeout_minutes if a rank is only slow (a long save or data load)") from err
