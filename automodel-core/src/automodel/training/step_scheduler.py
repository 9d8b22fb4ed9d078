"""Which micro-batches form a step, and when to log, validate and checkpoint (DESIGN §9)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from automodel.errors import AutomodelError
from automodel.training.sections import StepSchedulerConfig


class StepScheduler:
    """Groups micro-batches into optimizer steps; steps count from 1.

    Micro-batches left over at the end of an epoch (fewer than ``grad_accumulation_steps``) are dropped, so a
    checkpoint always falls between whole steps and a resume is exact.
    """

    def __init__(self, config: StepSchedulerConfig, grad_accumulation_steps: int, steps_per_epoch: int | None):
        self.config = config
        self.grad_accumulation_steps = grad_accumulation_steps
        self.steps_per_epoch = steps_per_epoch
        self.num_epochs = config.num_epochs
        if config.max_steps is not None:
            self.max_steps = config.max_steps
        elif steps_per_epoch is not None:
            self.max_steps = steps_per_epoch * config.num_epochs
        else:
            raise AutomodelError("step_scheduler.max_steps must be set when the dataset has no length (streaming)")
        if steps_per_epoch == 0:
            raise AutomodelError(
                f"the training data gives no full step: fewer micro-batches per epoch than "
                f"step_scheduler.grad_accumulation_steps={grad_accumulation_steps}; use more data or smaller batches")
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # steps trained in the current epoch
        self._skip = 0  # micro-batches of the current epoch already trained (a resume on another number of ranks)

    def batches(self, dataloader: Iterable[Any]) -> Iterator[list[Any]]:
        """Yield the micro-batches of each step until max_steps or num_epochs is reached."""
        while self.step < self.max_steps and self.epoch < self.num_epochs:
            buffer: list[Any] = []
            yielded = False
            set_epoch = getattr(getattr(dataloader, "sampler", None), "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)  # a distributed sampler shuffles per epoch
            for batch in dataloader:
                if self._skip:
                    self._skip -= 1
                    continue
                buffer.append(batch)
                if len(buffer) == self.grad_accumulation_steps:
                    yielded = True
                    yield buffer
                    buffer = []
                    if self.step >= self.max_steps:
                        return
            if not yielded and self.step < self.max_steps and self.steps_per_epoch is None:
                raise AutomodelError("the training data ran out before one full step")
            self.epoch += 1
            self.epoch_step = 0
            self._skip = 0

    def finish_step(self) -> int:
        self.step += 1
        self.epoch_step += 1
        return self.step

    def skip_trained_steps(self, steps: int) -> None:
        """Resuming with a fresh data loader: pass over the micro-batches of the ``steps`` already trained in the
        current epoch before the next step."""
        self._skip = steps * self.grad_accumulation_steps

    @property
    def done(self) -> bool:
        return self.step >= self.max_steps or self.epoch >= self.num_epochs

    def _every(self, interval: int | None) -> bool:
        return bool(interval) and self.step % interval == 0

    def is_log_step(self) -> bool:
        return self._every(self.config.log_interval) or self.step == self.max_steps

    def is_val_step(self) -> bool:
        return self._every(self.config.val_check_interval)

    def is_checkpoint_step(self, last: bool) -> bool:
        return self._every(self.config.checkpoint_interval) or last

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.epoch_step = int(state["step"]), int(state["epoch"]), int(state["epoch_step"])
