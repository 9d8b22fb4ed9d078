"""dist_env.cpu_malloc_tuning: freed step-sized buffers are reused from the heap instead of page-faulted back in."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc only")

# A step: eight 4 MiB buffers (activations, say) allocated, written, then all freed, as after a backward pass.
# Runs 20 steps; prints the page faults of the last 19.
PROBE = """
import ctypes, resource, sys
from automodel.training.host_memory import KEEP_FREED, apply_malloc_policy
if sys.argv[1] == "tuned":
    assert apply_malloc_policy(KEEP_FREED)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 4 * 1024 * 1024
def step():
    blocks = [libc.malloc(size) for _ in range(8)]
    for p in blocks:
        ctypes.memset(p, 1, size)  # touch every page, as a kernel writing its output does
    for p in blocks:
        libc.free(p)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_tuned_malloc_reuses_freed_buffers_instead_of_faulting_them_in_again():
    pages_per_step = 8 * 4 * 1024 * 1024 // 4096
    default, tuned = faults("default"), faults("tuned")
    # glibc's default trims the freed top of the heap after every step, so each step faults its pages in again
    assert default > 10 * pages_per_step
    assert tuned < pages_per_step  # tuned: the heap keeps them; at most a handful of faults in 19 steps


# 128 MiB of buffers of one size (argv[2] KiB: a sharded run's gathered parameters and gradients, its autograd
# temporaries) allocated, written and freed while a small long-lived block allocated after them pins the heap's
# top; prints how much of them stays resident.
HOLES = """
import ctypes, sys
from automodel.training.host_memory import KEEP_FREED, RETURN_FREED, apply_malloc_policy
assert apply_malloc_policy({"sharded": RETURN_FREED, "plain": KEEP_FREED}[sys.argv[1]])
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) / 1024
size = int(sys.argv[2]) * 1024
before = rss_mib()
blocks = [libc.malloc(size) for _ in range(128 * 1024 * 1024 // size)]
for p in blocks:
    ctypes.memset(p, 1, size)
kept = libc.malloc(1024)  # a long-lived allocation above them: the heap cannot shrink below it
for p in blocks:
    libc.free(p)
print(rss_mib() - before)
"""


def resident_after_free(mode: str, kib: int) -> float:
    out = subprocess.run([sys.executable, "-c", HOLES, mode, str(kib)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.parametrize("kib", [8192, 512])
def test_a_sharded_run_returns_freed_buffers_to_the_kernel(kib: int):
    assert resident_after_free("plain", kib) > 100  # 128 MiB freed, held in the heap
    assert resident_after_free("sharded", kib) < 16  # each buffer had its own mapping, unmapped when freed
