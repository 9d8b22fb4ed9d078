"""A step or a validation batch that runs out of memory, said as what to change instead of a traceback.

The weights, gradients and optimizer state are checked against the device's memory before anything is allocated
(:mod:`automodel.training.memory_fit`); the activations of a batch are not known then. When a forward or backward
then fails to allocate (CUDA's ``torch.OutOfMemoryError``, a CPU allocator's "can't allocate memory"), the run
stops with the step, the batch's shape and the keys that lower the activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from automodel.errors import AutomodelError


def ran_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (torch raises a ``RuntimeError`` for a failed CPU allocation)."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and (
        "out of memory" in text.lower() or "can't allocate memory" in text))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {(text.splitlines()[0] if text else '')[:300].rstrip('.')}"


@contextlib.contextmanager
def training_out_of_memory(step: Callable[[], int], batch: Callable[[], str]) -> Iterator[None]:
    """Around a training step (``step``: its number; ``batch``: its first micro-batch described)."""
    try:
        yield
    except RuntimeError as err:
        if not ran_out_of_memory(err):
            raise
        raise AutomodelError(
            f"step {step()} ran out of memory in its forward or backward ({_first_line(err)}); the micro-batch is "
            f"{batch()}. The weights, gradients and optimizer state fit (checked before the model was built): the "
            "activations did not. Lower dataloader.batch_size (step_scheduler.local_batch_size) or the sequence "
            "length (the data set's max length, packed_sequence.packed_sequence_size), set "
            "distributed.activation_checkpointing: true, or split the sequences over more processes "
            "(distributed.cp_size)") from err


@contextlib.contextmanager
def validation_out_of_memory(name: str, step: int, loader: Any) -> Iterator[None]:
    """Around a validation batch: training fit, so point at the validation batch size."""
    try:
        yield
    except RuntimeError as err:
        if not ran_out_of_memory(err):
            raise
        size = getattr(loader, "batch_size", None)
        raise AutomodelError(
            f"validation [{name}] at step {step} ran out of memory with batch size {size}: {_first_line(err)}. "
            "Training fit, so lower validation_dataloader.batch_size (it defaults to "
            "dataloader.batch_size) or shorten the validation samples; validation runs under torch.no_grad() in "
            "eval mode") from err
