"""Benchmark: time one simulated iteration of GPT-3 175B, 96 layers x 64 micro-batches
(batch 64, micro-batch 1).

Target: under 2 s per simulated iteration on a 2-core machine. Prints a table and writes
experiments/results/bench_simulator.csv. Run: python experiments/bench_simulator.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

from tierflow.api import resolve
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import simulate_graph

TARGET_S = 2.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_simulator.csv"))
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
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
