"""The schedule families and the runtimes that run them: their names and lookup tables, and the family a
builder's settings make (tierflow.planner.core.schedules builds them; planner/core/runtimes holds each
runtime's behaviour)."""

from __future__ import annotations

FAMILIES = ("horizontal", "vertical", "fuyou", "block")
# How a schedule's transfers may overlap: "ideal" is tierflow's executor (every transfer runs as early as the
# plan's dependencies and memory allow); "deepspeed" is ZeRO-Infinity as DeepSpeed's ZeRO-3 code runs it
# (docs/baselines-as-coded.md A): parameters on NVMe are fetched on demand, the optimizer's sub-groups are
# read, stepped and written back one after the other; "lohan" is Fuyou as its artifact's code runs it
# (docs/baselines-as-coded.md B2, B3): no weight prefetch in the backward, and the optimizer's NVMe reads and
# writes are waited for on the training thread, between one layer's backward and the next.
RUNTIMES = ("ideal", "deepspeed", "lohan")
# the runtime each family runs as unless asked otherwise: the system whose code the family models
DEFAULT_RUNTIME = {"horizontal": "deepspeed", "fuyou": "lohan", "vertical": "ideal", "block": "ideal"}
# the family each non-ideal runtime models
RUNTIME_FAMILY = {"deepspeed": "horizontal", "lohan": "fuyou"}
# the group size each family fixes (None: the block schedule's own --group)
FIXED_GROUP = {"horizontal": "1", "fuyou": "1", "vertical": "all micro-batches", "block": None}


def family_of(group: int, num_micro_batches: int, optimizer_overlap: bool) -> str:
    """The name of what a builder with these settings builds: one micro-batch per block sweep with the
    optimizer after the backward is ZeRO-Infinity's horizontal schedule, with the optimizer overlapped
    Fuyou's; all micro-batches per sweep is GreedySnake's vertical schedule; anything between is the block
    hybrid."""
    if group == 1 and num_micro_batches >= 1:
        return "fuyou" if optimizer_overlap else "horizontal"
    if group == num_micro_batches:
        return "vertical"
    return "block"
