"""Which micro-batches form a step, and when to log, validate and checkpoint (DESIGN §9)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from automodel.errors import AutomodelError
from automodel.training.sections import StepSchedulerConfig


def steps_per_epoch(micro_batches: int, grad_accumulation_steps: int) -> int:
    """Optimizer steps in one pass over ``micro_batches``: the last, shorter group is a step too."""
    return math.ceil(micro_batches / grad_accumulation_steps)


class StepScheduler:
    """Groups micro-batches into optimizer steps; steps count from 1.

    An epoch's last group may hold fewer than ``grad_accumulation_steps`` micro-batches: it is trained as a step
    (upstream's rule), its loss normalised by the label tokens it holds. ``num_epochs`` unset lets ``max_steps``
    alone decide, over as many epochs as it needs; with both set the first limit reached ends the run.
    """

    def __init__(self, config: StepSchedulerConfig, grad_accumulation_steps: int, steps_per_epoch: int | None):
        self.config = config
        self.grad_accumulation_steps = grad_accumulation_steps
        self.steps_per_epoch = steps_per_epoch
        self.num_epochs = config.num_epochs
        if config.max_steps is not None:
            self.max_steps = config.max_steps
        elif steps_per_epoch is not None:
            self.max_steps = steps_per_epoch * (config.num_epochs or 1)
            self.num_epochs = config.num_epochs or 1
        else:
            raise AutomodelError("step_scheduler.max_steps must be set when the dataset has no length (streaming)")
        if steps_per_epoch == 0:
            raise AutomodelError("the training data loader yields no batch (fewer samples than dataloader.batch_size "
                                 "with drop_last?); use more data or smaller batches")
        self.step = 0
        self.epoch = 0
        self.epoch_step = 0  # steps trained in the current epoch
        self._epoch_exhausted = False  # the current epoch's data has run out (its last step is being trained)
        self._skip = 0  # micro-batches of the current epoch already trained (a resume on another number of ranks)

    @property
    def total_steps(self) -> int:
        """The steps this run will train: ``max_steps``, or fewer when ``num_epochs`` ends the run first."""
        if self.num_epochs is None or self.steps_per_epoch is None:
            return self.max_steps
        return min(self.max_steps, self.num_epochs * self.steps_per_epoch)

    def _epochs_left(self) -> bool:
        return self.num_epochs is None or self.epoch < self.num_epochs

    def batches(self, dataloader: Iterable[Any]) -> Iterator[list[Any]]:
        """Yield the micro-batches of each step until max_steps or num_epochs is reached."""
        while self.step < self.max_steps and self._epochs_left():
            buffer: list[Any] = []
            seen = 0
            resumed = self.epoch_step > 0  # a restored loader may have nothing left of this epoch
            for sampler in (getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if set_epoch is not None:
                    set_epoch(self.epoch)  # a distributed (or bucket) sampler shuffles per epoch
            for batch in dataloader:
                seen += 1
                if self._skip:
                    self._skip -= 1
                    continue
                buffer.append(batch)
                if len(buffer) == self.grad_accumulation_steps:
                    yield buffer
                    buffer = []
                    if self.step >= self.max_steps:
                        return
            if buffer:
                self._epoch_exhausted = True
                yield buffer
            if seen == 0 and not resumed:
                raise AutomodelError("the training data ran out: an epoch gave no batch")
            self.epoch += 1
            self.epoch_step = 0
            self._epoch_exhausted = False
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
        return self.step >= self.max_steps or not self._epochs_left()

    def stop_reason(self) -> str:
        """Which limit ended the run (said in the log line after the last step)."""
        if self.step >= self.max_steps:
            return f"step_scheduler.max_steps: {self.max_steps} reached"
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            return f"step_scheduler.num_epochs: {self.num_epochs} done before max_steps: {self.max_steps}"
        return "stopped early"

    def _every(self, interval: int | None) -> bool:
        return bool(interval) and self.step % interval == 0

    def is_log_step(self) -> bool:
        """Whether training.jsonl gets this step (every ``log_interval`` steps, and the last one)."""
        return self._every(self.config.log_interval) or self.step == self.total_steps

    def is_remote_log_step(self) -> bool:
        """Whether the metric backends get this step (every ``log_remote_every_steps``, else with training.jsonl)."""
        if self.config.log_remote_every_steps is None:
            return self.is_log_step()
        return self._every(self.config.log_remote_every_steps) or self.step == self.total_steps

    def is_val_step(self) -> bool:
        return self._every(self.config.val_check_interval)

    def is_epoch_end(self) -> bool:
        """Whether the step just trained was its epoch's last (unknown for data without a length)."""
        return self._epoch_exhausted or self.epoch_step == self.steps_per_epoch

    def is_checkpoint_step(self, last: bool) -> bool:
        every_epoch = self.config.save_checkpoint_every_epoch and self.is_epoch_end()
        return self._every(self.config.checkpoint_interval) or every_epoch or last

    def state_dict(self) -> dict[str, int]:
        # After an epoch's data ran out, a resume starts the next epoch (the data loader's saved position is the
        # end of its pass, from which it begins a new one).
        if self._epoch_exhausted:
            return {"step": self.step, "epoch": self.epoch + 1, "epoch_step": 0}
        return {"step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.epoch_step = int(state["step"]), int(state["epoch"]), int(state["epoch_step"])
