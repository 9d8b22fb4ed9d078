"""The training progress a run shows on stderr, fitted to where stderr goes.

On a terminal: tqdm's bar, redrawn in place. Anywhere else (CI logs, ``nohup``, SLURM output files) a redrawn bar
is a stream of carriage-return frames, one enormous log line: there the progress is one plain line per log
interval instead (step, loss, learning rate, tokens/s, elapsed time and ETA), and nothing else is written.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tqdm import tqdm


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Steps done out of ``total`` (``initial`` already done when resuming); silent when not ``enabled`` (ranks
    other than 0)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, stream: IO[str] | None = None,
                 desc: str = "train"):
        self.stream = stream or sys.stderr
        self.total, self.step, self.desc = total, initial, desc
        self.enabled = enabled
        self.start, self.start_step = time.perf_counter(), initial
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=self.stream, dynamic_ncols=True) \
            if enabled and self.is_terminal(self.stream) else None

    @staticmethod
    def is_terminal(stream: Any) -> bool:
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty())

    def update(self, steps: int = 1) -> None:
        self.step += steps
        if self.bar is not None:
            self.bar.update(steps)

    def eta(self) -> float | None:
        done = self.step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.start) / done * (self.total - self.step)

    def show(self, loss: float, lr: float, tokens_per_second: float) -> None:
        """A log step's numbers: the bar's postfix on a terminal, else one line."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tps=f"{tokens_per_second:.0f}", refresh=False)
        elif self.enabled:
            eta = self.eta()
            self.stream.write(f"{self.desc} step {self.step}/{self.total}: loss {loss:.4f}, lr {lr:.2e}, "
                              f"{tokens_per_second:.0f} tokens/s, elapsed {_clock(time.perf_counter() - self.start)}"
                              f", ETA {_clock(eta) if eta is not None else '?'}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TaskProgress:
    """Progress of a task other than training (embedding a corpus, a search): tqdm's bar on a terminal; elsewhere
    one line when it ends (what, how many, how long). A context manager."""

    def __init__(self, total: int, desc: str, unit: str = "it", stream: IO[str] | None = None, **tqdm_args: Any):
        self.stream = stream or sys.stderr
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True, **tqdm_args) \
            if Progress.is_terminal(self.stream) else None

    def update(self, count: int = 1) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)

    def __enter__(self) -> TaskProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        elif exc[0] is None:
            self.stream.write(f"{self.desc}: {self.done} {self.unit}s in {_clock(time.perf_counter() - self.start)}\n")
            self.stream.flush()
