"""Times print in the unit that fits their size (planner/core/timefmt.fmt_s, everywhere a time is printed),
and `tierflow compare` says when the plan's profile is not the device its trace was measured on."""

from __future__ import annotations

import json
import re

import pytest

from tierflow.cli import main
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.io.compare import box_mismatch

TINY = ["--model", "tiny-gpt", "--hw", "rtx4090-lohan", "--batch", "2"]
CPU_PROFILE = "experiments/results/closed_loop_cpu.yaml"  # a CPU device, measured by tierflow calibrate


@pytest.mark.parametrize(("seconds", "kwargs", "text"), [
    (1199.345, {}, "1,199.35 s"), (2500.94, {"decimals": 1}, "2,500.9 s"), (1.0, {}, "1.00 s"),
    (0.8, {}, "800 ms"), (0.0012345, {}, "1.23 ms"), (0.0001854, {}, "185 us"),
    (0.0001854, {"sig": 4}, "185.4 us"), (5e-7, {}, "500 ns"), (0.00099996, {}, "1.00 ms"),
    (0.99996, {}, "1.00 s"), (-0.002, {}, "-2.00 ms"), (0.0, {}, "0 s"),
])
def test_fmt_s_picks_the_unit_that_fits(seconds, kwargs, text):
    assert fmt_s(seconds, **kwargs) == text


def test_plan_of_a_tiny_model_prints_its_times_in_units_that_show_them(tmp_path, capsys):
    assert main(["plan", *TINY, "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    zeros = re.findall(r"(?<![\d.,])0\.0+ s\b", out)
    assert not zeros, f"times that print as zero: {zeros}\n{out}"
    line = next(x for x in out.splitlines() if x.startswith("verified by simulation: "))
    assert re.match(r"verified by simulation: \d+(\.\d+)? (us|ms) per iteration", line), line
    assert re.search(r"objective \d+(\.\d+)? (us|ms)", out), out


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A tiny plan on a bundled GPU box, and the trace of two of its steps run on this CPU."""
    d = tmp_path_factory.mktemp("compare")
    assert main(["plan", *TINY, "-o", str(d / "plan.json")]) == 0
    plan = str(d / "plan.json")
    assert main(["run", plan, "--device", "cpu", "--steps", "2", "--out", str(d / "run")]) == 0
    return d


def test_compare_says_when_the_plans_box_is_not_the_device_it_ran_on(cpu_trace, capsys):
    trace = json.loads((cpu_trace / "run" / "trace.json").read_text())
    assert trace["otherData"]["measured_on"]["device_type"] == "cpu"
    capsys.readouterr()
    assert main(["compare", str(cpu_trace / "plan.json"), str(cpu_trace / "run" / "trace.json")]) == 0
    out = capsys.readouterr().out
    note = [x for x in out.splitlines() if x.startswith("note: ")]
    assert len(note) == 1 and "rtx4090-lohan" in note[0] and "the CPU" in note[0], out
    assert "tierflow calibrate -o box.yaml --device cpu" in note[0] and "--hw box.yaml" in note[0]
    line = next(x for x in out.splitlines() if x.startswith("iteration time: "))
    assert re.match(r"iteration time: predicted \d+(\.\d+)? us, measured \d+(\.\d+)? ms", line), line


def test_a_trace_written_before_it_said_its_device_is_read_from_its_process_name(cpu_trace, capsys):
    trace = json.loads((cpu_trace / "run" / "trace.json").read_text())
    del trace["otherData"]["measured_on"]
    old = cpu_trace / "old-trace.json"
    old.write_text(json.dumps(trace))
    capsys.readouterr()
    assert main(["compare", str(cpu_trace / "plan.json"), str(old)]) == 0
    assert "note: the plan's profile rtx4090-lohan" in capsys.readouterr().out


def test_no_note_when_the_profile_is_the_device():
    gpu, cpu = load_profile("rtx4090-lohan"), load_profile(CPU_PROFILE)
    assert box_mismatch(cpu, {"device_type": "cpu"}) is None
    assert box_mismatch(gpu, {"device_type": "cuda", "device_name": "NVIDIA GeForce RTX 4090"}) is None
    assert box_mismatch(gpu, None) is None
    assert "NVIDIA H200" in box_mismatch(gpu, {"device_type": "cuda", "device_name": "NVIDIA H200"})
    assert "models a CPU device" in box_mismatch(cpu, {"device_type": "cuda", "device_name": "NVIDIA H200"})
