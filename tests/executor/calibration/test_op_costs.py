"""The executor's fixed host cost per op by the path its handler takes (executor/calibration/op_costs.py,
graph_launch.py), the profile fields they become (profile_builder.executor_cost_fields) and how the simulator
charges them (planner/core/hostcost.py, capture.py)."""

from __future__ import annotations

import pytest

from tierflow.executor.calibration import op_costs
from tierflow.executor.calibration.dispatch import tiny_config
from tierflow.executor.calibration.profile_builder import executor_cost_fields
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.hostcost import crossing_ops, moved_ops
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.core.simulator import simulate_graph

FIXED = {k: None for k in ("gpu.op_overhead_us", "gpu.moved_op_overhead_us", "gpu.graph_launch_us",
                           "gpu.graph_op_us", "pcie.latency_us", "ssd.latency_us", "cpu.executor_op_us")}


def test_intercept_fit_recovers_a_line_and_a_shared_slope():
    a, c = op_costs.intercept_fit([(1.0, 5.0), (3.0, 11.0), (2.0, 8.0)])
    assert (a, c) == (pytest.approx(2.0), pytest.approx(3.0))
    assert op_costs.intercept_fit([(2.0, 4.0), (2.0, 6.0)]) == (5.0, 0.0)  # one size: the mean, no slope
    # two keys, one slope (-0.5) and their own intercepts (100, 300 us), at two sizes each; key b is twice
    # as frequent in a step, so the mean intercept is (100 + 2 x 300) / 3
    small, large = op_costs._Sized(8), op_costs._Sized(32)
    for s, w in ((small, {"a": 40e-6, "b": 10e-6}), (large, {"a": 120e-6, "b": 50e-6})):
        s.count = {"a": 1, "b": 2}
        s.work_s = dict(w)
        s.fixed_s = {"a": 100e-6 - 0.5 * w["a"], "b": 300e-6 - 0.5 * w["b"]}
    mean, slope, per_key = op_costs._fit_keys([small, large], lambda k: True)
    assert slope == pytest.approx(-0.5)
    assert per_key == {"a": pytest.approx(100e-6), "b": pytest.approx(300e-6)}
    assert mean == pytest.approx(700e-6 / 3)
    # a fixed cost that grows faster than the work is the roofline's error, not a cost per op: no slope
    for s in (small, large):
        s.fixed_s = {k: 200e-6 + 2.0 * w for k, w in s.work_s.items()}
    _, slope, per_key = op_costs._fit_keys([small, large], lambda k: True)
    assert slope == 0.0 and per_key["a"] == pytest.approx(200e-6 + 2.0 * 80e-6)


def test_moved_ops_are_the_compute_ops_connected_to_another_worker():
    """On the plan with host checkpoints the forward ops whose checkpoint is offloaded and the backward ops
    that wait for its fetch are moved, and only they pay gpu.moved_op_overhead_us; a plan that keeps every
    tensor on the device has none, and its step does not change."""
    model, hw, cfg = tiny_config("cpu", "checkpoints_host")
    g = build_graph(model, hw, cfg)
    moved = moved_ops(g.tasks)
    cross = crossing_ops(g.tasks)
    assert moved and {t.kind for t in moved} <= {"fwd", "bwd", "head"}
    assert all(t.resource == "gpu" and t.id in cross for t in moved)
    extra = hw.with_overrides({"gpu.moved_op_overhead_us": 500.0})
    g2 = build_graph(model, extra, cfg)
    diff = {t.id: g2.tasks[t.id].work - t.work for t in g.tasks if g2.tasks[t.id].work != t.work}
    assert set(diff) == {t.id for t in moved} and all(d == pytest.approx(500e-6) for d in diff.values())
    assert simulate_graph(g2, extra).iteration_s > simulate_graph(g, hw).iteration_s
    on_model, on_hw, on_cfg = tiny_config("cpu", "on_device")
    assert not moved_ops(build_graph(on_model, on_hw, on_cfg).tasks)
    assert simulate_graph(build_graph(on_model, on_hw.with_overrides({"gpu.moved_op_overhead_us": 500.0}),
                                      on_cfg), on_hw).iteration_s == pytest.approx(
        simulate_graph(build_graph(on_model, on_hw, on_cfg), on_hw).iteration_s)


def test_the_fields_take_the_engines_cost_off_what_includes_it_only():
    ex = {"executor_op_us": 100.0, "op_overhead_us": 400.0, "pcie_latency_us": 150.0,
          "moved_op_overhead_us": 300.0, "graph_launch_us": 250.0, "graph_op_us": 40.0,
          "ssd_latency_us": None}
    assert executor_cost_fields(ex) == {"cpu.executor_op_us": 100.0, "gpu.op_overhead_us": 300.0,
                                        "pcie.latency_us": 50.0, "gpu.graph_launch_us": 150.0,
                                        "gpu.moved_op_overhead_us": 300.0, "gpu.graph_op_us": 40.0}
    assert executor_cost_fields({}) == {}


def test_op_costs_are_measured_by_running_the_executor_on_a_cpu():
    """The resident and the host-checkpoint plans at two sizes really run: an intercept per compute op kind,
    the moved extra and the transfers' fixed cost are finite numbers of microseconds."""
    hw = load_profile("rtx3090-desktop").with_overrides(FIXED)
    costs = op_costs.measure_op_costs(hw, PlainCpuBackend, rounds=1)
    assert set(costs["per_kind_us"]) == {"fwd", "bwd", "head", "adam_gpu"}
    assert 0 <= costs["op_overhead_us"] < 1e6 and 0 <= costs["pcie_latency_us"] < 1e6, costs
    assert costs["moved_op_overhead_us"] is not None and costs["moved_op_overhead_us"] >= 0
    assert "8 and 32 tokens" in costs["fitted_on"]


def test_graph_replays_are_measured_on_the_emulation_and_not_on_a_cpu():
    """Two segment sizes (the plan's compute ops per iteration at 2 and 4 micro-batches: 14 and 28) replayed
    on the emulation give a cost per replay and one per captured op; the plain CPU has no graphs: None with
    the reason."""
    from tierflow.executor.calibration.graph_launch import measure_graph_launch

    hw = load_profile("rtx3090-desktop").with_overrides(FIXED)
    m = measure_graph_launch(hw, lambda: AdversarialCpuBackend(max_delay_s=0.0), rounds=1)
    # in CPU time on the emulation: every segment of the measured round, one per iteration at each size
    assert m["graph_segment_ops"] == [14, 28] and m["graph_replays"] == 2 * op_costs.ITERATIONS
    assert m["graph_launch_us"] >= 0 and m["graph_op_us"] >= 0 and m["graph_launch_host_us"] > 0
    none = measure_graph_launch(hw, PlainCpuBackend, rounds=1)
    assert none["graph_launch_us"] is None and "no CUDA graphs" in none["graph_launch_note"]


def test_a_cpu_devices_fixed_cost_is_its_handlers_cpu_time_less_work_plus_the_engines_share():
    """Per op key and round: the median over its ops of handler CPU - work + (process CPU - handlers' CPU) /
    ops; the first iteration of a round is left out, and keys that exchange tensors are their own."""
    from types import SimpleNamespace as T

    tasks = [T(id=0, resource="gpu", kind="fwd", block=1, iteration=0, work=10e-6),
             T(id=1, resource="gpu", kind="fwd", block=1, iteration=1, work=10e-6),
             T(id=2, resource="gpu", kind="fwd", block=1, iteration=2, work=10e-6),
             T(id=3, resource="gpu", kind="bwd", block=1, iteration=1, work=30e-6)]
    # 4 ops, 900 us of handlers, 1100 us of the process: 50 us of the engine's per op
    r1 = op_costs.CpuRound({0: 500e-6, 1: 100e-6, 2: 140e-6, 3: 160e-6}, 1100e-6)
    r2 = op_costs.CpuRound({0: 100e-6, 1: 100e-6, 2: 100e-6, 3: 100e-6}, 400e-6)  # no engine's share
    got = op_costs.op_fixed_cpu_s(tasks, [r1, r2], rates=None, cross={3})
    # fwd: ops 1 and 2 (100 and 140 us, each - 10 + 50), not op 0 of the first iteration
    assert got[("gpu", "fwd", 1, False)] == [pytest.approx(160e-6), pytest.approx(90e-6)]
    assert got[("gpu", "bwd", 1, True)] == [pytest.approx(180e-6), pytest.approx(70e-6)]


def test_handlers_are_clocked_in_the_cpu_time_of_the_thread_that_runs_them():
    """A handler that sleeps costs the host no CPU: a shared box's waits and the other processes' time slices
    stay out of the fixed costs; one that computes is counted, on whichever thread runs it."""
    import threading
    import time
    from types import SimpleNamespace as T

    def run(rs, t):
        if t.id == 0:
            time.sleep(0.05)
        else:
            c0 = time.thread_time()
            while time.thread_time() - c0 < 0.02:
                pass

    ex = T(ops=T(run=run))
    got = op_costs.clock_handlers(ex)
    ex.ops.run(None, T(id=0))
    th = threading.Thread(target=ex.ops.run, args=(None, T(id=1)))
    th.start()
    th.join()
    assert got[0] < 0.025 and got[1] >= 0.02


def test_an_op_a_transfer_of_another_block_only_waits_for_is_not_moved():
    """In the 4-layer plan with host checkpoints a fetch of layer 2's checkpoint waits for the head (to bound
    memory): the head crosses to another resource but moves none of its tensors, so it is not charged
    gpu.moved_op_overhead_us; every moved op has a transfer of its own block (and micro-batch) next to it."""
    hw = load_profile("rtx3090-desktop").with_overrides(FIXED)
    tasks = build_graph(*op_costs.cal_graph(hw, "checkpoints_host", 16, 3, 4)).tasks
    heads = [t for t in tasks if t.kind == "head"]
    cross, moved = crossing_ops(tasks), {t.id for t in moved_ops(tasks)}
    assert heads and all(t.id in cross and t.id not in moved for t in heads)
    for t in moved_ops(tasks):
        near = [tasks[d] for d in t.deps] + [u for u in tasks if t.id in u.deps]
        assert any(u.resource != "gpu" and u.block == t.block and u.mb == t.mb for u in near)
    assert {t.kind for t in moved_ops(tasks)} == {"fwd", "bwd"}
