"""The AdamW update of the optimizer ops (executor/ops/optimizer.py calls `adamw_update`) with the run's
settings (`Hyper`, `TrainHyper`): the learning rate of the step's schedule (lr_schedule.py), weight decay on
the decayed group only (decay.py), gradients clipped by norm (clipping.py; the op computes the step's clipping
factor from the round's gradients and passes it in).

Numerics as torch.optim.AdamW with two parameter groups (decayed / not) after clip_grad_norm_ and with a
LambdaLR schedule: PyTorch's own functional adamw on each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.optim.clipping import CLIP_MODES
from tierflow.executor.optim.lr_schedule import SCHEDULES, USES_TOTAL, lr_factor


@dataclass(frozen=True)
class Hyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass(frozen=True)
class TrainHyper(Hyper):
    """Hyper plus the learning-rate schedule and clipping. A checkpoint records its fields
    (`dataclasses.asdict`). The step norms are the run's (train_loop.Trainer.norms), not the settings'."""

    schedule: str = "constant"  # one of lr_schedule.SCHEDULES
    warmup_steps: int = 0
    total_steps: int = 0  # the run's --steps for linear / cosine (0 for the others, which do not use it)
    clip_grad_norm: float = 0.0  # 0: no clipping
    clip: str = "global"  # one of clipping.CLIP_MODES

    def __post_init__(self) -> None:
        assert self.schedule in SCHEDULES and self.clip in CLIP_MODES, (self.schedule, self.clip)

    def lr_at(self, step: int) -> float:
        total = self.total_steps if self.schedule in USES_TOTAL else 0
        return self.lr * lr_factor(self.schedule, step, self.warmup_steps, total)


def adamw_update(h: Hyper, tensors: list[list[torch.Tensor]], step: int, fused: bool,
                 decay: list[bool] | None = None, coef: torch.Tensor | float | None = None) -> None:
    """AdamW of step `step` (1-based) on tensors = [params, grads, ms, vs] (lists of matching pieces), the
    pieces with decay[i] False without weight decay; the gradients are multiplied by the clipping factor
    `coef` first when the run clips (None: it does not)."""
    params, grads, ms, vs = tensors
    if coef is not None:  # as clip_grad_norm_: always multiplied, a factor of 1 included
        torch._foreach_mul_(grads, coef_on(coef, grads[0].device))
    lr = lr_of(h, step)
    flags = decay if decay is not None else [True] * len(params)
    for on in (True, False):
        idx = [i for i, f in enumerate(flags) if f == on]
        if not idx:
            continue
        pick = [[x[i] for i in idx] for x in (params, grads, ms, vs)]
        # a fill kernel, not torch.tensor(..., device=cuda): that is a synchronizing copy from pageable memory
        steps = [torch.full((), float(step - 1), dtype=torch.float32, device=p.device) for p in pick[0]]
        adamw_step(*pick, [], steps, foreach=False if fused else None, fused=fused, amsgrad=False,
                   beta1=h.beta1, beta2=h.beta2, lr=lr, weight_decay=h.weight_decay if on else 0.0, eps=h.eps,
                   maximize=False)


def lr_of(h: Hyper, step: int) -> float:
    """The learning rate of `step` (1-based): the schedule's for a TrainHyper."""
    return h.lr_at(step) if isinstance(h, TrainHyper) else h.lr


def coef_on(coef: torch.Tensor | float, device: torch.device) -> torch.Tensor | float:
    return coef.to(device) if isinstance(coef, torch.Tensor) else coef


def fused_adamw_(h: Hyper, params: list[torch.Tensor], grads: list[torch.Tensor], ms: list[torch.Tensor],
                 vs: list[torch.Tensor], step: torch.Tensor, lr: float, decayed: bool) -> None:
    """torch's fused AdamW kernel on host tensors with the step count `step` (a 0-d float32 tensor, already
    the step's number, 1-based): the call torch.optim.adamw's fused path makes (after adding 1 to the step
    count), without its grouping of the tensors by device and dtype."""
    torch._fused_adamw_(params, grads, ms, vs, [], [step] * len(params), lr=lr, beta1=h.beta1, beta2=h.beta2,
                        weight_decay=h.weight_decay if decayed else 0.0, eps=h.eps, amsgrad=False,
                        maximize=False)


def check_hyper_extra(h: TrainHyper) -> list[str]:
    """What is wrong with the schedule and clipping settings (flag: problem), for run's check_hyper."""
    bad = []
    if h.warmup_steps < 0:
        bad.append(f"--warmup-steps {h.warmup_steps}: must be >= 0")
    if not (h.clip_grad_norm >= 0 and h.clip_grad_norm < float("inf")):
        bad.append(f"--clip-grad-norm {h.clip_grad_norm}: must be a finite number >= 0 (0: no clipping)")
    if not (0 <= h.beta1 < 1 and 0 <= h.beta2 < 1):
        bad.append(f"--adam-betas {h.beta1},{h.beta2}: each must be in [0, 1) (e.g. 0.9,0.95)")
    if not (h.eps > 0 and h.eps < float("inf")):
        bad.append(f"--adam-eps {h.eps}: must be a finite number > 0 (e.g. 1e-8)")
    return bad
