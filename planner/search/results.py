"""What the planner's search returns: each candidate's evaluation (its configuration, the placement model's
solve, the verifying simulation, the prediction) and the search's result (the best plan among them). Both the
search (tierflow.planner.search.plan_search) and its explanations (tierflow.planner.search.explain) read
them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.search.problem import Candidate, Problem
from tierflow.planner.search.slots import SolverReport

SKIPPED_TIME_LIMIT = "skipped: time limit"  # the error of a candidate the time limit left untried


@dataclass
class Evaluated:
    """One candidate of the search: the configuration its placement solve chose, the simulation that verified
    it (or why there is none) and the prediction for its decisions."""

    candidate: Candidate
    config: ScheduleConfig | None
    solver: SolverReport | None  # the placement model's solve (solve_placement)
    result: SimResult | None = None
    error: str = ""
    # the prediction for the decisions: the placement model's (IterationLoads.predict_s), replaced by the slot
    # model's (tierflow.planner.search.slots) for the chosen plan
    predicted_s: float = math.inf
    binding: str = ""
    prediction: SolverReport | None = None  # the slot model's solve behind predicted_s

    @property
    def verified_s(self) -> float:
        return self.result.iteration_s if self.result else math.inf


@dataclass
class SearchResult:
    """The search's answer: the best verified plan, every candidate evaluated on the way, and the best fixed
    schedules with their default settings."""

    best: Evaluated
    evaluated: list[Evaluated]
    wall_s: float
    problem: Problem
    baseline: dict[str, SimResult] = field(default_factory=dict)  # best fixed schedules with default settings

    @property
    def skipped_by_time_limit(self) -> int:
        """Candidates not tried because the time limit ran out: when > 0 the plan depends on the
        machine's speed (another run, or a larger batch, may find a better one), so say so and suggest a
        longer limit."""
        return sum(e.error == SKIPPED_TIME_LIMIT for e in self.evaluated)

    @property
    def model(self) -> ModelSpec:
        return self.problem.model

    @property
    def hw(self) -> HardwareProfile:
        return self.problem.hw
