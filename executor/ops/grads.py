"""The gradient ops on the host (`GradOps`): offload_grads sends a block's weight gradients to the host, where
they are added to the fp32 accumulators (with streams off the D2H queue, by `HostGradAdds`), write_grads and
read_grads move the accumulators' SSD range.

Numerics: weight gradients are accumulated in fp32 on the device (ops/grad_buffers.py), sent to the host in
the compute dtype and accumulated there in fp32.

No zeroing pass: the host optimizer op leaves a block's accumulator as it was after its update, and the step's
first write into it overwrites instead of adding (0 + g is g: the same fp32 values; only a zero's sign may
differ, -0 kept where 0 + -0 gave +0, which changes no AdamW result nor any square). Which write is first
comes from the plan (`host_grad_writes`): per iteration and owner block, the first offload_grads op, in its
queue's order, that takes gradients of that owner; the adds run in that order (on a plain CPU in the op's
queue, with streams in HostGradAdds' FIFO, which the queue fills). A first write that does not cover the
whole accumulator (a tied head's wte range) zeroes it before adding. An optimizer op of a block no write of
its iteration reaches zeroes the accumulator itself (`HostGradWrites.unwritten`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tierflow.executor.binding import OPTIMIZER_PART, ExecutionError
from tierflow.executor.device.base import RoundAborted
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import OFFLOAD_GRADS


@dataclass(frozen=True)
class HostGradWrites:
    """From the plan: `first`, the (offload_grads op, owner block) pairs whose write into the owner's host
    accumulator is the first of their iteration (it overwrites); `unwritten`, the (iteration, block) pairs of
    host optimizer ops that no write of their iteration reaches (they zero the accumulator first)."""

    first: frozenset[tuple[int, int]]
    unwritten: frozenset[tuple[int, int]]


def host_grad_writes(binding) -> HostGradWrites:
    """The plan's first write of each host accumulator per iteration (see the module docstring): the takers of
    each owner's gradients (binding.grad_range's (op, owner) keys) among the offload_grads ops, in their
    queue's order (key, id). Writers of one owner and iteration on two queues have no order: refused."""
    plan = getattr(binding, "plan", None)
    if plan is None:  # a lone optimizer op (executor/calibration/optimizer_op.py): no gradient ops
        return HostGradWrites(frozenset(), frozenset())
    tasks = binding.tasks
    writers: dict[tuple[int, int], list[Task]] = {}
    for op, owner in binding.grad_range:
        t = tasks[op]
        if t.kind == OFFLOAD_GRADS:
            writers.setdefault((t.iteration, owner), []).append(t)
    first = set()
    for (it, owner), ts in writers.items():
        queues = sorted({t.resource for t in ts})
        if len(queues) > 1:
            raise ExecutionError(f"{plan.source}: the gradients of block {owner} in iteration {it} reach the "
                                 f"host from two queues ({', '.join(queues)}): their order is not the plan's "
                                 "(inconsistent plan)")
        first.add((min(ts, key=lambda t: (t.key, t.id)).id, owner))
    unwritten = {(t.iteration, t.block) for t in tasks
                 if t.kind in OPTIMIZER_PART and (t.iteration, t.block) not in writers}
    return HostGradWrites(frozenset(first), frozenset(unwritten))


def accumulate(acc: torch.Tensor, lo: int, g: torch.Tensor, first: bool) -> None:
    """Add the gradients `g` (compute dtype or fp32) of elements [lo, lo + len) into the fp32 accumulator
    `acc`; the `first` write of a step overwrites (the whole accumulator zeroed first where `g` does not
    cover it)."""
    if not first:
        acc[lo: lo + g.numel()] += g.float()
    elif lo == 0 and g.numel() == acc.numel():
        acc.copy_(g)  # 0 + g: the same values, no zeroing pass and no read of the stale accumulator
    else:
        acc.zero_()
        acc[lo: lo + g.numel()] += g.float()


class GradOps:
    """Weight gradients on the host: fp32 accumulators, the SSD range written out and read back."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers
        self.writes = host_grad_writes(cx.binding)

    def offload_grads(self, rs: RoundState, t: Task) -> None:
        """Send a block's gradients (already in the compute dtype: GradBuffers) to the host; they are added to
        the fp32 accumulators on the host (the step's first write overwrites: `host_grad_writes`), not in
        the D2H queue: with streams by HostGradAdds (after this copy's event), on a plain CPU at once."""
        be = self.cx.backend
        done: set[int] = set()  # owners this op has written already (only its first piece of one overwrites)
        for o, lo, g in self.buffers.take(rs, t.id):
            rs.use_on(g, "d2h")
            first = (t.id, o) in self.writes.first and o not in done
            done.add(o)
            if not self.cx.asynchronous:
                accumulate(self.cx.state.grads[o], lo, g, first)
                continue
            host = self.cx.transfer_buffer(g.numel(), g.dtype)
            be.copy_async(host, g)
            rs.grad_adds.submit(t, o, lo, be.record(rs.streams["d2h"]), host, first)

    def _ssd_range(self, b: int) -> tuple[int, int]:
        _gpu_elems, _cpu_elems, ssd_elems = self.cx.state.grad_split[b]
        n = self.cx.state.shard_numel[b]
        return n - ssd_elems, n

    def write_grads(self, rs: RoundState, t: Task) -> None:
        HostGradAdds.wait_for(rs, t.block)
        a, z = self._ssd_range(t.block)
        if z > a:
            self.cx.ssd.write(f"grads_b{t.block}", self.cx.state.grads[t.block][a:z])
            self.cx.state.grads[t.block][a:z].zero_()

    def read_grads(self, rs: RoundState, t: Task) -> None:
        HostGradAdds.wait_for(rs, t.block)
        a, z = self._ssd_range(t.block)
        if z > a:
            back = self.cx.ssd.read(f"grads_b{t.block}", torch.float32, z - a)
            self.cx.state.grads[t.block][a:z].copy_(back)


class HostGradAdds:
    """Adds offloaded gradients to the host fp32 accumulators off the D2H queue: a thread per round that waits
    (blocking) for each offload_grads copy's event and adds its bytes, in the D2H queue's order, so that the
    D2H worker never synchronizes and the fp32 add runs on a host thread. Host ops that read a block's
    accumulators (adam, write_grads, read_grads) first wait for the block's adds queued before them."""

    def __init__(self, backend, state, rs: RoundState, fail) -> None:
        self.backend, self.state, self.rs, self.fail = backend, state, rs, fail
        self.cv = threading.Condition()
        self.items: list[tuple[Task, int, int, object, torch.Tensor, bool] | None] = []
        self.pending: dict[int, int] = {}
        self.thread = threading.Thread(target=self._loop, name="tierflow-gradadd", daemon=True)
        self.thread.start()

    def submit(self, t: Task, o: int, lo: int, event, host: torch.Tensor, first: bool = False) -> None:
        """Add `host` into block o's accumulator from element lo once `event` is done (`first`: the step's
        first write of it, which overwrites: `accumulate`)."""
        with self.cv:
            self.pending[o] = self.pending.get(o, 0) + 1
            self.items.append((t, o, lo, event, host, first))
            self.cv.notify_all()

    @staticmethod
    def wait_for(rs: RoundState, b: int) -> None:
        """Until every add of block b queued so far is done (no-op without streams)."""
        self = rs.grad_adds
        if self is None:
            return
        with self.cv:
            while self.pending.get(b, 0):
                if rs.abort.is_set():
                    raise RoundAborted()
                self.cv.wait(0.05)

    def close(self) -> None:
        with self.cv:
            self.items.append(None)
            self.cv.notify_all()
        self.thread.join()

    def _loop(self) -> None:
        self.backend.thread_init()
        while True:
            with self.cv:
                while not self.items:
                    self.cv.wait()
                item = self.items.pop(0)
            if item is None:
                return
            t, o, lo, event, host, first = item
            try:
                if not self.rs.abort.is_set():
                    self.backend.synchronize_event(event)
                    accumulate(self.state.grads[o], lo, host, first)
            except RoundAborted:
                pass
            except BaseException as e:  # noqa: BLE001 - the op whose gradients these are
                self.fail(t, e)
            with self.cv:
                self.pending[o] -= 1
                self.cv.notify_all()
