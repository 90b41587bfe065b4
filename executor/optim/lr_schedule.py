"""Learning-rate schedules by Hugging Face's names and formulas (transformers.get_scheduler): `constant`,
`constant_with_warmup`, `linear` and `cosine` (half a cosine, num_cycles 0.5), each a factor of the base
learning rate. Training step s (1-based) uses the factor of scheduler step s - 1, as the Trainer does (it
calls scheduler.step() after every optimizer.step()): with warmup, step 1 runs at learning rate 0.
"""

from __future__ import annotations

import math

from tierflow.planner.core.trainopts import SCHEDULES, USES_TOTAL

__all__ = ["SCHEDULES", "USES_TOTAL", "lr_factor"]


def lr_factor(name: str, step: int, warmup_steps: int, total_steps: int) -> float:
    """The factor of the base learning rate for training step `step` (1-based) of `total_steps`."""
    k = step - 1  # the scheduler's step counter before this optimizer step
    if name == "constant":
        return 1.0  # as transformers: constant ignores warmup
    if k < warmup_steps:
        return float(k) / float(max(1, warmup_steps))
    if name == "constant_with_warmup":
        return 1.0
    if name == "linear":
        return max(0.0, float(total_steps - k) / float(max(1, total_steps - warmup_steps)))
    if name == "cosine":
        progress = float(k - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    raise ValueError(f"unknown learning-rate schedule {name!r} (use one of {', '.join(SCHEDULES)})")
