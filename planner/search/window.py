"""Exact ordering of a steady-state window with CP-SAT.

A whole iteration of a 175B model is far too large to solve exactly, so the planner solves a *window*: the
task graph of the model cut down to a few layers (``dataclasses.replace(model, num_layers=w)``, w = 2..4) and
one iteration with all its micro-batches. `solve_window` decides the order of the tasks on every resource and
reports CP-SAT's proven lower bound, i.e. how far that order can be from optimal.

The model (one CP-SAT scheduling model over the whole graph):

- one fixed-size interval per task. Its duration is the task's work in seconds on gpu/cpu, and bytes / the
  link's *solo* rate on h2d, d2h, ssd_read and ssd_write. The window model ignores the duplex slow-down that
  the simulator applies while both directions of a link are busy (PCIe H2D + D2H, SSD reads + writes), so it
  is optimistic on shared links: its makespan and bound are those of a machine whose links never slow each
  other.
- durations are integers in a time unit chosen so that the makespan is ~2e5 units (greedy makespan / 2e5
  unless `time_unit_s` is given), rounded *up*, and >= 1 unit for any task with work;
- a NoOverlap per resource (one task at a time, as in the simulator);
- precedence: end(dep) <= start(task);
- memory, per tier, as a reservoir: each task's `mem_start` changes the tier's level at its start and
  `mem_end` at its end. The level starts at 0 = `graph.static_bytes` and must stay <= capacity - static (the
  fixed level of the resident tensors is folded into the maximum). Like the simulator, the model sets no floor
  on the level (the simulator only checks allocations against the capacity), so the reservoir's minimum is
  unbounded. Bytes are integers in a per-tier unit of 1 MB = 10^6 bytes (`MEM_UNIT_BYTES`; decimal megabytes,
  not MiB), *allocations rounded up and frees rounded down* (in magnitude): the model's level is then never
  below the true level, so any solution of the model fits in the real capacities (it is never more optimistic
  than reality). Rounding frees down leaks up to one unit per event, which could make a schedule that fits
  exactly look infeasible; to bound that, a tier whose number of events x 1 MB exceeds 0.1% of its headroom
  gets a smaller unit (headroom x 0.001 / events, >= 1 byte), so the model is at most 0.1% of the headroom
  more pessimistic than reality. A tier whose total allocations fit in its headroom cannot bind and gets no
  reservoir;
- objective: minimise the makespan = max end of all tasks.

Warm start: the graph is simulated with `simulate_graph` in the schedule's own order (`greedy_makespan_s`,
with the duplex-shared rates). The hint given to CP-SAT is the same order played again with the model's own
integer solo durations and rounded memory (`replay_order`), which makes it a feasible solution of the model
whenever that replay completes; if it cannot (a rounded capacity blocks it), the simulator's start times are
hinted instead and CP-SAT repairs them. The solver thus starts from a solution at least as good as the
schedule's own order under the same (solo) durations.

`best_bound_s` is CP-SAT's bound on the model with rounded-up durations, never below the preemptive
one-machine bound of `resource_lower_bound` (which also seeds the makespan's domain); the rounding costs at
most one time unit per task on a critical chain (e.g. <= 0.1% of the makespan for 400 tasks in a chain at 2e5
units).

Solver settings: reservoirs are kept as propagators (`expand_reservoir_constraints = False`: expanded, their
presolve alone takes seconds on a few hundred events), and the solve is reproducible
(`tierflow.planner.search.cpsat`): one worker with a fixed seed, stopped after `time_limit_s` units of
CP-SAT's deterministic time rather than wall-clock seconds, so the same window gives the same order and bound
on every run however loaded the machine is.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from ortools.sat.python import cp_model

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.graph import LINKS, RESOURCES, TIERS, TaskGraph
from tierflow.planner.core.simulator import SimulationError, simulate_graph
from tierflow.planner.search.cpsat import deterministic_solver

TARGET_UNITS = 2e5  # the greedy makespan in time units when no time unit is given
MEGABYTE = 10**6  # bytes in a (decimal) megabyte, not the 2**20-byte MiB
MEM_UNIT_BYTES = float(MEGABYTE)  # the default memory unit of the model's reservoirs
MEM_DRIFT_FRACTION = 1e-3  # worst-case pessimism of the rounded memory model, as a fraction of the headroom
_EPS_BYTES = 1.0  # the simulator's tolerance on capacities


@dataclass
class WindowResult:
    """What `solve_window` found: the best order of every resource, its makespan and CP-SAT's proven bound."""

    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "UNKNOWN" | "MODEL_INVALID"
    makespan_s: float  # solver's best makespan (seconds)
    best_bound_s: float  # CP-SAT's proven lower bound (seconds)
    gap: float  # (makespan - bound) / makespan
    wall_s: float
    greedy_makespan_s: float  # the simulator's makespan of the same graph with the schedule's own order
    order: dict[str, list[int]] = field(default_factory=dict)  # task ids per resource in the solver's order
    start_s: dict[int, float] = field(default_factory=dict)  # solver start time per task id
    num_tasks: int = 0


# ---- the model's data --------------------------------------------------------------------------------------


def solo_durations_s(graph: TaskGraph, hw: HardwareProfile) -> list[float]:
    """Each task's duration alone on its resource: work seconds on gpu/cpu, bytes / solo rate on links."""
    rates = link_rates(hw)
    out = []
    for t in graph.tasks:
        if t.resource in LINKS:
            rate = getattr(rates, t.resource)
            if t.work > 0 and rate <= 0:
                raise ValueError(f"task {t.id} ({t.label}) moves {t.work:.0f} bytes on {t.resource}, "
                                 f"which has no bandwidth on {hw.name}")
            out.append(t.work / rate if t.work > 0 else 0.0)
        else:
            out.append(max(float(t.work), 0.0))
    return out


def duration_units(durations_s: list[float], time_unit_s: float) -> list[int]:
    """Durations in time units, rounded up (>= 1 unit for any task with work)."""
    out = []
    for d in durations_s:
        if d <= 0:
            out.append(0)
        else:
            # the tiny tolerance keeps an exact multiple of the unit from rounding up by float noise
            out.append(max(1, math.ceil(d / time_unit_s - 1e-9)))
    return out


@dataclass
class _TierMemory:
    """One tier's reservoir in the window model: its unit, its headroom and its rounded level changes."""

    tier: int
    unit_bytes: float
    max_level: int  # headroom (capacity - static) in units, rounded down
    # (task id, at_end, level change in units): allocations rounded up, frees rounded down in magnitude
    events: list[tuple[int, bool, int]]


def memory_model(graph: TaskGraph) -> list[_TierMemory]:
    """The rounded memory events of every tier that could bind (see the module docstring)."""
    per_tier: list[list[tuple[int, bool, float]]] = [[] for _ in TIERS]
    for t in graph.tasks:
        for at_end, changes in ((False, t.mem_start), (True, t.mem_end)):
            net = [0.0] * len(TIERS)
            touched = [False] * len(TIERS)
            for tier, delta in changes:
                net[tier] += delta
                touched[tier] = True
            for i in range(len(TIERS)):
                if touched[i] and net[i] != 0.0:
                    per_tier[i].append((t.id, at_end, net[i]))
    out = []
    for i, name in enumerate(TIERS):
        events = per_tier[i]
        if not events:
            continue
        headroom = graph.capacity_bytes[name] - graph.static_bytes[name] + _EPS_BYTES
        unit = MEM_UNIT_BYTES
        if len(events) * unit > MEM_DRIFT_FRACTION * headroom:
            unit = max(1.0, math.floor(MEM_DRIFT_FRACTION * max(headroom, 0.0) / len(events)))
        max_level = math.floor(headroom / unit)
        ev = []
        for tid, at_end, delta in events:
            q = math.ceil(delta / unit) if delta > 0 else -math.floor(-delta / unit)
            if q:
                ev.append((tid, at_end, q))
        if sum(q for _, _, q in ev if q > 0) <= max_level:
            continue  # even every allocation at once fits: the tier cannot bind
        out.append(_TierMemory(i, unit, max_level, ev))
    return out


def replay_order(graph: TaskGraph, hw: HardwareProfile, time_unit_s: float, *, memory: bool = True,
                 order: dict[str, list[int]] | None = None) -> tuple[list[int] | None, int]:
    """Play the schedule's own order (or `order`) with the window model's integer solo durations and rounded
    memory, the way the simulator plays it: each resource runs its queue in order; a task starts once its
    dependencies are done, its resource is free and its start allocations fit.

    Returns (start of every task in time units, makespan in units), or (None, -1) when the order cannot be
    played to the end (an allocation never fits under the rounded capacities) or an allocation made at a
    task's end (which the simulator never refuses) overflows a tier. A returned replay is a feasible solution
    of the window model."""
    dur = duration_units(solo_durations_s(graph, hw), time_unit_s)
    tasks = graph.tasks
    n = len(tasks)
    order = order or graph.resource_order()
    queues = [order.get(r, []) for r in RESOURCES]
    mems = memory_model(graph) if memory else []
    start_delta: dict[int, list[tuple[int, int]]] = {}
    end_delta: dict[int, list[tuple[int, int]]] = {}
    for k, m in enumerate(mems):
        for tid, at_end, q in m.events:
            (end_delta if at_end else start_delta).setdefault(tid, []).append((k, q))
    level = [0] * len(mems)
    cap = [m.max_level for m in mems]
    ndeps = [len(set(t.deps)) for t in tasks]
    succ: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        for d in set(t.deps):
            succ[d].append(t.id)
    start = [-1] * n
    ptr = [0] * len(RESOURCES)
    busy_until = [-1] * len(RESOURCES)  # end time of the running task, -1 when idle
    running = [-1] * len(RESOURCES)
    now = 0
    done = 0
    while done < n:
        progress = True
        while progress:  # start everything that can start now (zero-length tasks may free more)
            progress = False
            for r in range(len(RESOURCES)):
                if running[r] >= 0 or ptr[r] >= len(queues[r]):
                    continue
                tid = queues[r][ptr[r]]
                if ndeps[tid]:
                    continue
                ch = start_delta.get(tid, ())
                if any(q > 0 and level[k] + q > cap[k] for k, q in ch):
                    continue
                for k, q in ch:
                    level[k] += q
                ptr[r] += 1
                start[tid] = now
                running[r] = tid
                busy_until[r] = now + dur[tid]
                progress = True
            for r in range(len(RESOURCES)):  # zero-duration tasks end at once
                if running[r] >= 0 and busy_until[r] == now:
                    done += _finish(r, running, end_delta, level, succ, ndeps)
                    progress = True
            if _over(level, cap):
                return None, -1  # an allocation at a task's end overflows: not a solution of the model
        if done >= n:
            break
        pending = [busy_until[r] for r in range(len(RESOURCES)) if running[r] >= 0]
        if not pending:
            return None, -1  # blocked for good: memory never fits (or a dependency cycle)
        now = min(pending)
        for r in range(len(RESOURCES)):
            if running[r] >= 0 and busy_until[r] == now:
                done += _finish(r, running, end_delta, level, succ, ndeps)
        if _over(level, cap):
            return None, -1
    makespan = max((start[i] + dur[i] for i in range(n)), default=0)
    return start, makespan


def _finish(r: int, running: list[int], end_delta: dict, level: list[int], succ: list[list[int]],
            ndeps: list[int]) -> int:
    """The task running on r ends: its memory changes at its end, its successors wait for one task less.
    Returns 1 (one more task done)."""
    tid = running[r]
    running[r] = -1
    for k, q in end_delta.get(tid, ()):
        level[k] += q
    for s in succ[tid]:
        ndeps[s] -= 1
    return 1


def _over(level: list[int], cap: list[int]) -> bool:
    """Whether some tier's rounded level exceeds its headroom."""
    return any(lv > c for lv, c in zip(level, cap))


# ---- a lower bound -----------------------------------------------------------------------------------------


def resource_lower_bound(graph: TaskGraph, dur: list[int]) -> int:
    """A lower bound on the makespan (in the units of `dur`): for every resource, the preemptive one-machine
    relaxation with heads (longest dependency chain before a task) and tails (longest chain after it), solved
    exactly by Jackson's preemptive schedule. Valid for the window model with or without memory."""
    tasks = graph.tasks
    topo = graph.topological_order()
    head = [0] * len(tasks)
    for i in topo:
        for d in tasks[i].deps:
            head[i] = max(head[i], head[d] + dur[d])
    tail = [0] * len(tasks)
    succ: list[list[int]] = [[] for _ in tasks]
    for t in tasks:
        for d in set(t.deps):
            succ[d].append(t.id)
    for i in reversed(topo):
        for s in succ[i]:
            tail[i] = max(tail[i], dur[s] + tail[s])
    best = max((head[i] + dur[i] + tail[i] for i in range(len(tasks))), default=0)
    by_res: dict[str, list[int]] = {}
    for t in tasks:
        by_res.setdefault(t.resource, []).append(t.id)
    for ids in by_res.values():
        best = max(best, _jackson_preemptive(sorted(ids, key=lambda i: head[i]), head, dur, tail))
    return best


def _jackson_preemptive(ids: list[int], head: list[int], dur: list[int], tail: list[int]) -> int:
    """max_i (completion_i + tail_i) of the preemptive schedule that always runs the released task with the
    longest tail: the optimum of the preemptive one-machine problem with heads and tails."""
    ready: list[tuple[int, int]] = []  # (-tail, id)
    left = {i: dur[i] for i in ids}
    now, k, best = 0, 0, 0
    while k < len(ids) or ready:
        if not ready:
            now = max(now, head[ids[k]])
        while k < len(ids) and head[ids[k]] <= now:
            heapq.heappush(ready, (-tail[ids[k]], ids[k]))
            k += 1
        _, i = ready[0]
        nxt = head[ids[k]] if k < len(ids) else math.inf
        run = min(left[i], nxt - now)
        now += run
        left[i] -= run
        if left[i] == 0:
            heapq.heappop(ready)
            best = max(best, now + tail[i])
    return best


# ---- the solver --------------------------------------------------------------------------------------------


def solve_window(graph: TaskGraph, hw: HardwareProfile, *, time_limit_s: float = 10.0,
                 time_unit_s: float | None = None, memory: bool = True) -> WindowResult:
    """Order the tasks of `graph` on every resource to minimise its makespan, with CP-SAT.

    The window model ignores the duplex slow-down that the simulator applies on shared links (it uses solo
    rates), so it is optimistic on shared links; see the module docstring for the whole model, the rounding of
    time and memory and the warm start. `memory=False` drops the capacity constraints. Returns the solver's
    best solution. When it found none, the result is the schedule's own order with the status CP-SAT gave: as
    the window model plays it (`replay_order`) when that replay is a solution of the model, else as the
    simulator played it (then `makespan_s` = `greedy_makespan_s`)."""
    t0 = time.perf_counter()
    trivial = _trivial_window(graph, memory, t0)
    if trivial is not None:
        return trivial
    data = _window_data(graph, hw, time_unit_s, memory)
    model = cp_model.CpModel()
    v = _window_variables(model, graph, data)
    _add_no_overlap(model, v)
    _add_precedence(model, graph, data.dur, v.starts)
    if memory:
        _add_memory(model, graph, data.dur, v.starts)
    objective = _add_objective(model, graph, data, v.starts)
    _add_hints(model, data, v.starts, objective.makespan)
    solver, code = _solve(model, time_limit_s)
    return _window_result(graph, data, v, objective, solver, code, t0)


def _trivial_window(graph: TaskGraph, memory: bool, t0: float) -> WindowResult | None:
    """The answer without a model: an empty graph, or resident tensors that do not fit (None otherwise)."""
    n = len(graph.tasks)
    if n == 0:
        return WindowResult("OPTIMAL", 0.0, 0.0, 0.0, time.perf_counter() - t0, 0.0, graph.resource_order(),
                            {}, 0)
    for name in TIERS:
        if memory and graph.static_bytes[name] > graph.capacity_bytes[name] + _EPS_BYTES:
            return WindowResult("INFEASIBLE", math.nan, math.nan, math.nan, time.perf_counter() - t0,
                                math.nan, graph.resource_order(), {}, n)
    return None


# ---- the solver: data --------------------------------------------------------------------------------------


class _WindowData(NamedTuple):
    """What the window model is built from (`_window_data`)."""

    sim_start: np.ndarray | None  # the simulator's start of every task in the schedule's order (None: failed)
    greedy_s: float  # the simulator's makespan (nan: it failed)
    time_unit_s: float  # seconds per time unit of the model
    dur: list[int]  # every task's solo duration in time units, rounded up
    hint: list[int] | None  # the schedule's own order as the model plays it (`replay_order`; None: it cannot)
    hint_makespan: int  # the replay's makespan in time units (-1: none)
    horizon: int  # the latest end of any task, in time units


def _window_data(graph: TaskGraph, hw: HardwareProfile, time_unit_s: float | None,
                 memory: bool) -> _WindowData:
    """The greedy (the simulator in the schedule's own order), the time unit, the integer durations and the
    warm start."""
    sim_start: np.ndarray | None = None
    try:
        sim = simulate_graph(graph, hw)
        sim_start = sim.start_s
        greedy_s = float(np.nanmax(sim.end_s)) if graph.tasks else 0.0
    except SimulationError:
        greedy_s = math.nan
    dur_s = solo_durations_s(graph, hw)
    if time_unit_s is None:
        time_unit_s = _default_time_unit_s(graph, dur_s, greedy_s)
    if time_unit_s <= 0:
        raise ValueError(f"time_unit_s must be > 0, got {time_unit_s}")
    dur = duration_units(dur_s, time_unit_s)
    hint, hint_makespan = replay_order(graph, hw, time_unit_s, memory=memory)
    horizon = max(sum(dur), hint_makespan, 1)
    return _WindowData(sim_start, greedy_s, time_unit_s, dur, hint, hint_makespan, horizon)


def _default_time_unit_s(graph: TaskGraph, dur_s: list[float], greedy_s: float) -> float:
    """The time unit that makes the greedy makespan (without one, the busiest resource's load) TARGET_UNITS
    units long."""
    ref = greedy_s
    if not ref or not math.isfinite(ref):  # no greedy: the busiest resource's load
        load: dict[str, float] = {}
        for t, d in zip(graph.tasks, dur_s):
            load[t.resource] = load.get(t.resource, 0.0) + d
        ref = max(load.values(), default=0.0)
    return ref / TARGET_UNITS if ref > 0 else 1.0


# ---- the solver: variables, constraints, objective ---------------------------------------------------------


class _WindowVars(NamedTuple):
    """The window model's variables (`_window_variables`)."""

    starts: list[cp_model.IntVar]  # the start of every task, in time units
    intervals: list[cp_model.IntervalVar]  # its fixed-size interval
    by_res: dict[str, list[int]]  # the task ids of each resource


def _window_variables(model: cp_model.CpModel, graph: TaskGraph, data: _WindowData) -> _WindowVars:
    """One start and one fixed-size interval per task, inside the horizon."""
    dur, horizon = data.dur, data.horizon
    n = len(graph.tasks)
    starts = [model.new_int_var(0, horizon - dur[i], f"s{i}") for i in range(n)]
    intervals = [model.new_fixed_size_interval_var(starts[i], dur[i], f"iv{i}") for i in range(n)]
    by_res: dict[str, list[int]] = {r: [] for r in RESOURCES}
    for t in graph.tasks:
        by_res[t.resource].append(t.id)
    return _WindowVars(starts, intervals, by_res)


def _add_no_overlap(model: cp_model.CpModel, v: _WindowVars) -> None:
    """One task at a time on every resource, as in the simulator."""
    for ids in v.by_res.values():
        if len(ids) > 1:
            model.add_no_overlap([v.intervals[i] for i in ids])


def _add_precedence(model: cp_model.CpModel, graph: TaskGraph, dur: list[int], starts: list) -> None:
    """A task starts after each of its dependencies ends."""
    for t in graph.tasks:
        for d in set(t.deps):
            model.add(starts[d] + dur[d] <= starts[t.id])


def _add_memory(model: cp_model.CpModel, graph: TaskGraph, dur: list[int], starts: list) -> None:
    """A reservoir per tier that could bind: the rounded level changes at the tasks' starts and ends stay
    within the headroom."""
    for m in memory_model(graph):
        times = [starts[tid] + (dur[tid] if at_end else 0) for tid, at_end, _ in m.events]
        changes = [q for _, _, q in m.events]
        floor_level = -sum(-q for q in changes if q < 0)  # no floor, like the simulator
        model.add_reservoir_constraint(times, changes, floor_level, m.max_level)


class _Objective(NamedTuple):
    """The makespan the model minimises (`_add_objective`)."""

    makespan: cp_model.IntVar  # in time units
    lower: int  # resource_lower_bound, the least value of its domain (within the horizon)


def _add_objective(model: cp_model.CpModel, graph: TaskGraph, data: _WindowData, starts: list) -> _Objective:
    """Minimise the makespan, the latest end of any task, whose domain starts at the resources' lower
    bound."""
    dur, horizon = data.dur, data.horizon
    lower = resource_lower_bound(graph, dur)
    makespan = model.new_int_var(min(lower, horizon), horizon, "makespan")
    for i in range(len(graph.tasks)):
        model.add(makespan >= starts[i] + dur[i])
    model.minimize(makespan)
    return _Objective(makespan, lower)


def _add_hints(model: cp_model.CpModel, data: _WindowData, starts: list, makespan: cp_model.IntVar) -> None:
    """The warm start: the schedule's own order as the model plays it, else the simulator's start times
    (rounded into the horizon), else none."""
    n, dur, horizon = len(starts), data.dur, data.horizon
    if data.hint is not None:
        for i in range(n):
            model.add_hint(starts[i], data.hint[i])
        model.add_hint(makespan, data.hint_makespan)
    elif data.sim_start is not None:
        hinted = [min(max(0, round(float(data.sim_start[i]) / data.time_unit_s)), horizon - dur[i])
                  for i in range(n)]
        for i in range(n):
            model.add_hint(starts[i], hinted[i])
        model.add_hint(makespan, max((hinted[i] + dur[i] for i in range(n)), default=0))


# ---- the solver: solve and read the answer -----------------------------------------------------------------


def _solve(model: cp_model.CpModel, time_limit_s: float) -> tuple[cp_model.CpSolver, int]:
    """Run CP-SAT on the model with the window's settings (see the module docstring): one worker, a fixed
    seed, `time_limit_s` units of deterministic time; the solver and its status code."""
    solver = deterministic_solver(time_limit_s)
    # keep each reservoir as one propagator: expanding it into pairwise precedence literals makes the presolve
    # (probing) of a few hundred events take the whole time limit before any search starts
    solver.parameters.expand_reservoir_constraints = False
    code = solver.solve(model)
    return solver, code


def _window_result(graph: TaskGraph, data: _WindowData, v: _WindowVars, objective: _Objective,
                   solver: cp_model.CpSolver, code: int, t0: float) -> WindowResult:
    """The answer: the solver's best solution (or the schedule's own order), its order per resource, and
    CP-SAT's bound and gap."""
    st, mk = _solution(data, v.starts, solver, code)
    start_s, order = _solution_order(graph, data, v.by_res, st)
    bound, gap = _bound_and_gap(solver, code, objective.lower, data.time_unit_s, mk)
    return WindowResult(status=solver.status_name(code), makespan_s=mk, best_bound_s=bound, gap=gap,
                        wall_s=time.perf_counter() - t0, greedy_makespan_s=data.greedy_s, order=order,
                        start_s=start_s, num_tasks=len(graph.tasks))


def _solution(data: _WindowData, starts: list, solver: cp_model.CpSolver,
              code: int) -> tuple[list[int] | None, float]:
    """The start of every task in time units (None: only the simulator's) and the makespan in seconds:
    CP-SAT's solution unless the warm start beats it; without one, the warm start, else the greedy."""
    st: list[int] | None = None
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        st = [int(solver.value(s)) for s in starts]
        obj = int(round(solver.objective_value))
        # CP-SAT did not keep its (feasible) warm start
        if data.hint is not None and data.hint_makespan < obj:
            st, obj = list(data.hint), data.hint_makespan
        mk = obj * data.time_unit_s
    elif data.hint is not None:  # no solution from CP-SAT: the schedule's own order, as the model plays it
        st, mk = list(data.hint), data.hint_makespan * data.time_unit_s
    else:  # no solution at all: the schedule's own order, as the simulator plays it
        mk = data.greedy_s
    return st, mk


def _solution_order(graph: TaskGraph, data: _WindowData, by_res: dict[str, list[int]],
                    st: list[int] | None) -> tuple[dict[int, float], dict[str, list[int]]]:
    """The start of every task in seconds and the task ids of each resource in the order they start."""
    tasks, dur, n = graph.tasks, data.dur, len(graph.tasks)
    if st is not None:
        start_s = {i: st[i] * data.time_unit_s for i in range(n)}
        order = {r: sorted(ids, key=lambda i: (st[i], st[i] + dur[i], tasks[i].key, i))
                 for r, ids in by_res.items()}
    else:
        start_s = {i: float(data.sim_start[i]) for i in range(n)} if data.sim_start is not None else {}
        order = graph.resource_order()
    return start_s, order


def _bound_and_gap(solver: cp_model.CpSolver, code: int, lower: int, time_unit_s: float,
                   mk: float) -> tuple[float, float]:
    """CP-SAT's proven bound in seconds (never below the resources' lower bound, never above the makespan)
    and the relative gap, in [0, 1]."""
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.UNKNOWN):
        b = float(solver.best_objective_bound)
        bound = max(b if math.isfinite(b) else 0.0, float(lower)) * time_unit_s
        if math.isfinite(mk):
            bound = min(bound, mk)
    else:
        bound = math.nan
    if mk and math.isfinite(mk) and math.isfinite(bound):
        gap = (mk - bound) / mk
    else:
        gap = 0.0 if mk == 0 else math.nan
    if math.isfinite(gap):
        gap = min(max(gap, 0.0), 1.0)
    return bound, gap
