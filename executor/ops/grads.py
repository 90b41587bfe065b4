"""The gradient ops on the host (`GradOps`): offload_grads sends a block's weight gradients to the host, where
they are added to the fp32 accumulators (with streams off the D2H queue, by `HostGradAdds`), write_grads and
read_grads move the accumulators' SSD range.

Numerics: weight gradients are accumulated in fp32 on the device (ops/grad_buffers.py), sent to the host in
the compute dtype and accumulated there in fp32.
"""

from __future__ import annotations

import threading

import torch

from tierflow.executor.device.base import RoundAborted
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.planner.core.graph import Task


class GradOps:
    """Weight gradients on the host: fp32 accumulators, the SSD range written out and read back."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers

    def offload_grads(self, rs: RoundState, t: Task) -> None:
        """Send a block's gradients (already in the compute dtype: GradBuffers) to the host; they are added to
        the fp32 accumulators on the host, not in the D2H queue: with streams by HostGradAdds (after this
        copy's event), on a plain CPU at once."""
        be = self.cx.backend
        for o, lo, g in self.buffers.take(rs, t.id):
            rs.use_on(g, "d2h")
            if not self.cx.asynchronous:
                self.cx.state.grads[o][lo: lo + g.numel()] += g.float()
                continue
            host = self.cx.transfer_buffer(g.numel(), g.dtype)
            be.copy_async(host, g)
            rs.grad_adds.submit(t, o, lo, be.record(rs.streams["d2h"]), host)

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
        self.items: list[tuple[Task, int, int, object, torch.Tensor] | None] = []
        self.pending: dict[int, int] = {}
        self.thread = threading.Thread(target=self._loop, name="tierflow-gradadd", daemon=True)
        self.thread.start()

    def submit(self, t: Task, o: int, lo: int, event, host: torch.Tensor) -> None:
        with self.cv:
            self.pending[o] = self.pending.get(o, 0) + 1
            self.items.append((t, o, lo, event, host))
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
            t, o, lo, event, host = item
            try:
                if not self.rs.abort.is_set():
                    self.backend.synchronize_event(event)
                    self.state.grads[o][lo: lo + host.numel()] += host.float()
            except RoundAborted:
                pass
            except BaseException as e:  # noqa: BLE001 - the op whose gradients these are
                self.fail(t, e)
            with self.cv:
                self.pending[o] -= 1
                self.cv.notify_all()
