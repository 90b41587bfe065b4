"""Measure what a profile's `compute:` section needs on this machine's device: the host time to issue one
kernel (framework dispatch + launch), the floor under a block of short kernels (planner/core/compute.py).

The probe issues `ops` in-place additions on a one-element tensor back to back and synchronises once at the
end: each kernel is far shorter than its launch, so the GPU waits on the host and the total is the launches
(on a CPU device the same loop measures torch's per-op dispatch). The median of `repeats` runs is reported
with its spread. The hook that writes it into a calibrated profile: `compute.kernel_launch_us` from
`measure_kernel_launch(device)["kernel_launch_us"]`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

DEFAULT_OPS = 2000
DEFAULT_REPEATS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one_run_s(x: torch.Tensor, ops: int) -> float:
    _sync(x.device)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    _sync(x.device)
    return time.perf_counter() - start


def measure_kernel_launch(device: str | torch.device = "cpu", ops: int = DEFAULT_OPS,
                          repeats: int = DEFAULT_REPEATS) -> dict[str, Any]:
    """{"kernel_launch_us": median per-kernel issue time, "spread_us": (min, max), "ops", "repeats",
    "device"} for `ops` tiny kernels issued back to back, `repeats` times after one warm-up run."""
    if ops < 1 or repeats < 1:
        raise ValueError(f"ops and repeats must be >= 1, got {ops} and {repeats}")
    device = torch.device(device)
    x = torch.zeros(1, device=device)
    with torch.no_grad():
        _one_run_s(x, min(ops, 100))  # warm-up: allocator, first launch, caches
        per_op_us = [_one_run_s(x, ops) / ops * 1e6 for _ in range(repeats)]
    return {"kernel_launch_us": statistics.median(per_op_us), "spread_us": (min(per_op_us), max(per_op_us)),
            "ops": ops, "repeats": repeats, "device": str(device)}
