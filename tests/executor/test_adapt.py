"""Self-correcting runs: the profile fitted from one measured trace (`tierflow fit --trace --plan`), and a
checkpoint resumed under another plan of the same training (the state moved bit for bit; another model or
batch refused in one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support.runs import make_plan
from support.runs import run as _run

from tierflow.cli import main
from tierflow.executor.options import CheckpointOptions
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import simulate_graph
from tierflow.planner.core.trace import write_chrome_trace
from tierflow.planner.fit.profile_fit import FitError, FitField
from tierflow.planner.fit.trace_fit import default_fields, fit_trace
from tierflow.planner.io.compare import load_measured
from tierflow.planner.io.planfile import plan_from_graph, write_plan

ROOT = Path(__file__).resolve().parents[2]
SSD = Split(0.0, 0.0, 1.0)
# the CPU profile `tierflow calibrate --device cpu` wrote on the project's test machine
CPU_HW = load_profile(ROOT / "experiments" / "results" / "closed_loop_cpu.yaml").with_overrides(
    {"gpu.memory_gib": 1.0})
TRUTH = {"ssd.read_gbps": 0.5, "gpu.op_overhead_us": 600.0, "cpu.adam_gparams_per_s": 1.0,
         "pcie.latency_us": 100.0}


def run(plan, d: Path, **kw):
    d.mkdir(parents=True, exist_ok=True)
    return _run(plan, d, **kw)


def _cpu_plan(iterations: int = 2):
    model = get_model("tiny-gpt")
    cfg = make_schedule("vertical", model, CPU_HW, batch=4, micro_batch=1, seq=64, alpha=0.25,
                        iterations=iterations, placement=Placement(master=SSD, adam_m=SSD, adam_v=SSD,
                                                                   checkpoints=Split(0.0, 0.5, 0.5)))
    return plan_from_graph(model, CPU_HW, cfg, build_graph(model, CPU_HW, cfg))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A plan on the calibrated profile and the trace of the same plan on a box that differs in four fields
    (simulated: the fields' true values are known)."""
    d = tmp_path_factory.mktemp("trace")
    plan = _cpu_plan()
    truth = CPU_HW.with_overrides(TRUTH)
    res = simulate_graph(build_graph(plan.model, truth, plan.config), truth, plan.config.world)
    write_chrome_trace(res, d / "trace.json")
    write_plan(plan, d / "plan.json")
    return plan, d


def test_trace_fit_recovers_the_fields_each_op_kind_measures(synthetic):
    plan, d = synthetic
    fields = [FitField(k, v / 4, v * 4) for k, v in
              {"ssd.read_gbps": 1.047, "gpu.op_overhead_us": 1115.0, "cpu.adam_gparams_per_s": 1.947,
               "pcie.latency_us": 225.2}.items()]
    res = fit_trace(plan, *load_measured(d / "trace.json", len(plan.graph.tasks)), CPU_HW, fields)
    for key, want in TRUTH.items():
        assert res.values[key] == pytest.approx(want, rel=0.05), key
    assert res.rms < 0.02
    groups = {r.run.label() for r in res.runs}
    assert {"fetch_weights h2d", "read_opt_states ssd_read", "adam cpu (opt_states)", "iteration"} <= groups
    # at the base profile the SSD reads were predicted 2x too fast: the fit moved them onto the measurement
    read = next(r for r in res.runs if r.run.label() == "read_opt_states ssd_read")
    assert abs(read.residual) < 0.03


def test_default_fields_follow_the_plans_op_kinds():
    keys = {f.key for f in default_fields(_cpu_plan(), CPU_HW)}
    assert {"ssd.read_gbps", "ssd.write_gbps", "ssd.latency_us", "ssd.mixed_efficiency", "pcie.h2d_gbps",
            "pcie.latency_us", "cpu.adam_gparams_per_s", "gpu.peak_tflops",
            "cpu.compute_slowdown_per_io_op"} <= keys
    gpu_only = make_plan("tiny-gpt", "vertical", "device")
    keys = {f.key for f in default_fields(gpu_only, gpu_only.hardware)}
    assert not any(k.startswith("ssd.") for k in keys) and "gpu.peak_tflops" in keys


def test_fit_trace_cli_writes_a_commented_profile(synthetic, tmp_path, capsys):
    plan, d = synthetic
    out = tmp_path / "fitted.yaml"
    assert main(["fit", "--trace", str(d / "trace.json"), "--plan", str(d / "plan.json"),
                 "--field", "ssd.read_gbps=0.2:4", "--field", "pcie.h2d_gbps=1:40", "-o", str(out),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["trace_file"].endswith("trace.json") and got["plan_file"].endswith("plan.json")
    assert {r["label"] for r in got["runs"]} >= {"read_opt_states ssd_read", "iteration"}
    fitted = load_profile(out)
    assert fitted.ssd.read_gbps == pytest.approx(got["values"]["ssd.read_gbps"], rel=1e-3)
    # the duplex rate moved with the solo rate it is tied to, so the profile stays valid
    ratio = fitted.pcie.h2d_gbps / CPU_HW.pcie.h2d_gbps
    assert fitted.pcie.duplex_h2d_gbps == pytest.approx(CPU_HW.pcie.duplex_h2d_gbps * ratio, rel=1e-3)
    text = out.read_text()
    assert "read_gbps: " in text and "fit: trace.json" in text
    assert yaml.safe_load(text)["ssd"]["read_gbps"] == fitted.ssd.read_gbps


def test_fit_trace_bad_input_is_one_line(synthetic, capsys):
    plan, d = synthetic
    assert main(["fit", "--trace", str(d / "trace.json")]) == 2
    assert "--plan" in capsys.readouterr().err
    assert main(["fit", "--trace", str(d / "trace.json"), "--plan", str(d / "plan.json"),
                 "--field", "ssd.mixed_efficiency=0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ssd.mixed_efficiency" in err
    with pytest.raises(FitError, match="not a field"):
        fit_trace(plan, *load_measured(d / "trace.json", len(plan.graph.tasks)), CPU_HW,
                  [FitField("gpu.warp_gbps", 1, 2)])


# -- resuming under another plan -----------------------------------------------------------------------------


def test_resume_under_another_placement_continues_bit_identically(tmp_path):
    """Weights on the host, then on a mix of all three tiers from step 2: the losses and the final fp32
    weights are those of the run that never switched, bit for bit."""
    a = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    b = make_plan("tiny-gpt", "vertical", "mix", iterations=1)
    never = run(a, tmp_path / "never", steps=4)
    ck = str(tmp_path / "ck")
    first = run(a, tmp_path / "a", steps=2, checkpoint=CheckpointOptions(ck, every=2))
    then = run(b, tmp_path / "b", steps=4, checkpoint=CheckpointOptions(ck, every=0))
    assert then.first_step == 2
    assert first.losses + then.losses == never.losses
    assert all(torch.equal(x, y) for x, y in zip(then.final_master, never.final_master))


def test_resume_under_another_schedule_and_micro_batch_moves_the_state(tmp_path):
    """A vertical plan's checkpoint resumed by a block plan of micro-batch 2 with the states on the SSD: the
    state it starts from is the checkpoint's bit for bit; training continues (the schedule's accumulation
    order changes the last bits of the sums: within 1e-5 of the run that never switched)."""
    a = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    b = make_plan("tiny-gpt", "block", "states_ssd", iterations=1, micro=2)
    ck = str(tmp_path / "ck")
    first = run(a, tmp_path / "a", steps=2, checkpoint=CheckpointOptions(ck, every=2))
    # resumed at step 2: nothing left to train
    loaded = run(b, tmp_path / "b", steps=2, checkpoint=CheckpointOptions(ck, every=0))
    assert loaded.records == [] and loaded.first_step == 2
    assert all(torch.equal(x, y) for x, y in zip(loaded.final_master, first.final_master))
    assert all(torch.equal(x, y) for x, y in zip(loaded.final_adam_m, first.final_adam_m))
    never = run(a, tmp_path / "never", steps=4)
    then = run(b, tmp_path / "b2", steps=4, checkpoint=CheckpointOptions(ck, every=0))
    assert then.losses == pytest.approx(never.losses[2:], rel=1e-5)


def test_resume_of_another_batch_is_refused_in_one_line(tmp_path, capsys):
    a = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    b = make_plan("tiny-gpt", "horizontal", "weights_cpu", iterations=1, batch=8, micro=2)
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    write_plan(a, fa)
    write_plan(b, fb)
    ck = str(tmp_path / "ck")
    assert main(["run", str(fa), "--steps", "1", "--device", "cpu", "--checkpoint-dir", ck, "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(fb), "--steps", "2", "--device", "cpu", "--checkpoint-dir", ck]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "batch 4 x seq 64" in err and "batch 8 x seq 64" in err


# -- --adapt -------------------------------------------------------------------------------------------------


def _lohan_on_this_box():
    """The bundled rtx4090-lohan profile capped to the calibrated CPU box's device memory and a small host
    memory (so that the optimizer states spill to the SSD tier), and the calibrated profile with the same
    caps: the box as it is."""
    caps = {"cpu.memory_gib": 0.02, "cpu.reserved_gib": 0}
    truth = load_profile(ROOT / "experiments" / "results" / "closed_loop_cpu.yaml").with_overrides(caps)
    lohan = load_profile("rtx4090-lohan")
    # the box's device memory for tensors, beside what a GPU's CUDA runtime maps under the cap (devicemem)
    runtime_gib = runtime_gpu_reserve_bytes("ideal", 1, lohan) / 2**30
    wrong = lohan.with_overrides({**caps, "gpu.memory_gib": truth.gpu.memory_gib + runtime_gib,
                                  "gpu.reserved_gib": 0, "ssd.count": 1})
    return wrong, truth


def test_decide_refits_replans_and_switches_on_a_wrong_profile(tmp_path):
    """Measured = the plan simulated on the box as it is (deterministic): the links are several times slower
    than the wrong profile says, so the decision refits them, plans again and switches to a plan predicted
    faster by more than the margin; the switch itself is a cross-plan resume at the step boundary."""
    from tierflow.executor.adapt import AdaptOptions, decide

    wrong, truth = _lohan_on_this_box()
    model = get_model("tiny-gpt")
    # the plan `tierflow plan` makes on the wrong profile
    cfg = make_schedule("vertical", model, wrong, batch=8, micro_batch=2, seq=64, alpha=0.25,
                        placement=Placement(master=Split(0.0, 0.35, 0.65), adam_m=Split(0.0, 0.35, 0.65),
                                            adam_v=Split(0.0, 0.35, 0.65)))
    plan = plan_from_graph(model, wrong, cfg, build_graph(model, wrong, cfg))
    measured = simulate_graph(build_graph(model, truth, plan.config), truth, plan.config.world)
    d, new = decide(plan, measured, 2,
                    AdaptOptions(time_limit_s=2.0, fit_evaluations=100))
    assert d.error > 0.10 and d.resources["ssd_read"] > 1.5
    assert d.refit["ssd.read_gbps"][1] < d.refit["ssd.read_gbps"][0]
    assert d.switched and new is not None and new.config != plan.config and d.gain > 0.05
    d.effective_step = 2
    line = d.line()
    assert line.count("\n") == 0 and "switching at step 2" in line and "ssd.read_gbps" in line
    # the switch: the old plan's checkpoint at step 2 resumed under the new plan
    never = run(plan, tmp_path / "never", steps=4)
    ck = str(tmp_path / "ck")
    first = run(plan, tmp_path / "a", steps=2, checkpoint=CheckpointOptions(ck, every=2))
    then = run(new, tmp_path / "b", steps=4, checkpoint=CheckpointOptions(ck, every=0))
    assert first.losses == never.losses[:2]
    assert then.losses == pytest.approx(never.losses[2:], rel=1e-5)


def test_adapt_cli_records_its_decision_and_continues(tmp_path, capsys):
    """Within the threshold the run keeps its plan: one decision line, recorded in --json and --out, and the
    losses are those of the run without --adapt, bit for bit; a second --adapt run resumes the first's
    checkpoint and counts its warm-up from there."""
    plan = make_plan("tiny-gpt", "vertical", "states_ssd", iterations=2)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    (tmp_path / "ssd").mkdir()
    common = [str(path), "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd"), "--json"]
    assert main(["run", *common, "--steps", "6"]) == 0
    plain = [s["loss"] for s in json.loads(capsys.readouterr().out)["steps"]]
    out, ck = tmp_path / "out", str(tmp_path / "ck")
    # a threshold no load can reach: on a loaded box a tiny plan's resource measured 1,000x its prediction
    adapt = ["--adapt", "--adapt-warmup", "2", "--adapt-threshold", "1e12", "--checkpoint-dir", ck]
    assert main(["run", *common, *adapt, "--steps", "4", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [s["loss"] for s in got["steps"]] == plain[:4]
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4]
    (d,) = got["adapt"]
    assert d["step"] == 2 and not d["switched"] and "keeping the plan" in d["line"]
    assert d["measured_iteration_s"] > 0 and d["predicted_iteration_s"] > 0 and d["resources"]
    assert json.loads((out / "adapt.json").read_text()) == got["adapt"]
    assert (out / "trace.json").is_file() and (out / "steps.csv").read_text().count("\n") == 5
    assert main(["run", *common, *adapt, "--steps", "6"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["first_step"] == 4 and again["adapt"] == []  # its warm-up reached --steps: nothing to decide
    assert [s["loss"] for s in again["steps"]] == plain[4:]


def test_adapt_decides_beside_training_and_switches_at_a_later_step(tmp_path, capsys):
    """Without --adapt-wait the refit and re-plan run in a child process while training goes on under the old
    plan: the decision taken at step 2 takes effect at a later step boundary (by step 8: --adapt-decide-within
    6 waits there at the latest), every step is trained once, and
    the switch's cost is recorded in its parts. The losses after the switch stay within 1e-5 of the run
    without --adapt (another schedule: the sums' order changes)."""
    plan = make_plan("tiny-gpt", "vertical", "states_ssd", iterations=2)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    (tmp_path / "ssd").mkdir()
    common = [str(path), "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd"), "--json", "--steps", "10"]
    assert main(["run", *common, "--adapt", "--adapt-warmup", "2", "--adapt-threshold", "1e-9",
                 "--adapt-margin", "0", "--adapt-time-limit", "1", "--adapt-fit-evaluations", "40",
                 "--adapt-decide-within", "6"]) == 0
    got = json.loads(capsys.readouterr().out)
    (d,) = got["adapt"]
    assert d["step"] == 2 and d["switched"], d["line"]
    # the child starts (a new interpreter) after the boundary of step 2 polled it: it arrives later, by step 8
    assert 2 < d["effective_step"] <= 8 and d["steps_while_deciding"] == d["effective_step"] - 2
    assert f"took effect at step {d['effective_step']}" in d["line"]
    assert [s["step"] for s in got["steps"]] == list(range(1, 11))
    assert set(d["switch_parts"]) == {"checkpoint_write_s", "old_run_end_s", "new_run_start_s"}
    # each part is rounded to 0.1 ms
    assert d["switch_s"] == pytest.approx(sum(d["switch_parts"].values()), abs=2e-4)
    assert main(["run", *common]) == 0
    plain = [s["loss"] for s in json.loads(capsys.readouterr().out)["steps"]]
    assert [s["loss"] for s in got["steps"]] == pytest.approx(plain, rel=1e-5)


def test_adapt_on_two_ranks_switches_every_rank_at_the_same_step(tmp_path):
    """`tierflow run --nproc 2 --adapt` with a refit forced (threshold 0, margin 0): rank 0 decides beside
    training and broadcasts at each step boundary whether the decision arrived; every rank resumes the sharded
    checkpoint under the plan decided at step 2 at the same step (4 at the latest: --adapt-decide-within 2)
    and trains to step 6 (a hang or a rank on another plan would fail the run). The losses stay those of one
    rank training the whole batch without --adapt (within 1e-5: 2 ranks and a switch change the order of the
    sums)."""
    from support.dist_worker import OPTIMIZER
    from support.dist_worker import make_plan as rank_plan

    from tierflow.executor.run import OutputOptions, RunConfig, run_plan

    path = tmp_path / "two.json"
    write_plan(rank_plan("tiny-gpt", "vertical", "states_ssd", gpus=2), path)
    (tmp_path / "ssd").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-m", "tierflow", "run", str(path), "--nproc", "2", "--device", "cpu",
                        "--ssd-dir", str(tmp_path / "ssd"), "--steps", "6", "--json", "--adapt",
                        "--adapt-warmup", "2", "--adapt-threshold", "1e-9", "--adapt-margin", "0",
                        "--adapt-time-limit", "2", "--adapt-fit-evaluations", "60",
                        "--adapt-decide-within", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    # one rank training the whole batch: what 2 ranks reproduce within 1e-5
    # (tests/executor/test_dist_executor.py)
    one = run_plan(rank_plan("tiny-gpt", "vertical", "states_ssd", gpus=1),
                   RunConfig(steps=6, device="cpu", ssd_dir=str(tmp_path / "ssd"), optimizer=OPTIMIZER,
                             output=OutputOptions(quiet=True)))
    want = {"steps": [{"loss": x} for x in one.losses]}
    (d,) = got["adapt"]
    # decided beside training from step 2 (every rank polls rank 0 at each boundary), waited for by step 4
    assert d["step"] == 2 and d["refit"] and d["effective_step"] in (2, 4)
    assert (f"switching at step {d['effective_step']}" in d["line"]) == d["switched"]
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4, 5, 6]
    assert [s["loss"] for s in got["steps"]] == pytest.approx([s["loss"] for s in want["steps"]], rel=1e-5)


def test_adapt_experiment_quick(tmp_path):
    """experiments/adapt.py --quick: the lohan profile capped to this machine, planned, run with --adapt, and
    the calibrated profile's plan run beside it. The decision is measured, so only its form is checked here;
    the targets are the full run's (docs/adapting.md)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import adapt as experiment

    heads = experiment.run(quick=True, out_dir=tmp_path)
    (row,) = [r for r in _csv(tmp_path / "adapt.csv")]
    assert row["scenario"] == "lohan-capped" and float(row["error_at_warmup"]) > 0.10  # the profile is wrong
    # the warm-up (2 steps) ends at the plan's first round boundary, step 3; --quick waits for the decision
    assert int(row["fields_refit"]) > 0 and float(row["step_s_after"]) > 0 and "adapt at step 3" in row[
        "decision"] and row["effective_step"] == "3"
    steps = _csv(tmp_path / "adapt_steps.csv")
    assert [int(r["step"]) for r in steps if r["run"] == "lohan-capped"] == [1, 2, 3, 4, 5, 6]
    groups = _csv(tmp_path / "adapt_groups.csv")  # the final plan's op groups on the refit profile
    assert {g["group"] for g in groups} >= {"iteration"} and all(float(g["measured_ms"]) > 0 for g in groups)
    assert (tmp_path / "adapt.png").stat().st_size > 1000 and heads and heads[0]["study"] == "adapt"


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
