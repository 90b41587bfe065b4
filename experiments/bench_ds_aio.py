"""DeepSpeed's NVMe I/O (its `aio_handle`, the one its swappers use) on this machine, against the `aio` keys:
read and write rates over block_size x queue_depth x intra_op_parallelism, and how well an in-flight bound
predicts the points it was not fitted on.

The model (planner/io/deepspeed/keys.py, `aio.*`: what would settle them): one request of `block_size` bytes
takes a fixed time L plus its bytes at the streaming rate R; the handle keeps `intra_op_parallelism x
queue_depth` requests in flight, so by Little's law it moves at most  p x q x b / (L + b / R)  bytes a second,
and never more than R:  T(b, q, p) = min(R, p q b / (L + b / R)).  L and R are fitted (least squares on log T)
on the points with queue_depth in FIT_DEPTHS and checked on the others.

Needs DeepSpeed with its async_io op (the `[baseline]` extra and libaio). Every timing run goes under the
shared lock: `flock <lock> python experiments/bench_ds_aio.py --dir DIR`. Prints one line per point and the
fit; `--csv FILE` also writes the points.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

from expcommon import script_main

BLOCKS = (128 * 1024, 512 * 1024, 1024 * 1024, 4 * 1024 * 1024)
DEPTHS = (1, 2, 8, 32)
FIT_DEPTHS = (1, 32)  # fitted; the others are held out
THREADS = (1, 2)


def handle(block: int, depth: int, threads: int):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load(verbose=False)
    return aio.aio_handle(block, depth, False, True, threads)  # single_submit False, overlap_events True


def time_point(path: str, nbytes: int, block: int, depth: int, threads: int, repeat: int) -> dict:
    """Median seconds of a write, then a read, of `nbytes` through one handle (O_DIRECT: no page cache)."""
    import torch

    h = handle(block, depth, threads)
    buf = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    out = {}
    for op in ("write", "read"):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            (h.sync_pwrite if op == "write" else h.sync_pread)(buf, path)
            times.append(time.perf_counter() - t0)
        out[op] = statistics.median(times)
        out[op + "_spread"] = (max(times) - min(times)) / out[op]
    h.free_cpu_locked_tensor(buf)
    return out


def model_gbps(block: int, depth: int, threads: int, latency_s: float, rate_gbps: float) -> float:
    per_request_s = latency_s + block / (rate_gbps * 1e9)
    return min(rate_gbps, threads * depth * block / per_request_s / 1e9)


def fit(points: list[dict], op: str) -> tuple[float, float]:
    """L (s) and R (GB/s) minimising the squared log error over the fitted points (a grid, then refined)."""
    train = [p for p in points if p["queue_depth"] in FIT_DEPTHS]
    peak = max(p[op + "_gbps"] for p in train)

    def err(lat: float, rate: float) -> float:
        return sum((math.log(model_gbps(p["block_size"], p["queue_depth"], p["threads"], lat, rate))
                    - math.log(p[op + "_gbps"])) ** 2 for p in train)

    best = min(((lat, rate) for lat in (10 ** (-6 + i / 20) for i in range(81))
                for rate in (peak * (0.5 + j / 40) for j in range(61))), key=lambda x: err(*x))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a folder on the drive DeepSpeed's nvme_path would use")
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per op, MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--csv", help="write the points here")
    args = ap.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("bench_ds_aio: skipped: DeepSpeed is not installed (pip install -e '.[baseline]')")
        return 0
    path = str(Path(args.dir) / "bench_ds_aio.bin")
    nbytes = args.mib * 1024 * 1024
    points = []
    print(f"load before: {os.getloadavg()}")
    try:
        for threads in THREADS:
            for block in BLOCKS:
                for depth in DEPTHS:
                    t = time_point(path, nbytes, block, depth, threads, args.repeat)
                    p = {"block_size": block, "queue_depth": depth, "threads": threads,
                         "read_gbps": nbytes / t["read"] / 1e9, "write_gbps": nbytes / t["write"] / 1e9,
                         "read_spread": t["read_spread"], "write_spread": t["write_spread"]}
                    points.append(p)
                    print(f"block {block // 1024:>5} KiB depth {depth:>3} threads {threads}: read "
                          f"{p['read_gbps']:.2f} GB/s (spread {p['read_spread']:.0%}), write "
                          f"{p['write_gbps']:.2f} GB/s (spread {p['write_spread']:.0%})", flush=True)
    finally:
        Path(path).unlink(missing_ok=True)
    print(f"load after: {os.getloadavg()}")
    report_fit(points)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(points[0]))
            w.writeheader()
            w.writerows(points)
    return 0


def report_fit(points: list[dict]) -> None:
    for op in ("read", "write"):
        lat, rate = fit(points, op)
        held = [p for p in points if p["queue_depth"] not in FIT_DEPTHS]
        errs = [model_gbps(p["block_size"], p["queue_depth"], p["threads"], lat, rate) / p[op + "_gbps"] - 1
                for p in held]
        print(f"{op}: fitted on queue_depth {FIT_DEPTHS}: L = {lat * 1e6:.0f} us, R = {rate:.2f} GB/s; "
              f"held out (queue_depth {sorted({p['queue_depth'] for p in held})}): median |error| "
              f"{statistics.median(abs(e) for e in errs):.0%}, max {max(abs(e) for e in errs):.0%}")


if __name__ == "__main__":
    sys.exit(script_main(main))
