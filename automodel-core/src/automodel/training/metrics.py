"""MetricsSample and the JSONL files the loop writes (appended to on resume)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


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
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


# Dense bf16 peak FLOP/s per device name fragment (vendor figures); MFU is reported only when known.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_FLOPS.items() if key in name), None)


def _drop_partial_last_line(path: Path) -> None:
    """Truncate an unterminated last line (what a kill -9 in the middle of a write leaves behind)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            keep = 0
            block = 4096
            pos = size
            while pos > 0:  # find the last newline, reading backwards
                start = max(0, pos - block)
                f.seek(start)
                chunk = f.read(pos - start)
                index = chunk.rfind(b"\n")
                if index >= 0:
                    keep = start + index + 1
                    break
                pos = start
            f.truncate(keep)
    except FileNotFoundError:
        return


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)  # a run killed mid-line must not corrupt the resumed run's lines
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
