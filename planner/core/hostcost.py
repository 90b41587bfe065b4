"""The host cost a compute op pays for exchanging tensors with another worker (`charge_moved_ops`).

A compute op whose plan connects it to another resource (a dependency on, or a dependent on, an op of another
queue: its weights fetched, its checkpoint offloaded or fetched, its gradients offloaded) takes the executor's
path for tensors it does not keep (autograd leaves made per call, saved tensors through the pack hooks) and
wakes up after another worker's op: `gpu.moved_op_overhead_us` (measured by tierflow calibrate:
executor/calibration/op_costs.py) on top of the gpu.op_overhead_us every compute op pays
(costmodel.CostModel). The other ops keep their cost. Capture segments (capture.py) never hold such an op.
"""

from __future__ import annotations

from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import ADAM_GPU, COMPUTE_KINDS

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


def moved_ops(tasks: list[Task]) -> list[Task]:
    """The gpu compute ops that exchange tensors with another worker."""
    cross = crossing_ops(tasks)
    return [t for t in tasks if t.resource == "gpu" and t.kind in DEVICE_KINDS and t.id in cross]


def charge_moved_ops(tasks: list[Task], hw) -> None:
    """Add gpu.moved_op_overhead_us to the work of every gpu compute op of `tasks` that exchanges tensors
    with another worker (in place; nothing where the profile leaves the field null)."""
    extra_s = hw.gpu.moved_op_overhead_s
    if extra_s <= 0:
        return
    for t in moved_ops(tasks):
        t.work += extra_s
