"""Gradient clipping by norm, and the gradient norm of every step.

Two modes, chosen at plan time (`--clip`, recorded in the plan file) and honoured by the executor:

- `global`: exact global-norm clipping, as torch.nn.utils.clip_grad_norm_ (and so Hugging Face's Trainer)
  does it: every gradient is scaled by min(1, max_norm / (norm + 1e-6)) where norm is the L2 norm of all of
  the step's gradients. Every optimizer op of a step waits for every gradient op of the step (the plan's
  graph as planner/core/clipwait.py makes it: `tierflow plan --clip-grad-norm`, or run re-orders a plan that
  does not wait yet); the first computes the norm (adamw.py).
- `delayed`: the previous step's global norm clips this step's gradients (as a one-step-delayed update does);
  the first step of a run is not clipped. No op waits, so every schedule runs as planned; a checkpoint keeps
  the last norm so that a resumed run clips as an uninterrupted one.

Either way every optimizer op adds the squares of the gradients it steps to its step's sum (`observe`), which
gives the step's gradient norm for the logs (steps.csv), clipping or not.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from tierflow.planner.core.trainopts import CLIP_MODES

__all__ = ["CLIP_MODES", "GradNorms", "clip_coef", "sum_of_squares"]
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def clip_coef(max_norm: float, norm: torch.Tensor | float) -> torch.Tensor | float:
    """The factor torch.nn.utils.clip_grad_norm_ scales the gradients by (a tensor for a tensor norm: no host
    synchronization)."""
    if isinstance(norm, torch.Tensor):
        return torch.clamp(max_norm / (norm + EPS), max=1.0)
    return min(1.0, max_norm / (norm + EPS))


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of `grads` as a 0-d float32 tensor on their device (no host synchronization)."""
    return torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()


@dataclass
class GradNorms:
    """The run's clipping settings and the gradient norms of its steps, kept as 0-d tensors on the
    optimizer's device until read (`value`), so that a GPU optimizer never waits for the host (one per run: a
    resumed run gets the last norm back from its checkpoint, `norms`)."""

    max_norm: float = 0.0  # 0: no clipping
    mode: str = "global"
    parts_per_step: int = 0  # optimizer ops per step (their squares make a step's norm); 0: no norms
    sumsq: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> squares added so far
    seen: dict[int, int] = field(default_factory=dict)  # step -> optimizer ops that added theirs
    norms: dict[int, torch.Tensor | float] = field(default_factory=dict)  # step -> its norm, once known
    coefs: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> the global factor applied
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, step: int, grads: list[torch.Tensor]) -> None:
        """An optimizer op of `step` adds the squares of the (unclipped) gradients it steps (not with several
        ranks, parts_per_step 0: each holds a shard)."""
        if self.parts_per_step:
            self.add_squares(step, sum_of_squares(grads))

    def wants_squares(self) -> bool:
        """Whether an optimizer op is to sum its gradients' squares: for the step's norm, unless global
        clipping has set it before the step's first op."""
        return bool(self.parts_per_step) and not (self.max_norm > 0 and self.mode == "global")

    def add_squares(self, step: int, s: torch.Tensor | float | None) -> None:
        """An optimizer op of `step` adds the sum of the squares of its (unclipped) gradients `s` (None: not
        summed, see wants_squares); the step's norm is known once every op of the step has added."""
        if not self.parts_per_step:
            return
        with self.lock:
            if s is not None:
                self.sumsq[step] = s if step not in self.sumsq else self.sumsq[step] + s
            self.seen[step] = self.seen.get(step, 0) + 1
            if self.seen[step] == self.parts_per_step:
                total = self.sumsq.pop(step, None)
                if total is not None:  # a float where every op of the step took the one-pass kernel
                    self.norms.setdefault(step, total.sqrt() if isinstance(total, torch.Tensor) else
                                          math.sqrt(total))
                self.seen.pop(step)

    def value(self, step: int) -> float | None:
        """The gradient norm of `step` as a number (None if not known)."""
        n = self.norms.get(step)
        return None if n is None else float(n)

    def delayed_coef(self, step: int) -> torch.Tensor | float:
        """The factor of `step` in delayed mode: from the previous step's norm (1 for a run's first step)."""
        prev = self.norms.get(step - 1)
        return 1.0 if prev is None else clip_coef(self.max_norm, prev)

    def set_global(self, step: int, norm: torch.Tensor) -> torch.Tensor:
        """The global norm of `step`, computed before its first optimizer op; its factor."""
        with self.lock:
            self.norms[step] = norm
            self.coefs[step] = c = clip_coef(self.max_norm, norm)
        return c

    def forget_before(self, step: int) -> None:
        """Drop what steps before `step` - 1 left (the previous step's norm is kept for delayed mode)."""
        with self.lock:
            for d in (self.norms, self.coefs):
                for s in [s for s in d if s < step - 1]:
                    del d[s]
