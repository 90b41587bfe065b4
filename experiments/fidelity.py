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
  by run_all.py, or read from <out>/summary.csv when this script runs alone;
- the measured runs of the other experiments, read from their results files (not re-run): the race against
  DeepSpeed on this machine (race.csv), the closed loop (closed_loop.csv), LoHan's 2x RTX 4090
  (multi_gpu.csv), and the given A100 sweep (dos_polaris.csv: Deep Optimizer States' DeepSpeed ZeRO-3 runs
  on one Polaris GPU, phase by phase: "given, fitted on" with the two values fitted on it, a consistency
  check; "given, not fitted" with each point left out of the fit), and the given H200 run of tierflow's
  executor (h200_run.csv: as calibrated counted, with the run's own times entered a consistency check).
Every check is one row of one table (fidelity.csv): source, point, measured, predicted, error, the mechanism
that dominates the point (the busiest resource of its simulation, where known), and whether it is a hit
(within 15%), a miss, or a consistency check: a check some value of the model was set from (the fit's own
runs, Gemini's host memory chosen from the paper's capacity figure, rtx4090-lohan's gemm_efficiency from
LoHan's 13B headline) is never counted as a hit.
Writes fidelity.csv and fidelity.png (predicted against measured with y = x and a +-15% band; the SSD-count
curves with the measured points) under the output folder.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    Progress,
    arg_parser,
    headline,
    markdown_table,
    new_figure,
    print_headlines,
    print_table,
    reference_line,
    save_figure,
    schedule_color,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.hwprofiles import load_profile
from tierflow.planner.fit.profile_fit import Run, load_runs, predict, simulate_run

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
# the held-out batch sweeps come from other figures of the same artifact (the data file's header says which)
BATCH_SOURCE = "RC4ML/LoHan artifact evaluation_data.md (Figures 5(a), 7(a), 7(b)); REFERENCE.md section 1"
# Checks that some value of the model was set from: (study, start of the metric) -> which value. They are
# consistency checks, never hits.
SET_FROM_THE_CHECK = {
    ("gemini_capacity", ""): "each box's host memory is chosen from the paper's own capacity figure",
    ("fuyou_lohan", "Fuyou, GPT-3 13B, batch 64"): "rtx4090-lohan's gpu.gemm_efficiency 0.97 is justified by "
                                                   "this headline (LoHan's 156 TFLOPS)",
    # a ratio of two headlines, one of them the consistency check above: not an independent check
    ("fuyou_lohan", "Fuyou / ZeRO-Infinity speedup"): "the ratio of the two 13B TFLOPS headlines, whose "
                                                      "Fuyou side is the consistency check above",
}
# Headlines whose paper value is whether the run starts at all: measured and predicted 1 (runs) or 0 (cannot
# run), error 0 when they agree, 100% when not
RUNS_VALUES = {"runs": 1.0, "cannot run": 0.0}


def _runs_value(x) -> float | None:
    """1.0 / 0.0 for a headline value that says whether a run starts ("runs, 55 TFLOPS", "cannot run")."""
    text = str(x).strip().lower()
    return next((v for k, v in sorted(RUNS_VALUES.items(), key=lambda kv: -len(kv[0])) if text.startswith(k)),
                None)
FITTED_ON = "rtx4090-lohan's SSD rates were fitted on these runs (tierflow fit)"
# The fit's near-optimal answers (docs/hardware-profiles.md, "Fitting a profile"): the bundled one (write
# 3.21, host path 99.4: 3.9% RMS on the fit's runs) and the other end of the same flat valley (start at 40
# GB/s: write 3.4 at its bound, host path 70.5: 4.0%). Every LoHan prediction is reported as the band over
# both.
NEAR_OPTIMA = ({"ssd.write_gbps": 3.4, "ssd.host_path_gbps": 70.5},)
MECHANISMS = {"gpu": "GPU compute", "h2d": "PCIe", "d2h": "PCIe", "ssd_read": "SSD", "ssd_write": "SSD",
              "cpu": "CPU Adam", "net": "GPU <-> GPU", "ssd": "SSD", "pcie": "PCIe", "cpu_adam": "CPU Adam",
              "dram": "host memory"}


def predict_runs(files: list[Path], profiles: list, quick: bool,
                 progress: Progress | None = None) -> list[dict]:
    """One row per measured run and profile: measured, predicted and the relative error."""
    rows = []
    for f in files:
        runs = load_runs(f)
        if quick and f != HELD_OUT[-1]:  # the SSD sweeps' ends and middle; every run of the batch sweeps
            runs = [r for r in runs if r.overrides.get("ssd.count") in ("1", "3", "12", 1, 3, 12)][:3]
        for run in runs:
            for hw in profiles:
                p = predict(run, hw)
                hw_run = hw.with_overrides(run.overrides) if run.overrides else hw
                kind = "fitted on" if f == FITTED else ("held out" if f in HELD_OUT else f.name)
                error = round(p.value / run.measured - 1, 4)
                band = [error] + [predict(run, hw.with_overrides(o)).value / run.measured - 1
                                  for o in (NEAR_OPTIMA if hw.name == HW else ())]
                rows.append({
                    "kind": kind, "data": f.name, "source": _source_of(f),
                    "hw": hw.name, "model": run.model, "batch": run.batch, "ssd_count": _ssd_count(run, hw),
                    "run": run.label(), "measure": run.measure, "measured": run.measured,
                    "predicted": round(p.value, 2), "error": error,
                    "error_low": round(min(band), 4), "error_high": round(max(band), 4),
                    "mechanism": busiest(simulate_run(run, hw_run, p.micro_batch).busy),
                    "check": check_of(error, FITTED_ON if kind == "fitted on" else ""),
                })
                if progress:
                    progress.step(run.label()[:40])
    return rows


def busiest(busy: dict[str, float]) -> str:
    """The mechanism that dominates a simulated point: its busiest resource and that resource's share."""
    if not busy:
        return ""
    name, share = max(busy.items(), key=lambda kv: kv[1])
    return f"{MECHANISMS.get(name, name)} {share:.0%}"


def check_of(error: float, set_from: str = "") -> str:
    """"consistency check (why)" when a value of the model was set from this check's number; else hit (within
    the band) or miss."""
    if set_from:
        return f"consistency check ({set_from})"
    return "hit" if abs(error) <= BAND else "miss"


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
        measure = h.get("unit", "")
        try:
            ours, paper = float(h["ours"]), float(h["paper"])
        except (TypeError, ValueError, KeyError):
            ours, paper = _runs_value(h.get("ours", "")), _runs_value(h.get("paper", ""))
            if ours is None or paper is None or h.get("study") not in SEED_STUDIES:
                continue
            measure = "runs (1) or cannot run (0)"
            paper_ok = True
        else:
            paper_ok = paper > 0
        if h.get("study") not in SEED_STUDIES or not paper_ok:
            # multi_gpu's rows are LoHan's artifact and GreedySnake's 4-GPU figure, not seed headlines
            continue
        runs_check = measure == "runs (1) or cannot run (0)"
        error = float(ours != paper) if runs_check else round(ours / paper - 1, 4)
        set_from = next((why for (study, start), why in SET_FROM_THE_CHECK.items()
                         if h["study"] == study and h["metric"].startswith(start)), "")
        out.append({"kind": "seed headline", "data": "REFERENCE.md", "source": h.get("paper_source")
                    or "REFERENCE.md", "hw": "", "model": "", "batch": "", "ssd_count": "",
                    "run": f"{h['study']}: {h['metric']}", "measure": measure, "measured": paper,
                    "predicted": ours, "error": error, "mechanism": _binds(h.get("note", "")),
                    "check": check_of(error, set_from)})
    return out


def _binds(note: str) -> str:
    """What a study's note says binds the point ("binds: gpu 95%"), or ""."""
    if "binds: " not in note:
        return ""
    return note.partition("binds: ")[2].split(";")[0].split(". ")[0].strip()


def results_points(out_dir: Path) -> list[dict]:
    """The measured runs of the other experiments, from their results files (not re-run): the race against
    DeepSpeed on this machine, the closed loop, LoHan's 2x RTX 4090. A missing file is skipped."""
    out = []
    for name, reader in (("race.csv", _race_rows), ("closed_loop.csv", _closed_loop_rows),
                         ("multi_gpu.csv", _multi_gpu_rows), ("dos_polaris.csv", _dos_rows),
                         ("h200_run.csv", _h200_rows)):
        path = out_dir / name
        if not path.exists():
            print(f"fidelity: no {path} (run its experiment first); its checks are left out", file=sys.stderr)
            continue
        with open(path, newline="") as f:
            for r in map(reader, csv.DictReader(f)):
                out += r if isinstance(r, list) else [r] if r is not None else []
    return out


def _point(kind: str, source: str, run: str, measure: str, measured: float, predicted: float,
           mechanism: str = "") -> dict:
    # the prediction's optimism, as every other check here and the race / closed-loop tables give it: a rate
    # predicted over measured - 1, so a time measured over predicted - 1 (+: slower than predicted)
    error = round((measured / predicted if measure.startswith("s per") else predicted / measured) - 1, 4)
    return {"kind": kind, "data": kind + ".csv", "source": source, "hw": "", "model": "", "batch": "",
            "ssd_count": "", "run": run, "measure": measure, "measured": measured,
            "predicted": round(predicted, 4), "error": error, "mechanism": mechanism,
            "check": check_of(error)}


def _race_rows(r: dict) -> dict | None:
    if r.get("failed") or not r.get("predicted_s") or r["predicted_s"] == "nan":
        return None
    return _point("race", "experiments/race_deepspeed.py: DeepSpeed 0.19.8 on this machine", f"{r['point']} "
                  f"{r['variant']}", "s per step", float(r["step_s"]), float(r["predicted_s"]),
                  "DeepSpeed runtime" if r["variant"].startswith("ds") else "tierflow executor")


def _closed_loop_rows(r: dict) -> dict:
    return _point("closed_loop", "experiments/closed_loop.py: tierflow's executor on this machine",
                  f"{r['model']} {r['schedule']}", "s per iteration", float(r["measured_s"]),
                  float(r["predicted_s"]), "tierflow executor")


def _multi_gpu_rows(r: dict) -> dict | None:
    if r.get("part") != "lohan_2gpu" or not r.get("measured_hw_tflops"):
        return None
    busy = {k[len("busy_"):]: float(v) for k, v in r.items() if k.startswith("busy_") and v}
    return _point("multi_gpu", "LoHan artifact: 2x RTX 4090 (experiments/multi_gpu.py)",
                  f"{r['model']} {r['gpus']} GPUs batch {r['batch']}", "hw TFLOPS",
                  float(r["measured_hw_tflops"]), float(r["ours_hw_tflops"]), busiest(busy))


DOS_SOURCE = ("Deep Optimizer States logs (arXiv 2410.21316) on one ALCF Polaris A100-40GB, DeepSpeed ZeRO-3 "
              "(experiments/dos_polaris.py)")
DOS_FITTED = ("polaris-a100-40g's pcie.pageable_d2h_gbps (backward) and cpu.deepspeed_adam_gparams_per_s "
              "(step) were fitted on these points")


def _dos_rows(r: dict) -> list[dict]:
    """The given A100 sweep, one phase of one point: its prediction with the fitted values ("given, fitted
    on": a consistency check; the forward depends on no fitted value and has none) and with the point left
    out of the fit ("given, not fitted": counted)."""
    phase = r["phase"]
    measure = "s per iteration" if phase == "iteration" else f"s per {phase} phase"
    run = f"llama 13B (4 kv heads) gbs {r['batch']} = {r['micro_batches']} x 4, {phase}"
    mech = "DeepSpeed runtime"
    out = []
    if phase != "fwd":
        p = _point("given, fitted on", DOS_SOURCE, run, measure, float(r["measured_s"]), float(r["after_s"]),
                   mech)
        p["check"] = check_of(p["error"], DOS_FITTED)
        out.append(p)
    out.append(_point("given, not fitted", DOS_SOURCE, run + " (left out of the fit)", measure,
                      float(r["measured_s"]), float(r["loo_s"]), mech))
    return out


H200_SOURCE = "tierflow's own run on the lent H200 (experiments/h200_run.py, hwprofiles/h200-lent.yaml)"
H200_FITTED = "the run's own op times entered the model"


def _h200_rows(r: dict) -> dict:
    """The given H200 run: as calibrated (nothing taken from the run: counted), then with the run's own
    measurements entered (consistency checks)."""
    p = _point("given H200", H200_SOURCE, f"gpt3-1.3b b8x2048 vertical mb4, host states: {r['model']}",
               "s per iteration", float(r["measured_s"]), float(r["predicted_s"]), "tierflow executor")
    if r["model"] != "as calibrated":
        p["check"] = check_of(p["error"], H200_FITTED)
    return p


def rms(errors: list[float]) -> float:
    return (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else float("nan")


def plot(points: list[dict], curve_rows: list[dict], path: Path) -> Path:
    fig, (ax1, ax2, ax3) = new_figure(3, width_in=6.0, height_in=4.6)
    _plot_checks(ax3, points)
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


def _plot_checks(ax, points: list[dict]) -> None:
    """Every check's error by kind: hits and misses filled and hollow, consistency checks grey."""
    kinds = [k for k in KIND_LABELS if any(p["kind"] == k for p in points)]
    for i, kind in enumerate(kinds):
        pts = [p for p in points if p["kind"] == kind]
        for check, face, edge in (("hit", "C0", "C0"), ("miss", "none", "C3"), ("consistency", "0.7", "0.5")):
            ys = [100 * float(p["error"]) for p in pts if p["check"].startswith(check)]
            ax.scatter([i] * len(ys), ys, facecolors=face, edgecolors=edge, s=22, zorder=3,
                       label=(check if check != "consistency" else "consistency check") if i == 0 else None)
    ax.axhspan(-100 * BAND, 100 * BAND, color="grey", alpha=0.2)
    ax.axhline(0, color="black", lw=1)
    ax.set_xticks(range(len(kinds)), [k.replace("_", " ") for k in kinds], rotation=20, fontsize=7)
    ax.set_ylabel("predicted / measured - 1 (%)")
    ax.set_title(f"Every check (band +-{BAND:.0%})")
    ax.legend(fontsize=7, loc="upper left")


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
    progress = Progress((13 if quick else 22) + n_curve, "fidelity")
    points = predict_runs([FITTED, *HELD_OUT], [hw], quick, progress)
    curve_rows = curves(hw, [32, 48, 64], quick, progress)
    progress.finish()
    points += headline_points(published) + results_points(out_dir)
    write_csv(points, out_dir / "fidelity.csv")
    plot(points, curve_rows, out_dir / "fidelity.png")
    print_table([{**p, "error": f"{p['error']:+.1%}", "check": p["check"].split(" (")[0]} for p in points],
                ["kind", "run", "measured", "predicted", "error", "mechanism", "check"])
    if out_dir.resolve() == Path(RESULTS_DIR).resolve():  # the docs show what the results files hold
        write_generated_block(DOC, DOC_TABLE, checks_table(points))
        write_generated_block(FIT_DOC, FIT_TABLE, heldout_table(points))
    heads = _sweep_headlines(points, hw.name)
    heads += _check_headlines(points)
    print_headlines(heads, "fidelity")
    return heads


DOC = REPO_DIR / "docs" / "reproductions.md"
DOC_TABLE = "fidelity checks (experiments/fidelity.py from experiments/results/fidelity.csv)"
KIND_LABELS = {"fitted on": "LoHan SSD sweep, batch 48 (the fit's runs)",
               "held out": "LoHan SSD sweeps (batch 32, 64) and batch sweeps (held out)",
               "seed headline": "seed headline numbers (REFERENCE.md)",
               "race": "race against DeepSpeed 0.19.8 on this machine (race.csv)",
               "closed_loop": "closed loop on this machine (closed_loop.csv)",
               "multi_gpu": "LoHan 2x RTX 4090 (multi_gpu.csv)",
               "given, fitted on": "given A100 sweep (Polaris, DeepSpeed ZeRO-3), with the fit's values "
                                   "(dos_polaris.csv)",
               "given, not fitted": "given A100 sweep, each point left out of the fit (dos_polaris.csv)",
               "given H200": "given H200 run of tierflow's executor, as calibrated and with the run's own "
                             "times entered (h200_run.csv)"}


def checks_table(points: list[dict]) -> str:
    """docs/reproductions.md's table: per kind of check, the hits, misses and consistency checks, the RMS and
    worst error (from the rows as written to or read from fidelity.csv)."""
    rows = []
    for kind, label in KIND_LABELS.items():
        pts = [p for p in points if p["kind"] == kind]
        if not pts:
            continue
        errors = [float(p["error"]) for p in pts]
        checks = [p["check"].split(" (")[0] for p in pts]
        worst = max(pts, key=lambda p: abs(float(p["error"])))
        rows.append((label, len(pts), checks.count("hit"), checks.count("miss"),
                     checks.count("consistency check"), f"{rms(errors):.1%}", _rms_band(pts),
                     f"{float(worst['error']):+.1%} ({worst['run']})"))
    return markdown_table(["checks", "points", f"hits (within {BAND:.0%})", "misses",
                          "consistency checks (not counted)", "RMS error", "RMS over the fit's near-optima",
                          "worst"], rows)


FIT_DOC = REPO_DIR / "docs" / "hardware-profiles.md"
FIT_TABLE = "held-out LoHan data (experiments/fidelity.py from experiments/results/fidelity.csv)"
FIT_LABELS = {
    HELD_OUT[0].name: "SSD sweep at batch 32 and 64 (Figure 10(b))",
    HELD_OUT[1].name: "batch sweeps at 12 SSDs, 13B batch 8-128 and 175B batch 8, 16 (Figures 5(a), 7(b))",
}


def heldout_table(points: list[dict]) -> str:
    """docs/hardware-profiles.md's table of the LoHan data the fit never saw: per file, the runs, the RMS
    error with the bundled fit and with each of the fit's near-optimal answers, the worst run (from the rows
    as written to or read from fidelity.csv)."""
    rows = []
    for data, label in FIT_LABELS.items():
        pts = [p for p in points if p["data"] == data and p["hw"] == HW]
        if not pts:
            continue
        worst = max(pts, key=lambda p: abs(float(p["error"])))
        rows.append((label, len(pts), f"{rms([float(p['error']) for p in pts]):.1%}", _rms_band(pts),
                     f"{float(worst['error']):+.1%} ({worst['model']}, batch {worst['batch']}, "
                     f"{worst['ssd_count']} SSDs)"))
    return markdown_table(["held-out data (LoHan's evaluation_data.md)", "runs", "RMS error",
                           "RMS over the fit's near-optima", "worst"], rows)


def _source_of(f: Path) -> str:
    """Where a data file's measurements were published."""
    if f == HELD_OUT[1]:
        return BATCH_SOURCE
    return SOURCE if f in (FITTED, *HELD_OUT) else f.name


def _rms_band(pts: list[dict]) -> str:
    """The RMS error with each of the fit's near-optimal answers, lowest .. highest ("-" for points that do
    not depend on the fit). A row keeps its error with the bundled answer (`error`) and the lower and higher
    of its errors over all of them; with the one other answer of NEAR_OPTIMA, that answer's error is the end
    that is not `error` (low + high - error). The RMS of the rows' low ends is no answer's RMS: it mixes the
    answers wherever the errors change sign."""
    if not all(p.get("error_low") not in (None, "") for p in pts):
        return "-"
    if len(NEAR_OPTIMA) != 1:
        raise ValueError(f"_rms_band reads one other near-optimal answer per row, NEAR_OPTIMA has "
                         f"{len(NEAR_OPTIMA)}: add a column per answer to predict_runs' rows")
    bundled = [float(p["error"]) for p in pts]
    other = [float(p["error_low"]) + float(p["error_high"]) - float(p["error"]) for p in pts]
    ends = [rms(bundled), rms(other)]
    return f"{min(ends):.1%} .. {max(ends):.1%}"


def _sweep_headlines(points: list[dict], hw_name: str) -> list[dict]:
    """RMS error of each LoHan sweep file (the fit's own runs are a consistency check)."""
    heads = []
    labels = {FITTED.name: "LoHan SSD sweep, batch 48 (the fit's data: consistency check)",
              HELD_OUT[0].name: "LoHan SSD sweep, batch 32 and 64 (held out)",
              HELD_OUT[1].name: "LoHan batch sweeps, 12 SSDs (held out)"}
    for data, label in labels.items():
        pts = [p for p in points if p["data"] == data]
        if not pts:
            continue
        worst = max(pts, key=lambda p: abs(p["error"]))
        heads.append(headline("fidelity", f"{label}: RMS error of {len(pts)} runs",
                              round(100 * rms([p["error"] for p in pts]), 1), None, "%",
                              note=f"max {worst['error']:+.1%} ({worst['run']}); profile {hw_name}; RMS over "
                              f"the fit's near-optimal answers {_rms_band(pts)}",
                              source=SOURCE))
    return heads


def _check_headlines(points: list[dict]) -> list[dict]:
    """Hits among the checks nothing in the model was set from, per kind of check; and how many consistency
    checks were left out of the count."""
    heads = []
    for kind, label in (("seed headline", f"seed headline numbers within {BAND:.0%}"),
                        ("race", f"DeepSpeed race steps predicted within {BAND:.0%}"),
                        ("closed_loop", f"closed-loop iterations predicted within {BAND:.0%}"),
                        ("multi_gpu", f"LoHan 2x RTX 4090 points within {BAND:.0%}"),
                        ("given, not fitted", f"given A100 sweep phases within {BAND:.0%}, each point left "
                                              "out of the fit"),
                        ("given H200", f"given H200 run within {BAND:.0%} as calibrated")):
        pts = [p for p in points if p["kind"] == kind]
        counted = [p for p in pts if not p["check"].startswith("consistency")]
        if not pts:
            continue
        hits = [p for p in counted if p["check"] == "hit"]
        misses = "; ".join(f"{p['run']} {p['error']:+.0%}" for p in counted if p["check"] == "miss")
        left = len(pts) - len(counted)
        note = (f"misses: {misses}" if misses else "all within the band") + (
            f"; {left} consistency check(s) not counted (a model value was set from them)" if left else "")
        heads.append(headline("fidelity", label, f"{len(hits)} of {len(counted)}", None, "", note=note,
                              source="REFERENCE.md" if kind == "seed headline"
                              else "h200_run.csv" if kind == "given H200"
                              else "dos_polaris.csv" if kind.startswith("given") else f"{kind}.csv"))
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
    sys.exit(script_main(main))
