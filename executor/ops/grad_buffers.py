"""Weight-gradient buffers on the device (`GradBuffers`): where the compute ops add their weight gradients
until the op that takes them (offload_grads, adam_gpu, or reduce_scatter_grads with several ranks) does.
"""

from __future__ import annotations

import torch

from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.planner.core.graph import Task


class GradBuffers:
    """Weight-gradient buffers on the device, one per (op that takes them, owner block), covering the owner's
    range the taking op gets (binding.grad_range: a tied head's buffer for block 0 is the wte range only).

    The plan counts a buffer that several compute ops add into (a weight use of several micro-batches, or
    gradients kept on the device) as fp32 and one written by a single compute op as the compute dtype
    (GRAD_ACCUM_BYTES vs GRAD_WIRE_BYTES): a single contribution is written straight into a compute-dtype
    buffer (the same values an fp32 buffer would round to on the wire), several are added in fp32 and, after
    the last, cast into a compute-dtype buffer on the compute stream, the fp32 one freed. Either way the
    offload_grads op only copies what it takes (no cast on the D2H queue). A GPU optimizer keeps fp32. Without
streams (a plain CPU device) a single contribution already in the compute dtype is not copied at all: its
gradients are kept as they are until offload_grads adds them to the host accumulators.

    With several ranks every buffer is fp32 (whatever the number of contributions) and spans the owner's whole
    vector padded to W*S elements: the reduce-scatter sums in fp32, and reduce_scatter_grads casts this rank's
    shard to the compute dtype on the net stream for an offload_grads taker (net.py), so that offload_grads
    still only copies."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx
        # main's dtype rule (compute dtype for a single contribution, cast after the last): one rank, host
        # optimizer
        self.wire_cast = not cx.state.placement.gpu_optimizer and cx.state.world.single

    def accumulate(self, rs: RoundState, t: Task, o: int,
                   pieces: list[tuple[int, int, torch.Tensor | None]]) -> None:
        """Gradients `pieces` = [(lo, hi, grad)] of owner o's ranges into the buffer of the op that will take
        them. A None gradient (a parameter the step did not use) adds nothing."""
        bind = self.cx.binding
        key = (bind.grad_group[(t.id, o)], o)
        base, end = bind.grad_range[key]
        cast = self.wire_cast
        single = bind.grad_contributors[key] == 1 and cast
        with rs.lock:
            acc = rs.grad_acc.get(key)
            left = rs.grad_left.setdefault(key, bind.grad_contributors[key]) - 1
            rs.grad_left[key] = left
        if single and not self.cx.asynchronous and all(g is None or g.dtype == self.cx.dtype
                                                        for _lo, _hi, g in pieces):
            # no streams and no cast: offload_grads adds the one contribution's gradients to the host
            # accumulators as they are, at once; a buffer would only be one more copy of them
            with rs.lock:
                rs.grad_acc[key] = [(lo, grad.reshape(-1)) for lo, _hi, grad in pieces if grad is not None]
            return
        first = acc is None
        if first:
            # with several ranks [base, end) is the owner's whole vector padded to W*S elements (binding)
            acc = self.cx.backend.empty(end - base, self.cx.dtype if single else torch.float32)
            if not _covers(pieces, base, end):
                acc.zero_()
                first = False  # then added into, as every later contribution
            with rs.lock:
                rs.grad_acc[key] = acc
        for lo, hi, grad in pieces:
            if grad is None:
                continue
            if single or first:  # the first of several: taken as is (0 + g is g), no zeroing pass
                acc[lo - base: hi - base].copy_(grad.reshape(-1))
            else:
                acc[lo - base: hi - base] += grad.reshape(-1)
        if left == 0 and acc.dtype != self.cx.dtype and cast:
            wire = self.cx.backend.empty(end - base, self.cx.dtype)
            wire.copy_(acc)  # the cast, on the compute stream where the gradient is produced
            with rs.lock:
                rs.grad_acc[key] = wire

    def take(self, rs: RoundState, group: int) -> list[tuple[int, int, torch.Tensor]]:
        """(owner, first element, buffer) of every buffer the op `group` takes (of every gradient, where a
        single contribution was kept as its pieces)."""
        out = []
        with rs.lock:
            keys = [k for k in rs.grad_acc if k[0] == group]
            for k in keys:
                rs.grad_left.pop(k, None)
                acc = rs.grad_acc.pop(k)
                if isinstance(acc, list):
                    out += [(k[1], lo, g) for lo, g in acc]
                else:
                    out.append((k[1], self.cx.binding.grad_range[k][0], acc))
        return out


def _covers(pieces: list[tuple[int, int, torch.Tensor | None]], base: int, end: int) -> bool:
    """Do the pieces' gradients fill [base, end) exactly, without a gap or an overlap? (Then the first
    contribution can be copied into a new buffer instead of added into a zeroed one.)"""
    at = base
    for lo, hi, grad in sorted(pieces, key=lambda p: p[0]):
        if grad is None or lo != at:
            return False
        at = hi
    return at == end
