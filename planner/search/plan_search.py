"""The planner's search: schedule family and group size, micro-batch, placement of every tensor class,
swap-vs-recompute and the deferred optimizer fraction, decided together for one Problem.

Four layers (see docs/planning.md, "Planning"):
1. candidates (group size k, micro-batch) are enumerated and pruned with the closed-form roofline bound;
2. for each candidate the CP-SAT placement model (tierflow.planner.search.placement_model) chooses the
   placement fractions and the number of layers that swap their activations instead of recomputing;
3. the best answers are expanded to full iterations and verified by the discrete-event simulator; a plan is
   never returned without that verification. A verification that overflows a tier tightens that tier in the
   CP-SAT model and solves again. Candidates whose CP-SAT objective, and fixed schedules whose slot-model
   prediction, exceed the best verified time by more than PRUNE_TOLERANCE are not simulated;
4. the chosen plan's iteration is predicted by the slot model (tierflow.planner.search.slots), which knows
   when each transfer may run, not only how much each resource works.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

from tierflow.errors import TierflowError
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.search.explain import infeasible_message
from tierflow.planner.search.loads import IterationLoads, iteration_loads
from tierflow.planner.search.placement_model import (
    Solved,
    linear_loads,
    placement_memory,
    placement_of,
    solve_placement,
)
from tierflow.planner.search.problem import Candidate, Problem
from tierflow.planner.search.results import SKIPPED_TIME_LIMIT, Evaluated, SearchResult
from tierflow.planner.search.slots import SlotModelError, predict_config
from tierflow.planner.search.window import solve_window

# debug: every candidate's solver status and verification (tierflow -v plan)
LOG = logging.getLogger(__name__)

# how far a model's prediction may lie above the simulated time (the placement model's objective: up to +1.1%,
# the slot model's: up to +0.7% over experiments/planner_quality.py and the fixed schedules of
# experiments/bench_planner.py): a candidate predicted slower than the best verified time by more than this
# cannot be the fastest and is not simulated
PRUNE_TOLERANCE = 0.02
# a verification that overflows a tier tightens that tier by this much more than the overflow, plus a share of
# the tier, and solves again (at most VERIFY_ATTEMPTS times)
TIGHTEN_OVERFLOW = 1.25
TIGHTEN_CAPACITY = 0.01
VERIFY_ATTEMPTS = 4


class PlanningError(TierflowError, ValueError):
    """No plan fits; the message says which tier overflows by how much and what would make it fit."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(batch: int, *, micro_batches: list[int] | None = None, max_groups: int = 4) -> list[Candidate]:
    out = []
    for mb in micro_batches or divisors(batch):
        M = batch // mb
        ks = sorted({1, M} | {k for k in divisors(M) if k in (2, 4, M // 4, M // 2)})
        if len(ks) > max_groups:
            ks = [ks[0], *ks[len(ks) - max_groups + 1:]]
        for k in ks:
            out.append(Candidate(micro_batch=mb, group=k, alpha=0.25 if k > 1 else 0.0))
    return out


def evaluate(problem: Problem, c: Candidate, *, time_limit_s: float = 5.0, verify: bool = True,
             prune_at: float = math.inf) -> Evaluated:
    """Solve one candidate's placement with CP-SAT and verify it in the simulator (unless the solver's
    objective already exceeds `prune_at` x (1 + PRUNE_TOLERANCE): then it cannot win and is not simulated)."""
    cfg0 = problem.config(c, iterations=1)
    lin = linear_loads(problem, cfg0)
    mem = placement_memory(problem, cfg0)
    tighten: dict[str, float] = {}
    last_error = ""
    solved: Solved | None = None
    for _attempt in range(VERIFY_ATTEMPTS):
        solved = solve_placement(problem, lin, mem, time_limit_s=time_limit_s, tighten_bytes=tighten,
                                 hint=solved)
        if solved is None:
            return Evaluated(c, None, None, error=last_error or "no placement fits every tier")
        cfg = problem.config(c, placement_of(solved.x), solved.n)
        loads = IterationLoads(work=lin.work(solved.x, solved.n), static_bytes={}, world=problem.world)
        ev = Evaluated(c, cfg, solved.report, predicted_s=loads.predict_s(problem.hw),
                       binding=loads.binding(problem.hw))
        if solved.report.objective_s > prune_at * (1 + PRUNE_TOLERANCE):
            ev.error = (f"pruned: solver objective {fmt_s(solved.report.objective_s, sig=4)} > best "
                        f"{fmt_s(prune_at, sig=4)}")
            return ev
        if not verify:
            return ev
        if math.isfinite(prune_at) and _predict(problem, ev).predicted_s > prune_at * (1 + PRUNE_TOLERANCE):
            # the slot model knows when each transfer may run: a candidate it predicts slower than the best
            # verified plan cannot win (its prediction lies within PRUNE_TOLERANCE below the simulated time)
            ev.error = (f"pruned: slot-model prediction {fmt_s(ev.predicted_s, sig=4)} > best "
                        f"{fmt_s(prune_at, sig=4)}")
            return ev
        try:
            ev.result = simulate_config(problem.model, problem.hw, cfg)
            return ev
        except CapacityError as e:
            last_error = str(e)
            tighten[e.tier] = tighten.get(e.tier, 0.0) + TIGHTEN_OVERFLOW * e.over_bytes \
                + TIGHTEN_CAPACITY * problem.capacity_bytes[e.tier]
    return Evaluated(c, None, solved.report if solved else None, error=last_error)


def _predict(problem: Problem, ev: Evaluated) -> Evaluated:
    """Set ev's prediction from the slot model of its (fully decided) configuration. The placement model's
    objective bounds the iteration from below but ignores when each transfer may run; the slot model keeps
    that, and is what the plan reports as its predicted time."""
    if ev.prediction is not None:
        return ev  # predicted already (when it was pruned or not)
    try:
        rep = predict_config(problem.model, problem.hw, ev.config)
    except SlotModelError:
        return ev  # keeps the placement model's prediction
    ev.prediction, ev.predicted_s = rep, rep.objective_s
    return ev


def plan_search(problem: Problem, *, time_limit_s: float = 60.0, micro_batches: list[int] | None = None,
                progress: Callable[[int, int, str], None] | None = None,
                baselines: bool = True) -> SearchResult:
    """Search every candidate (pruned by its roofline floor), return the best verified plan. Every step is
    reproducible (each CP-SAT solve runs on deterministic time: search/cpsat.py) but the cut: `time_limit_s`
    is wall-clock seconds for the whole search, so a search it cuts short (`skipped_by_time_limit` > 0, which
    the plan file records) may skip other candidates on a slower or busier machine."""
    t0 = time.perf_counter()
    batch = problem.rank_batch  # candidates split one rank's share of the batch
    cands = [c for c in candidates(batch, micro_batches=micro_batches) if problem.fits_gpu(c.micro_batch)]
    if not cands:
        raise PlanningError(infeasible_message(problem))
    # larger micro-batches use the GPU better: try them first so the pruning bound bites early
    cands.sort(key=lambda c: (problem.gpu_floor_s(c.micro_batch), -c.group))
    evaluated: list[Evaluated] = []
    best: Evaluated | None = None
    per_solve_s = max(1.0, min(10.0, time_limit_s / max(4, len(cands)) / 2))
    for i, c in enumerate(cands):
        if progress:
            progress(i, len(cands), c.describe(batch))
        floor = problem.gpu_floor_s(c.micro_batch)
        if best is not None and floor >= best.verified_s:
            evaluated.append(Evaluated(c, None, None, error=f"pruned: GPU floor {fmt_s(floor)} >= best "
                                                            f"{fmt_s(best.verified_s)}"))
            continue
        if time.perf_counter() - t0 > time_limit_s and best is not None:
            evaluated.append(Evaluated(c, None, None, error=SKIPPED_TIME_LIMIT))
            continue
        ev = evaluate(problem, c, time_limit_s=per_solve_s, prune_at=best.verified_s if best else math.inf)
        evaluated.append(ev)
        LOG.debug("candidate %s: %s", c.describe(batch), _evaluation_text(ev))
        if ev.result and (best is None or ev.verified_s < best.verified_s):
            _keep_metrics_only(best)
            best = ev
        elif ev is not best:
            _keep_metrics_only(ev)
    if best is not None:
        best = _order_variants(problem, best, evaluated)
    micro_batches_tried = sorted({c.micro_batch for c in cands})
    base = fixed_baselines(problem, micro_batches_tried, only_best=True) if baselines else {}
    for name, (cfg_b, res_b) in base.items():
        # the fixed schedules are part of the decision space: a plan is never slower than them
        if best is None or res_b.iteration_s < best.verified_s:
            c = Candidate(cfg_b.micro_batch, cfg_b.group, cfg_b.alpha, cfg_b.prefetch_depth,
                          cfg_b.optimizer_overlap)
            loads = iteration_loads(problem.model, problem.hw, cfg_b)
            _keep_metrics_only(best)
            best = Evaluated(c, cfg_b, None, res_b, predicted_s=loads.predict_s(problem.hw),
                             binding=loads.binding(problem.hw), error=f"baseline {name}")
            evaluated.append(best)
    if progress:
        progress(len(cands), len(cands), "done")
    if best is None:
        raise PlanningError(infeasible_message(problem))
    _predict(problem, best)
    return SearchResult(best=best, evaluated=evaluated, wall_s=time.perf_counter() - t0, problem=problem,
                        baseline={k: v[1] if v[1] is best.result else v[1].summary_only()
                                  for k, v in base.items()})


def _evaluation_text(ev: Evaluated) -> str:
    """One line on how a candidate fared (debug output): the CP-SAT status and objective, then the verified
    time or why it was not verified."""
    parts = []
    if ev.solver:
        parts.append(f"CP-SAT {ev.solver.status}, objective {fmt_s(ev.solver.objective_s, sig=4)}, "
                     f"gap {ev.solver.gap:.1%}, {fmt_s(ev.solver.wall_s)}")
    if ev.result:
        parts.append(f"verified {fmt_s(ev.verified_s, sig=4)}")
    if ev.error:
        parts.append(ev.error)
    return "; ".join(parts) or "no result"


def _order_variants(problem: Problem, best: Evaluated, evaluated: list[Evaluated]) -> Evaluated:
    """The decisions that change only the order, not the traffic: one more weight buffer ahead, and the
    deferred optimizer fraction; each variant is verified like the rest."""
    for variant in ({"prefetch_depth": 2}, {"alpha": 0.0}, {"alpha": 0.5}):
        if all(getattr(best.config, k) == v for k, v in variant.items()):
            continue
        cfg2 = replace(best.config, **variant)
        try:
            predicted = predict_config(problem.model, problem.hw, cfg2).objective_s
        except SlotModelError:
            predicted = 0.0  # no prediction: simulate it
        if predicted > best.verified_s * (1 + PRUNE_TOLERANCE):
            evaluated.append(Evaluated(replace(best.candidate, **variant), None, None,
                                       error=f"pruned: slot-model prediction {fmt_s(predicted, sig=4)} > "
                                             f"best {fmt_s(best.verified_s, sig=4)}"))
            continue
        try:
            r2 = simulate_config(problem.model, problem.hw, cfg2)
        except CapacityError:
            continue
        if r2.iteration_s < best.verified_s:
            _keep_metrics_only(best)
            best = Evaluated(replace(best.candidate, **variant), cfg2, best.solver, r2,
                             predicted_s=best.predicted_s, binding=best.binding)
            evaluated.append(best)
    return best


def _keep_metrics_only(ev: Evaluated | None) -> None:
    """A verified candidate that is not (or no longer) the best keeps its result's metrics but not its task
    graph and per-task times (SimResult.summary_only): only the best plan's timeline is ever read, and each
    175B graph of three iterations holds ~150 MB."""
    if ev is not None and ev.result is not None and ev.result.graph.tasks:
        ev.result = ev.result.summary_only()


def fixed_baselines(problem: Problem, micro_batches: list[int], *,
                    only_best: bool = False) -> dict[str, tuple[ScheduleConfig, SimResult]]:
    """The best of each fixed schedule (horizontal, fuyou, vertical) with its default settings over the
    micro-batches that fit, keyed 'family mb=b'. `only_best`: only the fastest of them all, found by
    simulating them in the order of the slot model's prediction (tierflow.planner.search.slots) and skipping
    those predicted slower than the best simulated one by more than PRUNE_TOLERANCE."""
    model, hw = problem.model, problem.hw
    cfgs = []
    for family in ("horizontal", "fuyou", "vertical"):
        for mb in micro_batches:
            try:
                cfg = make_schedule(family, model, hw, batch=problem.batch, micro_batch=mb, seq=problem.seq,
                                    gpus=problem.gpus, nodes=problem.nodes)
            except (CapacityError, ValueError):
                continue
            try:
                pred = predict_config(model, hw, cfg).objective_s if only_best else 0.0
            except SlotModelError:
                pred = 0.0  # no prediction: simulate it among the first
            cfgs.append((pred, family, mb, cfg))
    best: dict[str, tuple[ScheduleConfig, SimResult]] = {}
    for pred, family, _mb, cfg in sorted(cfgs, key=lambda t: (t[0], t[2])):
        key = "all" if only_best else family
        if key in best and pred > best[key][1].iteration_s * (1 + PRUNE_TOLERANCE):
            continue
        try:
            res = simulate_config(model, hw, cfg)
        except (CapacityError, ValueError):
            continue
        if key not in best or res.iteration_s < best[key][1].iteration_s:
            best[key] = (cfg, res)
    return {f"{c.family} mb={c.micro_batch}": (c, r) for c, r in best.values()}


def window_check(problem: Problem, cfg: ScheduleConfig, time_limit_s: float = 5.0, layers: int = 2) -> dict:
    """Solve the exact CP-SAT window model (every task an interval, NoOverlap per resource, a reservoir per
    memory tier; warm-started from the schedule's own order) on a `layers`-layer, one-iteration window of the
    chosen plan. Reports how far the builder's order is from the best order CP-SAT finds and proves for that
    window."""
    small = replace(problem.model, num_layers=min(layers, problem.model.num_layers))
    swap = min(cfg.swap_layers, small.num_layers)
    g = build_graph(small, problem.hw, replace(cfg, iterations=1, swap_layers=swap))
    w = solve_window(g, problem.hw, time_limit_s=time_limit_s)
    return {"window_layers": small.num_layers, "window_tasks": w.num_tasks, "window_status": w.status,
            "window_greedy_s": w.greedy_makespan_s, "window_makespan_s": w.makespan_s,
            "window_bound_s": w.best_bound_s, "window_gap": w.gap, "window_wall_s": w.wall_s}


__all__ = ["PRUNE_TOLERANCE", "Candidate", "Evaluated", "PlanningError", "Problem", "SearchResult",
           "candidates", "evaluate", "fixed_baselines", "plan_search", "window_check"]
