"""The AdamW update of the optimizer ops (executor/ops/optimizer.py calls `adamw_update`) with the run's
settings (`TrainHyper`): the learning rate of the step's schedule (schedule.py), weight decay on the decayed
group only (decay.py), gradients clipped by norm (clipping.py).

Numerics as torch.optim.AdamW with two parameter groups (decayed / not) after clip_grad_norm_ and with a
LambdaLR schedule: PyTorch's own functional adamw on each group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.clipping import CLIP_MODES, GradNorms, sum_of_squares
from tierflow.executor.ops.context import Hyper, OpContext, RoundState
from tierflow.executor.ops.grads import HostGradAdds
from tierflow.executor.schedule import SCHEDULES, USES_TOTAL, lr_factor
from tierflow.planner.core.graph import Task


@dataclass(frozen=True)
class TrainHyper(Hyper):
    """Hyper plus the learning-rate schedule and clipping. A checkpoint records its fields
    (`dataclasses.asdict`); the step norms live in `norms` (not a field)."""

    schedule: str = "constant"  # one of schedule.SCHEDULES
    warmup_steps: int = 0
    total_steps: int = 0  # the run's --steps for linear / cosine (0 for the others, which do not use it)
    clip_grad_norm: float = 0.0  # 0: no clipping
    clip: str = "global"  # one of clipping.CLIP_MODES

    def __post_init__(self) -> None:
        assert self.schedule in SCHEDULES and self.clip in CLIP_MODES, (self.schedule, self.clip)
        object.__setattr__(self, "norms", GradNorms(self.clip_grad_norm, self.clip))

    def lr_at(self, step: int) -> float:
        total = self.total_steps if self.schedule in USES_TOTAL else 0
        return self.lr * lr_factor(self.schedule, step, self.warmup_steps, total)


def norms_of(h: Hyper) -> GradNorms | None:
    return getattr(h, "norms", None)


def adamw_update(cx: OpContext, rs: RoundState, t: Task, tensors: list[list[torch.Tensor]], step: int,
                 fused: bool, decay: list[bool] | None = None) -> None:
    """AdamW of step `step` (1-based) on tensors = [params, grads, ms, vs] (lists of matching pieces), the
    pieces with decay[i] False without weight decay; the gradients are clipped first when the run clips."""
    h = cx.hyper
    params, grads, ms, vs = tensors
    coef = clip_prelude(cx, rs, t, step, grads)
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


def clip_prelude(cx: OpContext, rs: RoundState, t: Task, step: int,
                 grads: list[torch.Tensor]) -> torch.Tensor | float | None:
    """What an optimizer op of `step` does before its update: adds the squares of its (unclipped) gradients
    to the step's norm, and returns the factor its gradients are to be multiplied by (None: no clipping)."""
    norms = norms_of(cx.hyper)
    if norms is None:
        return None
    coef = None
    if norms.max_norm > 0 and norms.mode == "global":
        coef = _global_coef(cx, rs, t, step, norms, grads)
    elif norms.max_norm > 0:
        coef = norms.delayed_coef(step)
    norms.observe(step, grads)
    return coef


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


def _global_coef(cx: OpContext, rs: RoundState, t: Task, step: int, norms: GradNorms,
                 grads: list[torch.Tensor]) -> torch.Tensor:
    """The clipping factor of `step`: at the step's first optimizer op, after every gradient op of the step
    (the plan's dependencies, planner/core/clipwait.py), from the norm of all of the step's gradients (the
    optimizer ops run on one worker, in order). A GPU optimizer op has taken its own gradients (`grads`) out
    of the buffers already."""
    with norms.lock:
        if step in norms.coefs:
            return norms.coefs[step]
    state = cx.state
    if state.placement.gpu_optimizer:
        taken: dict[int, torch.Tensor] = {}
        with rs.lock:
            for (group, _owner), buf in rs.grad_acc.items():
                if group != t.id and cx.binding.plan.graph.tasks[group].iteration == t.iteration:
                    taken[group] = buf.float() if group not in taken else taken[group] + buf.float()
        sumsq = sum_of_squares([*taken.values(), *grads])
    else:
        sumsq = torch.stack([_host_sq(cx, rs, b) for b in range(len(state.grads))]).sum()
    return norms.set_global(step, sumsq.sqrt())


def _host_sq(cx: OpContext, rs: RoundState, b: int) -> torch.Tensor:
    """Squares of block b's fp32 gradient accumulator: its host range, and its SSD range from the SSD tier's
    file (where the step's last write_grads left it; read back once more here)."""
    HostGradAdds.wait_for(rs, b)
    state = cx.state
    _g, _c, ssd_elems = state.grad_split[b]
    n = state.shard_numel[b]
    host = sum_of_squares([state.grads[b][: n - ssd_elems]])
    if ssd_elems == 0:
        return host
    return host + sum_of_squares([cx.ssd.read(f"grads_b{b}", torch.float32, ssd_elems)])


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
