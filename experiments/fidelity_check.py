"""Check a profile's predictions against measured runs: the runs it was fitted on and runs held out.

    python experiments/fidelity_check.py [--hw PROFILE_OR_YAML] [RUNS.csv ...]

Defaults: the profile fitted by `tierflow fit` on LoHan's batch-48 SSD sweep (experiments/results/
rtx4090-lohan-fit.yaml, written by the command in the README) and the bundled rtx4090-lohan for comparison, on
experiments/data/lohan_fuyou_ssd_count.csv (fitted on) and lohan_fuyou_ssd_count_heldout.csv (never fitted on);
`--as-coded`: the bundled profile on the *_as_coded CSVs (LoHan's runs as its code runs them).
Prints measured vs predicted per run and writes experiments/results/fidelity_check.csv.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from tierflow.hwprofiles import load_profile
from tierflow.planner.io.progress import Progress
from tierflow.planner.search.fit import load_runs, predict

HERE = Path(__file__).parent
DATA = [HERE / "data" / "lohan_fuyou_ssd_count.csv", HERE / "data" / "lohan_fuyou_ssd_count_heldout.csv"]
PROFILES = ["rtx4090-lohan", str(HERE / "results" / "rtx4090-lohan-fit.yaml")]
# the same runs as LoHan's code runs them: its benchmark model has no LM head and the whole batch goes through at
# once (model.lm_head=false, micro-batch = batch in the overrides and micro_batch columns)
AS_CODED = [HERE / "data" / "lohan_fuyou_ssd_count_as_coded.csv",
            HERE / "data" / "lohan_fuyou_ssd_count_as_coded_heldout.csv"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", default=None, help="CSV files of measured runs")
    ap.add_argument("--hw", action="append", default=None, help="profiles to compare (repeatable)")
    ap.add_argument("--as-coded", action="store_true",
                    help="LoHan's runs as its code runs them (no lm_head, the whole batch at once), bundled profile")
    args = ap.parse_args(argv)
    if args.as_coded:
        args.runs = args.runs or [str(p) for p in AS_CODED]
        args.hw = args.hw or ["rtx4090-lohan"]
    args.runs = args.runs or [str(p) for p in DATA]
    profiles = [load_profile(p) for p in (args.hw or PROFILES)]
    runs = [(Path(f).name, r) for f in args.runs for r in load_runs(f)]
    prog = Progress(len(runs) * len(profiles), "fidelity")
    rows = []
    for src, run in runs:
        row = {"data": src, "run": run.label(), "measured": run.measured}
        for hw in profiles:
            p = predict(run, hw)
            row[f"{hw.name} predicted"] = round(p.value, 1)
            row[f"{hw.name} error"] = round(p.value / run.measured - 1, 4)
            prog.step(run.label()[:40])
        rows.append(row)
    prog.finish()
    out = HERE / "results" / "fidelity_check.csv"
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for hw in profiles:
        for src in [*dict.fromkeys(r["data"] for r in rows), "all runs"]:
            errs = [abs(r[f"{hw.name} error"]) for r in rows if src in (r["data"], "all runs")]
            rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
            print(f"{hw.name:<24} {src:<42} RMS error {rms:6.1%}  max {max(errs):6.1%}  ({len(errs)} runs)")
    for r in rows:
        print("  ".join(f"{v:+.1%}" if "error" in k else str(v) for k, v in r.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
