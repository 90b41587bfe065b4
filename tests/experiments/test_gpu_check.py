"""experiments/gpu_check.py --quick on the adversarial CPU emulation of a CUDA device: every step runs (the
calibration is replaced by a bundled profile to stay short; tests/executor/calibration/test_calibrate.py
covers calibrate), the plan puts weights and optimizer states beyond the capped device memory and on the SSD
tier, the run trains on the emulation, and the summary collects what each step wrote. A step that cannot run
is reported, not hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_check.py"


def gpu_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The quick check on the emulation, one intra-op thread per process (its timings are not looked at; two
    threads per process on a busy 2-core runner are up to 10x slower on these tiny ops). The check ends
    within its own 480 s budget (plus a step's 15 s grace): the timeout is above it."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu-adversarial", "--ssd-dir",
                           str(ssd), "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_gpu_check_quick_on_the_emulation(tmp_path):
    res = gpu_check(tmp_path, "--hw", "rtx3090-desktop")
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "out"
    summary = (out / "summary.md").read_text()
    # 13 steps (calibrate replaced by --hw); the CUDA graph step is skipped where the run has no such option
    graphs = "| bench_executor_graphs | ok |" in summary
    assert f"{13 if graphs else 12} of 13 steps succeeded" in summary
    assert graphs or "| bench_executor_graphs | skipped (this tierflow's run options have no CUDA" in summary
    assert "| bench_executor_eager | ok |" in summary and "| bench_dispatch | ok |" in summary
    assert "bench_executor on the device / plain PyTorch, CUDA graphs off: 2 x 128 (--quick) " in summary
    assert "host CPU per op, the executor beyond plain PyTorch" in summary and " us over plain's " in summary
    assert "bench_optimizer (the executor's host AdamW" in summary
    # the quick check's tiny model keeps its 1.6 MiB of weights on the GPU beside its working memory
    # (counted to the KiB); its optimizer states go to the SSD tier
    assert "optimizer states on the SSD tier: yes" in summary
    assert "optimizer states wholly in host memory: yes" in summary
    plan = json.loads((out / "plan-ssd.json").read_text())
    place = plan["decisions"]["placement"]
    for cls in ("master", "adam_m", "adam_v"):
        assert place[cls]["ssd"] > 0, (cls, place[cls])
    host = json.loads((out / "plan-host.json").read_text())["decisions"]["placement"]
    assert all(host[cls]["cpu"] == 1.0 for cls in ("master", "adam_m", "adam_v")), host
    run = json.loads((out / "07-run_ssd.out").read_text())
    assert len(run["steps"]) == 3 and run["ssd_bytes_read"] > 0 and run["ssd_bytes_written"] > 0
    for name, n in (("host", 5), ("ssd", 8)):
        cmp = json.loads((out / f"{n:02d}-compare_{name}.out").read_text())
        assert cmp["measured_iteration_s"] > 0 and f"measured {cmp['measured_iteration_s']:.3f} s" in summary
        kind = cmp["by_kind"][0]
        assert f"| {kind['kind']} | {kind['resource']} | {kind['ops']} |" in summary  # per op kind
        assert (out / f"compare-{name}.png").stat().st_size > 0
        assert (out / f"run-{name}" / "trace.json").is_file()
    store = (out / "bench_store" / "bench_store.csv").read_text()
    executor = (out / "bench_executor" / "bench_executor.csv").read_text()
    assert "store" in store and "states on SSD" in executor
    assert "| bench_executor | ok |" in summary and "x reference" in summary
    env = json.loads((out / "01-env.out").read_text())
    assert env["versions"]["torch"] in summary
    assert f"- host AdamW: {env['host_optimizer']}" in summary and env["host_optimizer"]


def test_gpu_check_reports_a_step_that_cannot_run(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    res = gpu_check(tmp_path, "--hw", missing, "--skip", "bench_optimizer", "bench_store", "bench_executor",
                    "bench_executor_graphs", "bench_executor_eager", "bench_dispatch")
    assert res.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| env | ok |" in summary
    assert "| plan_host | skipped (" in summary and "missing.yaml" in summary
    assert "| run_ssd | skipped (plan-ssd.json was not written by an earlier step) |" in summary
    assert "| bench_store | skipped (--skip) |" in summary
    assert "No plan was written." in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_refuses_cuda_without_a_gpu(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--device cpu-adversarial" in res.stderr


def test_a_full_bench_executor_predicts_on_the_calibrated_box(tmp_path, monkeypatch):
    """The full check's bench_executor takes the profile calibrate wrote (no second calibration); without that
    file, or in the quick check, it gets no --hw."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check as check
    profile = tmp_path / "box.yaml"
    _store, executor = check.bench_argv(check.FULL, "cuda", tmp_path, tmp_path, profile)
    assert "--hw" not in executor
    profile.write_text("name: box\n")
    _store, executor = check.bench_argv(check.FULL, "cuda", tmp_path, tmp_path, profile)
    assert executor[executor.index("--hw") + 1] == str(profile)
    _store, executor = check.bench_argv(check.QUICK, "cuda", tmp_path, tmp_path, profile)
    assert "--hw" not in executor


def test_a_step_past_its_budget_is_stopped_and_kept(tmp_path, monkeypatch):
    """A step still running at its deadline gets SIGTERM, is marked stopped, and what it wrote is kept; the
    budget shares what is left among the steps still to come, in proportion to their shares."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check as check

    monkeypatch.setattr(check, "TERM_GRACE_S", 2)
    slow = check.Step("run_ssd", [sys.executable, "-c",
                                  "import time; print('measured so far', flush=True); time.sleep(60)"])
    check.run_step(slow, tmp_path, deadline_s=2.0)
    assert slow.stopped and slow.rc == 124 and slow.wall_s < 60  # stopped before its 60 s sleep ended
    assert "measured so far" in (tmp_path / "07-run_ssd.out").read_text()
    assert "stopped at its budget" in (tmp_path / "07-run_ssd.err").read_text()
    lines = check.steps_section([slow], tmp_path)
    assert any("| run_ssd | **stopped at its budget** (2 s) |" in line for line in lines)

    budget = check.Budget(100.0, ["run_host", "bench_store"])
    share = check.STEP_SHARE
    expect = 100.0 * share["run_host"] / (share["run_host"] + share["bench_store"])
    assert abs(budget.take_s("run_host") - expect) < 1.0
    # the last step gets the rest: what remained just before and just after it asked (the clock runs between
    # the reads: a loaded CI run measured 1 us)
    before = budget.remaining_s()
    last = budget.peek_s("bench_store")
    assert before >= last >= budget.remaining_s()
    assert check.Budget(None, ["env"]).take_s("env") is None
    # calibrate, which every later step plans on, gets its floor where its share is less (never more than is
    # left)
    steps = [n for n in check.STEPS if n != "env"]
    floor = check.STEP_FLOOR_S["calibrate"]
    assert check.Budget(480.0, steps).peek_s("calibrate") == pytest.approx(floor, abs=1.0)
    assert 480.0 * share["calibrate"] / sum(share[n] for n in steps) < floor  # the floor mattered
    assert check.Budget(30.0, steps).peek_s("calibrate") <= 30.0


def test_a_runs_steps_fit_its_share(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check as check

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"predicted": {"iteration_s": 20.0}}))
    assert check.steps_for(check.FULL, plan, None) == 3
    assert check.steps_for(check.FULL, plan, 1000.0) == 3
    assert check.steps_for(check.FULL, plan, check.RUN_OVERHEAD_S + 2 * 2 * 20.0) == 2
    assert check.steps_for(check.FULL, plan, 10.0) == 2  # never fewer than 2: compare needs them
    caps = check.caps(check.QUICK, "rtx3090-desktop", check.SCENARIOS[0], device="cuda")
    emulated = check.caps(check.QUICK, "rtx3090-desktop", check.SCENARIOS[0], device="cpu-adversarial")
    assert caps["gpu.memory_gib"] - emulated["gpu.memory_gib"] >= check.QUICK.min_cuda_gpu_gib - 0.03
    assert "cpu.memory_gib" not in caps  # the host scenario keeps the box's host memory


def _csv_file(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([",".join(rows[0]), *(",".join(str(v) for v in r.values()) for r in rows)]))


def test_the_summary_states_the_three_host_cost_figures(tmp_path, monkeypatch):
    """From fake step results: the graphs and eager ratios at 4 x 256 and 6 x 384 against 0.97 and 0.9, the
    executor's CPU per op beyond plain PyTorch's against 40 us; a step that did not run says why."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check as check

    def executor(name: str, small: float, medium: float) -> None:
        _csv_file(tmp_path / name / "bench_executor.csv",
                  [{"model": m, "case": c, "ratio": x} for m, x in (("small", small), ("medium", medium))
                   for c in ("on device", "states on SSD")])

    executor("bench_executor_graphs", 0.98, 0.95)
    executor("bench_executor_eager", 0.93, 0.91)
    _csv_file(tmp_path / "bench_dispatch" / "bench_dispatch.csv",
              [{"backend": b, "plan": p, "variant": v, "ops_per_step": 10, "plain_cpu_ms": 2.0,
                "executor_op_cpu_us": us}
               for b, p, v, us in (("cpu", "on_device", "direct", 30.0),
                                   ("cpu", "checkpoints_host", "direct", 55.5),
                                   ("cpu", "on_device", "functional_call", 1.0),
                                   ("cpu-adversarial", "on_device", "direct", 1.0))])
    steps = [check.Step(n, ["x"], rc=0) for n in ("bench_executor_graphs", "bench_executor_eager",
                                                    "bench_dispatch")]
    text = "\n".join(check.decide_section(steps, tmp_path))
    assert ("CUDA graphs on: 4 x 256 0.980x, 6 x 384 **0.950x** (target >= 0.97x: **not met**)") in text
    assert "CUDA graphs off: 4 x 256 0.930x, 6 x 384 0.910x (target >= 0.9x: met)" in text
    assert ("on_device +30.0 us over plain's 200.0 us (1.15x); checkpoints_host **+55.5 us over plain's "
            "200.0 us (1.28x)** (target <= 40 us: **not met**)") in text

    skipped = check.Step("bench_executor_graphs", [], why_skipped="no CUDA graph switch",
                         unsupported=True)
    failed = check.Step("bench_dispatch", ["x"], rc=1)
    text = "\n".join(check.decide_section([skipped, failed], tmp_path / "none"))
    assert "CUDA graphs on: not measured (bench_executor_graphs skipped: no CUDA graph switch" in text
    assert "CUDA graphs off: not measured (bench_executor_eager has not run yet)" in text
    assert "not measured (bench_dispatch failed, exit 1; see `14-bench_dispatch.err`)" in text


@pytest.mark.parametrize("has_option", [False, True])
def test_the_graph_steps_follow_the_run_option(tmp_path, monkeypatch, has_option):
    """With the run option, graphs on then off; without it, the graphs step is skipped (one line, not a
    failure) and the eager one runs without the flag."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check as check

    monkeypatch.setattr(check, "graphs_missing", lambda: None if has_option else "no switch here")
    profile = tmp_path / "box.yaml"
    profile.write_text("name: box\n")
    on, off = check.graph_steps(check.FULL, "cuda", tmp_path, tmp_path, profile)
    assert off.argv[off.argv.index("--hw") + 1] == str(profile)  # predicted on the calibrated box
    at = off.argv.index("--models")
    assert "--device-only" in off.argv and off.argv[at + 1: at + 3] == ["small", "medium"]
    if has_option:
        assert "--cuda-graphs" in on.argv and "--no-cuda-graphs" in off.argv and not on.why_skipped
    else:
        assert not on.argv and on.unsupported and on.why_skipped == "no switch here"
        assert not any("cuda-graphs" in a for a in off.argv)


def test_bench_executor_refuses_a_graph_switch_the_run_lacks(tmp_path, monkeypatch, capsys):
    """bench_executor's --[no-]cuda-graphs goes to RunConfig.cuda_graphs; without that field it is refused
    with one line (exit 2) before anything runs."""
    from dataclasses import fields

    from tierflow.executor.run import RunConfig

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_executor as be

    has = be.GRAPHS_FIELD in {f.name for f in fields(RunConfig)}
    assert (be.graphs_missing() is None) == has
    if has:
        pytest.skip("this tierflow has the CUDA graph switch")
    with pytest.raises(SystemExit) as e:
        be.main(["--no-cuda-graphs", "--quick", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--no-cuda-graphs: this tierflow's run options have no CUDA graph switch" \
        in capsys.readouterr().err
    assert not be.RUN_EXTRA and not list(tmp_path.iterdir())
