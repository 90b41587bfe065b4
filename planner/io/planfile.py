"""Plan files: the schedule as data, the load/save entry of the plan format.

A plan file is a versioned JSON document holding everything the simulator and the executor need to run one
schedule: the model's shapes, the hardware profile, the schedule decisions (batch split, group, alpha,
placement, ...), and every op of the task graph with its resource, amount of work, dependencies, position in
its resource's queue and memory effects. ``docs/plan-format.md`` documents every field. The Plan itself is
tierflow.planner.core.contract's; the writer is tierflow.planner.io.planwrite, the validator
tierflow.planner.io.planvalidate.

    plan = plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))
    write_plan(plan, "plan.json")          # "plan.json.gz": gzip-compressed
    plan = load_plan("plan.json")          # validates everything; PlanError on any problem; reads gzip too
    simulate_plan(plan).iteration_s
"""

from __future__ import annotations

from tierflow.planner.core.contract import Plan
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.io.planvalidate import (
    MAX_PLAN_BYTES,
    PLAN_FORMAT,
    PLAN_VERSION,
    SUPPORTED_VERSIONS,
    PlanError,
    check_ops_match_decisions,
    load_plan,
    plan_digest,
    plan_from_dict,
    validate_plan_dict,
)
from tierflow.planner.io.planwrite import (
    LARGE_PLAN_BYTES,
    WrittenPlan,
    dumps_plan_dict,
    plan_from_graph,
    plan_to_dict,
    write_plan,
)


def simulate_plan(plan: Plan) -> SimResult:
    """Play the plan's graph on the plan's hardware (tierflow.planner.core.simulator); tokens and FLOPs filled
    in as tierflow.planner.core.simulate.simulate_config does."""
    return simulate_config(plan.model, plan.hardware, plan.config, plan.graph)


__all__ = [
    "PLAN_FORMAT", "PLAN_VERSION", "SUPPORTED_VERSIONS", "LARGE_PLAN_BYTES", "Plan", "PlanError",
    "WrittenPlan", "plan_from_graph", "plan_to_dict",
    "plan_from_dict", "write_plan", "load_plan", "validate_plan_dict", "simulate_plan", "dumps_plan_dict",
    "plan_digest", "MAX_PLAN_BYTES", "check_ops_match_decisions",
]
