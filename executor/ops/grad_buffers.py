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
        # (LoRA: the adapters' gradients stay fp32 on the device for their adam_gpu)
        self.wire_cast = (not cx.state.placement.gpu_optimizer and cx.state.lora is None
                          and cx.state.world.single)

    def add(self, rs: RoundState, t: Task, o: int, lo: int, hi: int, grad: torch.Tensor) -> None:
        """The flat gradient `grad` of owner o's elements [lo, hi) into the buffer of the op that will take
        it. The first contribution that covers the whole buffer becomes the buffer (0 + g is g: no zeroing
        pass, no copy; the emulation's allocator gets a copy, backend.own); a later one is added into it."""
        bind, be = self.cx.binding, self.cx.backend
        key = (bind.grad_group[(t.id, o)], o)
        base, end = bind.grad_range[key]
        cast = self.wire_cast
        single = bind.grad_contributors[key] == 1 and cast
        with rs.lock:
            acc = rs.grad_acc.get(key)
            left = rs.grad_left.setdefault(key, bind.grad_contributors[key]) - 1
            rs.grad_left[key] = left
        want = self.cx.dtype if single else torch.float32
        if single and not self.cx.asynchronous and grad.dtype == want:
            # no streams and no cast: offload_grads adds the one contribution's gradients to the host
            # accumulators as they are, at once; a buffer would only be one more copy of them
            with rs.lock:
                rs.grad_acc[key] = [(lo, grad)]
            return
        if acc is None:
            if (lo, hi) == (base, end):
                acc = be.own(grad if grad.dtype == want else grad.to(want))
            else:  # with several ranks [base, end) is the owner's whole vector padded to W*S elements
                acc = be.empty(end - base, want).zero_()
                acc[lo - base: hi - base] += grad
            with rs.lock:
                rs.grad_acc[key] = acc
        elif (lo, hi) == (base, end):
            acc += grad
        else:
            acc[lo - base: hi - base] += grad
        if left == 0 and acc.dtype != self.cx.dtype and cast:
            wire = be.empty(end - base, self.cx.dtype)
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
