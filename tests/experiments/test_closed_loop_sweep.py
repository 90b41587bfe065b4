"""The closed loop's out-of-sample sweep (experiments/closed_loop.py --sweep): the drawn configurations are
reproducible, valid for the executor and spread over the ranges; the summary names the misses' op kinds."""

from __future__ import annotations

import sys
from pathlib import Path

from tierflow.hwprofiles import load_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

import closed_loop  # noqa: E402


def test_the_draw_is_seeded_valid_and_spread():
    a, b = closed_loop.draw_configs(24, 29), closed_loop.draw_configs(24, 29)
    assert a == b and a != closed_loop.draw_configs(24, 30)
    for c in a:
        assert c["batch"] % c["micro_batch"] == 0
        assert c["hidden"] % c["heads"] == 0
        assert 2.0 <= c["device_weights_x"] <= 6.0 and 12.0 <= c["host_bytes_per_param"] <= 20.0
    for key in ("layers", "hidden", "vocab", "seq", "schedule", "batch"):
        assert len({c[key] for c in a}) >= 3, key


def test_the_box_is_capped_as_drawn():
    hw0 = load_profile("rtx3090-desktop").with_overrides({"gpu.reserved_gib": 0})  # as a CPU device's
    c = closed_loop.draw_configs(1, 7)[0]
    model = closed_loop.gpt(c["layers"], c["hidden"], c["heads"], c["vocab"], c["seq"])
    hw = closed_loop.sweep_box(hw0, c, model)
    weights_bytes = 2 * model.total_params()
    assert hw.gpu.memory_gib * 2**30 >= c["device_weights_x"] * weights_bytes
    host_bytes = (hw.cpu.memory_gib - hw0.cpu.reserved_gib) * 2**30
    assert host_bytes >= c["host_bytes_per_param"] * model.total_params() * 0.999


def test_the_summary_names_the_misses_by_op_kind():
    rows = [{"iteration_error": 0.05, "worst_kind": "fwd", "error": ""},
            {"iteration_error": -0.3, "worst_kind": "offload_act_grad", "error": ""},
            {"iteration_error": 0.0, "worst_kind": "", "error": "does not fit"}]
    line = closed_loop.sweep_summary(rows)
    assert "2 of 3 ran" in line and "median 17.5%" in line and "max 30.0%" in line
    assert "offload_act_grad" in line and "fwd" not in line.split(";")[-1]
    kind, ratio = closed_loop.worst_kind([{"kind": "fwd", "predicted_s": 1.0, "measured_s": 1.2},
                                          {"kind": "bwd", "predicted_s": 2.0, "measured_s": 1.5}])
    assert kind == "bwd" and ratio == 0.75
