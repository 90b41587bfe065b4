"""The host cost a compute op pays for exchanging tensors with another worker (`charge_moved_ops`).

A compute op moves tensors when a transfer carries one of its own: it consumes what a transfer of its block
brought in (a dependency on a fetch of its weights, or of its micro-batch's checkpoint or activations), or it
produces what a transfer of its block takes out (an offload of its micro-batch's checkpoint or activations,
or of its block's gradients, depends on it). Such an op takes the executor's path for tensors it does not
keep (autograd leaves made per call, saved tensors through the pack hooks) and wakes up after another
worker's op: `gpu.moved_op_overhead_us` (measured by tierflow calibrate: executor/calibration/op_costs.py) on
top of the gpu.op_overhead_us every compute op pays (costmodel.CostModel). A dependency on, or from, a
transfer of another block or micro-batch only orders the two (a fetch that waits for an earlier op to bound
memory, a prefetch window): the op keeps its own tensors and pays nothing more (in a 4-layer plan with host
checkpoints the head, which a fetch of layer 2's checkpoint waits for, took the resident head's CPU time).
The other ops keep their cost. Capture segments (capture.py) never hold an op with any dependency on, or
from, another resource (`crossing_ops`).
"""

from __future__ import annotations

from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import ADAM_GPU, COMPUTE_KINDS, STATE_KINDS

DEVICE_KINDS = COMPUTE_KINDS | {ADAM_GPU}  # the compute ops gpu.op_overhead_us is charged to


def crossing_ops(tasks: list[Task]) -> set[int]:
    """Ids of the ops with a dependency on, or a dependent on, an op of another resource."""
    out: set[int] = set()
    for t in tasks:
        for d in t.deps:
            if tasks[d].resource != t.resource:
                out.add(d)
                out.add(t.id)
    return out


def _carries(transfer: Task, op: Task) -> bool:
    """Whether `transfer` moves a tensor of compute op `op`: one of its block, and of its micro-batch unless
    the tensor is the block's own (weights, gradients: a state op)."""
    return transfer.block == op.block and (transfer.kind in STATE_KINDS or transfer.mb == op.mb)


def moved_op_ids(tasks: list[Task]) -> set[int]:
    """Ids of the gpu compute ops that exchange tensors with another worker (see the module docstring)."""
    out: set[int] = set()
    for t in tasks:
        for d in t.deps:
            u = tasks[d]
            if u.resource == t.resource:
                continue
            if t.resource == "gpu" and t.kind in DEVICE_KINDS and _carries(u, t):
                out.add(t.id)  # it consumes what u brought in
            if u.resource == "gpu" and u.kind in DEVICE_KINDS and _carries(t, u):
                out.add(u.id)  # t takes out what it produced
    return out


def moved_ops(tasks: list[Task]) -> list[Task]:
    """The gpu compute ops that exchange tensors with another worker."""
    moved = moved_op_ids(tasks)
    return [t for t in tasks if t.id in moved]


def charge_moved_ops(tasks: list[Task], hw) -> None:
    """Add gpu.moved_op_overhead_us to the work of every gpu compute op of `tasks` that exchanges tensors
    with another worker (in place; nothing where the profile leaves the field null)."""
    extra_s = hw.gpu.moved_op_overhead_s
    if extra_s <= 0:
        return
    for t in moved_ops(tasks):
        t.work += extra_s
