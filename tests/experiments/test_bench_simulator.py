"""experiments/bench_simulator.py --quick: the simulator against SimPy on the same graphs, `tierflow plan` per
phase and an --adapt decision, on small models. Structure only: no timing assertions (the figures live in the
script's results)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_bench_simulator_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_simulator.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    sims = _rows(tmp_path / "bench_simulator.csv")
    assert [r["graph"] for r in sims] == ["tiny-gpt horizontal", "tiny-gpt vertical", "tiny-gpt 4 GPUs"]
    for r in sims:
        assert int(r["tasks"]) > 0 and float(r["simulate_s"]) > 0
        assert float(r["tasks_per_s"]) == pytest.approx(int(r["tasks"]) / float(r["simulate_s"]), rel=0.01)
        assert float(r["simulated_iteration_s"]) > 0
        try:
            import simpy  # noqa: F401
        except ImportError:
            assert not r.get("simpy_s")
        else:
            assert float(r["simpy_s"]) > 0 and float(r["speed_vs_simpy"]) > 0
    (plan,) = _rows(tmp_path / "bench_planner_phases.csv")
    assert plan["model"] == "tiny-gpt" and plan["rc"] == "0"
    phases = ("candidates", "slot_lp", "verification", "window", "plan_file", "other")
    # the phases split the command's wall time, and each phase's peak RSS is at most the process's
    assert sum(float(plan[f"{p}_s"]) for p in phases) == pytest.approx(float(plan["wall_s"]), abs=0.05)
    assert float(plan["verification_s"]) > 0 and float(plan["slot_lp_s"]) > 0
    assert all(float(plan[f"{p}_peak_gb"]) <= float(plan["peak_rss_gb"]) + 1e-3 for p in phases)
    (decision,) = _rows(tmp_path / "bench_decisions.csv")
    assert float(decision["wall_s"]) >= float(decision["fit_s"]) + float(decision["replan_s"]) - 0.02
    assert float(decision["fit_s"]) > 0 and float(decision["replan_s"]) > 0


def test_simpy_reference_plays_the_graph_in_its_queue_order():
    """The SimPy reference on a hand-built graph: a chain across resources ends at the sum of its times."""
    pytest.importorskip("simpy")
    import bench_simulator

    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.costmodel import link_rates
    from tierflow.planner.core.graph import TIERS, Task, TaskGraph
    from tierflow.planner.core.world import SINGLE

    hw = load_profile("rtx4090-lohan")
    r = link_rates(hw, SINGLE)
    tasks = [Task(i, "k", res, work, "t", 0, -1, 0, deps, float(i))
             for i, (res, work, deps) in enumerate([("gpu", 0.5, []), ("h2d", 1e9, [0]), ("gpu", 0.25, [1]),
                                                    ("gpu", 0.125, [])])]
    g = TaskGraph(tasks, dict.fromkeys(TIERS, 0.0), dict.fromkeys(TIERS, 1e12), 1, 1)
    # the GPU queue is 0, 2, 3: task 3 waits behind task 2, which waits for the copy
    expected = 0.5 + r.latency_s("h2d") + 1e9 / r.h2d + 0.25 + 0.125
    assert bench_simulator.simpy_play(g, hw, SINGLE) == pytest.approx(expected, rel=1e-12)
