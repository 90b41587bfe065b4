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
"""

from __future__ import annotations

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
