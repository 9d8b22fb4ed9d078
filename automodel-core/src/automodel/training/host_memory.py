"""glibc malloc settings for a CPU training run: reuse freed step buffers (speed), or return them (sharded runs).

Every step allocates and frees the same few-MiB activation and gradient buffers. With glibc's defaults a freed
block above the mmap threshold goes back to the kernel and the next step's allocation page-faults it in again,
zero-filled; on a small CPU job that churn costs several percent of the step time (measured in
docs/performance.md). :data:`KEEP_FREED` fixes the mmap threshold at the cap of glibc's own dynamic one and the trim
threshold well above a step's working set, so glibc reuses the blocks instead; the heap stops shrinking between
steps. PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) swaps in jemalloc/tcmalloc for the same
reason; this needs no preloaded library.

A sharded (FSDP2) run is there to save memory, and its steps free the opposite way: every block's gathered
parameters, their full gradients, the reduce-scatter buffers and the autograd temporaries are freed between
long-lived allocations (the sharded gradients, the optimizer's state), and the holes they leave in the heap stay
resident: ~390 MiB per rank for a 150M-parameter Llama on 2 ranks (docs/performance.md, row 9). There
:data:`RETURN_FREED` gives every block of 256 KiB or more its own mapping, returned to the kernel when freed, and
trims the heap's top as glibc does by default. The price is page faults: ~13% more CPU time in that run.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

# mallopt parameters from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class MallocPolicy:
    """Blocks of ``mmap_threshold`` bytes or more get their own mapping; free space of ``trim_threshold`` bytes or
    more at the heap's top goes back to the kernel."""

    name: str
    mmap_threshold: int
    trim_threshold: int

    def describe(self) -> str:
        return (f"glibc malloc maps blocks of {byte_size(self.mmap_threshold)} or more on their own and trims the heap "
                f"above {byte_size(self.trim_threshold)} ({self.name})")


def byte_size(num_bytes: int) -> str:
    """``num_bytes`` in GiB, MiB or KiB, whichever is the largest under it (one decimal where not whole)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if num_bytes >= 1 << shift:
            value = num_bytes / (1 << shift)
            return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"
    return f"{num_bytes >> 10} KiB"


# 32 MiB: the cap of glibc's own dynamic mmap threshold on 64-bit.
KEEP_FREED = MallocPolicy("freed step buffers stay in the heap for the next step", 32 << 20, 1 << 30)
# 128 KiB: glibc's default trim threshold.
RETURN_FREED = MallocPolicy("sharded run: freed buffers go back to the kernel", 256 << 10, 128 << 10)


def apply_malloc_policy(policy: MallocPolicy) -> bool:
    """Set ``policy``'s thresholds; True when they took effect (Linux with glibc), False where malloc is not
    glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, policy.mmap_threshold)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, policy.trim_threshold))


__all__ = ["KEEP_FREED", "RETURN_FREED", "MallocPolicy", "apply_malloc_policy"]
