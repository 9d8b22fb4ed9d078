"""Where checkpoint writes run and how their ranks agree: one background writer thread, one gloo group.

A background save must never interleave its collectives with training's, so checkpoint writes talk over a group
of their own (``checkpoint_group``, gloo: it reduces host tensors whatever the training backend). A rank that fails
its part of a write must not leave the others waiting in a collective: ``all_ok`` tells every rank whether all
succeeded.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_checkpoint_group: Any = None
_background: ThreadPoolExecutor | None = None


@dataclass
class PendingSave:
    """A save running in the background: ``wait()`` (or ``done()``) before publishing the directory."""

    future: Future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


def run_in_background(work: Callable[[], None]) -> PendingSave:
    """Run ``work`` on the one checkpoint-writing thread (saves run one after the other, in order)."""
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
    return PendingSave(_background.submit(work))


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def checkpoint_group() -> Any:
    """A gloo group of every rank for checkpoint writes (None without a process group). Every rank must call it the
    first time at the same point (creating a group is a collective)."""
    global _checkpoint_group
    if not distributed():
        return None
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


def forget_checkpoint_group() -> None:
    """Drop the cached group once the process groups are destroyed: a destroyed group must not be handed out again,
    and this module's reference must not keep its gloo threads alive until interpreter shutdown."""
    global _checkpoint_group
    _checkpoint_group = None


def group_rank(group: Any = None) -> tuple[int, int]:
    """(this rank, the number of ranks) in ``group``; (0, 1) without a process group."""
    if not distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_ok(ok: bool, group: Any = None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a gloo group; the checkpoint group when None)."""
    if not distributed():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group if group is not None else checkpoint_group())
    return flag.item() == 0.0


def barrier(group: Any = None) -> None:
    if distributed():
        dist.barrier(group=group if group is not None else checkpoint_group())


@contextlib.contextmanager
def single_process_is_intended() -> Iterator[None]:
    """DCP warns on every save and load without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
