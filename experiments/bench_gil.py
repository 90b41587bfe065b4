"""The interpreter lock as a budget: how long each executor worker holds the GIL per op, and the hot-path
functions beside the launcher, on the plain CPU backend (no GPU needed).

    python experiments/bench_gil.py [--quick] [--rounds N] [--model small|medium|tiny] [--out DIR]

**Method.** A probe thread (executor/gil_probe.py) loops on a C call that releases the GIL; a turn that
takes long is a gap, and the kernel's scheduler statistics of the probe thread split each gap into the time
it was blocked (waiting for the GIL another thread held) and the time the OS kept it off a CPU (the
machine's load, left out). The engine runs a plan that has every host-side op kind (vertical schedule: the
weights, gradients and checkpoints in host memory, the optimizer states on the SSD tier, recompute) with
its ops serialized: `Ops.run` is wrapped by one lock, so at any moment at most one op runs (its worker
thread, plus the SSD store's I/O threads and torch's intra-op threads working for it) and the GIL time the
probe sees between an op's start and end is that op's. Each op's wall time and its worker thread's CPU
time (time.thread_time) are kept beside it. Serializing takes away the contention between workers (a real
run overlaps them), not what each op does. The launcher is the gpu worker (its compute ops launch kernels
on CUDA); every other worker's GIL time per op should stay below the launcher's.

**Hot-path functions** are measured alone, called in a loop beside the probe (`gil_share`): the bf16 cast
of the host optimizer's output, a chunk's CRC, an SSD store write + read, the host AdamW (as installed:
numba's one-pass kernel where it is built; and torch's kernels).

Writes bench_gil.csv (worker, op kind: ops, median wall and CPU microseconds per op, mean GIL
microseconds per op) and
bench_gil_functions.csv under --out; with the default --out also the tables in docs/performance.md.
torch computes on one thread (torch.set_num_threads(1)), as per-op costs are measured in this project.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    markdown_table,
    print_table,
    script_main,
    write_csv,
    write_generated_block,
)

LAUNCHER = "gpu"  # the worker that launches compute (kernels on CUDA)
MIB = 1 << 20
DOC = REPO_DIR / "docs" / "performance.md"
DOC_TABLE = "GIL per op (experiments/bench_gil.py from experiments/results/bench_gil.csv)"
FUNCTIONS_TABLE = ("GIL of the hot-path functions (experiments/bench_gil.py from "
                   "experiments/results/bench_gil_functions.csv)")


def gil_plan(model_name: str, path: Path):
    """The vertical plan of bench_executor's model with every host-side op kind: weights, gradients and
    checkpoints in host memory, the optimizer states on the SSD tier, recompute on."""
    import bench_executor as be

    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.placement import Placement
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

    model = be.plan_model(be.MODELS[model_name], "cpu")
    place = Placement(weights=be.ON_CPU, master=be.ON_SSD, adam_m=be.ON_SSD, adam_v=be.ON_SSD,
                      grads=be.ON_CPU, checkpoints=be.ON_CPU)
    hw = load_profile("rtx3090-desktop").with_overrides({"gpu.memory_gib": 64, "cpu.memory_gib": 64})
    cfg = make_schedule("vertical", model, hw, batch=be.BATCH, micro_batch=be.MICRO_BATCH, seq=be.SEQ,
                        placement=place, iterations=be.STEPS_PER_ROUND, runtime="ideal", recompute=True)
    write_plan(plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg)), path)
    return load_plan(path)


class SerialOps:
    """Ops.run wrapped by one lock (one op at a time), each op's (worker, kind, start, end, thread CPU)
    recorded."""

    def __init__(self) -> None:
        from tierflow.executor.ops.table import Ops

        self.cls, self.orig = Ops, Ops.run
        self.lock = threading.Lock()
        self.records: list[tuple[str, str, float, float, float]] = []

    def __enter__(self) -> SerialOps:
        orig, lock, records = self.orig, self.lock, self.records

        def run(ops, rs, t) -> None:
            with lock:
                c0, t0 = time.thread_time(), time.perf_counter()
                try:
                    orig(ops, rs, t)
                finally:
                    records.append((t.resource, t.kind, t0, time.perf_counter(), time.thread_time() - c0))

        self.cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        self.cls.run = self.orig


def engine_rows(model_name: str, rounds: int) -> list[dict]:
    """Per (worker, op kind): ops counted after the warm-up round, median wall and thread CPU microseconds
    per op, mean GIL microseconds per op (the probe's hits are sparse in short ops: a median would read 0),
    the GIL time's share of the ops' wall time, and the comparison with the launcher's mean over its ops."""
    from tierflow.executor.gil_probe import GilProbe
    from tierflow.executor.run import OutputOptions, RunConfig, run_plan

    QUIET = OutputOptions(quiet=True)

    per: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-gil-", dir=REPO_DIR) as tmp:
        plan = gil_plan(model_name, Path(tmp) / "plan.json")
        ssd = Path(tmp) / "ssd"
        ssd.mkdir()
        with GilProbe() as probe, SerialOps() as serial:
            for r in range(rounds):
                serial.records.clear()
                run_plan(plan, RunConfig(steps=3, device="cpu", ssd_dir=str(ssd), output=QUIET))
                if r == 0:
                    continue  # warm-up: numba's compile, first allocations, the SSD files' first write
                for res, kind, t0, t1, cpu in serial.records:
                    per.setdefault((res, kind), []).append((t1 - t0, cpu, probe.held_s(t0, t1)))
    rows = []
    for (res, kind), ops in sorted(per.items()):
        wall, cpu = (statistics.median(x[i] for x in ops) for i in range(2))
        held = sum(x[2] for x in ops) / len(ops)
        rows.append({"worker": res, "kind": kind, "ops": len(ops), "wall_us": round(wall * 1e6),
                     "cpu_us": round(cpu * 1e6), "gil_us": round(held * 1e6, 1),
                     "gil_share": round(sum(x[2] for x in ops) / sum(x[0] for x in ops), 4)})
    launcher = [x[2] for (res, _k), ops in per.items() if res == LAUNCHER for x in ops]
    ref = sum(launcher) / len(launcher) * 1e6 if launcher else float("nan")
    for r in rows:
        r["launcher_gil_us"] = round(ref, 1)
        r["below_launcher"] = "" if r["worker"] == LAUNCHER else ("yes" if r["gil_us"] < ref else "no")
    return rows


def function_cases(tmp: Path):
    """(name, size, function) of each hot-path function, and a closer to call at the end."""
    import torch

    from tierflow.executor.optim.adamw import Hyper
    from tierflow.executor.optim.host_adamw import _cast_into, host_adamw
    from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty, chunk_checksum

    n = MIB
    master, dest = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    crc_name, crc = chunk_checksum(lambda m: print(m, file=sys.stderr))
    chunk = aligned_empty(8 * MIB)
    view = memoryview(chunk.numpy())
    store = SsdStore(tmp, warn=lambda m: print(m, file=sys.stderr))
    data, out = aligned_empty(16 * MIB), aligned_empty(16 * MIB)
    data.random_(0, 255)
    states = {k: [(0, n, torch.rand(n) if k == "adam_v" else torch.randn(n))]
              for k in ("master", "adam_m", "adam_v")}
    grads = torch.randn(n)
    steps = iter(range(1, 1 << 30))

    def adamw() -> None:
        host_adamw(Hyper(), next(steps), [(0, n, True)], states, grads, [(0, n, dest)], squares=True)

    def round_trip() -> None:
        store.write("t", data)
        store.read("t", torch.uint8, data.numel(), into=lambda k: out)

    cases = [("cast fp32 -> bf16 (_cast_into)", "1M elements", lambda: _cast_into([(0, n, master)],
                                                                                  [(0, n, dest)], 0, n)),
             (f"chunk CRC ({crc_name})", "8 MiB", lambda: crc(view, chunk.data_ptr())),
             ("SSD store write + read (O_DIRECT, CRCs)", "16 MiB", round_trip),
             ("host AdamW, as installed", "1M elements", adamw),
             ("host AdamW, torch kernels (TIERFLOW_PURE_ADAMW=1)", "1M elements", adamw)]
    return cases, store.close


def function_rows(duration_s: float, repeats: int) -> list[dict]:
    """Each hot-path function beside the probe, `repeats` times alternating: median GIL, CPU and wall
    microseconds per call and GIL per CPU second (the spread of GIL per call)."""
    from tierflow.executor.gil_probe import gil_share

    got: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-gil-", dir=REPO_DIR) as tmp:
        cases, close = function_cases(Path(tmp))
        try:
            for name, _size, fn in cases:  # warm-up (numba's compile, the store's file)
                with _pure(name):
                    fn()
            for _ in range(repeats):
                for name, _size, fn in cases:
                    with _pure(name):
                        got.setdefault(name, []).append(gil_share(fn, duration_s))
        finally:
            close()
    rows = []
    for name, size, _fn in cases:
        xs = got[name]
        held = [s.held_s_per_call * 1e6 for s in xs]
        rows.append({"function": name, "size": size, "calls": sum(s.calls for s in xs),
                     "gil_us": round(statistics.median(held), 1), "gil_us_min": round(min(held), 1),
                     "gil_us_max": round(max(held), 1),
                     "cpu_us": round(statistics.median(s.cpu_s_per_call * 1e6 for s in xs)),
                     "wall_us": round(statistics.median(s.wall_s_per_call * 1e6 for s in xs)),
                     "gil_per_cpu": round(statistics.median(s.held_per_cpu for s in xs), 4)})
    return rows


class _pure:
    """TIERFLOW_PURE_ADAMW=1 for the case that names it."""

    def __init__(self, name: str) -> None:
        self.on = "PURE_ADAMW" in name

    def __enter__(self) -> None:
        if self.on:
            os.environ["TIERFLOW_PURE_ADAMW"] = "1"

    def __exit__(self, *exc) -> None:
        if self.on:
            os.environ.pop("TIERFLOW_PURE_ADAMW", None)


def _stamp() -> dict:
    import torch

    return {"threads": torch.get_num_threads(), "load_1m": round(os.getloadavg()[0], 2),
            "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def _caption(rows: list[dict]) -> str:
    loads = [float(r["load_1m"]) for r in rows]
    return (f"{rows[0]['utc']} UTC, {rows[0]['threads']} torch thread, load (1 min) {min(loads):.1f}-"
            f"{max(loads):.1f} on the 2-core dev box (shared with other sessions).")


def gil_table(rows: list[dict]) -> str:
    """docs/performance.md's table of bench_gil.csv, with the run's time, threads and load."""
    out = [[r["worker"] + (" (launcher)" if r["worker"] == LAUNCHER else ""), r["kind"], r["ops"],
            r["wall_us"], r["cpu_us"], r["gil_us"], f"{float(r['gil_share']):.1%}",
            "**no**" if r["below_launcher"] == "no" else (r["below_launcher"] or "")] for r in rows]
    m = rows[0]["model"]
    return (f"Model {m}; the launcher's GIL per op over all its ops: {rows[0]['launcher_gil_us']} us. "
            f"{_caption(rows)}\n\n" +
            markdown_table(["worker", "op kind", "ops", "wall us/op", "thread CPU us/op", "GIL us/op",
                            "GIL / wall", "GIL below the launcher's"], out))


def functions_table(rows: list[dict]) -> str:
    """docs/performance.md's table of bench_gil_functions.csv, with the run's time, threads and load."""
    out = [[r["function"], r["size"], r["calls"], f"{r['gil_us']} ({r['gil_us_min']}-{r['gil_us_max']})",
            r["cpu_us"], r["wall_us"], f"{float(r['gil_per_cpu']):.3f}"] for r in rows]
    return (f"{_caption(rows)}\n\n" +
            markdown_table(["function", "size", "calls", "GIL us/call, median (min-max)", "CPU us/call",
                            "wall us/call", "GIL / CPU"], out))


def write_docs(rows: list[dict], funcs: list[dict]) -> None:
    write_generated_block(DOC, DOC_TABLE, gil_table(rows))
    write_generated_block(DOC, FUNCTIONS_TABLE, functions_table(funcs))


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None,
                    help="runs of the plan (3 steps each), the first a warm-up (default 4; --quick 2)")
    ap.add_argument("--model", default="small", choices=["tiny", "small", "medium"],
                    help="bench_executor's model (default small = 4 x 256)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rounds = args.rounds or (2 if args.quick else 4)
    if rounds < 2:
        ap.error("--rounds must be at least 2 (the first is a warm-up)")
    t0 = time.perf_counter()
    stamp = _stamp()
    rows = [{**r, "model": args.model, **stamp} for r in engine_rows(args.model, rounds)]
    funcs = [{**r, **_stamp()} for r in function_rows(0.1 if args.quick else 0.3, 1 if args.quick else 3)]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench_gil.csv")
    write_csv(funcs, args.out / "bench_gil_functions.csv")
    if args.out.resolve() == RESULTS_DIR.resolve():
        write_docs(rows, funcs)
    print_table(rows, ["worker", "kind", "ops", "wall_us", "cpu_us", "gil_us", "gil_share", "below_launcher"])
    print_table(funcs, ["function", "size", "gil_us", "gil_us_min", "gil_us_max", "cpu_us", "wall_us",
                        "gil_per_cpu"])
    print(f"wrote {args.out / 'bench_gil.csv'} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
