"""`tierflow plan --clip-grad-norm`: what exact global-norm clipping costs the chosen plan on the box. The
plan's graph gets the waits (every optimizer op of a step after every gradient op of the step,
planner/core/clipwait.py) and is simulated again; the plan file written is that graph, so that `tierflow run
--clip-grad-norm` runs it as simulated. The search itself does not weigh clipping: it re-times its choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clipwait import wait_for_norm
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.graph import CycleError, TaskGraph
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import SimResult


@dataclass
class ClipCost:
    """The chosen plan with global clipping: its graph and simulation (None when it cannot wait)."""

    graph: TaskGraph
    result: SimResult | None
    without_s: float  # seconds per iteration without clipping

    def line(self) -> str:
        if self.result is None:
            return ("global clipping (--clip-grad-norm): this plan cannot wait for the step's last gradient "
                    "before its optimizer steps; run it with --clip delayed (the previous step's norm)")
        with_s = self.result.iteration_s
        return (f"global clipping (--clip-grad-norm): {with_s:,.4g} s per iteration vs "
                f"{self.without_s:,.4g} s without ({with_s / self.without_s - 1:+.1%}): the optimizer steps "
                "wait for the step's last gradient; the plan file has the waits")

    def to_dict(self) -> dict:
        return {"global_possible": self.result is not None, "without_s": self.without_s,
                "with_s": self.result.iteration_s if self.result is not None else None}


def clip_cost(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, graph: TaskGraph,
              without: SimResult) -> ClipCost:
    """The chosen plan's graph with the waits of global clipping, simulated (CapacityError if holding the
    gradients until the norm overflows a tier)."""
    try:
        waiting = wait_for_norm(graph)
    except CycleError:
        return ClipCost(graph, None, without.iteration_s)
    return ClipCost(waiting, simulate_config(model, hw, cfg, waiting), without.iteration_s)
