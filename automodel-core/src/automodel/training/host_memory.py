"""glibc malloc settings that keep a CPU training step's freed buffers in the process heap.

Every step allocates and frees the same few-MiB activation and gradient buffers. With glibc's defaults a freed
block above the mmap threshold goes back to the kernel and the next step's allocation page-faults it in again,
zero-filled; on a small CPU job that churn costs several percent of the step time (measured in
docs/performance.md). Fixing the mmap threshold at the cap of glibc's own dynamic one and the trim threshold well
above a step's working set makes glibc reuse the blocks instead. Peak memory is unchanged: the heap only stops shrinking
between steps. PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) swaps in jemalloc/tcmalloc for the
same reason; this needs no preloaded library.

A sharded (FSDP2) run is there to save memory, and its steps free the opposite way: every block's gathered
parameters, their full gradients and the reduce-scatter buffers (1-50 MiB) are freed between long-lived
allocations (the sharded gradients, the optimizer's state), and the holes they leave in the heap stay resident:
~400 MiB per rank for a 150M-parameter Llama on 2 ranks (docs/performance.md, row 9). There the mmap threshold is
4 MiB, so each such buffer has its own mapping and goes back to the kernel when freed.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt parameters from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # the cap of glibc's own dynamic threshold on 64-bit
SHARDED_MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
_TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def keep_freed_memory_in_heap(mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set the thresholds (blocks of ``mmap_threshold`` bytes or more get their own mapping); True when they
    took effect (Linux with glibc), False where malloc is not glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


__all__ = ["MMAP_THRESHOLD_BYTES", "SHARDED_MMAP_THRESHOLD_BYTES", "keep_freed_memory_in_heap"]
