"""Planner quality on a grid of (model, box, batch) cases.

For each case: plan with `plan_search`, and compare the verified (simulated) iteration time with (a) the best
fixed schedule (horizontal / fuyou / vertical with default settings, best micro-batch) and (b) the planner's
own prediction of its decisions (the slot model's LP, tierflow.planner.search.slots). Writes
experiments/results/planner_quality.csv and prints a table.
Run: python experiments/planner_quality.py [--time-limit 30]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from expcommon import REPO_DIR, markdown_table, script_main, write_generated_block

from tierflow.api import resolve
from tierflow.planner.io.planning import PlanOptions, make_plan
from tierflow.planner.search.loads import iteration_loads
from tierflow.planner.search.plan_search import PlanningError

CASES = [
    # (model, hw, batch, seq)
    ("gpt3-13b", "rtx4090-lohan", 16, 1024), ("gpt3-13b", "rtx4090-lohan", 64, 1024),
    ("gpt3-13b", "rtx4090-lohan", 256, 1024), ("gpt3-175b", "rtx4090-lohan", 16, 2048),
    ("gpt3-175b", "rtx4090-lohan", 64, 2048), ("gpt3-175b", "rtx4090-lohan", 128, 2048),
    ("gpt-65b", "a100-80g-nvme", 16, 2048), ("gpt-65b", "a100-80g-nvme", 64, 2048),
    ("gpt3-175b", "a100-80g-nvme", 32, 2048), ("llama2-70b", "a100-80g-nvme", 16, 4096),
    ("gpt3-6.7b", "rtx3090-desktop", 8, 2048), ("gpt3-6.7b", "rtx3090-desktop", 32, 2048),
    ("llama2-7b", "rtx3090-desktop", 8, 2048), ("gpt3-13b", "rtx3090-desktop", 16, 2048),
    ("gpt3-1.3b", "rtx2060-laptop", 8, 1024), ("gpt3-2.7b", "rtx2060-laptop", 8, 1024),
    ("gpt3-13b", "v100-32g", 16, 2048), ("llama2-13b", "v100-32g", 16, 2048),
    ("gpt-65b", "h100-80g", 32, 2048), ("llama2-70b", "h100-80g", 32, 4096),
    ("gpt3-175b", "h100-80g", 32, 2048), ("gpt3-2.7b", "h100-80g", 64, 2048),
]

DOC = REPO_DIR / "docs" / "planning.md"
DOC_TABLE = "planner quality (experiments/planner_quality.py from experiments/results/planner_quality.csv)"


def quality_table(rows: list[dict]) -> str:
    """docs/planning.md's table of the planner's cases, from the rows as written to or read from
    planner_quality.csv (a case the planner could not plan shows its error)."""
    out = []
    for r in rows:
        case = (r["model"], r["hw"], f"{r['batch']} x {r['seq']}")
        if r.get("error"):
            out.append((*case, f"error: {r['error']}", "-", "-", "-", "-", "-"))
            continue
        verified = float(r["verified_s"])
        placement = (f"{verified / float(r['placement_model_s']) - 1:+.1%}"
                     if r["placement_model_s"] not in ("", None) else "-")
        out.append((*case, f"{r['plan']}, {r['swap_layers']} layers swapped", f"{verified:.1f}",
                    f"{float(r['speedup_vs_fixed']):.2f}x ({r['best_fixed']})",
                    f"{float(r['prediction_error']):+.1%}", placement,
                    f"{float(r['fraction_of_roofline']):.1%}"))
    return markdown_table(["model", "box", "batch x seq", "plan", "simulated s/it", "vs best fixed schedule",
                           "prediction error (slot model)", "placement model error", "% of roofline"], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--only", type=int, default=None, help="run the first N cases")
    args = ap.parse_args()
    rows = []
    cases = CASES[: args.only] if args.only else CASES
    for i, (name, hwname, batch, seq) in enumerate(cases):
        model, hw = resolve(name, hwname)
        model = model.with_seq(seq) if not model.max_positions or seq <= model.max_positions else model
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(cases)}] {name} on {hwname}, batch {batch} x {seq} ...", file=sys.stderr,
              flush=True)
        try:
            opts = PlanOptions(time_limit_s=args.time_limit, window=False)
            sr = make_plan(model, hw, batch, seq, opts).search
        except PlanningError as e:
            rows.append({"model": name, "hw": hwname, "batch": batch, "seq": seq, "error": str(e)})
            continue
        b = sr.best
        bound = iteration_loads(model, hw, b.config).bound_s(hw)
        fixed_name, fixed = min(sr.baseline.items(),
                                key=lambda kv: kv[1].iteration_s) if sr.baseline else ("-", None)
        rows.append({
            "model": name, "hw": hwname, "batch": batch, "seq": seq, "plan": b.candidate.describe(batch),
            "swap_layers": b.config.swap_layers, "verified_s": round(b.verified_s, 3),
            "solver_prediction_s": round(b.predicted_s, 3),
            "prediction_error": round(b.verified_s / b.predicted_s - 1, 4),
            "placement_model_s": round(b.solver.objective_s, 3) if b.solver else "",
            "roofline_bound_s": round(bound, 3),
            "fraction_of_roofline": round(bound / b.verified_s, 4),
            "binding": b.binding,
            "best_fixed": fixed_name, "best_fixed_s": round(fixed.iteration_s, 3) if fixed else "",
            "speedup_vs_fixed": round(fixed.iteration_s / b.verified_s, 3) if fixed else "",
            "hw_tflops": round(b.result.hw_tflops, 1), "wall_s": round(time.perf_counter() - t0, 1),
            "error": "",
        })
    out = Path(__file__).parent / "results" / "planner_quality.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    # the docs show what the results file holds (a run of --only N cases shows those)
    write_generated_block(DOC, DOC_TABLE, quality_table(_csv_rows(out)))
    ok = [r for r in rows if not r.get("error")]
    print(f"{'model':<11} {'hw':<16} {'batch':>5} {'plan':<42} {'sim s':>9} {'pred err':>8} "
          f"{'roofline':>8} {'vs fixed':>8}")
    for r in rows:
        if r.get("error"):
            print(f"{r['model']:<11} {r['hw']:<16} {r['batch']:>5} ERROR {r['error'][:90]}")
            continue
        print(f"{r['model']:<11} {r['hw']:<16} {r['batch']:>5} {r['plan']:<42} {r['verified_s']:>9.1f} "
              f"{r['prediction_error']:>+8.1%} {r['fraction_of_roofline']:>8.1%} "
              f"{r['speedup_vs_fixed']:>7.2f}x")
    slower = [r for r in ok if r["speedup_vs_fixed"] != "" and r["speedup_vs_fixed"] < 1 - 1e-9]
    print(f"{len(ok)} cases planned; slower than the best fixed schedule: {len(slower)}; "
          f"within 2% of the solver's prediction: {sum(abs(r['prediction_error']) <= 0.02 for r in ok)}; "
          f"wrote {out}")


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


if __name__ == "__main__":
    sys.exit(script_main(main))
