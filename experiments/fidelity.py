"""Fidelity: the simulator's predictions against published measurements, point by point, with the error.

    # the study (run_all.py runs it last)
    python experiments/fidelity.py [--quick] [--out DIR]
    # any measured runs, any profiles
    python experiments/fidelity.py --runs RUNS.csv [RUNS.csv ...] [--hw P ...]

The study's points:
- LoHan's SSD sweep (its Figure 10(b), RC4ML/LoHan evaluation_data.md: GPT-3 13B, seq 1024, Fuyou, 1-12 SSDs)
  as its code runs it (no LM head, the whole batch at once): batch 48, the runs the bundled rtx4090-lohan's
  SSD rates were fitted on (experiments/data/lohan_fuyou_ssd_count_as_coded.csv, `tierflow fit`), and batch 32
  and 64, held out (never fitted on: ..._as_coded_heldout.csv);
- LoHan's batch sweeps with 12 SSDs (Figures 5(a)/7(a) and 7(b): 13B at batch 8-128, 175B at 8 and 16),
  held out (lohan_fuyou_batch_heldout.csv);
- every seed headline number with a numeric paper value (REFERENCE.md): the other studies' rows, handed over
  by run_all.py, or read from <out>/summary.csv when this script runs alone.
Writes fidelity.csv and fidelity.png (predicted against measured with y = x and a +-15% band; the SSD-count
curves with the measured points) under the output folder.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

from expcommon import (
    Progress,
    arg_parser,
    headline,
    new_figure,
    print_headlines,
    print_table,
    reference_line,
    save_figure,
    schedule_color,
    write_csv,
)

from tierflow.hwprofiles import load_profile
from tierflow.planner.search.fit import Run, load_runs, predict

HERE = Path(__file__).parent
FITTED = HERE / "data" / "lohan_fuyou_ssd_count_as_coded.csv"
HELD_OUT = [HERE / "data" / "lohan_fuyou_ssd_count_as_coded_heldout.csv",
            HERE / "data" / "lohan_fuyou_batch_heldout.csv"]
HW = "rtx4090-lohan"
BAND = 0.15  # the fidelity target: every seed headline within 15%
# the studies of REFERENCE.md's headlines
SEED_STUDIES = ("fuyou_lohan", "greedysnake_a100", "gemini_capacity")
CURVE_SSD_COUNTS = [1, 2, 3, 4, 6, 8, 12]
SOURCE = "RC4ML/LoHan artifact evaluation_data.md (Figure 10(b)); REFERENCE.md section 1"


def predict_runs(files: list[Path], profiles: list, quick: bool,
                 progress: Progress | None = None) -> list[dict]:
    """One row per measured run and profile: measured, predicted and the relative error."""
    rows = []
    for f in files:
        runs = load_runs(f)
        if quick:  # the sweep's ends and its middle
            runs = [r for r in runs if r.overrides.get("ssd.count") in ("1", "3", "12", 1, 3, 12)][:3]
        for run in runs:
            for hw in profiles:
                p = predict(run, hw)
                rows.append({
                    "kind": "fitted on" if f == FITTED else ("held out" if f in HELD_OUT else f.name),
                    "data": f.name,
                    "hw": hw.name, "model": run.model, "batch": run.batch, "ssd_count": _ssd_count(run, hw),
                    "run": run.label(), "measure": run.measure, "measured": run.measured,
                    "predicted": round(p.value, 2), "error": round(p.value / run.measured - 1, 4),
                })
                if progress:
                    progress.step(run.label()[:40])
    return rows


def _ssd_count(run: Run, hw) -> int:
    return int(run.overrides.get("ssd.count", hw.ssd.count))


def curves(hw, batches: list[int], quick: bool, progress: Progress | None = None) -> list[dict]:
    """Predicted hardware TFLOPS of LoHan's runs along the SSD count, one curve per batch."""
    base = load_runs(FITTED)[0]
    counts = [1, 3, 12] if quick else CURVE_SSD_COUNTS
    rows = []
    for batch in batches:
        for n in counts:
            run = replace(base, batch=batch, micro_batch=batch,
                          overrides={**base.overrides, "ssd.count": str(n)})
            rows.append({"batch": batch, "ssd_count": n, "predicted": round(predict(run, hw).value, 2)})
            if progress:
                progress.step(f"curve batch {batch} ssd {n}")
    return rows


def headline_points(published: list[dict]) -> list[dict]:
    """The seed headline numbers with a numeric paper value: ours against the paper's."""
    out = []
    for h in published:
        try:
            ours, paper = float(h["ours"]), float(h["paper"])
        except (TypeError, ValueError, KeyError):
            continue
        if h.get("study") not in SEED_STUDIES or paper <= 0:
            # multi_gpu's rows are LoHan's artifact and GreedySnake's 4-GPU figure, not seed headlines
            continue
        out.append({"kind": "seed headline", "data": "REFERENCE.md", "hw": "", "model": "", "batch": "",
                    "ssd_count": "", "run": f"{h['study']}: {h['metric']}", "measure": h.get("unit", ""),
                    "measured": paper, "predicted": ours, "error": round(ours / paper - 1, 4)})
    return out


def rms(errors: list[float]) -> float:
    return (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else float("nan")


def plot(points: list[dict], curve_rows: list[dict], path: Path) -> Path:
    fig, (ax1, ax2) = new_figure(2, width_in=6.0, height_in=4.6)
    # every published run here is Fuyou's (LoHan's code), in the fuyou schedule's colour;
    # the kinds differ by marker
    fuyou = schedule_color("fuyou")
    styles = {"fitted on": ("o", fuyou, fuyou), "held out": ("s", "none", fuyou),
              "seed headline": ("^", "0.3", "0.3")}
    tflops = [p for p in points if p["measure"] in ("hw_tflops", "TFLOPS (recompute counted)")]
    hi = max([p["measured"] for p in tflops] + [p["predicted"] for p in tflops] + [1.0]) * 1.1
    xs = [0, hi]
    ax1.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    ax1.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="grey", alpha=0.2,
                     label=f"+-{BAND:.0%}")
    for kind, (marker, face, edge) in styles.items():
        pts = [p for p in tflops if p["kind"] == kind]
        if pts:
            ax1.scatter([p["measured"] for p in pts], [p["predicted"] for p in pts], marker=marker,
                        facecolors=face, edgecolors=edge,
                        label=f"{kind} ({len(pts)})" + (" (any schedule)" if kind == "seed headline" else ""),
                        zorder=3)
    ax1.set_xlim(0, hi)
    ax1.set_ylim(0, hi)
    ax1.set_xlabel("measured (published) hardware TFLOPS")
    ax1.set_ylabel("predicted hardware TFLOPS")
    ax1.set_title("Predicted vs measured")
    ax1.legend(fontsize=7, loc="upper left")
    dashes = {32: ":", 48: "-", 64: "--"}  # one schedule (fuyou), one colour: batches differ by line style
    for batch in sorted({r["batch"] for r in curve_rows}):
        cr = [r for r in curve_rows if r["batch"] == batch]
        ax2.plot([r["ssd_count"] for r in cr], [r["predicted"] for r in cr], color=fuyou,
                 ls=dashes.get(batch, "-."), label=f"batch {batch} predicted")
        pts = [p for p in points if p["data"] in (FITTED.name, HELD_OUT[0].name) and p["batch"] == batch]
        marker = {32: "v", 48: "o", 64: "s"}.get(batch, "D")
        ax2.scatter([p["ssd_count"] for p in pts], [p["measured"] for p in pts], marker=marker,
                    facecolors=fuyou if batch == 48 else "none", edgecolors=fuyou,
                    label=f"batch {batch} published" + (" (fitted on)" if batch == 48 else " (held out)"),
                    zorder=3)
    gpu = load_profile(HW).gpu
    reference_line(ax2, gpu.peak_tflops, f"{gpu.model} peak {gpu.peak_tflops:g} TFLOPS", ls=":")
    ax2.set_ylim(0, gpu.peak_tflops * 1.08)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(CURVE_SSD_COUNTS, [str(n) for n in CURVE_SSD_COUNTS])
    ax2.set_xlabel("SSDs in the RAID0 array")
    ax2.set_ylabel("hardware TFLOPS")
    ax2.set_title("LoHan GPT-3 13B on the 4090 box (Fig. 10(b))")
    ax2.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


def read_summary(out_dir: Path) -> list[dict]:
    path = out_dir / "summary.csv"
    if not path.exists():
        print(f"fidelity: no {path} (run experiments/run_all.py first for the seed headlines)",
              file=sys.stderr)
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run(quick: bool, out_dir: Path, published: list[dict] | None = None) -> list[dict]:
    hw = load_profile(HW)
    published = read_summary(out_dir) if published is None else published
    n_curve = len([32, 48, 64]) * (3 if quick else len(CURVE_SSD_COUNTS))
    progress = Progress((6 if quick else 22) + n_curve, "fidelity")
    points = predict_runs([FITTED, *HELD_OUT], [hw], quick, progress)
    curve_rows = curves(hw, [32, 48, 64], quick, progress)
    progress.finish()
    points += headline_points(published)
    write_csv(points, out_dir / "fidelity.csv")
    plot(points, curve_rows, out_dir / "fidelity.png")
    print_table([{**p, "error": f"{p['error']:+.1%}"} for p in points],
                ["kind", "run", "measured", "predicted", "error"])
    heads = []
    labels = {FITTED.name: "LoHan SSD sweep, batch 48 (the fit's data)",
              HELD_OUT[0].name: "LoHan SSD sweep, batch 32 and 64 (held out)",
              HELD_OUT[1].name: "LoHan batch sweeps, 12 SSDs (held out)"}
    for data, label in labels.items():
        pts = [p for p in points if p["data"] == data]
        if not pts:
            continue
        worst = max(pts, key=lambda p: abs(p["error"]))
        heads.append(headline("fidelity", f"{label}: RMS error of {len(pts)} runs",
                              round(100 * rms([p["error"] for p in pts]), 1), None, "%",
                              note=f"max {worst['error']:+.1%} ({worst['run']}); profile {hw.name}",
                              source=SOURCE))
    seeds = [p for p in points if p["kind"] == "seed headline"]
    inside = [p for p in seeds if abs(p["error"]) <= BAND]
    misses = "; ".join(f"{p['run']} {p['error']:+.0%}" for p in seeds if abs(p["error"]) > BAND)
    if seeds:
        heads.append(headline("fidelity", f"seed headline numbers within {BAND:.0%}",
                              f"{len(inside)} of {len(seeds)}", None, "",
                              note=f"misses: {misses}" if misses else "all within the band",
                              source="REFERENCE.md"))
    print_headlines(heads, "fidelity")
    return heads


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--runs", nargs="+", type=Path,
                    help="CSV/YAML files of measured runs (`tierflow fit` format)")
    ap.add_argument("--hw", action="append", help="profiles to compare (repeatable; default rtx4090-lohan)")
    args = ap.parse_args(argv)
    if not args.runs:
        run(args.quick, args.out)
        return
    profiles = [load_profile(p) for p in (args.hw or [HW])]
    rows = predict_runs(args.runs, profiles, args.quick)
    for hw in profiles:
        for kind in [*dict.fromkeys(r["kind"] for r in rows), "all runs"]:
            errs = [r["error"] for r in rows if r["hw"] == hw.name and kind in (r["kind"], "all runs")]
            print(f"{hw.name:<24} {kind:<42} RMS error {rms(errs):6.1%}  max {max(map(abs, errs)):6.1%}  "
                  f"({len(errs)} runs)")
    print_table([{**r, "error": f"{r['error']:+.1%}"} for r in rows],
                ["hw", "run", "measured", "predicted", "error"])


if __name__ == "__main__":
    main()
