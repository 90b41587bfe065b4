"""The host optimizer op's work on flat fp32 tensors (ops/optimizer.py `adam` calls `host_adamw`): the AdamW
update of an element range, its gradient accumulator zeroed and the compute copy of the updated weights
written where it goes, without temporaries: one fused AdamW call per decay flag over all of its groups, one
zeroing, one cast per destination straight from the master.

Numerics: bit for bit those of torch.optim.AdamW(fused=True) on the decay groups (torch._fused_adamw_, as its
functional fused path calls it), followed by the zeroing and the cast. The fused CPU kernel takes the scalar
path for the last, partial vector of each tensor it is given, so a group that the host/SSD boundary cuts is
updated in a contiguous copy (and copied back): every element takes the same path whatever the placement (a
checkpoint resumes bit for bit under another one).

Tried and dropped: the range in 64k-element chunks on one thread (update, zeroing and cast per chunk, in L2)
was not faster on the dev box (100M parameters: 507 ms against 464 ms in one pass, median of 5 alternating
pairs, each pair faster in one pass; 10M: even) - the cast and the zeroing cost compute, not only memory,
and each chunk's calls ~20 us of Python - and with a team of threads each chunk's calls are parallel regions
that wait at their barrier for the slowest thread: on a shared host one preempted thread makes each cost a
scheduler slice (100M parameters took 5.6 s at 2 threads in 256k chunks against 0.2 s for fused AdamW).
"""

from __future__ import annotations

import torch

from tierflow.executor.optim.adamw import Hyper, coef_on, fused_adamw_, lr_of

Stretch = tuple[int, int, torch.Tensor]  # (a, z, tensor of the elements [a, z))
STATE_CLASSES = ("master", "adam_m", "adam_v")


def host_adamw(h: Hyper, step: int, groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]],
               grads: torch.Tensor, dests: list[Stretch], coef: torch.Tensor | float | None = None) -> None:
    """AdamW step `step` (1-based) on the adjacent element ranges `groups` [(a, z, decayed)]: `states` has
    the stretches of the master ("master") and the moments ("adam_m", "adam_v") that cover them, `grads` the
    fp32 gradient accumulator indexed by element (zeroed over the groups after their update), `dests` the
    buffers the updated master goes to in the compute dtype; `coef` multiplies the gradients first
    (clipping)."""
    lr = lr_of(h, step)
    step_t = torch.full((), float(step), dtype=torch.float32)
    lo, hi = groups[0][0], groups[-1][1]
    g = grads[lo:hi]
    if coef is not None:  # as clip_grad_norm_: always multiplied, a factor of 1 included
        torch._foreach_mul_([g], coef_on(coef, grads.device))
    for decayed in (True, False):
        ranges = [(a, z) for a, z, d in groups if d == decayed]
        if not ranges:
            continue
        spans = {cls: [_span(states[cls], a, z) for a, z in ranges] for cls in STATE_CLASSES}
        p, m, v = ([t for t, _back in spans[cls]] for cls in STATE_CLASSES)
        fused_adamw_(h, p, [grads[a:z] for a, z in ranges], m, v, step_t, lr, decayed)
        for cls in STATE_CLASSES:
            for whole, back in spans[cls]:
                _scatter(whole, back)
    g.zero_()
    for sa, sz, master in states["master"]:
        for a, z, buf in dests:
            x, y = max(a, sa, lo), min(z, sz, hi)
            if y > x:
                buf[x - a: y - a].copy_(master[x - sa: y - sa])  # the cast to the compute dtype


def _span(stretches: list[Stretch], a: int, z: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The elements [a, z): a view where one stretch holds them all, else a contiguous copy and the views it
    is to be copied back into."""
    views = [t[max(a, sa) - sa: min(z, sz) - sa] for sa, sz, t in stretches if min(z, sz) > max(a, sa)]
    if len(views) == 1:
        return views[0], []
    return torch.cat(views), views


def _scatter(whole: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy the contiguous `whole` back into the views it was concatenated from."""
    at = 0
    for p in pieces:
        p.copy_(whole[at: at + p.numel()])
        at += p.numel()
