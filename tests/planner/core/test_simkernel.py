"""The simulator's compiled event loop (tierflow.planner.core.simkernel, with numba) plays every graph
exactly as its pure-Python loop does: the same start and end of every task, peaks, memory trace and iteration,
and the same refusal (capacity, deadlock) word for word. Skipped without numba (then the pure loop is the only
one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core import simkernel
from tierflow.planner.core.graph import TIERS, Task, TaskGraph
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import parse_placement
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import SimulationError, simulate_graph

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[3]


def _both(graph, hw, monkeypatch):
    """The graph played by the kernel (every size) and by the pure loop: (result or error text) of each."""
    out = []
    monkeypatch.setattr(simkernel, "MIN_KERNEL_TASKS", 0)
    for pure in ("0", "1"):
        monkeypatch.setenv("TIERFLOW_PURE_SIM", pure)
        try:
            out.append(simulate_graph(graph, hw))
        except SimulationError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _assert_same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    assert np.array_equal(a.start_s, b.start_s, equal_nan=True)
    assert np.array_equal(a.end_s, b.end_s, equal_nan=True)
    assert a.peak_bytes == b.peak_bytes
    assert np.array_equal(np.asarray(a.memory_trace), np.asarray(b.memory_trace))
    assert a.iteration_s == b.iteration_s and a.busy == b.busy


def _cases():
    lohan = load_profile("rtx4090-lohan")
    cpu_box = load_profile(ROOT / "experiments" / "results" / "closed_loop_cpu.yaml").with_overrides(
        {"gpu.memory_gib": 1.0})
    slow_gpu = load_profile("h100-80g").with_overrides({"cpu.adam_gparams_per_s": 0.3,
                                                       "cpu.gpu_slowdown_beside_host_optimizer": 3.0})
    out = []
    for family in ("horizontal", "fuyou", "vertical"):  # DRAM shared by the links and CPU Adam, SSD tiers
        out.append((f"gpt3-1.3b {family}", "gpt3-1.3b", lohan, family, dict(batch=8, micro_batch=2)))
    out.append(("host device: shared cores, measured I/O interference", "tiny-gpt", cpu_box, "vertical",
                dict(batch=4, micro_batch=1, seq=64, placement=parse_placement("ssd"))))
    out.append(("GPU slowed beside the host optimizer", "gpt3-350m", slow_gpu, "vertical",
                dict(batch=8, micro_batch=2, seq=1024, placement=parse_placement("cpu"))))
    out.append(("4 ranks: collectives", "tiny-gpt", load_profile("rtx4090-lohan-4gpu"), "vertical",
                dict(batch=8, micro_batch=1, gpus=4)))
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_kernel_plays_schedules_as_the_pure_loop(case, monkeypatch):
    _, model_name, hw, family, kw = case
    model = get_model(model_name)
    cfg = make_schedule(family, model, hw, iterations=2, **kw)
    g = build_graph(model, hw, cfg)
    if cfg.world.ranks > 1:
        g.meta["world"] = cfg.world.to_dict()
    kernel_res, pure_res = _both(g, hw, monkeypatch)
    assert not isinstance(kernel_res, str), kernel_res
    _assert_same(kernel_res, pure_res)


def T(i, resource, work, deps=(), key=None, mem_start=(), mem_end=()):
    return Task(i, "k", resource, float(work), "t", 0, -1, 0, list(deps), float(i if key is None else key),
                list(mem_start), list(mem_end))


def graph_of(tasks, cap=(1e12, 1e12, 1e12)):
    return TaskGraph(tasks, dict.fromkeys(TIERS, 0.0), dict(zip(TIERS, cap)), 1, 1)


@pytest.mark.parametrize("name,tasks,cap", [
    ("waits for memory", [T(0, "gpu", 1.0, mem_start=[(0, 80.0)], mem_end=[(0, -80.0)]),
                          T(1, "h2d", 1e6, mem_start=[(0, 50.0), (0, -10.0), (1, 5.0)], mem_end=[(0, -40.0)]),
                          T(2, "d2h", 1e6, deps=[0, 0], mem_start=[(1, 7.0)], mem_end=[(1, -12.0)])],
     (100.0, 1e12, 1e12)),
    ("capacity error", [T(0, "gpu", 1.0), T(1, "cpu", 1.0, mem_start=[(1, 250.0)], mem_end=[(1, -250.0)])],
     (1e12, 100.0, 1e12)),
    ("deadlock", [T(0, "gpu", 1.0, deps=[1], key=0), T(1, "gpu", 1.0, key=1)], (1e12, 1e12, 1e12)),
])
def test_kernel_waits_and_refuses_as_the_pure_loop(name, tasks, cap, monkeypatch):
    kernel_res, pure_res = _both(graph_of(tasks, cap), load_profile("rtx4090-lohan"), monkeypatch)
    _assert_same(kernel_res, pure_res)
    assert isinstance(kernel_res, str) == (name != "waits for memory")
