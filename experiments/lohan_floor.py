"""LoHan's floor and several ranks on one host: the host-side mechanisms that can be measured on this machine.

    python experiments/lohan_floor.py [--quick] [--out DIR]

LoHan runs CPU Adam in a child process and hands it the gradients of each sub-group; several GPUs of one box
share its SSD array and its memory bandwidth. Three measurements, each repeated (median and spread):
(a) hand-off: tensors put on a `torch.multiprocessing` queue to a child that sums them and answers. A tensor
    not yet in shared memory is first copied there (torch's `share_memory_()` on put): GB/s of that path; a
    tensor already shared crosses as a handle: the fixed cost per hand-off.
(b) CPU AdamW (torch, foreach) on shared fp32 tensors: params/s in this process and in a child process, alone
    and beside a memcpy loop in the parent (the training thread's copies competing for host memory bandwidth).
(c) the SSD directory: one writer+reader process against two at once on the same directory (files written
    with fsync, read back): GB/s each and together (ranks sharing one array).
Writes lohan_floor.csv under --out. Nothing here is fitted; the figures are for the models of LoHan's child
process and of ranks sharing a host (docs/multi-gpu.md).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from expcommon import arg_parser, print_table, script_main, write_csv

MIB = 2**20


def _child_sum(q_in, q_out) -> None:
    while True:
        t = q_in.get()
        if t is None:
            return
        q_out.put(float(t[:1].sum()) + t.numel())


def handoff(sizes_mib: list[int], repeats: int) -> list[dict]:
    """Seconds per hand-off of a fresh tensor (copied into shared memory) and of a shared one (a handle)."""
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_sum, args=(q_in, q_out))
    child.start()
    rows = []
    try:
        for size in sizes_mib:
            n = size * MIB // 4
            shared = torch.ones(n).share_memory_()
            for label, make in (("fresh", lambda n=n: torch.ones(n)), ("shared", lambda s=shared: s)):
                times = []
                for _ in range(repeats + 1):
                    t = make()
                    t0 = time.perf_counter()
                    q_in.put(t)
                    q_out.get()
                    times.append(time.perf_counter() - t0)
                times = times[1:]  # the first pays the child's start-up
                rows.append(_row(f"handoff {label}", size, [x * 1e3 for x in times], "ms per hand-off"))
                rows.append(_row(f"handoff {label}", size, [size * MIB / x / 1e9 for x in times], "GB/s"))
    finally:
        q_in.put(None)
        child.join(timeout=30)
    return rows


def _adam_rate(params: list[torch.Tensor], steps: int) -> float:
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # allocates m and v
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return sum(p.numel() for p in params) * steps / (time.perf_counter() - t0)


def _child_adam(n: int, steps: int, q_out) -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    q_out.put(_adam_rate([torch.zeros(n)], steps))


def _memcpy_loop(stop_s: float, nbytes: int) -> None:
    a, b = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    end = time.perf_counter() + stop_s
    while time.perf_counter() < end:
        b.copy_(a)


def adam_rates(n: int, steps: int, repeats: int) -> list[dict]:
    """CPU AdamW params/s here and in a child process, alone and beside a memcpy loop in the parent."""
    ctx = mp.get_context("spawn")
    out = {"in process": [], "child": [], "child beside memcpy": []}
    for _ in range(repeats):
        out["in process"].append(_adam_rate([torch.zeros(n)], steps))
        for label, busy in (("child", False), ("child beside memcpy", True)):
            q = ctx.Queue()
            child = ctx.Process(target=_child_adam, args=(n, steps, q))
            child.start()
            if busy:
                _memcpy_loop(2.0, 64 * MIB)
            out[label].append(q.get(timeout=120))
            child.join(timeout=30)
    return [_row(f"cpu adam {k}", n * 4 // MIB, [x / 1e9 for x in v], "Gparams/s") for k, v in out.items()]


def _ssd_worker(path: str, nbytes: int, q_out) -> None:
    buf = os.urandom(MIB) * (nbytes // MIB)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    w = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the device, not the page cache
    t0 = time.perf_counter()
    while os.read(fd, 8 * MIB):
        pass
    r = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    q_out.put((nbytes / w / 1e9, nbytes / r / 1e9))


def ssd_sharing(nbytes: int, repeats: int, folder: Path) -> list[dict]:
    """Write and read GB/s of one process, and of each of two at once, on one directory."""
    ctx = mp.get_context("spawn")
    rows = []
    for ranks in (1, 2):
        writes, reads = [], []
        for rep in range(repeats):
            q = ctx.Queue()
            procs = [ctx.Process(target=_ssd_worker, args=(str(folder / f"r{rep}-{i}"), nbytes, q))
                     for i in range(ranks)]
            for p in procs:
                p.start()
            res = [q.get(timeout=300) for _ in procs]
            for p in procs:
                p.join(timeout=30)
            writes.append(sum(w for w, _ in res))
            reads.append(sum(r for _, r in res))
        for label, v in (("write", writes), ("read", reads)):
            rows.append(_row(f"ssd {label}, {ranks} process{'es' if ranks > 1 else ''} together",
                             nbytes // MIB, v, "GB/s (sum)"))
    return rows


def _row(measure: str, size_mib: int, values: list[float], unit: str) -> dict:
    """One table row: the median and spread of `values` in `unit`."""
    return {"measure": measure, "size_mib": size_mib, "median": f"{statistics.median(values):.4g}",
            "min": f"{min(values):.4g}", "max": f"{max(values):.4g}", "unit": unit, "runs": len(values)}


def run(quick: bool, out_dir: Path) -> list[dict]:
    repeats = 3 if quick else 5
    rows = handoff([1, 16] if quick else [1, 16, 64], repeats)
    rows += adam_rates(2**20 if quick else 2**23, 3 if quick else 5, 2 if quick else 3)
    with tempfile.TemporaryDirectory(prefix="tierflow-lohan-floor-", dir=out_dir) as d:
        rows += ssd_sharing((32 if quick else 256) * MIB, 2 if quick else 3, Path(d))
    write_csv(rows, out_dir / "lohan_floor.csv")
    print_table(rows, ["measure", "size_mib", "median", "min", "max", "unit", "runs"])
    return rows


def main(argv: list[str] | None = None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.quick, args.out)
    print(f"wrote {args.out / 'lohan_floor.csv'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
