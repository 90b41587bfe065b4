"""The plan's ops: one handler per op kind, in an explicit table (`Ops.handlers`) built once per executor and
checked against OP_KINDS (tierflow.planner.core.opkinds), the op kinds a plan may contain. A handler is called
as handler(round_state, task) by the worker of the op's resource, after the op's dependencies have finished.

    entries (activations, their gradients, saved-tensor packs)   entries.EntryOps
    fwd, recompute, head, bwd                                     compute.ComputeOps
    weights                                                       weights.WeightOps
    gradients                                                     grads.GradOps (grad_buffers.GradBuffers)
    optimizer steps                                               optimizer.OptimizerOps
    collectives of several ranks (resource net)                   net.NetOps
"""

from __future__ import annotations

from collections.abc import Callable

from tierflow.executor.ops.compute import ComputeOps
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.entries import EntryOps
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.grads import GradOps
from tierflow.executor.ops.net import NetOps
from tierflow.executor.ops.optimizer import OptimizerOps
from tierflow.executor.ops.weights import WeightOps
from tierflow.planner.core import opkinds as k
from tierflow.planner.core.graph import Task

Handler = Callable[[RoundState, Task], None]


class Ops:
    """The op implementations of one executor, and the table from op kind to handler."""

    def __init__(self, cx: OpContext) -> None:
        self.entries = EntryOps(cx)
        self.weights = WeightOps(cx)
        self.grad_buffers = GradBuffers(cx)
        self.compute = ComputeOps(cx, self.entries, self.weights, self.grad_buffers)
        self.grads = GradOps(cx, self.grad_buffers)
        self.optimizer = OptimizerOps(cx, self.grad_buffers)
        self.net = NetOps(cx, self.weights, self.grad_buffers)
        self.handlers = self._table()

    def _table(self) -> dict[str, Handler]:
        c, w, g, o, e = self.compute, self.weights, self.grads, self.optimizer, self.entries
        table: dict[str, Handler] = {
            k.FWD: c.fwd, k.RECOMPUTE: c.recompute, k.HEAD: c.head, k.BWD: c.bwd,
            k.READ_WEIGHTS: w.read_weights, k.FETCH_WEIGHTS: w.fetch_weights,
            k.UPDATE_WEIGHTS: w.update_weights,
            k.OFFLOAD_GRADS: g.offload_grads, k.WRITE_GRADS: g.write_grads, k.READ_GRADS: g.read_grads,
            k.READ_OPT_STATES: o.read_opt_states, k.ADAM: o.adam, k.ADAM_DEFERRED: o.adam,
            k.WRITE_OPT_STATES: o.write_opt_states, k.ADAM_GPU: o.adam_gpu,
            k.ALL_GATHER_WEIGHTS: self.net.all_gather_weights,
            k.REDUCE_SCATTER_GRADS: self.net.reduce_scatter_grads,
            k.ALL_REDUCE_GRADS: self.net.all_reduce_grads,
        }
        entry_ops = {"offload": e.offload, "fetch": e.fetch, "write": e.write, "read": e.read}
        for verb, kinds in k.ENTRY_KINDS.items():
            table.update(dict.fromkeys(kinds, entry_ops[verb]))
        assert set(table) == k.OP_KINDS, sorted(set(table) ^ k.OP_KINDS)
        return table

    def run(self, rs: RoundState, t: Task) -> None:
        self.handlers[t.kind](rs, t)
