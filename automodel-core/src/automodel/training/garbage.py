"""``step_scheduler.gc_every_steps``: Python's garbage collector run between steps instead of by allocation counts.

An automatic collection starts whenever allocations cross a threshold, so in a multi-process run each rank pauses
at a different moment inside a step and the others wait for it at the next collective. Upstream (as torchtitan)
turns automatic collection off for the run and collects on a step schedule; so does this.
"""

from __future__ import annotations

import gc
from typing import Any


class PeriodicGarbageCollection:
    """With ``every`` set: automatic collection is off while the run trains, one full collection happens at the
    start, and the young generations are collected (``gc.collect(1)``) after every ``every``-th step; the
    collector's previous setting comes back at the end. With ``every`` unset nothing changes."""

    def __init__(self, every: int | None):
        self.every = every
        self._was_enabled = False

    def __enter__(self) -> PeriodicGarbageCollection:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc: Any) -> None:
        if self.every and self._was_enabled:
            gc.enable()
