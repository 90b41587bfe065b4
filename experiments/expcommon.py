"""Shared helpers for the paper-reproduction experiments: progress on stderr, the placements the papers ran,
best-micro-batch simulation, resource utilisation and the binding resource, and the ours-vs-paper table.

Every experiment script imports this module from its own folder (`python experiments/<script>.py` puts
experiments/ on sys.path). Nothing here models hardware or schedules: all numbers come from the library
(tierflow.api, tierflow.planner.search.plan_search, tierflow.planner.search.capacity); this file only runs it
and formats what it returns.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from tierflow.api import simulate_config
from tierflow.hwprofiles import HardwareProfile
from tierflow.logs import add_verbosity_options, configure, level_of
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.dsruntime import as_runtime_steps
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import ScheduleError, make_schedule
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.io.progress import Progress
from tierflow.planner.search.loads import duplex_time_s, pcie_time_s, pool_times_s

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TRACEBACK_ENV = "TIERFLOW_TRACEBACK"  # set to 1: an experiment script that fails shows the traceback too
NOTE_THRESHOLD = 0.15  # a headline that differs from the paper by more than this must carry an explanation

_ON_SSD = Split(gpu=0.0, cpu=0.0, ssd=1.0)
_ON_CPU = Split(gpu=0.0, cpu=1.0, ssd=0.0)

# What each paper's code puts where when the model lives on the SSD array (REFERENCE.md section 1):
# Fuyou: bf16 weights and fp32 master / m / v on SSD, fp32 gradients in host memory, checkpoints in pinned
# DRAM.
# ZeRO-Infinity with params + optimizer on NVMe: the same, and the fp32 gradients spilled to NVMe with the
# optimizer states; activation checkpoints offloaded to CPU memory.
PAPER_PLACEMENTS = {
    "fuyou": Placement(
        weights=_ON_SSD, master=_ON_SSD, adam_m=_ON_SSD, adam_v=_ON_SSD, grads=_ON_CPU, checkpoints=_ON_CPU
    ),
    "horizontal": Placement(
        weights=_ON_SSD, master=_ON_SSD, adam_m=_ON_SSD, adam_v=_ON_SSD, grads=_ON_SSD, checkpoints=_ON_CPU
    ),
}


# ---- simulation helpers -----------------------------------------------------------------------------------


def divisors_up_to(batch: int, limit: int) -> list[int]:
    """Micro-batch sizes to try: powers of two that divide the batch, up to `limit` sequences."""
    out, mb = [], 1
    while mb <= min(batch, limit):
        if batch % mb == 0:
            out.append(mb)
        mb *= 2
    return out


def simulate_family(
    model: ModelSpec,
    hw: HardwareProfile,
    family: str,
    batch: int,
    micro_batch: int,
    seq: int,
    placement: Placement | None = None,
    overrides: dict | None = None,
) -> SimResult:
    """One schedule family with its defaults (placement None = the library's default for that family);
    `overrides`: ScheduleConfig fields set on top (e.g. a DeepSpeed config's buffer keys)."""
    cfg = make_schedule(family, model, hw, batch=batch, micro_batch=micro_batch, seq=seq, placement=placement)
    if overrides:
        cfg = replace(cfg, **overrides)
    return simulate_config(model, hw, cfg)


def best_micro_batch(
    model: ModelSpec,
    hw: HardwareProfile,
    family: str,
    batch: int,
    seq: int,
    micro_batches: Iterable[int],
    placement: Placement | None = None,
    progress: Progress | None = None,
    overrides: dict | None = None,
) -> tuple[int | None, SimResult | None, dict[int, str]]:
    """Simulate every micro-batch that fits; return (best micro-batch, its result, {micro-batch: error})."""
    best_mb, best, errors = None, None, {}
    for mb in micro_batches:
        if progress:
            progress.step(f"{model.name} {family} batch {batch} mb {mb} on {hw.name}")
        try:
            res = simulate_family(model, hw, family, batch, mb, seq, placement, overrides)
        except (CapacityError, ScheduleError) as e:
            errors[mb] = str(e)
            continue
        if best is None or res.iteration_s < best.iteration_s:
            best_mb, best = mb, res
    return best_mb, best, errors


def utilisation(res: SimResult, hw: HardwareProfile) -> dict[str, float]:
    """Share of the steady-state iteration each resource is needed: GPU and CPU from SimResult.busy; links
    from the bytes they carry at their solo rates (PCIe both ways with the profile's duplex rates, the SSD
    array's reads and writes likewise with its mixed rates, ssd.mixed_efficiency). CPU Adam's DRAM traffic at
    the rate of the implementation the run's runtime steps with, as the simulator ran it (its graph's
    meta["runtime"]: dsruntime.as_runtime_steps)."""
    rates = link_rates(as_runtime_steps(hw, res.graph.meta.get("runtime")))
    t = res.iteration_s
    lb = res.link_bytes
    h2d, d2h = lb["cpu->gpu"], lb["gpu->cpu"]
    rd, wr = lb["ssd->cpu"], lb["cpu->ssd"]
    ssd_s = duplex_time_s(rd, wr, rates.ssd_read, rates.ssd_write, rates.ssd_read_mixed,
                          rates.ssd_write_mixed) if rates.ssd_read > 0 else 0.0
    out = {
        "gpu": res.busy["gpu"],
        "cpu_adam": res.busy["cpu"],
        "pcie": pcie_time_s(h2d, d2h, rates) / t,
        "ssd": ssd_s / t,
    }
    # host memory: the links' bytes and CPU Adam's at its solo rate (cpu.memory_efficiency)
    if rates.dram_bound:
        it = max(res.graph.num_iterations - 2, 0)
        adam_s = (sum(x.work for x in res.graph.tasks if x.resource == "cpu" and x.iteration == it)
                  if res.graph.tasks else res.busy["cpu"] * t)
        work = {"h2d": h2d, "d2h": d2h, "ssd_read": rd, "ssd_write": wr, "cpu": adam_s}
        out["dram"] = pool_times_s(work, rates)["dram"] / t
    return out


# the users' box of the LoRA and compressed-states studies: rtx4090-lohan with 256 GB of RAM (19 GB reserved:
# the profile's rule, 6 GiB + 5% of DRAM) and 4 of its 12 SSDs (profile overrides)
BOX_4090_256GB_4SSDS = {"cpu.memory_gib": 256, "cpu.reserved_gib": 19, "ssd.count": 4}
SATURATED = 0.85  # a resource needed for at least this share of the iteration is called the binding one


def binding(util: dict[str, float]) -> str:
    """The resource closest to saturation, e.g. 'gpu 99%'; when none is needed for 85% of the iteration, the
    two busiest, e.g. 'mixed: gpu 76% / ssd 61%' (the iteration alternates between phases bound by different
    resources, so none of them is busy all the time)."""
    order = sorted(util, key=util.get, reverse=True)
    top = order[0]
    if util[top] >= SATURATED or len(order) == 1:
        return f"{top} {100 * util[top]:.0f}%"
    second = order[1]
    return f"mixed: {top} {100 * util[top]:.0f}% / {second} {100 * util[second]:.0f}%"


def result_row(res: SimResult, hw: HardwareProfile) -> dict:
    """The columns every experiment CSV shares for one simulated configuration."""
    util = utilisation(res, hw)
    row = {
        "iteration_s": round(res.iteration_s, 3),
        "tokens_per_s": round(res.tokens_per_s, 2),
        "model_tflops": round(res.model_tflops, 2),
        "hw_tflops": round(res.hw_tflops, 2),
    }
    row.update({f"util_{k}": round(v, 3) for k, v in util.items()})
    row["binding"] = binding(util)
    row.update({f"bytes_{k.replace('->', '_to_')}": round(v) for k, v in res.link_bytes.items()})
    row.update({f"peak_{k}_bytes": round(v) for k, v in res.peak_bytes.items()})
    return row


# ---- ours vs paper ----------------------------------------------------------------------------------------


def ratio(ours, paper) -> float | None:
    """ours / paper when both are numbers, else None."""
    if isinstance(ours, (int, float)) and isinstance(paper, (int, float)) and paper and not math.isnan(ours):
        return ours / paper
    return None


def headline(study: str, metric: str, ours, paper, unit: str, note: str = "", source: str = "") -> dict:
    """One ours-vs-paper number. A numeric difference of more than 15%, or a non-numeric disagreement, must
    come with a note that names the differing assumption (enforced here, so no script can forget it)."""
    r = ratio(ours, paper)
    differs = (r is not None and abs(r - 1) > NOTE_THRESHOLD) or (
        r is None and paper is not None and str(ours) != str(paper)
    )
    if differs and not note:
        raise ValueError(f"{study}/{metric}: ours {ours} vs paper {paper} differ; a note must explain why")
    return {
        "study": study,
        "metric": metric,
        "ours": _round(ours),
        "paper": _round(paper),
        "ratio": round(r, 3) if r is not None else "",
        "unit": unit,
        "differs_over_15pct": differs,
        "note": note,
        "paper_source": source,
    }


def _round(x):
    if isinstance(x, float):
        return round(x, 3 if abs(x) < 10 else 1)
    return "" if x is None else x


def print_headlines(rows: Sequence[dict], title: str, stream=None) -> None:
    """The ours-vs-paper table, then one note for every number that differs by more than 15%."""
    stream = stream or sys.stdout
    print(f"\n{title}", file=stream)
    w = max([len(r["metric"]) for r in rows] + [6])
    print(f"{'metric':<{w}}  {'ours':>14}  {'paper':>14}  {'ratio':>6}  unit", file=stream)
    print("-" * (w + 52), file=stream)
    for r in rows:
        ratio_s = f"{r['ratio']:.2f}" if r["ratio"] != "" else "-"
        print(
            f"{r['metric']:<{w}}  {_fmt(r['ours']):>14}  {_fmt(r['paper']):>14}  {ratio_s:>6}  {r['unit']}",
            file=stream,
        )
    notes = [r for r in rows if r["note"]]
    if notes:
        print("\nnotes (every difference over 15% says which assumption differs):", file=stream)
    for r in notes:
        flag = "NOTE (>15%)" if r["differs_over_15pct"] else "note"
        print(f"- {flag} {r['metric']}: {r['note']}", file=stream)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 10 else f"{x:,.1f}"
    return str(x) if x != "" else "-"


def print_table(rows: Sequence[dict], columns: Sequence[str], stream=None) -> None:
    """A plain fixed-width table of the chosen columns."""
    stream = stream or sys.stdout
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    print("  ".join(c.rjust(wd) for c, wd in zip(columns, widths)), file=stream)
    print("  ".join("-" * wd for wd in widths), file=stream)
    for row in cells:
        print("  ".join(v.rjust(wd) for v, wd in zip(row, widths)), file=stream)


def write_csv(rows: Sequence[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


class _ExperimentParser(argparse.ArgumentParser):
    """Parses like argparse and then sets the `tierflow` logger's level from -q / -v (the progress display and
    debug lines follow it, as in the `tierflow` command)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        configure(level_of(ns))
        return ns


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """The options every experiment script shares: --quick, --out and -q / --quiet, -v / --verbose."""
    ap = _ExperimentParser(
        description=doc.strip().splitlines()[0],
        epilog="\n".join(doc.strip().splitlines()[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--quick", action="store_true", help="a small, fast subset (smoke test; about a minute or less)"
    )
    ap.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help=f"folder for the CSV and PNG (default {RESULTS_DIR})"
    )
    add_verbosity_options(ap)
    return ap


# ---- figures ----------------------------------------------------------------------------------------------

# One colour per schedule in every experiment figure (the papers' systems take their schedule's colour:
# ZeRO-Infinity = horizontal, Fuyou = fuyou, GreedySnake = vertical). Other series use other markers or line
# styles, never these colours for something else.
SCHEDULE_COLORS = {
    "horizontal": "#ff7f0e",
    "fuyou": "#1f77b4",
    "vertical": "#2ca02c",
    "block": "#9467bd",
    "plan": "#d62728",
}
REFERENCE_COLOR = "0.35"  # reference lines (hardware peaks, published values, the box as published)


def schedule_color(family: str) -> str:
    """The colour of a schedule family; 'block k=2 ...' or 'vertical mb=2' name their family first."""
    name = family.split()[0] if family else ""
    if name not in SCHEDULE_COLORS:
        raise KeyError(f"no colour for schedule {family!r}; add it to SCHEDULE_COLORS")
    return SCHEDULE_COLORS[name]


def reference_line(ax, value: float, label: str, vertical: bool = False, ls: str = "--",
                   left: bool = False) -> None:
    """A grey reference line with its label written on the plot (at the right end of a horizontal line, or the
    left one with `left`; the top of a vertical one), so that it reads without the legend."""
    style = {"color": REFERENCE_COLOR, "lw": 0.9, "ls": ls, "zorder": 1}
    if vertical:
        ax.axvline(value, **style)
        ax.annotate(label, (value, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -3),
                    textcoords="offset points", rotation=90, ha="left", va="top", fontsize=7,
                    color=REFERENCE_COLOR)
    else:
        ax.axhline(value, **style)
        ax.annotate(label, (0.0 if left else 1.0, value), xycoords=("axes fraction", "data"),
                    xytext=(2 if left else -2, 2), textcoords="offset points", ha="left" if left else "right",
                    va="bottom", fontsize=7, color=REFERENCE_COLOR, zorder=7)


def paper_point(ax, x: float, y: float, family: str, label: str) -> None:
    """A number a paper published: a star in its schedule's colour, outlined in black."""
    ax.scatter([x], [y], marker="*", s=170, color=schedule_color(family), edgecolors="black", linewidths=0.7,
               zorder=6, label=label)


def no_fit_markers(ax, xs: Sequence[float], family: str | None, label: str | None = None,
                   level: int = 0) -> None:
    """'x' markers on the x axis where a configuration does not fit in memory: in the schedule's colour, black
    for a box where no schedule fits (family None); `level` > 0 stacks them above another series' markers."""
    if not xs:
        return
    ax.scatter(list(xs), [0.025 + 0.05 * level] * len(xs), marker="x", s=55, linewidths=1.8,
               color=schedule_color(family) if family else "black", transform=ax.get_xaxis_transform(),
               clip_on=False, zorder=6, label=label or f"{family or 'no schedule'}: does not fit")


def new_figure(ncols: int, width_in: float = 5.0, height_in: float = 3.8):
    """A row of matplotlib axes, without a display (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width_in * ncols, height_in), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- tables in the docs, generated from the results files ----------------------------------------------

REPO_DIR = Path(__file__).resolve().parent.parent


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A Markdown table of `rows` (cells as given, already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_cell(text):
    """A results-file cell as the script wrote it: int, float, bool, None for an empty cell, else the text
    (values that are not text pass through, so a render function takes live rows and CSV rows alike)."""
    if not isinstance(text, str):
        return text
    if text in ("", "None"):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parsed_rows(rows: Iterable[dict]) -> list[dict]:
    """`rows` with every cell parsed (parse_cell)."""
    return [{k: parse_cell(v) for k, v in r.items()} for r in rows]


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"


def generated_block(doc: Path, name: str) -> str:
    """The text of generated block `name` in `doc` (between its two markers)."""
    text = doc.read_text()
    start, end = _markers(name)
    if start not in text or end not in text:
        raise ValueError(f"{doc}: no generated block {name!r} (markers {start} ... {end})")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def write_generated_block(doc: Path, name: str, body: str) -> None:
    """Replace generated block `name` of `doc` with `body` (the scripts' tables;
    tests/system/test_docs_tables.py checks that each block equals what its script makes of its results
    file)."""
    text = doc.read_text()
    start, end = _markers(name)
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    doc.write_text(f"{before}{start}\n{body}\n{end}{after}")


def script_main(main, argv: Sequence[str] | None = None) -> int:
    """Run an experiment script's main(); a failure is one line on stderr, not a traceback: the script's name,
    what failed and where its output is (set TIERFLOW_TRACEBACK=1 to see the traceback). Exit codes: main's
    own (None: 0), a TierflowError's, 2 for bad input (ValueError, OSError), 1 for anything else, 130 on
    Ctrl-C."""
    import os

    from tierflow.errors import TierflowError

    name = Path(sys.argv[0]).name
    try:
        rc = main(argv) if argv is not None else main()
        return int(rc or 0)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        text = " ".join(str(e).split())[:300] or "(no message)"
        print(f"{name}: {type(e).__name__}: {text} (set {TRACEBACK_ENV}=1 for the traceback)",
              file=sys.stderr)
        if isinstance(e, TierflowError):
            return e.exit_code
        return 2 if isinstance(e, (ValueError, OSError)) else 1
