"""Graceful stop on SIGTERM / SIGINT: finish the current step, checkpoint, exit; a second SIGINT aborts."""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

from automodel.errors import AutomodelError


class TrainingStopped(AutomodelError):
    """Raised after a requested stop has been checkpointed; the exit code follows the shell's 128 + signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """Installs handlers for the duration of training; ``requested`` is checked between steps."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: abort now, without a checkpoint
        self.signum = signum
        print(f"\nreceived {signal.Signals(signum).name}: finishing the current step, then writing a checkpoint "
              "(press Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
