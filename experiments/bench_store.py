"""The SSD tier's store against the raw device: the executor's SsdStore and native references, in the same
run, on the same directory, alternating.

    python experiments/bench_store.py [--quick] [--dir DIR] [--reps N] [--device DEVICE] [--out DIR]

For each tensor size (16 MiB to 1 GiB; --quick: 16 and 64 MiB with small totals) and each mode (read, write,
and both at once: one thread reads a set of tensors while another writes a second set), it moves the same
bytes through:

- **store**: `SsdStore` as the executor uses it: `write(name, tensor)` from a page-aligned tensor (as the
  transfer area's), one tensor at a time (each write returns when its last chunk is down), `read(...,
  into=...)` into one, a CRC per chunk included; with --device cuda (or the emulation, cpu-adversarial) those
  tensors come from the device backend's `pinned_area`, the transfer area's own allocation (page-locked with
  cudaHostRegister on a GPU);
- **store-async**: the same store writing with `write(..., wait=False)`: each write returns once its chunks
  are queued, the set's writes are waited for at the end (`flush`), so the requests of the next tensor queue
  behind those of the last; reads as the store's;
- **reference**: `fio` (libaio, queue depth 16, 1 MiB blocks, O_DIRECT) when installed, its own time and
  CPU; else a raw loop of 1 MiB O_DIRECT requests, 16 in flight from 16 threads (os.preadv / os.pwritev
  release the GIL), each thread from or into its own 1 MiB buffer, as fio's jobs do; no checksums;
- **raw-tensor** (a diagnostic): that loop moving the tensor's own memory (block i of a file from or into
  bytes i MiB on of the same tensor-sized buffers as the store's), to separate the store's path from what
  the memory it moves costs;
- **store-locked** (a diagnostic): the store on buffers of its own page-locked with mlock (as a GPU box's
  transfer area is, by cudaHostRegister), where mlock is allowed;
- **store-nocrc** (a diagnostic, not a mode of the executor): the same store with its checksum replaced by a
  no-op, to show what the CRC costs;
- **deepspeed**: DeepSpeed's `aio_handle` (libaio, 1 MiB blocks, queue depth 16, overlapped events, one I/O
  thread per handle; a handle for reads and one for writes) on buffers from its own page-locked allocator
  (`new_cpu_locked_tensor`, so no bounce copy), when `deepspeed.ops.op_builder.AsyncIOBuilder` loads (the
  `baseline` extra and the system's libaio); otherwise one line says it is skipped.

Each measurement reports GB/s (bytes moved over wall time) and CPU seconds per GB moved (user + sys of this
process from resource.getrusage, all threads; fio's own time and CPU from its report). The systems alternate
within each repetition, so a noisy shared machine slows them alike; the CSV has the median and the spread
(min, max) over the repetitions. Targets (tensors >= 64 MiB): the store's read and write >= 0.9x the
reference, mixed >= 0.8x, <= 0.1 CPU seconds per GB moved; the `met` column says which hold (for store and
store-async). Writes bench_store.csv and bench_store.png under --out and prints the table; a full run into the
results folder also regenerates the table of docs/executor.md.

Then where a write's time goes (bench_store_timeline.csv): 1 GiB of 64 MiB, 256 MiB and 1 GiB tensors
written through the store: rewriting its files one at a time (store) and with wait=False (store-async), into
new names whose files are deleted after (store-newfiles: the store renames a deleted file of the same size,
as the executor's activation files come and go) and into new files without that (store-fresh: created and
preallocated by each write); each chunk's request timed in its I/O worker: GB/s, the requests in flight on
average and the share of the time with fewer than the store's workers busy, the gap at each tensor boundary
(from the last chunk's start to the next tensor's first), the preallocation per tensor.
And where a chunk's time goes (bench_store_chunks.csv): 256 MiB tensors written and read through the store
with each checksum it can use (and none), timing in the I/O worker, per chunk, the checksum and the rest of
the chunk's work (its pwritev/preadv requests) in wall seconds and in the thread's own CPU seconds
(time.thread_time), summed per GB moved.
"""

from __future__ import annotations

import ctypes
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

from expcommon import (
    RESULTS_DIR,
    Progress,
    arg_parser,
    generated_block,
    headline,
    new_figure,
    print_table,
    save_figure,
    script_main,
    write_csv,
    write_generated_block,
)

MIB = 1 << 20
SIZES_MIB = (16, 64, 256, 1024)
QUICK_SIZES_MIB = (16, 64)
TOTAL_BYTES = 1 << 30  # bytes moved per measurement (at least one tensor)
QUICK_TOTAL_BYTES = 64 * MIB
MODES = ("read", "write", "mixed")
REF_BLOCK = MIB  # the reference's request size and queue depth, as fio --bs=1M --iodepth=16
REF_DEPTH = 16
ALIGN_PAGE = 4096
DS_SETTINGS = {"block_size": REF_BLOCK, "queue_depth": REF_DEPTH, "single_submit": False,
               "overlap_events": True, "intra_op_parallelism": 1}  # aio_handle's arguments, in order
TARGET_MIN_MIB = 64  # targets apply to tensors of this size and larger
TARGET_RATIO = {"read": 0.9, "write": 0.9, "mixed": 0.8}
TARGET_CPU_S_PER_GB = 0.1
TARGETED = ("store", "store-async")  # the systems the targets are for: the store's two write paths
PROFILE_MIB, PROFILE_COUNT = 256, 2  # the chunk profile: 2 tensors of 256 MiB per pass
TIMELINE_MIB = (64, 256, 1024)  # the write timeline's tensor sizes (1 GiB per pass)
REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "executor.md"  # its store table is generated (store_table)
DOC_TABLE = "bench_store (experiments/bench_store.py from experiments/results/bench_store.csv)"


@dataclass
class Sample:
    """One measurement: bytes moved, wall seconds, CPU seconds."""

    nbytes: int
    wall_s: float
    cpu_s: float


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], int]) -> Sample:
    c0, t0 = _cpu_s(), time.perf_counter()
    n = fn()
    return Sample(n, time.perf_counter() - t0, _cpu_s() - c0)


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


@dataclass
class Buffers:
    """One size's source (random bytes) and destination tensors, page-aligned, shared by the cases that move
    tensor memory (the store's and raw-tensor)."""

    src: object
    dst: object

    @classmethod
    def of(cls, size: int) -> Buffers:
        from tierflow.executor.tiers.ssd_store import aligned_empty

        src = host_buffer(size) if BACKEND else aligned_empty(size)
        src.random_(0, 256)
        return cls(src, host_buffer(size) if BACKEND else aligned_empty(size))

    @classmethod
    def locked(cls, size: int) -> Buffers:
        """New buffers of `size`, page-locked with mlock (as pinned memory is; OSError where refused)."""
        bufs = cls.of(size)
        libc = ctypes.CDLL(None, use_errno=True)
        for t in (bufs.src, bufs.dst):
            if libc.mlock(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(size)) != 0:
                raise OSError(ctypes.get_errno(), f"mlock of {size} bytes: {os.strerror(ctypes.get_errno())}")
        return bufs


class StoreCase(TwoSets):
    """SsdStore on `count` tensors of `size` bytes per set (a: read, b: written while a is read), one write
    at a time."""

    name = "store"
    wait = True

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers) -> None:
        import torch

        from tierflow.executor.tiers.ssd_store import SsdStore

        self.torch, self.size, self.count = torch, size, count
        (directory / self.name).mkdir()
        self.store = SsdStore(directory / self.name, warn=lambda m: print(m, file=sys.stderr))
        self.src, self.dst = bufs.src, bufs.dst
        self.numel = size // 4

    def write(self, prefix: str = "a") -> int:
        data = self.src.view(self.torch.float32)
        for i in range(self.count):
            self.store.write(f"{prefix}{i}", data, wait=self.wait)
        self.store.flush()
        return self.size * self.count

    def read(self) -> int:
        for i in range(self.count):
            self.store.read(f"a{i}", self.torch.float32, self.numel, into=lambda n: self.dst)
        return self.size * self.count

    def close(self) -> None:
        self.store.close()


class AsyncStoreCase(StoreCase):
    """The store writing with wait=False: the next tensor's requests queue behind the last one's."""

    name = "store-async"
    wait = False


class LockedStoreCase(StoreCase):
    """Diagnostic: the same store on buffers of its own, page-locked with mlock (as a GPU box's transfer
    area is, by cudaHostRegister; on this CPU backend it is pageable), to show what pageable memory costs."""

    name = "store-locked"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers) -> None:
        super().__init__(directory, size, count, Buffers.locked(size))


class NoCrcStoreCase(StoreCase):
    """Diagnostic only: the same store with its chunk checksum replaced by a no-op, which separates the CRC's
    cost from the rest of the store's path. The executor never runs without the checksums."""

    name = "store-nocrc"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers) -> None:
        super().__init__(directory, size, count, bufs)
        self.store.io.crc = lambda view, address: 0


# -- where a chunk's time and CPU go -------------------------------------------------------------------------


def chunk_profile(directory: Path, size: int, count: int, rounds: int) -> list[dict]:
    """Per chunk, in the I/O worker that moves it: wall and thread CPU seconds of the checksum and of the
    rest (the pwritev/preadv requests), for each checksum the store can use; summed per GB moved."""
    from tierflow.executor.tiers import ssd_store as ss

    checksums = {"zlib-ng crc32": ss._ZLIB_NG, "google-crc32c": ss._CRC32C, "none": lambda view, address: 0}
    acc: dict[tuple[str, str], list[float]] = {}
    directory = directory / "chunks"
    directory.mkdir()
    case = StoreCase(directory, size, count, Buffers.of(size))
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


# -- where a write's time goes: the requests in flight across tensor boundaries ------------------------------

TIMELINE_VARIANTS = ("store", "store-async", "store-newfiles", "store-fresh")


def write_timeline(directory: Path, sizes_mib: tuple[int, ...], total: int, rounds: int) -> list[dict]:
    """Per tensor size and write variant (one at a time, wait=False, into new files): each chunk's request
    timed in its I/O worker over `rounds` passes of `total` bytes, the variants alternating; medians."""
    directory = directory / "timeline"
    directory.mkdir()
    rows = []
    try:
        for size_mib in sizes_mib:
            size = size_mib * MIB
            count = max(1, total // size)
            case = StoreCase(directory, size, count, Buffers.of(size))
            try:
                for i in range(count):  # the files the store and store-async variants rewrite, and spares
                    case.store.write(f"a_{i}", case.src)
                    case.store.write(f"s_{i}", case.src)
                    case.store.delete(f"s_{i}")
                got: dict[str, list[dict]] = {v: [] for v in TIMELINE_VARIANTS}
                for r in range(rounds):
                    for variant in TIMELINE_VARIANTS if r % 2 == 0 else TIMELINE_VARIANTS[::-1]:
                        got[variant].append(_timeline_pass(case, variant, r))
                rows += [_timeline_row(size_mib, count, v, got[v], case.store.io.workers) for v in got]
            finally:
                case.close()
                shutil.rmtree(directory / "store", ignore_errors=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _timeline_pass(case: StoreCase, variant: str, rnd: int) -> dict:
    """One pass of the case's tensors written as `variant`: the chunks' (tensor, start, end), the window, the
    preallocations' seconds."""
    store, io = case.store, case.store.io
    spans: list[tuple[int, float, float]] = []
    allocs: list[float] = []
    inner, allocate = io._write_chunk, store._allocate

    def chunk(fd, buf, mv, lo, hi, name):
        t0 = time.perf_counter()
        out = inner(fd, buf, mv, lo, hi, name)
        spans.append((int(name.rsplit("_", 1)[-1]), t0, time.perf_counter()))
        return out

    def alloc(f, size):
        t0 = time.perf_counter()
        allocate(f, size)
        allocs.append(time.perf_counter() - t0)

    io._write_chunk, store._allocate = chunk, alloc
    new = variant in ("store-newfiles", "store-fresh")
    prefix = f"{variant[6]}{rnd}_" if new else "a_"
    store.recycle = variant != "store-fresh"
    data = case.src.view(case.torch.float32)
    try:
        t0 = time.perf_counter()
        for i in range(case.count):
            store.write(f"{prefix}{i}", data, wait=variant != "store-async")
        store.flush()
        t1 = time.perf_counter()
    finally:
        io._write_chunk, store._allocate = inner, allocate
    if new:
        for i in range(case.count):
            store.delete(f"{prefix}{i}")
    store.recycle = True
    return {"spans": spans, "t0": t0, "t1": t1, "allocs": allocs, "nbytes": case.size * case.count,
            "chunk": io.chunk_bytes(case.size)}


def _below(spans: list[tuple[int, float, float]], t0: float, t1: float, full: int) -> float:
    """Seconds of [t0, t1] with fewer than `full` requests in flight."""
    events = sorted([(s, 1) for _, s, _ in spans] + [(e, -1) for _, _, e in spans])
    n, last, below = 0, t0, 0.0
    for t, d in events:
        if n < full:
            below += t - last
        n, last = n + d, t
    return below + (t1 - last)


def _timeline_row(size_mib: int, count: int, variant: str, passes: list[dict], workers: int) -> dict:
    def med(f) -> float:
        return statistics.median(f(p) for p in passes)

    def gap_s(p: dict) -> float:  # from a tensor's last chunk start to the next tensor's first, mean
        first = {i: min(s for j, s, _ in p["spans"] if j == i) for i in range(count)}
        last = {i: max(s for j, s, _ in p["spans"] if j == i) for i in range(count)}
        return statistics.fmean(max(0.0, first[i + 1] - last[i]) for i in range(count - 1))

    def wall(p: dict) -> float:
        return p["t1"] - p["t0"]

    def below(p: dict) -> float:
        return _below(p["spans"], p["t0"], p["t1"], workers) / wall(p)

    def chunk_s(p: dict) -> float:
        return statistics.median(e - s for _, s, e in p["spans"])

    return {"size_mib": size_mib, "tensors": count, "variant": variant, "passes": len(passes),
            "chunk_mib": passes[0]["chunk"] / MIB, "workers": workers,
            "gbps": round(med(lambda p: p["nbytes"] / wall(p) / 1e9), 3),
            "in_flight_mean": round(med(lambda p: sum(e - s for _, s, e in p["spans"]) / wall(p)), 2),
            "below_full_share": round(med(below), 3),
            "boundary_gap_ms": round(med(gap_s) * 1e3, 2) if count > 1 else "",
            "chunk_ms_median": round(med(chunk_s) * 1e3, 2),
            "alloc_ms_per_tensor": round(med(lambda p: sum(p["allocs"]) / count) * 1e3, 3)}


# -- the raw O_DIRECT reference ------------------------------------------------------------------------------


class RawCase:
    """1 MiB O_DIRECT requests over files like the store's, REF_DEPTH of them in flight from as many threads
    (the mixed run: half reading set a, half writing set b), each thread from or into its own 1 MiB buffer.
    No checksums, no copies."""

    name = "raw-loop"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers | None = None) -> None:
        self.size, self.count = size, count
        root = directory / self.name
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

    def _memory(self, thread: int, write: bool, off: int) -> memoryview:
        """The memory a request moves: the thread's own 1 MiB buffer."""
        return memoryview(self.bufs[thread])

    def _pass(self, jobs: list[tuple[str, bool]]) -> int:
        """Each (prefix, write) job's blocks on its share of the REF_DEPTH threads, all at once."""
        threads = []
        per = REF_DEPTH // len(jobs)
        for j, (prefix, write) in enumerate(jobs):
            blocks = self._blocks(prefix)
            for t in range(per):
                threads.append(threading.Thread(target=self._loop, args=(blocks[t::per], j * per + t, write)))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return self.size * self.count * len(jobs)

    def _loop(self, blocks: list[tuple[int, int]], thread: int, write: bool) -> None:
        for fd, off in blocks:
            buf = self._memory(thread, write, off)
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


class RawReferenceCase(RawCase):
    """The raw loop as the reference (fio is not installed)."""

    name = "reference"


class RawTensorCase(RawCase):
    """Diagnostic: the raw loop moving the tensor's own memory, as the store does: a request at byte `off` of
    a file writes from (reads into) bytes `off` on of the size's shared source (destination) tensor."""

    name = "raw-tensor"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers) -> None:
        super().__init__(directory, size, count)
        self.src = memoryview(bufs.src.numpy())
        self.dst = memoryview(bufs.dst.numpy())

    def _memory(self, thread: int, write: bool, off: int) -> memoryview:
        return (self.src if write else self.dst)[off: off + REF_BLOCK]


class FioCase:
    """fio with libaio, queue depth 16, 1 MiB blocks, O_DIRECT, on `count` files of `size` per set. Its time
    and CPU are fio's own for the I/O (the JSON's runtime of the slower direction, and usr + sys CPU over the
    jobs' runtime), not the process's start, its file checks and its report, which took 0.2-0.4 s a run here
    and would halve its GB/s at 1 GiB."""

    name = "reference"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers | None = None) -> None:
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
        nbytes = int(job["read"]["io_bytes"]) + int(job["write"]["io_bytes"])
        wall_s = max(job["read"]["runtime"], job["write"]["runtime"]) / 1e3
        cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3
        self.last = Sample(nbytes, wall_s, cpu_s)
        return nbytes

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
    """DeepSpeed's aio_handle (libaio; DS_SETTINGS) reading into and writing from buffers of its own
    page-locked allocator (new_cpu_locked_tensor: no bounce copy); one handle reads while another writes."""

    name = "deepspeed"

    def __init__(self, directory: Path, size: int, count: int, bufs: Buffers | None = None) -> None:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        op = AsyncIOBuilder().load(verbose=False)
        self.reader, self.writer = (op.aio_handle(*DS_SETTINGS.values()) for _ in range(2))
        self.root, self.size, self.count = directory / "deepspeed", size, count
        self.root.mkdir()
        like = torch.empty(0, dtype=torch.uint8)
        self.src = self.writer.new_cpu_locked_tensor(size, like)
        self.dst = self.reader.new_cpu_locked_tensor(size, like)
        self.src.random_(0, 256)

    def _path(self, prefix: str, i: int) -> str:
        return str(self.root / f"{prefix}{i}.bin")

    def write(self, prefix: str = "a") -> int:
        for i in range(self.count):
            self.writer.sync_pwrite(self.src, self._path(prefix, i))
        return self.size * self.count

    def read(self) -> int:
        for i in range(self.count):
            self.reader.sync_pread(self.dst, self._path("a", i))
        return self.size * self.count

    def close(self) -> None:
        self.writer.free_cpu_locked_tensor(self.src)
        self.reader.free_cpu_locked_tensor(self.dst)


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
    """One run of `mode`: timed here, or the case's own measurement (fio's)."""
    sample = timed(getattr(case, mode))
    return case.last if isinstance(case, FioCase) else sample


def summarize(size_mib: int, mode: str, system: str, samples: list[Sample], ref_gbps: float | None) -> dict:
    gbps = [s.nbytes / s.wall_s / 1e9 for s in samples]
    cpu = [s.cpu_s / (s.nbytes / 1e9) for s in samples]
    med = statistics.median(gbps)
    row = {"size_mib": size_mib, "mode": mode, "system": system, "reps": len(samples),
           "gbps": round(med, 3), "gbps_min": round(min(gbps), 3), "gbps_max": round(max(gbps), 3),
           "cpu_s_per_gb": round(statistics.median(cpu), 4), "cpu_s_per_gb_min": round(min(cpu), 4),
           "cpu_s_per_gb_max": round(max(cpu), 4),
           "vs_reference": round(med / ref_gbps, 3) if ref_gbps else "", "target": "", "met": ""}
    if system in TARGETED and size_mib >= TARGET_MIN_MIB and ref_gbps:
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
        bufs = Buffers.of(size)
        cases += [f(directory, size, count, bufs) for f in factories]
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
    styles = {"store": ("#1f77b4", "o"), "store-async": ("#2ca02c", "D"), "reference": ("#7f7f7f", "s"),
              "raw-loop": ("#bcbcbc", "s"), "raw-tensor": ("#8c564b", "P"), "store-nocrc": ("#9ecae1", "v"),
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


def systems() -> list:
    """The cases of this run: the store's two write paths, the reference (fio, else the raw loop), the
    diagnostics, DeepSpeed's aio_handle where it loads (else one line says why not)."""
    fio = shutil.which("fio") is not None
    factories: list = [StoreCase, AsyncStoreCase, FioCase if fio else RawReferenceCase, RawTensorCase,
                       NoCrcStoreCase]
    print("reference: " + ("fio (libaio, iodepth 16, 1 MiB, O_DIRECT)" if fio else
                           "fio is not installed: a raw O_DIRECT loop, 1 MiB x 16 threads"), file=sys.stderr)
    try:
        Buffers.locked(ALIGN_PAGE)
        factories.insert(4, LockedStoreCase)
    except OSError as e:
        print(f"store-locked: skipped (cannot page-lock memory here: {e.strerror})", file=sys.stderr)
    why_not = deepspeed_available()
    if why_not is None:
        factories.append(DeepSpeedCase)
        print(f"deepspeed aio_handle: {DS_SETTINGS}", file=sys.stderr)
    else:
        print(f"deepspeed aio_handle: skipped ({why_not})", file=sys.stderr)
    return factories


def run(quick: bool, out_dir: Path, directory: Path | None = None, reps: int | None = None,
        device: str | None = None) -> list[dict]:
    if device:
        from tierflow.executor.device.factory import make_backend

        BACKEND[:] = [make_backend(device)]
        print(f"store buffers: {device}'s pinned_area (the transfer area's allocation)", file=sys.stderr)
    sizes = QUICK_SIZES_MIB if quick else SIZES_MIB
    total = QUICK_TOTAL_BYTES if quick else TOTAL_BYTES
    reps = reps or (3 if quick else 5)
    factories = systems()
    parent = Path(directory) if directory is not None else REPO
    work = Path(tempfile.mkdtemp(prefix=".bench-store-", dir=parent))
    rows: list[dict] = []
    try:
        prog = Progress(len(sizes) * reps, "bench_store")
        for size_mib in sizes:
            rows += run_size(work, size_mib * MIB, total, reps, factories, prog)
        prog.finish()
        timeline_rows = write_timeline(work, sizes if quick else TIMELINE_MIB, total, 1 if quick else 3)
        chunk_rows = chunk_profile(work, sizes[-1] * MIB if quick else PROFILE_MIB * MIB,
                                   1 if quick else PROFILE_COUNT, 1 if quick else reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, timeline_rows, chunk_rows, out_dir, quick)
    return headlines(rows)


def headlines(rows: list[dict]) -> list[dict]:
    """run_all's headline numbers: per mode the store's lowest GB/s ratio to the reference, and its highest
    CPU seconds per GB, at tensors >= TARGET_MIN_MIB."""
    big = [r for r in rows
           if r["system"] == "store" and r["size_mib"] >= TARGET_MIN_MIB and r["vs_reference"]]
    if not big:
        return []
    at = f"tensors >= {TARGET_MIN_MIB} MiB"
    out = [headline("bench_store", f"store / reference GB/s, {mode}, {at} (lowest)",
                    min(r["vs_reference"] for r in big if r["mode"] == mode), None, "x") for mode in MODES]
    out.append(headline("bench_store", f"store CPU s per GB moved, {at} (highest)",
                        max(r["cpu_s_per_gb"] for r in big), None, "s/GB"))
    return out


def report(rows: list[dict], timeline_rows: list[dict], chunk_rows: list[dict], out_dir: Path,
           quick: bool) -> None:
    """The CSVs, the figure, the tables printed; a full run into the results folder regenerates the docs'."""
    write_csv(rows, out_dir / "bench_store.csv")
    write_csv(timeline_rows, out_dir / "bench_store_timeline.csv")
    write_csv(chunk_rows, out_dir / "bench_store_chunks.csv")
    print_table(chunk_rows, list(chunk_rows[0]))
    print_table(timeline_rows, list(timeline_rows[0]))
    figure(rows, out_dir / "bench_store.png")
    print_table(rows, ["size_mib", "mode", "system", "gbps", "gbps_min", "gbps_max", "cpu_s_per_gb",
                       "vs_reference", "met"])
    if not quick and out_dir.resolve() == RESULTS_DIR.resolve():
        generated_block(DOC, DOC_TABLE)  # the markers are there
        write_generated_block(DOC, DOC_TABLE, store_table([{k: str(v) for k, v in r.items()} for r in rows]))


def store_table(rows: list[dict]) -> str:
    """The docs' table from bench_store.csv's rows (strings): per size and mode, each system's GB/s (min-max)
    and CPU s/GB, the store's ratios to the reference; bold: a target missed."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    head = ["MiB", "mode", *(f"{s} GB/s (min-max), CPU s/GB" for s in systems),
            *(f"{s} / ref" for s in TARGETED if s in systems)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size, mode in dict.fromkeys((r["size_mib"], r["mode"]) for r in rows):
        at = {r["system"]: r for r in rows if (r["size_mib"], r["mode"]) == (size, mode)}
        cells = [size, mode]
        for s in systems:
            r = at[s]
            cpu = f"{float(r['cpu_s_per_gb']):.3f}"
            cells.append(f"{float(r['gbps']):.2f} ({float(r['gbps_min']):.2f}-{float(r['gbps_max']):.2f}), "
                         + (f"**{cpu}**" if _missed(r, "cpu") else cpu))
        for s in TARGETED:
            if s in at:
                ratio = f"{float(at[s]['vs_reference']):.2f}"
                cells.append(f"**{ratio}**" if _missed(at[s], "gbps") else ratio)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _missed(r: dict, what: str) -> bool:
    """Does row `r` (strings) miss its target's `what` (gbps: the ratio; cpu: the CPU per GB)?"""
    if r.get("met") != "no":
        return False
    if what == "cpu":
        return float(r["cpu_s_per_gb"]) > TARGET_CPU_S_PER_GB
    return float(r["vs_reference"]) < TARGET_RATIO[r["mode"]]


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
    sys.exit(script_main(main))
