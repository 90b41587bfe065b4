"""Tests for tierflow.planner.search.window: the CP-SAT window solver. Real windows (2 layers, one iteration)
are checked for feasibility by replaying the solver's start times independently (dependencies, one task per
resource, exact bytes against the capacities); toy graphs whose optimum is known by hand check the model
itself."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.graph import RESOURCES, TIERS, Task, TaskGraph
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import simulate_graph
from tierflow.planner.search.window import (
    TARGET_UNITS,
    WindowResult,
    duration_units,
    memory_model,
    replay_order,
    resource_lower_bound,
    solo_durations_s,
    solve_window,
)

HW = "rtx3090-desktop"
STATUSES = ("OPTIMAL", "FEASIBLE")


@cache
def hw():
    return load_profile(HW)


def window_graph(family: str, headroom: float) -> TaskGraph:
    """gpt3-125m cut to 2 layers, one iteration of batch 4 in micro-batches of 1, with the GPU and CPU
    capacities set to `headroom` x the peak the schedule's own order reaches, so that memory constrains the
    solver."""
    h = hw()
    model = replace(get_model("gpt3-125m"), num_layers=2)
    g = build_graph(model, h, make_schedule(family, model, h, batch=4, micro_batch=1, iterations=1))
    peak = simulate_graph(g, h).peak_bytes
    for tier in ("gpu", "cpu"):
        g.capacity_bytes[tier] = peak[tier] * headroom
    return g


def check_solution(g: TaskGraph, res: WindowResult, unit: float) -> None:
    """Replay the solver's start times with the model's solo durations: dependencies, one task at a time per
    resource, and every tier's exact level (static + changes so far) within its capacity."""
    dur = duration_units(solo_durations_s(g, hw()), unit)
    assert set(res.start_s) == {t.id for t in g.tasks}
    st = {i: round(s / unit) for i, s in res.start_s.items()}
    assert all(abs(st[i] * unit - s) <= 1e-9 * max(1.0, s) for i, s in res.start_s.items())
    for t in g.tasks:
        assert st[t.id] >= 0
        for d in t.deps:
            assert st[d] + dur[d] <= st[t.id], f"{g.tasks[d].label} ends after {t.label} starts"
    assert sorted(res.order) == sorted(RESOURCES)
    for r in RESOURCES:
        ids = res.order[r]
        assert sorted(ids) == sorted(t.id for t in g.tasks if t.resource == r)
        for a, b in zip(ids, ids[1:]):
            assert st[a] + dur[a] <= st[b], f"{g.tasks[a].label} overlaps {g.tasks[b].label} on {r}"
    events: dict[int, list[tuple[int, float]]] = {}
    for t in g.tasks:
        for changes, at in ((t.mem_start, st[t.id]), (t.mem_end, st[t.id] + dur[t.id])):
            for tier, delta in changes:
                events.setdefault(at, []).append((tier, delta))
    level = [g.static_bytes[x] for x in TIERS]
    for at in sorted(events):
        for tier, delta in events[at]:
            level[tier] += delta
        for i, x in enumerate(TIERS):
            assert level[i] <= g.capacity_bytes[x] + 1.0, f"{x} over capacity at t={at * unit:.6f} s"


@pytest.mark.parametrize("family", ["vertical", "horizontal"])
def test_window_solution_is_feasible(family):
    g = window_graph(family, headroom=1.0)
    assert memory_model(g), "the capacities should constrain the model"
    res = solve_window(g, hw(), time_limit_s=4.0)
    assert res.status in STATUSES
    assert res.num_tasks == len(g.tasks)
    check_solution(g, res, res.greedy_makespan_s / TARGET_UNITS)


@pytest.mark.parametrize("family", ["vertical", "horizontal"])
def test_window_improves_on_its_warm_start(family):
    g = window_graph(family, headroom=1.02)
    unit = simulate_graph(g, hw()).end_s.max() / TARGET_UNITS
    hint, hint_units = replay_order(g, hw(), unit)
    assert hint is not None, "the schedule's own order is a solution of the model"
    res = solve_window(g, hw(), time_limit_s=4.0, time_unit_s=unit)
    assert res.status in STATUSES
    assert res.makespan_s <= hint_units * unit * (1 + 1e-9)
    assert res.greedy_makespan_s == pytest.approx(simulate_graph(g, hw()).end_s.max())
    assert 0.0 < res.best_bound_s <= res.makespan_s
    assert 0.0 <= res.gap <= 1.0
    assert res.gap == pytest.approx((res.makespan_s - res.best_bound_s) / res.makespan_s)
    if res.status == "OPTIMAL":
        assert res.gap == pytest.approx(0.0, abs=1e-9)
    check_solution(g, res, unit)


def toy_graph(specs, gpu_capacity: float = 10e9, gpu_static: float = 0.0) -> TaskGraph:
    """specs: (resource, work, deps, mem_start, mem_end) per task, in order."""
    tasks = [Task(i, "toy", r, float(w), "toy", 0, -1, 0, list(d), float(i), list(ms), list(me))
             for i, (r, w, d, ms, me) in enumerate(specs)]
    return TaskGraph(tasks, {"gpu": gpu_static, "cpu": 0.0, "ssd": 0.0},
                     {"gpu": gpu_capacity, "cpu": 100e9, "ssd": 1e12}, num_iterations=1, num_blocks=1)


def transfers_then_compute() -> TaskGraph:
    # 25 GB/s solo on h2d and d2h: 0.1 s + 0.2 s of H2D, then 0.05 s on the GPU, then 0.1 s of D2H
    return toy_graph([
        ("h2d", 2.5e9, [], [], []),
        ("h2d", 5e9, [], [], []),
        ("gpu", 0.05, [0, 1], [], []),
        ("d2h", 2.5e9, [2], [], []),
    ])


def test_toy_graph_optimum_is_known():
    g = transfers_then_compute()
    assert hw().pcie.h2d_gbps == 25 and hw().pcie.d2h_gbps == 25
    res = solve_window(g, hw(), time_limit_s=5.0, time_unit_s=1e-3)
    assert res.status == "OPTIMAL"
    assert res.makespan_s == pytest.approx(0.45)
    assert res.best_bound_s == pytest.approx(0.45)
    assert res.gap == pytest.approx(0.0, abs=1e-12)
    assert res.greedy_makespan_s == pytest.approx(0.45)
    assert res.start_s[2] == pytest.approx(0.3) and res.start_s[3] == pytest.approx(0.35)
    assert res.order["gpu"] == [2] and res.order["d2h"] == [3] and sorted(res.order["h2d"]) == [0, 1]
    assert resource_lower_bound(g, duration_units(solo_durations_s(g, hw()), 1e-3)) == 450
    # the default time unit gives the same answer within its rounding (one unit per task)
    res = solve_window(g, hw(), time_limit_s=5.0)
    assert res.status == "OPTIMAL"
    assert res.makespan_s == pytest.approx(0.45, rel=1e-4)


def memory_bound_pair(gpu_capacity: float = 10e9) -> TaskGraph:
    # a GPU task (0.1 s) and a CPU task (0.2 s), each holding 60% of the GPU tier while it runs
    hold = 0.6 * gpu_capacity
    return toy_graph([
        ("gpu", 0.1, [], [(0, hold)], [(0, -hold)]),
        ("cpu", 0.2, [], [(0, hold)], [(0, -hold)]),
    ], gpu_capacity=gpu_capacity)


def test_memory_forces_serialization():
    g = memory_bound_pair()
    res = solve_window(g, hw(), time_limit_s=5.0, time_unit_s=1e-3)
    assert res.status == "OPTIMAL"
    assert res.makespan_s == pytest.approx(0.3)
    assert res.greedy_makespan_s == pytest.approx(0.3)  # the simulator waits for the memory too
    s0, s1 = res.start_s[0], res.start_s[1]
    assert s0 + 0.1 <= s1 + 1e-9 or s1 + 0.2 <= s0 + 1e-9
    free = solve_window(g, hw(), time_limit_s=5.0, time_unit_s=1e-3, memory=False)
    assert free.status == "OPTIMAL"
    assert free.makespan_s == pytest.approx(0.2)


def test_static_bytes_count_against_capacity():
    # 30% of the GPU resident: the two 60% holders still fit one at a time; at 50% resident neither fits
    g = memory_bound_pair()
    g.static_bytes["gpu"] = 0.3 * g.capacity_bytes["gpu"]
    assert solve_window(g, hw(), time_limit_s=5.0, time_unit_s=1e-3).makespan_s == pytest.approx(0.3)
    g.static_bytes["gpu"] = 0.5 * g.capacity_bytes["gpu"]
    assert replay_order(g, hw(), 1e-3) == (None, -1)
    res = solve_window(g, hw(), time_limit_s=5.0, time_unit_s=1e-3)
    assert res.status == "INFEASIBLE"
    g.static_bytes["gpu"] = 1.5 * g.capacity_bytes["gpu"]
    res = solve_window(g, hw(), time_limit_s=5.0)
    assert res.status == "INFEASIBLE" and math.isnan(res.makespan_s)


def test_memory_rounding_is_conservative():
    # allocations round up and frees down: the model's level never falls below the true one, and its
    # worst-case excess stays within 0.1% of the headroom
    g = window_graph("vertical", headroom=1.0)
    for m in memory_model(g):
        tier = TIERS[m.tier]
        headroom = g.capacity_bytes[tier] - g.static_bytes[tier]
        assert m.max_level * m.unit_bytes <= headroom + 1.0
        assert len(m.events) * m.unit_bytes <= 1e-3 * headroom + m.unit_bytes
        exact = {}
        for t in g.tasks:
            for at_end, changes in ((False, t.mem_start), (True, t.mem_end)):
                for i, delta in changes:
                    if i == m.tier:
                        exact[t.id, at_end] = exact.get((t.id, at_end), 0.0) + delta
        for tid, at_end, q in m.events:
            assert q * m.unit_bytes >= exact[tid, at_end]
            assert q * m.unit_bytes - exact[tid, at_end] < m.unit_bytes


def test_durations_use_solo_rates_and_round_up():
    g = transfers_then_compute()
    assert solo_durations_s(g, hw()) == pytest.approx([0.1, 0.2, 0.05, 0.1])
    assert duration_units([0.1, 0.2, 0.05, 1e-9, 0.0], 1e-3) == [100, 200, 50, 1, 0]
    assert duration_units([0.1005], 1e-3) == [101]
