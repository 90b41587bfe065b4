"""`tierflow run --profile`: torch.profiler's Chrome trace beside the measured plan trace, each op of the plan
under a record_function named after it; the plan-format trace.json carries flow arrows for the dependencies
between ops on different resources, each end inside an existing op's slice. Real PyTorch on the CPU, a tiny
plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierflow.cli import main
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.trace import chrome_trace
from tierflow.planner.io.planfile import plan_from_graph, write_plan

HW = load_profile("rtx3090-desktop")
STATES_SSD = Placement(master=Split(0.0, 0.0, 1.0), adam_m=Split(0.0, 0.0, 1.0), adam_v=Split(0.0, 0.0, 1.0))


def tiny_plan(tmp_path: Path, iterations: int = 1) -> tuple[Path, object]:
    model = get_model("tiny-gpt")
    cfg = make_schedule("vertical", model, HW, batch=2, micro_batch=1, seq=32, placement=STATES_SSD,
                        iterations=iterations)
    plan = plan_from_graph(model, HW, cfg, build_graph(model, HW, cfg))
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    return path, plan


def flows_bind_to_slices(trace: dict) -> tuple[int, set[tuple[int, int]]]:
    """Check every flow event: its id comes as one "s" and one "f", and its (tid, ts) lies inside an "X" slice
    of that track; return the number of arrows and the (source op id, dependent op id) pairs they join."""
    slices: dict[int, list[dict]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") == "X":
            slices.setdefault(ev["tid"], []).append(ev)
    ends: dict[int, dict[str, int]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") not in ("s", "f"):
            continue
        inside = [x for x in slices.get(ev["tid"], []) if x["ts"] <= ev["ts"] <= x["ts"] + x["dur"]]
        assert inside, f"flow {ev} does not lie in any op of its track"
        assert ev["ph"] not in ends.setdefault(ev["id"], {}), (
            f"flow id {ev['id']} has two {ev['ph']!r} events")
        ends[ev["id"]][ev["ph"]] = inside[0]["args"]["id"]
    assert all(set(e) == {"s", "f"} for e in ends.values())
    return len(ends), {(e["s"], e["f"]) for e in ends.values()}


def test_run_profile_writes_the_torch_trace_with_the_plans_op_names(tmp_path, capsys):
    path, plan = tiny_plan(tmp_path)
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    ssd.mkdir()
    assert main(["run", str(path), "--steps", "1", "--device", "cpu", "--ssd-dir", str(ssd),
                 "--out", str(out), "--profile"]) == 0
    assert "torch_trace.json" in capsys.readouterr().out
    torch_trace = json.loads((out / "torch_trace.json").read_text())
    names = {ev.get("name") for ev in torch_trace["traceEvents"]}
    want = {f"op {t.id} {t.label}" for t in plan.graph.tasks}
    assert want <= names, f"ops missing from the torch trace: {sorted(want - names)[:5]}"
    # the record_functions run on the workers' threads (the profiler sees every thread), with aten ops inside
    op_events = [ev for ev in torch_trace["traceEvents"] if str(ev.get("name", "")).startswith("op ")]
    assert len({ev["tid"] for ev in op_events}) >= 3
    fwd = next(ev for ev in op_events if " fwd b1 " in ev["name"])
    nested = [ev for ev in torch_trace["traceEvents"] if ev.get("tid") == fwd["tid"] and ev.get("ph") == "X"
              and str(ev.get("name", "")).startswith("aten::")
              and fwd["ts"] <= ev["ts"] <= fwd["ts"] + fwd["dur"]]
    assert nested, "no aten op inside the forward's record_function"
    # the measured plan trace beside it has the dependency arrows between resources
    trace = json.loads((out / "trace.json").read_text())
    n, pairs = flows_bind_to_slices(trace)
    cross = {(d, t.id) for t in plan.graph.tasks for d in t.deps
             if plan.graph.tasks[d].resource != t.resource}
    assert n == len(cross) > 0 and pairs == cross


def test_profile_without_out_is_one_line_exit_2(tmp_path, capsys):
    path, _ = tiny_plan(tmp_path)
    assert main(["run", str(path), "--steps", "1", "--device", "cpu", "--profile"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile" in err and "--out" in err


def test_without_profile_no_torch_trace(tmp_path):
    path, _ = tiny_plan(tmp_path)
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    ssd.mkdir()
    assert main(["run", str(path), "--steps", "1", "--device", "cpu", "--ssd-dir", str(ssd),
                 "--out", str(out), "--json"]) == 0
    assert (out / "trace.json").exists() and not (out / "torch_trace.json").exists()


@pytest.mark.parametrize("max_flows", [5, 10_000])
def test_simulated_trace_flows_are_bounded_and_bind(max_flows, monkeypatch):
    import tierflow.planner.core.trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_FLOWS", max_flows)
    model = get_model("tiny-llama")
    cfg = make_schedule("horizontal", model, HW, batch=4, micro_batch=1, seq=64, placement=STATES_SSD,
                        iterations=3)
    res = simulate_config(model, HW, cfg)
    cross = {(d, t.id) for t in res.graph.tasks for d in t.deps if res.graph.tasks[d].resource != t.resource}
    n, pairs = flows_bind_to_slices(chrome_trace(res))
    assert pairs <= cross and n == min(max_flows, len(cross))
    if max_flows < len(cross):  # the kept arrows lead into the steady-state window
        w0, w1 = res.window_s
        assert all(w0 <= res.start_s[dst] <= w1 for _, dst in pairs)
