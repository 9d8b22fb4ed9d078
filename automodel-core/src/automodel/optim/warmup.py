"""Warmup-then-decay schedulers named by ``_target_`` (``CosineAnnealingWarmup``, ...); their state is plain numbers."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


class _WarmupScheduler(LRScheduler):
    """Linear warmup over ``warmup_steps`` then ``_decay(progress)`` in [0, 1] from base lr down to ``min_lr``."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, min_lr: float = 0.0,
                 total_steps: int | None = None, last_epoch: int = -1):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, found {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self.min_lr = float(min_lr)
        self.total_steps = total_steps
        super().__init__(optimizer, last_epoch)

    def _decay(self, progress: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        lrs = []
        for base in self.base_lrs:
            if self.warmup_steps and step < self.warmup_steps:
                lrs.append(base * (step + 1) / self.warmup_steps)
                continue
            if not self.total_steps or self.total_steps <= self.warmup_steps:
                factor = self._decay(0.0)
            else:
                progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
                factor = self._decay(progress)
            lrs.append(self.min_lr + (base - self.min_lr) * factor)
        return lrs


class CosineAnnealingWarmup(_WarmupScheduler):
    """Linear warmup, then cosine decay to ``min_lr`` at ``total_steps`` (the run's max_steps by default)."""

    def _decay(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class LinearWarmup(_WarmupScheduler):
    """Linear warmup, then linear decay to ``min_lr`` at ``total_steps``."""

    def _decay(self, progress: float) -> float:
        return 1.0 - progress


class ConstantWarmup(_WarmupScheduler):
    """Linear warmup, then the base learning rate held constant."""

    def _decay(self, progress: float) -> float:
        return 1.0
