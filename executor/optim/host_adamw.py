"""The host optimizer op's work on flat fp32 tensors (ops/optimizer.py `adam` calls `host_adamw`): the AdamW
update of an element range, the compute copy of the updated weights written where it goes, when asked the sum
of the gradients' squares for the step's norm, and the gradient accumulator zeroed unless the caller says
not to (`zero_grads=False`: the executor's adam op, whose next step's first gradient write overwrites the
accumulator instead of adding to it, ops/grads.py: no zeroing pass).

Two ways, the same job:
- **one pass** (fused_host_adamw.py: a C++ extension built on first use where a compiler and ninja are
  there) for host tensors, fp32 and contiguous, with bf16, fp16 or fp32 destinations, from
  MIN_KERNEL_ELEMENTS elements up: each element read and written once, on torch's intra-op threads.
  Numerics: every element as the vector path of torch's fused AdamW kernel computes it (bit for bit; torch's
  scalar path for the last partial vector of a tensor differs in the last bits, and this one never takes it,
  so an element's result does not depend on placement or threads); the squares in fp32 lanes, the same bits
  on any cut, alignment and thread count.
- **torch's kernels** otherwise (smaller ranges, no kernel built, other tensors, TIERFLOW_PURE_ADAMW=1): one
  fused AdamW call per decay flag over all of its groups, one zeroing, one cast per destination straight from
  the master, the squares by torch.linalg.vector_norm in fp32. Numerics: bit for bit those of
  torch.optim.AdamW(fused=True) on the decay groups (torch._fused_adamw_, as its functional fused path calls
  it); since the fused CPU kernel takes its scalar path for the last, partial vector of each tensor it is
  given, a group that the host/SSD boundary cuts is updated in a contiguous copy (and copied back): every
  element takes the same path whatever the placement (a checkpoint resumes bit for bit under another one).

Which way an op takes depends on its size and on the install, not on the placement; the two differ in the last
bits of the elements that torch's scalar path takes and of the step's norm, so a run resumes bit for bit on
the same kind of install (the kernel built or not, TIERFLOW_PURE_ADAMW or not).

Tried and dropped for torch's kernels: the range in 64k-element chunks on one thread (update, zeroing and cast
per chunk, in L2) was not faster (100M parameters: 507 ms against 464 ms in one pass, median of 5 alternating
pairs; 10M: even) - the cast and the zeroing cost compute, not only memory, and each chunk's calls ~20 us of
Python - and with a team of threads each chunk's calls are parallel regions that wait at their barrier for the
slowest thread: on a shared host one preempted thread makes each cost a scheduler slice (100M parameters took
5.6 s at 2 threads in 256k chunks against 0.2 s for fused AdamW). The one-pass kernel's threads take
16k-element chunks in turn within one parallel region per call.
"""

from __future__ import annotations

import torch

from tierflow.executor.optim import fused_host_adamw
from tierflow.executor.optim.adamw import Hyper, coef_on, fused_adamw_, lr_of
from tierflow.executor.optim.clipping import sum_of_squares

Stretch = tuple[int, int, torch.Tensor]  # (a, z, tensor of the elements [a, z))
# the fewest elements an op hands to the one-pass kernel: below it the op's Python weighs as much as its
# memory traffic either way, and a run of small blocks (tiny-gpt's are ~200k parameters: the tests' runs)
# never builds or loads the kernel (seconds once) nor changes its numerics
MIN_KERNEL_ELEMENTS = 1 << 18
STATE_CLASSES = ("master", "adam_m", "adam_v")


def host_adamw(h: Hyper, step: int, groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]],
               grads: torch.Tensor, dests: list[Stretch], coef: torch.Tensor | float | None = None,
               squares: bool = False, zero_grads: bool = True) -> torch.Tensor | float | None:
    """AdamW step `step` (1-based) on the adjacent element ranges `groups` [(a, z, decayed)]: `states` has
    the stretches of the master ("master") and the moments ("adam_m", "adam_v") that cover them, `grads` the
    fp32 gradient accumulator indexed by element, `dests` the buffers the updated master goes to in the
    compute dtype (a stretch or a buffer may reach beyond the groups: only their elements are read and
    written); `coef` multiplies the gradients first
    (clipping). With `squares`, returns the sum of the squares of the (unclipped) gradients for the step's
    norm (a float from the one-pass kernel, a 0-d fp32 tensor from torch's kernels). With `zero_grads` the
    gradients of the groups are zeroed after the update; without, their values afterwards are unspecified
    (the one-pass kernel leaves them, torch's kernels leave them multiplied by `coef`). (`RangeStep`, made
    once, for the same range's every step.)"""
    return RangeStep(groups, states, grads, dests)(h, step, states, grads, dests, coef, squares, zero_grads)


class RangeStep:
    """host_adamw of one range whose pieces lie where they lay when it was made: the same groups, the same
    spans (a, z) and dtypes of the states' stretches and of the destinations, in the same order (the tensors
    may be others: an SSD range read anew, a transfer buffer). The executor's adam op keeps one per optimizer
    part, whose ranges the plan fixes, so a step does not work out again which way it runs, where the kernel
    cuts the range and what it casts after: after a step that streamed megabytes through the caches every
    Python or torch call runs from cold caches (tens of microseconds each at 1M parameters)."""

    def __init__(self, groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]],
                 grads: torch.Tensor, dests: list[Stretch]) -> None:
        self.groups = groups
        self.kernel = fused_host_adamw.kernel() if _fusable(groups, states, grads, dests) else None
        self.cut = fused_host_adamw.cutting(groups, states, dests) if self.kernel is not None else None
        self.fp16 = any(b.dtype is torch.float16 for _a, _z, b in dests)  # cast after the kernel

    def __call__(self, h: Hyper, step: int, states: dict[str, list[Stretch]], grads: torch.Tensor,
                 dests: list[Stretch], coef: torch.Tensor | float | None = None, squares: bool = False,
                 zero_grads: bool = True) -> torch.Tensor | float | None:
        """host_adamw's step on these pieces (see host_adamw)."""
        if self.kernel is None:
            return _torch_step(h, step, self.groups, states, grads, dests, coef, squares, zero_grads)
        consts = fused_host_adamw.coefficients(lr_of(h, step), h.beta1, h.beta2, h.eps, h.weight_decay, step,
                                               1.0 if coef is None else float(coef))
        s = fused_host_adamw.run_cut(self.kernel, self.cut, consts, states, grads, dests, zero_grads)
        if self.fp16:
            _cast_into(states["master"], dests, self.groups[0][0], self.groups[-1][1], only=torch.float16)
        return s if squares else None


def _torch_step(h: Hyper, step: int, groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]],
                grads: torch.Tensor, dests: list[Stretch], coef: torch.Tensor | float | None, squares: bool,
                zero_grads: bool) -> torch.Tensor | None:
    """host_adamw by torch's kernels (see the module's docstring)."""
    sumsq = sum_of_squares([grads[a:z] for a, z, _d in groups]) if squares else None
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
    if zero_grads:
        g.zero_()
    _cast_into(states["master"], dests, lo, hi)
    return sumsq


def _cast_into(masters: list[Stretch], dests: list[Stretch], lo: int, hi: int, only=None) -> None:
    """The updated master's elements [lo, hi) cast into the destinations that hold them (only those of dtype
    `only`, if given)."""
    for sa, sz, master in masters:
        for a, z, buf in dests:
            x, y = max(a, sa, lo), min(z, sz, hi)
            if y > x and (only is None or buf.dtype is only):
                buf[x - a: y - a].copy_(master[x - sa: y - sa])  # the cast to the compute dtype


def _fusable(groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]], grads: torch.Tensor,
             dests: list[Stretch]) -> bool:
    """Whether the compiled one-pass kernel takes the step: at least MIN_KERNEL_ELEMENTS of them, the kernel
    built (and not switched off), every tensor on the host and contiguous, the states fp32, the destinations
    bf16, fp16 or fp32."""
    if groups[-1][1] - groups[0][0] < MIN_KERNEL_ELEMENTS or fused_host_adamw.kernel() is None:
        return False
    for pieces in states.values():
        for _a, _z, t in pieces:
            if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
                return False
    for _a, _z, b in dests:
        if b.dtype not in _DEST_DTYPES or not b.is_cpu or not b.is_contiguous():
            return False
    return grads.dtype is torch.float32 and grads.is_cpu and grads.is_contiguous()


_DEST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
