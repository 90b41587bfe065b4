"""The plan's collectives (resource `net`, several data-parallel ranks; dist.py): every rank runs them in the
plan's order on the net worker, so the i-th collective of every rank is the same one.

    all_gather_weights    after this rank's fetch_weights put its shard of a block's compute weights into its
                          slot of a full-size buffer (slot r = elements [r*S, r*S + shard) with S =
                          ceil(n/W)), fill the other ranks' slots: `all_gather_single`
                          (all_gather_into_tensor), in place. A block whose shard is wholly on the device has
                          no fetch: the gather builds the buffer from the device shard.
    reduce_scatter_grads  sum the ranks' fp32 gradient accumulators of a block (padded to W*S elements) and
                          keep this rank's shard: `reduce_scatter_single` (reduce_scatter_tensor), which gloo
                          (CPU) has in the PyTorch this project pins (2.13); where a backend lacks it (older
                          gloo), all_reduce and take the shard, which moves more bytes but sums the same
                          numbers. The shard goes to the op that takes it: to offload_grads cast to the
                          compute dtype on the net stream (offload_grads only copies, as with one rank), to
                          adam_gpu (a GPU optimizer) in fp32.
    all_reduce_grads      LoRA: sum the ranks' fp32 adapter gradients of a layer (the whole vector: every rank
                          keeps the adapters whole) with `all_reduce`, in place, for the layer's adam_gpu.

On a CUDA device the net worker has a stream of its own: NCCL's collectives are enqueued with it current, so
`work.wait()` makes that stream (not the host) wait, and the ops after the collective wait on its end event as
on any stream. On the CPU (gloo) the net worker waits for each collective. A rank whose round failed does not
wait for a collective the other ranks will never join: the engine stops waiting for its net worker after a
grace period, the rank exits, and torchrun stops the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.weights import WeightOps
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import FETCH_WEIGHTS, OFFLOAD_GRADS

_HAS_REDUCE_SCATTER: dict[str, bool] = {}  # backend name -> whether reduce_scatter works there
# reduce_scatter_single is reduce_scatter_tensor's new name (the old one warns from PyTorch 2.13 on)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # likewise


class NetOps:
    def __init__(self, cx: OpContext, weights: WeightOps, buffers: GradBuffers) -> None:
        self.cx, self.weights, self.buffers = cx, weights, buffers
        self.world = cx.state.world

    def _finish(self, rs: RoundState, work) -> None:
        """Wait for a collective: on CUDA the current (net) stream waits for it, not the host; on the CPU the
        host. (Polling gloo's work.is_completed() is no way out of a collective another rank never joins: it
        stays False for a completed reduce-scatter in PyTorch 2.13; the engine gives up on this worker
        instead, see Executor.run_round.)"""
        work.wait()

    def all_gather_weights(self, rs: RoundState, t: Task) -> None:
        fid = self.cx.binding.dep_of_kind[t.id].get(FETCH_WEIGHTS)
        bufs = rs.weight_bufs.pop(fid) if fid is not None else self.weights.shard_buffers(rs, t, {})
        r = self.world.rank
        for o in sorted(bufs):
            full = bufs[o]
            rs.use_on(full, "net")
            s = self.world.shard_size(self.cx.layout.numel[o])
            work = ALL_GATHER(full, full[r * s:(r + 1) * s], group=self.world.net_group,
                                               async_op=True)
            self._finish(rs, work)
        rs.weight_bufs[t.id] = bufs

    def reduce_scatter_grads(self, rs: RoundState, t: Task) -> None:
        consumer = self.cx.binding.tasks[self.cx.binding.scatter_to[t.id]]
        for o, _lo, acc in sorted(self.buffers.take(rs, t.id), key=lambda x: x[0]):
            rs.use_on(acc, "net")
            n = self.cx.layout.numel[o]
            s, r = self.world.shard_size(n), self.world.rank
            lo, hi = self.world.shard(n)
            out = self._reduce_scatter(rs, acc, s, r)[: hi - lo]
            if consumer.kind == OFFLOAD_GRADS and out.dtype != self.cx.dtype:
                # offload_grads only copies (GradBuffers): the shard in the compute dtype, cast on this stream
                wire = self.cx.backend.empty(hi - lo, self.cx.dtype)
                wire.copy_(out)
                out = wire
            rs.use_on(out, consumer.resource)  # made on the net stream, read on the taker's
            with rs.lock:
                rs.grad_acc[(consumer.id, o)] = out

    def all_reduce_grads(self, rs: RoundState, t: Task) -> None:
        """LoRA: the ranks' fp32 adapter gradients of a layer summed in place on every rank
        (`all_reduce`), handed whole to the layer's adam_gpu: every rank steps the same adapters with the
        same gradient."""
        consumer = self.cx.binding.tasks[self.cx.binding.scatter_to[t.id]]
        for o, _lo, acc in self.buffers.take(rs, t.id):
            rs.use_on(acc, "net")
            self._finish(rs, dist.all_reduce(acc, group=self.world.net_group, async_op=True))
            rs.use_on(acc, consumer.resource)  # summed on the net stream, read on the taker's
            with rs.lock:
                rs.grad_acc[(consumer.id, o)] = acc

    def _reduce_scatter(self, rs: RoundState, acc: torch.Tensor, s: int, r: int) -> torch.Tensor:
        group = self.world.net_group
        backend = self.world.backend
        if _HAS_REDUCE_SCATTER.get(backend, True):
            out = self.cx.backend.empty(s, acc.dtype)
            try:
                work = _REDUCE_SCATTER(out, acc, group=group, async_op=True)
            except (RuntimeError, NotImplementedError):  # the same on every rank: all fall back together
                _HAS_REDUCE_SCATTER[backend] = False
            else:
                self._finish(rs, work)
                return out
        work = dist.all_reduce(acc, group=group, async_op=True)
        self._finish(rs, work)
        return acc[r * s:(r + 1) * s]
