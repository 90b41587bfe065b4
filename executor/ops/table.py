"""The plan's ops: one handler per op kind, in an explicit table (`Ops.handlers`) built once per executor and
checked against KINDS, the op kinds a plan may contain. A handler is called as handler(round_state, task) by the
worker of the op's resource, after the op's dependencies have finished.

    entries (activations, their gradients, saved-tensor packs)   ops_entries.EntryOps
    fwd, recompute, head, bwd                                     ops_compute.ComputeOps
    weights, gradients, optimizer steps                           ops_state.WeightOps, GradOps, OptimizerOps
    collectives of several ranks (resource net)                   ops_net.NetOps
"""

from __future__ import annotations

from collections.abc import Callable

from tierflow.executor.binding import ENTRY_KINDS
from tierflow.executor.context import OpContext, RoundState
from tierflow.executor.ops_compute import ComputeOps
from tierflow.executor.ops_entries import EntryOps
from tierflow.executor.ops_net import NetOps
from tierflow.executor.ops_state import GradBuffers, GradOps, OptimizerOps, WeightOps
from tierflow.planner.core.graph import Task

Handler = Callable[[RoundState, Task], None]

KINDS = frozenset({
    "fwd", "recompute", "bwd", "head", "adam_gpu", "adam", "adam_deferred", "fetch_weights", "update_weights",
    "read_weights", "offload_grads", "write_grads", "read_grads", "read_opt_states", "write_opt_states",
    "all_gather_weights", "reduce_scatter_grads",
    *(kind for kinds in ENTRY_KINDS.values() for kind in kinds),
})


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
            "fwd": c.fwd, "recompute": c.recompute, "head": c.head, "bwd": c.bwd,
            "read_weights": w.read_weights, "fetch_weights": w.fetch_weights, "update_weights": w.update_weights,
            "offload_grads": g.offload_grads, "write_grads": g.write_grads, "read_grads": g.read_grads,
            "read_opt_states": o.read_opt_states, "adam": o.adam, "adam_deferred": o.adam,
            "write_opt_states": o.write_opt_states, "adam_gpu": o.adam_gpu,
            "all_gather_weights": self.net.all_gather_weights, "reduce_scatter_grads": self.net.reduce_scatter_grads,
        }
        entry_ops = {"offload": e.offload, "fetch": e.fetch, "write": e.write, "read": e.read}
        for verb, kinds in ENTRY_KINDS.items():
            table.update(dict.fromkeys(kinds, entry_ops[verb]))
        assert set(table) == KINDS, sorted(set(table) ^ KINDS)
        return table

    def run(self, rs: RoundState, t: Task) -> None:
        self.handlers[t.kind](rs, t)
