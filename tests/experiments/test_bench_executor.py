"""experiments/bench_executor.py's bookkeeping around CUDA graphs (its runs are covered by the quick gpu_check
on the emulation, tests/experiments/test_gpu_check.py): which steps of a run it counts, and how it predicts a
run that replayed the plan's segments as graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "bench_executor.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_executor

    monkeypatch.setattr(bench_executor, "RUN_EXTRA", {})
    return bench_executor


def test_a_run_counts_its_steps_after_its_setup_and_its_capture(bench):
    """CUDA graphs are the run's default on CUDA only; a run that uses them also leaves out the step that
    captured them (executor/graphs.py WARMUP eager occurrences, then the capture)."""
    from tierflow.executor.graphs import WARMUP

    assert bench.lead_steps("cpu") == bench.lead_steps("cpu-adversarial") == 1
    assert bench.lead_steps("cuda") == 1 + WARMUP
    bench.RUN_EXTRA[bench.GRAPHS_FIELD] = False
    assert bench.lead_steps("cuda") == 1 and not bench.graphs_on("cuda")
    bench.RUN_EXTRA[bench.GRAPHS_FIELD] = True
    assert bench.lead_steps("cpu-adversarial") == 1 + WARMUP and bench.graphs_on("cpu-adversarial")


def test_a_graphed_run_is_predicted_as_it_ran_and_no_op_kind_is_compared(bench, tmp_path):
    """The on-device plan's segments replayed as graphs: the step as planner/core/capture.py's graphed_graph
    plays it (no trace is read: a replay is timed as a whole, not op by op)."""
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.capture import capture_plan, graphed_graph
    from tierflow.planner.core.simulator import simulate_graph

    hw = load_profile("rtx3090-desktop").with_overrides({"gpu.graph_launch_us": 20.0, "gpu.graph_op_us": 5.0,
                                                         "gpu.op_overhead_us": 100.0})
    plan = bench.make_plan(bench.plan_model(bench.MODELS["tiny"], "cuda"), bench.ALL_ON_DEVICE,
                           tmp_path / "tiny.json", hw)
    assert capture_plan(plan.graph).segments
    row, kinds = bench.prediction(plan, tmp_path / "no-trace.json", "tiny", "on device", 0.01, graphs=True)
    want = simulate_graph(graphed_graph(plan.graph, plan.hardware), plan.hardware).iteration_s
    assert row["predicted_s"] == round(want, 4) and kinds == []
    eager_s = simulate_graph(plan.graph, plan.hardware).iteration_s
    assert row["predicted_s"] < round(eager_s, 4)  # one launch per segment instead of per-op overheads
    assert row["kinds_off"].startswith("- (CUDA graphs")
