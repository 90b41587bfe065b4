"""Self-correcting runs on this machine: plan on a wrong profile, run with --adapt, compare with the plan of
the calibrated profile.

    python experiments/adapt.py [--quick] [--ssd-dir DIR] [--out DIR]

The box is this CPU as the executor's device, as `tierflow calibrate --device cpu` measured it
(experiments/results/closed_loop_cpu.yaml, written by experiments/closed_loop.py), with a host memory cap
(CAPS) so that the optimizer states spill to the SSD tier. Two wrong profiles of it:

- `ssd5x-compute2x`: the calibrated profile with the SSD tier claimed 5x faster and compute 2x slower;
- `lohan-capped`: the bundled rtx4090-lohan profile capped to this machine's memory (device, host, one SSD).

For each: `tierflow plan` on the wrong profile, then `tierflow run PLAN --adapt` (warm-up, refit from the
trace, re-plan, switch) for STEPS steps; and `tierflow run` of the plan made on the calibrated profile, the
reference. The targets (docs/adapting.md): after adapting, throughput within 10% of the reference's measured
throughput; the refit profile predicts the final plan's iteration within 10%; the switch costs less than two
steps. The decision runs beside training (the run switches at the first step boundary after it arrived); the
calibrated plan runs before and after each scenario (the two averaged). Writes adapt.csv (one row per
scenario), adapt_steps.csv (every step of every run), adapt_groups.csv (the final plan's op groups, measured
vs predicted on the refit profile) and adapt.png (step time over steps, the decision and the switch marked)
under --out; 3 to 5 minutes on the 2-core dev machine. --quick: the lohan scenario only, 6 steps, a shorter
refit and re-plan waited for at the warm-up's end (a CI test runs it).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    Progress,
    arg_parser,
    headline,
    markdown_table,
    new_figure,
    print_table,
    save_figure,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.fit.trace_fit import ITERATION, iteration_seconds, observations
from tierflow.planner.io import planning
from tierflow.planner.io.compare import load_measured
from tierflow.planner.io.planfile import load_plan, plan_from_graph, simulate_plan, write_plan

ROOT = Path(__file__).resolve().parents[1]
CALIBRATED = ROOT / "experiments" / "results" / "closed_loop_cpu.yaml"
MODEL, BATCH, SEQ = "tiny-gpt", 8, 64
CAPS = {"cpu.memory_gib": 0.02, "cpu.reserved_gib": 0}  # the optimizer states do not fit in host memory
TARGET = 0.10
LOHAN_RUNTIME_GIB = runtime_gpu_reserve_bytes("ideal", 1, load_profile("rtx4090-lohan")) / 2**30


def profiles() -> dict[str, HardwareProfile]:
    """The box as calibrated (capped) and the two wrong profiles of it."""
    right = load_profile(CALIBRATED).with_overrides(CAPS)
    g, s = right.gpu, right.ssd
    return {
        "calibrated": right,
        "ssd5x-compute2x": right.with_overrides({"ssd.read_gbps": 5 * s.read_gbps, "ssd.write_gbps":
                                                 5 * s.write_gbps, "gpu.peak_tflops": g.peak_tflops / 2}),
        # the box's device memory for tensors, beside what a GPU's CUDA runtime maps under the cap (devicemem)
        "lohan-capped": load_profile("rtx4090-lohan").with_overrides(
            {**CAPS, "gpu.memory_gib": g.memory_gib + LOHAN_RUNTIME_GIB, "gpu.reserved_gib": 0,
             "ssd.count": 1}),
    }


def settings(quick: bool) -> dict:
    """--quick waits for the decision at the warm-up's end (--adapt-decide-within 0): 6 steps would end
    before a decision taken beside training arrives."""
    return {"scenarios": ["lohan-capped"] if quick else ["ssd5x-compute2x", "lohan-capped"],
            "steps": 6 if quick else 150, "warmup": 2 if quick else 3, "time_limit_s": 1 if quick else 10,
            "fit_evaluations": 60 if quick else 400, "decide_within": 0 if quick else None}


def make_plan(hw: HardwareProfile, path: Path, time_limit_s: float) -> Path:
    """`tierflow plan`'s best plan for the model on `hw`, written to `path`."""
    model = get_model(MODEL).with_precision("fp32")  # the CPU device trains in fp32, calibrated in real bytes
    write_plan(planning.make_plan(model, hw, BATCH, SEQ,
                                  planning.PlanOptions(time_limit_s=time_limit_s, window=False)).plan(), path)
    return path


def tierflow_run(plan: Path, steps: int, ssd_dir: Path, extra: list[str]) -> dict:
    """`tierflow run PLAN --json` in a process of its own (as a user runs it); its JSON."""
    cmd = [sys.executable, "-m", "tierflow", "run", str(plan), "--device", "cpu", "--ssd-dir", str(ssd_dir),
           "--steps", str(steps), "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def steady_step_s(steps: list[dict], after: int) -> float:
    """Median step time of the steps after step `after + 1` (the first step of a run pays its start-up)."""
    times = [s["step_s"] for s in steps if s["step"] > after + 1]
    return statistics.median(times) if times else float("nan")


def scenario(name: str, hws: dict, s: dict, work: Path, ssd_dir: Path, ref_s: float) -> tuple[dict, list,
                                                                                         list]:
    """Plan on the wrong profile, run with --adapt; one row of results, the run's steps and the final plan's
    op groups measured vs predicted on the refit profile."""
    plan = make_plan(hws[name], work / f"{name}.json", s["time_limit_s"])
    out = work / f"out-{name}"
    wait = [] if s["decide_within"] is None else ["--adapt-decide-within", str(s["decide_within"])]
    got = tierflow_run(plan, s["steps"], ssd_dir, [
        "--adapt", "--adapt-warmup", str(s["warmup"]), "--adapt-time-limit", str(s["time_limit_s"]),
        "--adapt-fit-evaluations", str(s["fit_evaluations"]), "--out", str(out), *wait])
    (d,) = got["adapt"]
    steps = got["steps"]
    # the final plan's steady steps: after the switch (its first step pays the new run's start), or after the
    # warm-up when the plan was kept
    after_s = steady_step_s(steps, d["effective_step"] if d["switched"] else s["warmup"])
    before = [x["step_s"] for x in steps if 1 < x["step"] <= s["warmup"]] or [steps[0]["step_s"]]
    # the refit profile's prediction of the plan that runs after the decision
    predicted = d["new_predicted_s"] if d["switched"] else d["old_predicted_s"]
    row = {"scenario": name, "start_plan": d["old_plan"], "final_plan": d["new_plan"] if d["switched"]
           else d["old_plan"], "switched": d["switched"],
           "error_at_warmup": round(d["measured_iteration_s"] / d["predicted_iteration_s"] - 1, 3),
           "fields_refit": len(d["refit"]), "step_s_before": round(statistics.median(before), 4),
           "step_s_after": round(after_s, 4), "reference_step_s": round(ref_s, 4),
           "throughput_vs_reference": round(ref_s / after_s - 1, 3),
           "refit_predicts_final": round(after_s / predicted - 1, 3) if predicted else "",
           "decide_s": round(d["decide_s"], 2) if d["decide_s"] is not None else "",
           "decided_at_step": d["step"], "effective_step": d["effective_step"] if d["effective_step"] else "",
           "steps_while_deciding": d["steps_while_deciding"],
           "switch_s": round(d["switch_s"], 3) if d["switch_s"] is not None else "",
           **{k: round(v, 3) for k, v in d["switch_parts"].items()},
           "switch_steps": round(d["switch_s"] / after_s, 2) if d["switch_s"] is not None else "",
           "decision": d["line"]}
    groups = final_groups(name, plan, d, out) if d["refit"] else []
    # the same prediction against the final plan's measured trace (its last round's steady iterations: the
    # simulator's quantity), beside the median step time above
    it = [g for g in groups if g["group"] == ITERATION]
    if it and predicted:
        row["final_trace_iteration_s"] = round(it[0]["measured_ms"] / 1e3, 4)
        row["refit_predicts_final_trace"] = round(it[0]["measured_ms"] / 1e3 / predicted - 1, 3)
    return row, [{"run": name, "step": x["step"], "step_s": x["step_s"], "loss": x["loss"]} for x in steps], \
        groups


def final_groups(name: str, start_plan: Path, d: dict, out: Path) -> list[dict]:
    """The final plan's op groups (its measured trace, the run's last round) against their prediction on the
    refit profile: which op kinds carry the refit's error on the plan it chose."""
    final = load_plan(out / "adapted_plan.json" if d["switched"] else start_plan)
    refit = load_plan(start_plan).hardware.with_overrides({k: v for k, (_, v) in d["refit"].items()
                                                           if v is not None})
    cfg = final.config
    on_refit = plan_from_graph(final.model, refit, cfg, build_graph(final.model, refit, cfg))
    start_s, end_s = load_measured(out / "trace.json", len(on_refit.graph.tasks))
    obs, ref = observations(on_refit, start_s, end_s, "the final plan's trace")
    pred = simulate_plan(on_refit)
    pdur = pred.end_s - pred.start_s
    rows = []
    for o in obs:
        p = iteration_seconds(ref, on_refit.graph.tasks, pred.end_s) if o.group == ITERATION else \
            float(np.sum(pdur[list(o.ops)]))
        rows.append({"scenario": name, "plan": final.config.describe(), "group": str(o.group),
                     "measured_ms": round(o.measured * 1e3, 3), "predicted_ms": round(p * 1e3, 3),
                     "predicted_vs_measured": round(p / o.measured - 1, 3) if o.measured > 0 else ""})
    return rows


def plot(step_rows: list[dict], rows: list[dict], warmup: int, path: Path) -> Path:
    fig, (ax,) = new_figure(1, width_in=8.0)
    for run in dict.fromkeys(r["run"] for r in step_rows):
        pts = [(r["step"], r["step_s"] * 1e3) for r in step_rows if r["run"] == run]
        ax.plot(*zip(*pts), marker="o", ms=3, label=run, ls="--" if run == "calibrated" else "-")
    for r in rows:
        ax.axvline(r["decided_at_step"] + 0.5, color="0.6", ls=":", lw=0.8)
        if r["switched"] and r["effective_step"]:
            ax.axvline(r["effective_step"] + 0.5, color="0.25", ls="-.", lw=0.8,
                       label=f"{r['scenario']}: decided after step {r['decided_at_step']}, switched after "
                             f"step {r['effective_step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"{MODEL}, batch {BATCH} x {SEQ}, CPU device, optimizer states on the SSD tier", loc="left",
                 fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool, out_dir: Path, ssd_dir: Path | None = None) -> list[dict]:
    s = settings(quick)
    hws = profiles()
    prog = Progress(1 + len(s["scenarios"]), "adapt")
    with tempfile.TemporaryDirectory(prefix="tierflow-adapt-exp-") as tmp:
        work = Path(tmp)
        ssd = ssd_dir or work / "ssd"
        ssd.mkdir(parents=True, exist_ok=True)
        prog.step("the calibrated profile's plan")
        ref_plan = make_plan(hws["calibrated"], work / "calibrated.json", s["time_limit_s"])
        ref = tierflow_run(ref_plan, s["steps"], ssd, [])
        step_rows = [{"run": "calibrated", "step": x["step"], "step_s": x["step_s"], "loss": x["loss"]}
                     for x in ref["steps"]]
        rows, groups = [], []
        for name in s["scenarios"]:
            prog.step(name)
            # the reference runs just before and just after: a shared machine's load drifts over minutes
            ref_s = steady_step_s(ref["steps"], 0)
            row, steps, g = scenario(name, hws, s, work, ssd, ref_s)
            rows.append(row)
            step_rows += steps
            groups += g
            if not quick:
                ref = tierflow_run(ref_plan, s["steps"], ssd, [])
                step_rows += [{"run": f"calibrated after {name}", "step": x["step"], "step_s": x["step_s"],
                               "loss": x["loss"]} for x in ref["steps"]]
                row["reference_after_step_s"] = round(steady_step_s(ref["steps"], 0), 4)
                ref_s = statistics.mean([ref_s, row["reference_after_step_s"]])
                row["reference_step_s"] = round(ref_s, 4)
                row["throughput_vs_reference"] = round(ref_s / row["step_s_after"] - 1, 3)
    prog.finish()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "adapt.csv")
    write_csv(step_rows, out_dir / "adapt_steps.csv")
    if groups:
        write_csv(groups, out_dir / "adapt_groups.csv")
    plot(step_rows, rows, s["warmup"], out_dir / "adapt.png")
    if out_dir.resolve() == RESULTS_DIR.resolve():  # the docs show what the results files hold
        write_generated_block(DOC, DOC_TABLE, adapt_table(rows))
    print(f"Adapting: {MODEL}, batch {BATCH} x {SEQ} on this CPU (caps {CAPS}); reference: the calibrated "
          f"profile's plan at {min(r['reference_step_s'] for r in rows) * 1e3:.1f} ms/step (best run)")
    print_table(rows, ["scenario", "switched", "error_at_warmup", "step_s_before", "step_s_after",
                       "reference_step_s", "throughput_vs_reference", "refit_predicts_final",
                       "refit_predicts_final_trace", "decide_s",
                       "decided_at_step", "effective_step", "switch_s", "switch_steps"])
    for r in rows:
        print(f"  {r['scenario']}: {r['decision']}")
    return [headline("adapt", f"{r['scenario']}: step time after adapting / calibrated plan's",
                     r["step_s_after"] / r["reference_step_s"], None, "x") for r in rows]


DOC = REPO_DIR / "docs" / "adapting.md"
DOC_TABLE = "adapting (experiments/adapt.py from experiments/results/adapt.csv)"


def plan_change(start: str, final: str) -> str:
    """`start` -> `final` shown by the parts of the plans' descriptions that differ."""
    a, b = start.split(", "), final.split(", ")
    same = [x for x in a if x in b]
    family = f"{a[0].split(':')[0]}: " if a[0] == b[0] else ""  # the schedule, named once when it stays
    return f"{family}{', '.join(x for x in a if x not in same)} -> {', '.join(x for x in b if x not in same)}"


def _decision(r: dict) -> str:
    """Where the decision took effect and what it did, with the gain the refit profile predicted (from the
    decision's line)."""
    gain = re.search(r" ms \(([+-]\d+%)\)", r["decision"])
    gain_s = f"predicted {gain.group(1)}" if gain else "no refit"
    if str(r["switched"]) != "True":
        return f"{r['effective_step'] or '-'}: kept ({gain_s})"
    return f"{r['effective_step']}: {plan_change(r['start_plan'], r['final_plan'])} ({gain_s})"


def _switch(r: dict) -> str:
    if r["switch_s"] in ("", None):
        return "-"
    keys = ("checkpoint_write_s", "old_run_end_s", "new_run_start_s")
    parts = " + ".join(f"{float(r[k]):.2f}" for k in keys)
    return f"{float(r['switch_s']):.2f} s ({float(r['switch_steps']):.1f}): {parts}"


def _fmt(x, spec: str) -> str:
    """`x` (a number, or its text as read from the CSV) in format `spec`; "-" for an empty cell."""
    return "-" if x in (None, "") else format(float(x), spec)


def adapt_table(rows: list[dict]) -> str:
    """docs/adapting.md's table of the scenarios, from the rows as written to or read from adapt.csv."""
    out = []
    for r in rows:
        out.append((r["scenario"], _decision(r),
                    f"{_fmt(r['decide_s'], '.1f')} s ({r['steps_while_deciding']})",
                    f"{_fmt(r['step_s_after'], '.3f')} / {_fmt(r['reference_step_s'], '.3f')} s "
                    f"({_fmt(r['throughput_vs_reference'], '+.1%')})",
                    f"{_fmt(r['refit_predicts_final'], '+.0%')} / "
                    f"{_fmt(r.get('refit_predicts_final_trace'), '+.0%')}", _switch(r)))
    taken = "/".join(dict.fromkeys(str(r["decided_at_step"]) for r in rows))
    return markdown_table(["scenario", f"decision: taken at step {taken}, took effect at",
                           "refit + re-plan (steps trained meanwhile)",
                           "step after / calibrated plan's (throughput)",
                           "refit predicts the final plan: median step / last round's trace",
                           "switch (steps): checkpoint + old run's end + new run's start"], out)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--ssd-dir", type=Path, default=None, help="directory for the SSD tier (default: a "
                    "temporary folder)")
    args = ap.parse_args(argv)
    run(args.quick, args.out, args.ssd_dir)


if __name__ == "__main__":
    sys.exit(script_main(main))
