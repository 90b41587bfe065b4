"""experiments/h200_run.py: the H200 run of the first GPU session simulated on the profile calibrate wrote
there, then with what the run measured (the executor's host optimizer rate, each op kind's duration)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import h200_run  # noqa: E402


def test_the_executors_adam_rate_weights_both_optimizer_ops_by_their_share():
    r = h200_run.MEASURED_RATIOS
    assert h200_run.executor_adam_rate(4.0, 0.0) == pytest.approx(4.0 / r["adam"])
    assert h200_run.executor_adam_rate(4.0, 1.0) == pytest.approx(4.0 / r["adam_deferred"])
    mid = h200_run.executor_adam_rate(4.0, 0.25)
    assert 4.0 / r["adam"] < mid < 4.0 / r["adam_deferred"]


def test_only_the_measured_kinds_are_scaled():
    hw = h200_run.box()
    model, cfg = h200_run.config(hw)
    from tierflow.planner.core.schedules import build_graph

    before = build_graph(model, hw, cfg)
    after = h200_run.scaled_graph(build_graph(model, hw, cfg))
    for a, b in zip(before.tasks, after.tasks):
        assert b.work == pytest.approx(a.work * h200_run.MEASURED_RATIOS.get(a.kind, 1.0))
    assert {t.kind for t in before.tasks} >= {"fwd", "bwd", "adam", "offload_grads"}


def test_each_measured_mechanism_moves_the_prediction_toward_the_run(tmp_path):
    rows = h200_run.rows()
    assert [r["model"] for r in rows] == ["as calibrated", "host optimizer at the executor's rate",
                                          "and GPU ops slowed beside it",
                                          "every op kind at its measured duration"]
    pred = [r["predicted_s"] for r in rows]
    assert pred[0] < pred[1] <= pred[2] < pred[3]  # slower host optimizer, then slower ops: each adds time
    assert rows[2]["busy_gpu"] > rows[1]["busy_gpu"]  # the GPU's ops take longer beside the optimizer
    assert pred[0] == pytest.approx(h200_run.PREDICTED_THEN_S, rel=0.25)  # the run's own prediction
    for r in rows:
        assert r["error"] == pytest.approx(r["measured_s"] / r["predicted_s"] - 1, rel=2e-3, abs=2e-3)
