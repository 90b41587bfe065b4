"""How many intra-op threads the host optimizer ops (adam, adam_deferred) run with.

On a CUDA run whose plan steps the optimizer on the host, the optimizer would otherwise take every core
torch uses while the thread that launches the GPU's work (the gpu worker) also needs one: its launches then
wait for a core and the GPU idles (the first H200 run: every GPU op 2.6-10.8x its prediction beside the host
optimizer). So the host optimizer runs on one thread fewer than torch's setting, and the launching thread
keeps a core. Elsewhere (a CPU device, the CUDA emulation, a GPU optimizer) nothing changes.

`torch.set_num_threads` is process-wide in part: with OpenMP it sets the calling thread's own team size and
the process-wide value from which a thread takes its own at its first parallel op. So the executor's cpu
worker sets it in its own thread, after that thread's first look at it (`apply_in_this_thread`), and the
round restores the process-wide value afterwards from the main thread (`restore`), whose own count is that
value already; a thread whose first parallel op falls inside the round starts with the optimizer's count.

One OpenMP team at a time (`release_team`): with torch's OpenMP backend every thread that runs a parallel op
gets a team of its own (libgomp's thread pool, kept until that thread exits, and a while after), and once the
process holds more OpenMP threads than cores libgomp throttles every team's spin-wait to ~100 iterations (its
gomp_throttled_spin_count_var; 1000 with OMP_WAIT_POLICY=ACTIVE): each parallel region of the executor's
compute worker then sleeps and wakes through futexes (2 voluntary context switches per op, measured on 2
cores beside the main thread's team) where plain PyTorch on the main thread, the one team in its process,
spins (0). No environment variable lifts the throttled count; releasing the idle teams does.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


def optimizer_threads(device_type: str, host_optimizer: bool, threads: int | None = None) -> int | None:
    """The host optimizer's intra-op threads for a run on `device_type` ("cuda", "cpu") whose plan has host
    optimizer ops or not, with `threads` torch threads (default: torch's setting in this thread); None:
    torch's setting, unchanged."""
    threads = threads or torch.get_num_threads()
    if device_type != "cuda" or not host_optimizer or threads < 2:
        return None
    return threads - 1


def apply_in_this_thread(n: int | None) -> None:
    """Run this thread's intra-op work on `n` threads (None: leave torch's setting)."""
    if n is None:
        return
    torch.get_num_threads()  # this thread's own value first, from the process-wide one (torch does it lazily)
    torch.set_num_threads(n)


def restore(threads: int) -> None:
    """Set the process-wide thread count back to `threads` (from a thread whose own count is `threads`)."""
    torch.set_num_threads(threads)


def release_team() -> bool:
    """Release this thread's OpenMP team (its pool of worker threads), so that it does not count against the
    cores another thread's team spins on (`omp_pause_resource_all(omp_pause_soft)`, OpenMP 5.0, in the
    OpenMP runtime torch loaded); this thread's next parallel op makes a new one. False (nothing done) where
    torch's threads are not OpenMP's, the runtime lacks the call, or this thread is in a parallel region."""
    pause = _omp_pause()
    return pause is not None and pause(1) == 0


@functools.cache
def _omp_pause():
    """omp_pause_resource_all of the OpenMP runtime torch uses, or None."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib", "libiomp5.dylib"):
        try:  # by its soname, only if loaded already: torch's own runtime, never a second one
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except (OSError, AttributeError):
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None
