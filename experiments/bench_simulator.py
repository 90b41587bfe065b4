"""Benchmark: time one simulated iteration of GPT-3 175B, 96 layers x 64 micro-batches
(batch 64, micro-batch 1).

Target: under 2 s per simulated iteration on a 2-core machine. Prints a table and writes
experiments/results/bench_simulator.csv. Run: python experiments/bench_simulator.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path

from expcommon import REPO_DIR, markdown_table, script_main, write_generated_block

from tierflow.api import resolve
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import simulate_graph

TARGET_S = 2.0
RESULTS = Path(__file__).parent / "results" / "bench_simulator.csv"
DOC = REPO_DIR / "docs" / "planning.md"
DOC_TABLE = ("simulator benchmark (experiments/bench_simulator.py from "
             "experiments/results/bench_simulator.csv)")


def bench_table(rows: list[dict]) -> str:
    """docs/planning.md's benchmark table, from the rows as written to or read from bench_simulator.csv: per
    schedule, one iteration's tasks and time, and the default 3 iterations' total and per-iteration time."""
    out = []
    for family in dict.fromkeys(r["schedule"] for r in rows):
        one = next(r for r in rows if r["schedule"] == family and int(r["iterations"]) == 1)
        three = next(r for r in rows if r["schedule"] == family and int(r["iterations"]) == 3)
        total_s = float(three["build_s"]) + float(three["simulate_s"])
        out.append((family, f"{int(one['tasks']):,}", f"{float(one['per_iteration_s']):.2f} s",
                    f"{total_s:.2f} s, {float(three['per_iteration_s']):.2f} s"))
    return markdown_table(["schedule", "tasks per iteration", "build + simulate, 1 iteration",
                           "3 iterations (the default): total, per iteration"], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    model, hw = resolve("gpt3-175b", "rtx4090-lohan")
    rows = []
    for family in ("horizontal", "fuyou", "vertical"):
        for iters in (1, 3):
            best_build = best_sim = float("inf")
            for _ in range(args.repeat):
                cfg = make_schedule(family, model, hw, batch=64, micro_batch=1, iterations=iters)
                t0 = time.perf_counter()
                g = build_graph(model, hw, cfg)
                t1 = time.perf_counter()
                simulate_graph(g, hw)
                t2 = time.perf_counter()
                best_build, best_sim = min(best_build, t1 - t0), min(best_sim, t2 - t1)
            per_it = (best_build + best_sim) / iters
            rows.append({"schedule": family, "iterations": iters, "tasks": len(g.tasks),
                         "build_s": round(best_build, 3), "simulate_s": round(best_sim, 3),
                         "per_iteration_s": round(per_it, 3), "target_s": TARGET_S, "ok": per_it < TARGET_S})
            print(f"{family:<11} iterations={iters} tasks={len(g.tasks):>7,} build {best_build:.2f}s "
                  f"simulate {best_sim:.2f}s -> {per_it:.2f}s per iteration "
                  f"({'OK' if per_it < TARGET_S else 'OVER'} target {TARGET_S}s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["machine"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "machine": f"{platform.processor() or platform.machine()} "
                                        f"({__import__('os').cpu_count()} cores)"})
    if Path(args.out).resolve() == RESULTS.resolve():  # the docs show what the results file holds
        with open(args.out, newline="") as f:
            write_generated_block(DOC, DOC_TABLE, bench_table(list(csv.DictReader(f))))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(script_main(main))
