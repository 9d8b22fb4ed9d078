"""MetricsSample and the JSONL files the loop writes (continued on resume, each step once)."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from automodel.errors import AutomodelError
from automodel.training.durable import write_atomic


@dataclass
class MetricsSample:
    step: int
    epoch: int
    loss: float
    grad_norm: float | None
    lr: float
    mem: float  # GiB: peak CUDA memory allocated, or peak resident set size on CPU
    tps: float  # tokens per second since the previous sample
    mfu: float | None  # model FLOPs utilisation, when the device's peak is known
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:  # Linux: this process's own high-water mark (ru_maxrss keeps the forking parent's across exec)
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # KiB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


# Dense bf16 peak FLOP/s per device name fragment (vendor figures); MFU is reported only when known.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_FLOPS.items() if key in name), None)


def _kept_lines(path: Path, keep_through_step: int) -> list[bytes]:
    """The complete lines of ``path`` whose step is at most ``keep_through_step`` (a torn last line, what a kill in
    the middle of a write leaves, is dropped too)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    kept = []
    for line in raw.split(b"\n")[:-1]:  # the part after the last newline is a torn line (or empty)
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step <= keep_through_step:
            kept.append(line + b"\n")
    return kept


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line.

    Opening it drops the records past ``keep_through_step`` (the step a resumed run continues from; -1 for a run
    that starts fresh), so after any resume the file holds each step once. A write the disk refuses stops the run
    naming the file."""

    def __init__(self, path: Path, keep_through_step: int = -1):
        self.path = path
        self.keep_through_step = keep_through_step
        self._opened = False
        self._file = None

    def open(self) -> None:
        """Drop the records past ``keep_through_step`` (and a torn last line) from the file, once."""
        if self._opened:
            return
        self._opened = True
        with self._writing():
            kept = _kept_lines(self.path, self.keep_through_step)
            if kept or self.path.exists():
                write_atomic(self.path, b"".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        self.open()
        with self._writing():
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            raise AutomodelError(f"writing '{self.path}' failed: {err.strerror or err}; is the disk full, or a quota "
                                 "or file-size limit reached? The checkpoints and LATEST are not affected: make room "
                                 "and run the same command again to resume") from None

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # a line the disk refused is already reported
                self._file.close()
            self._file = None
