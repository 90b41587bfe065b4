"""The SSD tier's store against the raw device: the executor's SsdStore and a native reference, in the same
run, on the same directory, alternating.

    python experiments/bench_store.py [--quick] [--dir DIR] [--reps N] [--device DEVICE] [--out DIR]

For each tensor size (16 MiB to 1 GiB; --quick: 16 and 64 MiB with small totals) and each mode (read, write,
and both at once: one thread reads a set of tensors while another writes a second set), it moves the same
bytes through:

- **store**: `SsdStore` as the executor uses it: `write(name, tensor)` from a page-aligned tensor (as the
  transfer area's), `read(..., into=...)` into one, CRC32C per chunk included; with --device cuda (or the
  emulation, cpu-adversarial) those tensors come from the device backend's `pinned_area`, the transfer area's
  own allocation (page-locked with cudaHostRegister on a GPU);
- **reference**: `fio` (libaio, queue depth 16, 1 MiB blocks, O_DIRECT) when installed; else a raw O_DIRECT
  loop of 1 MiB blocks with 16 requests in flight from 16 threads (os.preadv / os.pwritev release the GIL), no
  checksums;
- **store-nocrc** (a diagnostic, not a mode of the executor): the same store with its checksum replaced by a
  no-op, to show what the CRC costs;
- **store-crc32c** (a diagnostic): the same store with google-crc32c's CRC32C instead of zlib-ng's CRC32;
- **deepspeed**: DeepSpeed's `aio_handle` (libaio, 1 MiB blocks, queue depth 16) when importable (the
  `baseline` extra and the system's libaio); otherwise one line says it is skipped.

Each measurement reports GB/s (bytes moved over wall time) and CPU seconds per GB moved (user + sys of this
process from resource.getrusage, all threads; fio's own from RUSAGE_CHILDREN). The systems alternate within
each repetition, so a noisy shared machine slows them alike; the CSV has the median and the spread (min, max)
over the repetitions. Targets (tensors >= 64 MiB): the store's read and write >= 0.9x the reference, mixed >=
0.8x, <= 0.1 CPU seconds per GB moved; the `met` column says which hold. Writes bench_store.csv and
bench_store.png under --out and prints the table.

Then where a chunk's time goes (bench_store_chunks.csv): 256 MiB tensors written and read through the store
with each checksum it can use (and none), timing in the I/O worker, per chunk, the checksum and the rest of
the chunk's work (its pwritev/preadv requests) in wall seconds and in the thread's own CPU seconds
(time.thread_time), summed per GB moved.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from expcommon import Progress, arg_parser, new_figure, print_table, save_figure, write_csv

MIB = 1 << 20
SIZES_MIB = (16, 64, 256, 1024)
QUICK_SIZES_MIB = (16, 64)
TOTAL_BYTES = 1 << 30  # bytes moved per measurement (at least one tensor)
QUICK_TOTAL_BYTES = 64 * MIB
MODES = ("read", "write", "mixed")
REF_BLOCK = MIB  # the reference's request size and queue depth, as fio --bs=1M --iodepth=16
REF_DEPTH = 16
TARGET_MIN_MIB = 64  # targets apply to tensors of this size and larger
TARGET_RATIO = {"read": 0.9, "write": 0.9, "mixed": 0.8}
TARGET_CPU_S_PER_GB = 0.1
PROFILE_MIB, PROFILE_COUNT = 256, 2  # the chunk profile: 2 tensors of 256 MiB per pass
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Sample:
    """One measurement: bytes moved, wall seconds, CPU seconds."""

    nbytes: int
    wall_s: float
    cpu_s: float


def _cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], int], who: int = resource.RUSAGE_SELF) -> Sample:
    c0, t0 = _cpu_s(who), time.perf_counter()
    n = fn()
    return Sample(n, time.perf_counter() - t0, _cpu_s(who) - c0)


def both(read: Callable[[], int], write: Callable[[], int]) -> int:
    """Run `read` on another thread while `write` runs here; bytes moved by both."""
    got: dict[str, int] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            got["read"] = read()
        except BaseException as e:  # re-raised here
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    wrote = write()
    th.join()
    if errors:
        raise errors[0]
    return got["read"] + wrote


# -- the store -----------------------------------------------------------------------------------------------


class TwoSets:
    """A case over two sets of files (a: read, b: written while a is read): mixed and prepare in terms of
    its own read and write(prefix)."""

    def mixed(self) -> int:
        return both(self.read, lambda: self.write("b"))

    def prepare(self) -> None:
        """Both sets written once (files created and allocated)."""
        self.write()
        self.write("b")


BACKEND: list = []  # --device: the device backend whose pinned_area the store's buffers come from


def host_buffer(size: int):
    """A page-aligned uint8 view of `size` bytes of the backend's pinned_area (as the transfer area takes
    its memory: one allocation, aligned by skipping into it)."""
    from tierflow.executor.tiers.direct_io import ALIGN

    raw = BACKEND[0].pinned_area(size + ALIGN)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + size]


class StoreCase(TwoSets):
    """SsdStore on `count` tensors of `size` bytes per set (a: read, b: written while a is read)."""

    name = "store"

    def __init__(self, directory: Path, size: int, count: int) -> None:
        import torch

        from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty

        self.torch, self.size, self.count = torch, size, count
        (directory / self.name).mkdir()
        self.store = SsdStore(directory / self.name, warn=lambda m: print(m, file=sys.stderr))
        self.src = host_buffer(size) if BACKEND else aligned_empty(size)
        self.src.random_(0, 256)
        self.dst = host_buffer(size) if BACKEND else aligned_empty(size)
        self.numel = size // 4

    def write(self, prefix: str = "a") -> int:
        data = self.src.view(self.torch.float32)
        for i in range(self.count):
            self.store.write(f"{prefix}{i}", data)
        return self.size * self.count

    def read(self) -> int:
        for i in range(self.count):
            self.store.read(f"a{i}", self.torch.float32, self.numel, into=lambda n: self.dst)
        return self.size * self.count


    def close(self) -> None:
        self.store.close()


class NoCrcStoreCase(StoreCase):
    """Diagnostic only: the same store with its chunk checksum replaced by a no-op, which separates the CRC's
    cost from the rest of the store's path. The executor never runs without the checksums."""

    name = "store-nocrc"

    def __init__(self, directory: Path, size: int, count: int) -> None:
        super().__init__(directory, size, count)
        self.store.io.crc = lambda view, address: 0


class Crc32cStoreCase(StoreCase):
    """Diagnostic only: the same store with google-crc32c's CRC32C as its chunk checksum (the store's
    choice where zlib-ng is missing, and its only checksum before), to compare the checksums' cost in the same
    run."""

    name = "store-crc32c"

    def __init__(self, directory: Path, size: int, count: int) -> None:
        from tierflow.executor.tiers.ssd_store import _CRC32C

        super().__init__(directory, size, count)
        self.store.io.crc = _CRC32C


# -- where a chunk's time and CPU go -------------------------------------------------------------------------


def chunk_profile(directory: Path, size: int, count: int, rounds: int) -> list[dict]:
    """Per chunk, in the I/O worker that moves it: wall and thread CPU seconds of the checksum and of the
    rest (the pwritev/preadv requests), for each checksum the store can use; summed per GB moved."""
    from tierflow.executor.tiers import ssd_store as ss

    checksums = {"zlib-ng crc32": ss._ZLIB_NG, "google-crc32c": ss._CRC32C, "none": lambda view, address: 0}
    acc: dict[tuple[str, str], list[float]] = {}
    directory = directory / "chunks"
    directory.mkdir()
    case = StoreCase(directory, size, count)
    io = case.store.io
    moves = {"write": (io._write_chunk, case.write), "read": (io._read_chunk, case.read)}
    try:
        case.prepare()
        for _ in range(rounds):
            for label, crc in checksums.items():
                if crc is None:
                    continue
                for mode, (inner, op) in moves.items():
                    sums = acc.setdefault((label, mode), [0.0] * 5)
                    io.crc = _timed_crc(crc, sums)
                    setattr(io, f"_{mode}_chunk", _timed_chunk(inner, sums))
                    sums[4] += op()
                    setattr(io, f"_{mode}_chunk", inner)
    finally:
        case.close()
        shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for (label, mode), (crc_wall, crc_cpu, all_wall, all_cpu, nbytes) in acc.items():
        gb = nbytes / 1e9
        rows.append({"checksum": label, "mode": mode, "size_mib": size // MIB,
                     "crc_cpu_s_per_gb": round(crc_cpu / gb, 4),
                     "io_cpu_s_per_gb": round((all_cpu - crc_cpu) / gb, 4),
                     "crc_wall_s_per_gb": round(crc_wall / gb, 4),
                     "io_wall_s_per_gb": round((all_wall - crc_wall) / gb, 4)})
    return rows


def _timed_crc(crc, sums: list[float]):
    def timed_crc(view, address):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = crc(view, address)
        sums[0] += time.perf_counter() - w0
        sums[1] += time.thread_time() - c0
        return out
    return timed_crc


def _timed_chunk(inner, sums: list[float]):
    def timed_chunk(*args):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = inner(*args)
        sums[2] += time.perf_counter() - w0
        sums[3] += time.thread_time() - c0
        return out
    return timed_chunk


# -- the raw O_DIRECT reference ------------------------------------------------------------------------------


class RawCase:
    """1 MiB O_DIRECT requests over the same files as the store's, REF_DEPTH of them in flight from as many
    threads (the mixed run: half reading set a, half writing set b). No checksums, no copies."""

    name = "reference"

    def __init__(self, directory: Path, size: int, count: int) -> None:
        self.size, self.count = size, count
        root = directory / "raw"
        root.mkdir()
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
        self.fds = {f"{p}{i}": os.open(root / f"{p}{i}.bin", flags, 0o600)
                    for p in "ab" for i in range(count)}
        for fd in self.fds.values():
            os.posix_fallocate(fd, 0, size)
        self.bufs = [mmap.mmap(-1, REF_BLOCK) for _ in range(REF_DEPTH)]  # page-aligned
        for b in self.bufs:
            b.write(os.urandom(REF_BLOCK))

    def _blocks(self, prefix: str) -> list[tuple[int, int]]:
        return [(self.fds[f"{prefix}{i}"], off) for i in range(self.count)
                for off in range(0, self.size, REF_BLOCK)]

    def _pass(self, jobs: list[tuple[str, bool]]) -> int:
        """Each (prefix, write) job's blocks on its share of the REF_DEPTH threads, all at once."""
        threads = []
        per = REF_DEPTH // len(jobs)
        for j, (prefix, write) in enumerate(jobs):
            blocks = self._blocks(prefix)
            for t in range(per):
                buf = self.bufs[j * per + t]
                threads.append(threading.Thread(target=self._loop, args=(blocks[t::per], buf, write)))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return self.size * self.count * len(jobs)

    @staticmethod
    def _loop(blocks: list[tuple[int, int]], buf: mmap.mmap, write: bool) -> None:
        for fd, off in blocks:
            n = os.pwritev(fd, [buf], off) if write else os.preadv(fd, [buf], off)
            if n != REF_BLOCK:
                raise OSError(f"short {'write' if write else 'read'} ({n} of {REF_BLOCK} bytes)")

    def write(self) -> int:
        return self._pass([("a", True)])

    def read(self) -> int:
        return self._pass([("a", False)])

    def mixed(self) -> int:
        return self._pass([("a", False), ("b", True)])

    def prepare(self) -> None:
        self._pass([("a", True), ("b", True)])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        for b in self.bufs:
            b.close()


class FioCase:
    """fio with libaio, queue depth 16, 1 MiB blocks, O_DIRECT, on `count` files of `size` per set; its CPU
    time is the child's (RUSAGE_CHILDREN)."""

    name = "reference"
    who = resource.RUSAGE_CHILDREN

    def __init__(self, directory: Path, size: int, count: int) -> None:
        self.root, self.size, self.count = directory / "fio", size, count
        self.root.mkdir()

    def _run(self, jobs: list[tuple[str, str]]) -> int:
        args = ["fio", "--output-format=json", "--ioengine=libaio", "--direct=1", f"--iodepth={REF_DEPTH}",
                "--bs=1M", f"--size={self.size * self.count}", f"--filesize={self.size}",
                f"--nrfiles={self.count}", "--group_reporting"]
        for prefix, rw in jobs:
            args += [f"--name={prefix}", f"--directory={self.root}", f"--filename_format={prefix}.$filenum",
                     f"--rw={rw}", f"--iodepth={REF_DEPTH // len(jobs)}"]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return int(job["read"]["io_bytes"]) + int(job["write"]["io_bytes"])

    def write(self) -> int:
        return self._run([("a", "write")])

    def read(self) -> int:
        return self._run([("a", "read")])

    def mixed(self) -> int:
        return self._run([("a", "read"), ("b", "write")])

    def prepare(self) -> None:
        self._run([("a", "write"), ("b", "write")])

    def close(self) -> None:
        pass


class DeepSpeedCase(TwoSets):
    """DeepSpeed's aio_handle (libaio) reading into and writing from a page-aligned tensor."""

    name = "deepspeed"

    def __init__(self, directory: Path, size: int, count: int) -> None:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        from tierflow.executor.tiers.ssd_store import aligned_empty

        self.handle = AsyncIOBuilder().load().aio_handle(REF_BLOCK, REF_DEPTH, False, True, 1)
        self.root, self.size, self.count = directory / "deepspeed", size, count
        self.root.mkdir()
        self.src, self.dst = aligned_empty(size), aligned_empty(size)
        self.src.random_(0, 256)
        self.torch = torch

    def _path(self, prefix: str, i: int) -> str:
        return str(self.root / f"{prefix}{i}.bin")

    def write(self, prefix: str = "a") -> int:
        for i in range(self.count):
            self.handle.sync_pwrite(self.src, self._path(prefix, i))
        return self.size * self.count

    def read(self) -> int:
        for i in range(self.count):
            self.handle.sync_pread(self.dst, self._path("a", i))
        return self.size * self.count


    def close(self) -> None:
        pass


def deepspeed_available() -> str | None:
    """None when DeepSpeed's aio_handle can be built here, else why not (one line)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:  # ImportError, or DeepSpeed failing at import without CUDA
        return f"DeepSpeed is not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "DeepSpeed's async_io op is not compatible here (install libaio-dev)"
    except Exception as e:
        return f"DeepSpeed's async_io op cannot be checked ({type(e).__name__})"
    return None


# -- the run -------------------------------------------------------------------------------------------------


def measure(case, mode: str) -> Sample:
    return timed(getattr(case, mode), getattr(case, "who", resource.RUSAGE_SELF))


def summarize(size_mib: int, mode: str, system: str, samples: list[Sample], ref_gbps: float | None) -> dict:
    gbps = [s.nbytes / s.wall_s / 1e9 for s in samples]
    cpu = [s.cpu_s / (s.nbytes / 1e9) for s in samples]
    med = statistics.median(gbps)
    row = {"size_mib": size_mib, "mode": mode, "system": system, "reps": len(samples),
           "gbps": round(med, 3), "gbps_min": round(min(gbps), 3), "gbps_max": round(max(gbps), 3),
           "cpu_s_per_gb": round(statistics.median(cpu), 4), "cpu_s_per_gb_min": round(min(cpu), 4),
           "cpu_s_per_gb_max": round(max(cpu), 4),
           "vs_reference": round(med / ref_gbps, 3) if ref_gbps else "", "target": "", "met": ""}
    if system == "store" and size_mib >= TARGET_MIN_MIB and ref_gbps:
        row["target"] = f">= {TARGET_RATIO[mode]}x ref, <= {TARGET_CPU_S_PER_GB} cpu s/GB"
        ok = med >= TARGET_RATIO[mode] * ref_gbps and row["cpu_s_per_gb"] <= TARGET_CPU_S_PER_GB
        row["met"] = "yes" if ok else "no"
    return row


def run_size(directory: Path, size: int, total: int, reps: int, factories: list,
             prog: Progress) -> list[dict]:
    """All modes of one tensor size: each system once as a warm-up (files created and allocated), then `reps`
    rounds that alternate the systems (their order reversed every round)."""
    count = max(1, total // size)
    directory = directory / f"{size // MIB}mib"
    directory.mkdir()
    cases: list = []
    samples: dict[tuple[str, str], list[Sample]] = {}
    try:
        cases += [f(directory, size, count) for f in factories]
        for case in cases:
            case.prepare()
        for rep in range(reps):
            prog.step(f"{size // MIB} MiB, round {rep + 1}/{reps}")
            order = cases if rep % 2 == 0 else cases[::-1]
            for mode in MODES:
                for case in order:
                    samples.setdefault((case.name, mode), []).append(measure(case, mode))
    finally:
        for case in cases:
            case.close()
        shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for mode in MODES:
        ref = samples.get(("reference", mode))
        ref_gbps = statistics.median(s.nbytes / s.wall_s / 1e9 for s in ref) if ref else None
        for case in cases:
            rows.append(summarize(size // MIB, mode, case.name, samples[(case.name, mode)], ref_gbps))
    return rows


def figure(rows: list[dict], path: Path) -> Path:
    fig, axes = new_figure(len(MODES) + 1, width_in=4.2)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    styles = {"store": ("#1f77b4", "o"), "reference": ("#7f7f7f", "s"), "store-nocrc": ("#9ecae1", "v"),
              "deepspeed": ("#d62728", "^")}
    for ax, mode in zip(axes, MODES):
        for system in systems:
            rs = [r for r in rows if r["mode"] == mode and r["system"] == system]
            xs = [r["size_mib"] for r in rs]
            ys = [r["gbps"] for r in rs]
            err = [[r["gbps"] - r["gbps_min"] for r in rs], [r["gbps_max"] - r["gbps"] for r in rs]]
            color, marker = styles.get(system, ("black", "x"))
            ax.errorbar(xs, ys, yerr=err, color=color, marker=marker, capsize=3, label=system)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}: GB/s (median, min-max)")
        ax.set_xlabel("tensor size (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[-1]
    for system in systems:
        for mode, ls in zip(MODES, ("-", "--", ":")):
            rs = [r for r in rows if r["mode"] == mode and r["system"] == system]
            color, marker = styles.get(system, ("black", "x"))
            ax.plot([r["size_mib"] for r in rs], [r["cpu_s_per_gb"] for r in rs], color=color, ls=ls,
                    marker=marker, label=f"{system} {mode}")
    ax.axhline(TARGET_CPU_S_PER_GB, color="black", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_title("CPU seconds per GB moved")
    ax.set_xlabel("tensor size (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool, out_dir: Path, directory: Path | None = None, reps: int | None = None,
        device: str | None = None) -> list[dict]:
    if device:
        from tierflow.executor.device.factory import make_backend

        BACKEND[:] = [make_backend(device)]
        print(f"store buffers: {device}'s pinned_area (the transfer area's allocation)", file=sys.stderr)
    sizes = QUICK_SIZES_MIB if quick else SIZES_MIB
    total = QUICK_TOTAL_BYTES if quick else TOTAL_BYTES
    reps = reps or (3 if quick else 5)
    factories: list = [StoreCase, FioCase if shutil.which("fio") else RawCase, NoCrcStoreCase]
    from tierflow.executor.tiers.ssd_store import _CRC32C, _ZLIB_NG

    if _CRC32C is not None and _ZLIB_NG is not None:
        factories.append(Crc32cStoreCase)
    print(f"reference: {'fio (libaio, iodepth 16, 1 MiB, O_DIRECT)' if shutil.which('fio') else ''}"
          f"{'' if shutil.which('fio') else 'fio is not installed: a raw O_DIRECT loop, 1 MiB x 16 threads'}",
          file=sys.stderr)
    why_not = deepspeed_available()
    if why_not is None:
        factories.append(DeepSpeedCase)
    else:
        print(f"deepspeed aio_handle: skipped ({why_not})", file=sys.stderr)
    parent = Path(directory) if directory is not None else REPO
    work = Path(tempfile.mkdtemp(prefix=".bench-store-", dir=parent))
    rows: list[dict] = []
    try:
        prog = Progress(len(sizes) * reps, "bench_store")
        for size_mib in sizes:
            rows += run_size(work, size_mib * MIB, total, reps, factories, prog)
        prog.finish()
        chunk_rows = chunk_profile(work, sizes[-1] * MIB if quick else PROFILE_MIB * MIB,
                                   1 if quick else PROFILE_COUNT, 1 if quick else reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_csv(rows, out_dir / "bench_store.csv")
    write_csv(chunk_rows, out_dir / "bench_store_chunks.csv")
    print_table(chunk_rows, list(chunk_rows[0]))
    figure(rows, out_dir / "bench_store.png")
    print_table(rows, ["size_mib", "mode", "system", "gbps", "gbps_min", "gbps_max", "cpu_s_per_gb",
                       "vs_reference", "met"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory under test (default: a temp dir in the repository's folder, so on the "
                    "disk that holds the checkout)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per point (default 5; --quick 3)")
    ap.add_argument("--device", default=None,
                    help="take the store's buffers from this device backend's pinned_area (cuda, cuda:N, or "
                    "cpu-adversarial; default: plain page-aligned host memory)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    run(args.quick, args.out, args.dir, args.reps, args.device)
    print(f"wrote {args.out / 'bench_store.csv'} and bench_store.png ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
