"""The C heap under a run whose device is the CPU (`keep_freed_heap`).

There the device tier's tensors (activations, saved tensors, gradients, the optimizer's temporaries) are
allocated by torch's CPU allocator, which takes every block from the C library's malloc and frees it at once
(no cache). glibc's malloc returns free memory at the top of its heap to the kernel once it exceeds
M_TRIM_THRESHOLD, a threshold it adapts at run time (twice the largest block it has handed out by mmap and
freed); the next allocations take those pages back one page fault at a time, each zeroed by the kernel. A
step of the executor's plan builds up and frees more than that threshold: on the 6 x 384 model of
experiments/bench_executor.py (2 torch threads) the heap grew by about 38 MB within each step and was trimmed
at its end, 14-23k minor page faults and 44-72 ms of system time per 1.1-1.2 s step, where plain PyTorch
training the same blocks settled at 0-330 faults per step (strace of brk, getrusage; docs/executor.md).

`keep_freed_heap` fixes both thresholds for the rest of the process, as glibc's documented tunables
(mallopt(3)) do: blocks from 32 MiB up come from mmap (the ceiling glibc's own adaptation reaches on 64-bit,
DEFAULT_MMAP_THRESHOLD_MAX), and a free top of the heap is kept up to 2 GiB (the largest value mallopt
takes), so that memory a step freed serves the next step without faults. Memory is only kept if the run had it
in use; plain PyTorch in the same process gets the same policy. Elsewhere (no glibc: macOS, Windows, musl)
nothing changes. On CUDA the device tier is not in this heap and the executor does not call it.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt(3)'s parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: its adaptive ceiling
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int

_kept = False


def glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc, else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError, AttributeError):  # no such name on this platform
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_heap() -> bool:
    """Keep freed heap memory in the process instead of trimming it (once per process); True if the policy
    is in force (glibc), False where the C library is another."""
    global _kept
    if _kept:
        return True
    libc = glibc()
    if libc is None:
        return False
    # the mmap threshold first: setting either one stops glibc's adaptation of both
    _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _kept


def heap_kept() -> bool:
    """Whether keep_freed_heap has put the policy in force in this process."""
    return _kept


__all__ = ["heap_kept", "keep_freed_heap"]
