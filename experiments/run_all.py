"""Regenerate every paper-reproduction experiment and the summary of headline numbers (ours, paper, ratio).

Runs fuyou_lohan, greedysnake_a100, gemini_capacity, own_plans, what_if, multi_gpu, race_deepspeed (only where
DeepSpeed is importable: the race against ZeRO-Infinity on this machine), adapt, bench_store (the SSD store
against fio and DeepSpeed's aio_handle on this disk), bench_optimizer (the executor's host AdamW op against
torch's fused AdamW), bench_dispatch (the executor's host cost per op, its parts and its model),
bench_simulator (the simulator against SimPy, the planner per phase, an --adapt decision), dos_polaris (the
given A100 DeepSpeed sweep), h200_run (the first GPU run), the measurements on this machine that the fidelity
docs cite (host_adam_model: CPU Adam's per-core costs and the host model against every measured rate;
lohan_floor: LoHan's candidate per-iteration costs; dist_executor: the executor on several gloo ranks;
closed_loop and closed_loop_sweep: the executor against its plan's prediction, the fixed cases and 12 drawn
ones) and fidelity (last: predicted against published
for every headline and LoHan's SSD sweep) in this process (each writes its CSV and PNG under the output folder
and prints its own tables), then writes summary.csv and summary.md there
with every headline number, the paper's value, the ratio and the note explaining any difference over 15%.
Progress goes to stderr. The full run takes several minutes on a 2-core machine; --quick a minute or two.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import adapt
import bench_dispatch
import bench_optimizer
import bench_simulator
import bench_store
import closed_loop
import dist_executor
import dos_polaris
import fidelity
import fuyou_lohan
import gemini_capacity
import greedysnake_a100
import h200_run
import host_adam_model
import lohan_floor
import multi_gpu
import own_plans
import race_deepspeed
import what_if
from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    Progress,
    arg_parser,
    markdown_table,
    parsed_rows,
    print_headlines,
    script_main,
    write_csv,
    write_generated_block,
)

SWEEP_RUNS, SWEEP_SEED = 12, 29  # the closed loop's out-of-sample sweep as docs/executor.md runs it


class MeasuredHere:
    """A study whose run returns its own rows, not headline numbers: run it, add no headline."""

    def __init__(self, run) -> None:
        self._run = run

    def run(self, quick: bool, out_dir: Path) -> list[dict]:
        self._run(quick, out_dir)
        return []


STUDIES = {
    "fuyou_lohan": fuyou_lohan,
    "greedysnake_a100": greedysnake_a100,
    "gemini_capacity": gemini_capacity,
    "own_plans": own_plans,
    "what_if": what_if,
    # several GPUs: LoHan's 2x RTX 4090 points (check data), GreedySnake on 4 A100s, simulation cost
    "multi_gpu": multi_gpu,
    # tierflow against DeepSpeed ZeRO-Infinity on this machine: only where DeepSpeed (the baseline extra) and
    # libaio are installed; otherwise it prints one line and adds no headline
    "race_deepspeed": race_deepspeed,
    "adapt": adapt,  # plan on a wrong profile, run --adapt on this CPU, against the calibrated profile's plan
    # the SSD tier's store against fio and DeepSpeed's aio_handle on the disk that holds the checkout
    "bench_store": bench_store,
    # the executor's host adam op against torch's fused AdamW on the same tensors, 1 thread and all cores
    "bench_optimizer": bench_optimizer,
    # the executor's host cost per op and its parts on a plan of tiny ops, against plain PyTorch and the model
    "bench_dispatch": bench_dispatch,
    # the simulator against SimPy on the same graphs, `tierflow plan` phase by phase, an --adapt decision
    "bench_simulator": bench_simulator,
    # the given A100 sweep: Deep Optimizer States' DeepSpeed ZeRO-3 runs on one Polaris GPU, phase
    # by phase, with its two fitted values checked leaving each point out (fidelity reads dos_polaris.csv)
    "dos_polaris": dos_polaris,
    # the first GPU run (H200) simulated on its calibrated profile, then with what it measured
    "h200_run": h200_run,
    # measured here, cited by docs/hardware-profiles.md, reproductions.md and multi-gpu.md; no paper headline
    "host_adam_model": MeasuredHere(lambda quick, out: host_adam_model.main(
        ["--out", str(out)] + (["--quick"] if quick else []))),
    "lohan_floor": MeasuredHere(lohan_floor.run),
    "dist_executor": MeasuredHere(dist_executor.run),  # the executor on gloo ranks (docs/multi-gpu.md)
    "closed_loop": MeasuredHere(closed_loop.run),  # fidelity reads closed_loop.csv
    "closed_loop_sweep": MeasuredHere(
        lambda quick, out: closed_loop.run_sweep(SWEEP_RUNS, SWEEP_SEED, quick, out)),
    "fidelity": fidelity,  # last: it compares every earlier study's headline numbers with the papers'
}


def run_studies(names: list[str], quick: bool, out_dir: Path) -> tuple[list[dict], dict[str, float]]:
    """Run each study; return all headline rows and each study's wall time in seconds."""
    overall = Progress(len(names), "run_all")
    heads, wall_s = [], {}
    for name in names:
        overall.step(f"{name}{' --quick' if quick else ''}")
        print(f"\n===== {name} =====", flush=True)
        t0 = time.perf_counter()
        if name == "fidelity":
            heads += fidelity.run(quick, out_dir, published=list(heads))
        else:
            heads += STUDIES[name].run(quick, out_dir)
        wall_s[name] = time.perf_counter() - t0
        sys.stdout.flush()
    overall.finish(f"done in {sum(wall_s.values()):.0f} s")
    return heads, wall_s


def summary_markdown(heads: list[dict], wall_s: dict[str, float], command: str) -> str:
    lines = [
        f"Produced by `{command}` in {sum(wall_s.values()):.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in wall_s.items())}).",
        "",
        "| study | metric | ours | paper | ratio | note |",
        "|---|---|---|---|---|---|",
    ]
    for h in heads:
        ratio = f"{h['ratio']:.2f}" if h["ratio"] != "" else "-"
        flag = "**>15%:** " if h["differs_over_15pct"] else ""
        note = (flag + h["note"]).replace("|", "/")
        lines.append(
            f"| {h['study']} | {h['metric']} | {_md(h['ours'])} | {_md(h['paper'])} | {ratio} | {note} |"
        )
    return "\n".join(lines) + "\n"


DOC = REPO_DIR / "docs" / "reproductions.md"
DOC_TABLE = "ours vs the papers (experiments/run_all.py from experiments/results/summary.csv)"
PAPER_STUDIES = ("fuyou_lohan", "greedysnake_a100", "gemini_capacity", "what_if")  # headlines with a paper's


def papers_table(heads: list[dict]) -> str:
    """docs/reproductions.md's table of the seed papers' headline numbers against ours, from the headline rows
    as written to or read from summary.csv (their full notes are in summary.md)."""
    out = []
    for h in parsed_rows(heads):
        if h["study"] not in PAPER_STUDIES or h["paper"] is None:
            continue
        ratio = f"{h['ratio']:.2f}" if isinstance(h["ratio"], float) else "-"
        out.append((h["study"], h["metric"], _md(h["ours"]), _md(h["paper"]), h["unit"] or "-", ratio,
                     "**no**" if h["differs_over_15pct"] else "yes"))
    return markdown_table(["study", "metric", "ours", "paper", "unit", "ratio", "agrees (within 15%)"], out)


def _md(x) -> str:
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 10 else f"{x:,.1f}"
    return str(x) if x != "" else "-"


def main(argv=None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--only", nargs="+", choices=list(STUDIES), help="run only these studies")
    args = ap.parse_args(argv)
    names = args.only or list(STUDIES)
    heads, wall_s = run_studies(names, args.quick, args.out)
    command = (
        "python experiments/run_all.py"
        + (" --quick" if args.quick else "")
        + (f" --only {' '.join(names)}" if args.only else "")
    )
    write_csv([{**h, "ratio": h["ratio"]} for h in heads], args.out / "summary.csv")
    (args.out / "summary.md").write_text(summary_markdown(heads, wall_s, command))
    if args.out.resolve() == RESULTS_DIR.resolve():  # the docs show what the results files hold
        write_generated_block(DOC, DOC_TABLE, papers_table(heads))
    print_headlines(heads, f"SUMMARY: every headline number, ours vs the paper ({command})")
    print(
        f"\nwall time: {sum(wall_s.values()):.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in wall_s.items())
        + ")"
    )
    print(f"wrote {args.out / 'summary.csv'} and {args.out / 'summary.md'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
