"""The one planning function: `make_plan(model, hw, batch, seq, options)` searches (planner/search), chooses
the optimizer-state format where asked, checks a 2-layer window with CP-SAT, re-times the choice with
global clipping where the run clips, and returns the plan with its verification. `tierflow plan` (it parses,
calls this and writes), `tierflow run --adapt`'s re-plan (executor/decide.py `replan`) and the experiments
call it with the same `PlanOptions`, so a run that adapts switches only to a plan `tierflow plan` would make
on that profile (tests/planner/io/test_planning.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.models import ModelSpec

if TYPE_CHECKING:
    from tierflow.planner.core.contract import Plan, ScheduleConfig
    from tierflow.planner.core.graph import TaskGraph
    from tierflow.planner.core.simulator import SimResult
    from tierflow.planner.io.clipreport import ClipCost
    from tierflow.planner.search.plan_search import SearchResult
    from tierflow.planner.search.problem import Problem

Progress = Callable[[int, int, str], None]  # (candidate index, candidates, what)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan (`tierflow plan`'s options past the model, box and batch; its defaults are these)."""

    time_limit_s: float = 60.0  # the whole search
    micro_batches: tuple[int, ...] | None = None  # the micro-batches to try (None: all that fit)
    allow_ssd: bool = True  # False: GPU and CPU memory only
    baselines: bool = True  # simulate the fixed schedules too (one of them may be the plan)
    window: bool = True  # the exact CP-SAT check of a 2-layer window (one rank only)
    clip: bool = False  # the run clips by global norm: the plan's graph waits for the step's norm
    # the optimizer-state formats to choose from, fastest first of equals (None: the model's own format)
    auto_states: tuple[str, ...] | None = None
    gpus: int = 1  # data-parallel GPUs per box
    nodes: int = 1  # boxes


@dataclass(frozen=True)
class Planned:
    """A plan and how it was found: the problem (its model in the chosen state format), the search, the
    chosen graph (with clipping's waits where asked), the solver report the plan file records, the clipping
    cost, and with auto_states each format's verified iteration."""

    problem: Problem
    search: SearchResult
    graph: TaskGraph
    solver: dict[str, Any]
    clip: ClipCost | None
    state_times_s: dict[str, float] | None

    @property
    def config(self) -> ScheduleConfig:
        return self.search.best.config

    @property
    def verified(self) -> SimResult:
        """The chosen plan's simulation (with clipping's waits where asked and possible)."""
        if self.clip is not None and self.clip.result is not None:
            return self.clip.result
        return self.search.best.result

    def plan(self) -> Plan:
        """The plan (what a plan file holds)."""
        from tierflow.planner.io.planfile import plan_from_graph

        p = self.problem
        return plan_from_graph(p.model, p.hw, self.config, self.graph, predicted=self.verified,
                               solver=self.solver)


def make_plan(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, opts: PlanOptions,
              progress: Progress | None = None) -> Planned:
    """Plan `model` (its precision and state format set) on `hw` for `batch` sequences of `seq` tokens."""
    from tierflow.planner.io.clipreport import clip_cost
    from tierflow.planner.search.problem import Problem

    problem = Problem(model, hw, batch, seq, allow_ssd=opts.allow_ssd, gpus=opts.gpus, nodes=opts.nodes)
    times = None
    if opts.auto_states is not None:
        problem, sr, times = _choose_states(problem, opts, progress)
    else:
        sr = _search(problem, opts, progress)
    best = sr.best
    graph = _chosen_graph(problem.model, hw, best.config, best.result)
    solver = _solver_report(problem, sr, opts)
    clip = clip_cost(problem.model, hw, best.config, graph, best.result) if opts.clip else None
    if clip is not None:
        graph = clip.graph
    return Planned(problem, sr, graph, solver, clip, times)


def _search(problem: Problem, opts: PlanOptions, progress: Progress | None) -> SearchResult:
    from tierflow.planner.search.plan_search import plan_search

    mbs = list(opts.micro_batches) if opts.micro_batches else None
    return plan_search(problem, time_limit_s=opts.time_limit_s, micro_batches=mbs, progress=progress,
                       baselines=opts.baselines)


def _choose_states(problem: Problem, opts: PlanOptions,
                   progress: Progress | None) -> tuple[Problem, SearchResult, dict[str, float]]:
    """The search for each format of opts.auto_states (in order), and the fastest (the first of equals): its
    problem, search result, and each format's verified iteration."""
    best, times = None, {}
    for f in opts.auto_states:
        p = dataclasses.replace(problem, model=problem.model.with_optimizer_states(f), _cache={})
        sr = _search(p, opts, progress)
        times[f] = sr.best.result.iteration_s
        if best is None or times[f] < best[1].best.result.iteration_s:
            best = (p, sr)
    return best[0], best[1], times


def _chosen_graph(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig,
                  result: SimResult | None) -> TaskGraph:
    """The chosen plan's task graph: the one its verification simulated (built from the same decisions, and
    left as built by the simulator), else built again."""
    from tierflow.planner.core.schedules import build_graph

    if result is not None and result.graph.tasks and result.meta.get("schedule") == cfg.to_dict():
        return result.graph
    return build_graph(model, hw, cfg)


def _solver_report(problem: Problem, sr: SearchResult, opts: PlanOptions) -> dict[str, Any]:
    """What the plan file records of the search: the chosen candidate's solver report, the search's totals,
    the slot model's prediction and the window check (one rank only)."""
    best = sr.best
    solver = best.solver.to_dict() if best.solver else {"status": "BASELINE"}
    solver.update({"search_wall_s": sr.wall_s, "candidates": len(sr.evaluated),
                   "predicted_s": best.predicted_s, "verified_s": best.verified_s,
                   "skipped_by_time_limit": sr.skipped_by_time_limit})
    if best.prediction:
        solver["prediction"] = best.prediction.to_dict()
    if opts.window and problem.world.ranks == 1:  # the window model covers one rank
        from tierflow.planner.search.plan_search import window_check

        window_s = min(10.0, max(1.0, opts.time_limit_s / 10))
        solver.update(window_check(problem, best.config, time_limit_s=window_s))
    return solver
