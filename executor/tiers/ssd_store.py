"""The SSD tier: one file per tensor segment in a directory on the SSD (array), read and written with O_DIRECT
straight from and into the callers' page-aligned host memory, in chunks on a thread pool, with a CRC per chunk
so that a corrupted file is reported by name instead of silently training on garbage.

The hot path (the executor's transfer area, tiers/arena.py, is page-aligned): a write goes from the tensor's
own memory (only an unaligned tail, or an unaligned tensor, is copied through a small per-thread staging
buffer); a read lands in the buffer the caller hands in (`into`). Each file is preallocated once
(posix_fallocate) and its descriptor kept open in a small cache, so an op is a few pread/pwrite calls; a
deleted file is kept as a spare and renamed to the next new file of its size (writes into a new file's
unwritten extents ran at 0.7-0.8x the speed of overwrites: ext4 converts them as they complete). A
tensor is split into about CHUNKS_PER_WORKER chunks per worker of the pool (MIN_CHUNK_BYTES to CHUNK_BYTES
each), one request each; the worker that moves a chunk also computes its checksum (zlib-ng's CRC32, folded
with carry-less multiplies; else google-crc32c's CRC32C from its C library; else zlib's CRC32 with one
warning; all three run without the GIL), so the integrity check is off the serial path: some workers
checksum while the others' requests keep the drives busy. A file's checksum is the tuple of its chunks'
CRCs, kept in memory for the life of the run (the files are scratch: checkpoints are written by
checkpoint.py with their own CRC32s).

A write waits for its chunks by default. `write(..., wait=False)` returns once they are queued (a
PendingWrite that holds the tensor until they are down), so that a caller writing tensor after tensor keeps
the requests in flight across tensor boundaries; whatever claims the file afterwards (a read, a delete or a
rewrite of that name, `flush`, `close`) waits for it first, and a file is recorded (readable) only once all
its chunks are down.

`ChunkIo` is the part that moves bytes between host memory and an open file; another backend (GPUDirect
Storage, io_uring) would replace it and keep SsdStore's interface (`write(..., wait=...)`, `read(...,
into=...)`, `flush`, `delete`, `used_bytes`, `close`, `path`).

Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems: EINVAL), the store falls back to
buffered I/O and warns once. Reads without `into` come from the device backend's host allocator, pageable
(optimizer states, gradients) or pinned."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import glob
import os
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path

import torch

from tierflow.errors import TierflowError
from tierflow.executor.tiers.direct_io import ALIGN, page_round, probe_o_direct

CHUNK_BYTES = 8 << 20  # the largest I/O request (and CRC); several run at once to keep an array busy
MIN_CHUNK_BYTES = 1 << 20  # the smallest: a smaller tensor is one request
CHUNKS_PER_WORKER = 4  # a worker checksums one chunk while the others' requests keep the drives busy
DEFAULT_WORKERS = 8  # requests in flight per store; the block layer splits each 8 MiB one into many
FD_CACHE = 64  # open file descriptors kept per store (least recently used ones are closed beyond it)
MAX_PENDING_WRITES = 4  # asynchronous writes queued per store before the next one waits for the oldest
SPARE_PREFIX = ".spare-"  # a deleted tensor's file kept for the next new file of its size


class ChecksumError(TierflowError, RuntimeError):
    """A file of the SSD tier does not hold what was written to it."""


class SsdError(TierflowError, RuntimeError):
    """The SSD directory cannot be used (missing, read-only, full)."""


class SsdFileGone(ChecksumError):
    """A file of the SSD tier, or its whole directory, deleted while the run used it (exit 2; a read and a
    write say it alike, in one line)."""


def split_counts(n: int, gpu: float, ssd: float) -> tuple[int, int, int]:
    """Elements of an n-element tensor on (gpu, cpu, ssd): [0, g) on the GPU, [g, g+c) in host memory, the
    rest on the SSD. The planner's placement fractions are of bytes; rounding to elements is the
    executor's."""
    g = min(n, int(round(n * gpu)))
    s = min(n - g, int(round(n * ssd)))
    return g, n - g - s, s


class SsdPieces:
    """The SSD files of a tensor class's flat vector of one block: what TierVector and QTierVector share
    (`cls`, `block`, `g` and `c` of split_counts, `parts`: the (lo, hi) of each part)."""

    cls: str
    block: int
    g: int
    c: int
    parts: list[tuple[int, int]]

    @property
    def ssd_lo(self) -> int:
        return self.g + self.c

    def ssd_pieces(self) -> list[tuple[str, int, int, int]]:
        """(file name, part index, lo, hi) of every SSD file of this vector."""
        out = []
        for j, (lo, hi) in enumerate(self.parts):
            lo2, hi2 = max(lo, self.ssd_lo), hi
            if hi2 > lo2:
                out.append((f"{self.cls}_b{self.block}_p{j}", j, lo2, hi2))
        return out


def aligned_empty(nbytes: int, pinned: bool = False, backend=None) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` (rounded up to ALIGN) whose address is ALIGN-aligned, from `backend`'s
    host allocator (plain torch.empty without one). Pinned memory is page-aligned: no extra page is asked
    for."""
    padded = page_round(max(nbytes, 1))

    def alloc(n: int) -> torch.Tensor:
        if backend is None:
            return torch.empty(n, dtype=torch.uint8)
        return backend.host_buffer(n, torch.uint8, pinned=pinned)

    if pinned:
        raw = alloc(padded)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        del raw
    raw = alloc(padded + ALIGN)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off: off + padded]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# -- checksums -----------------------------------------------------------------------------------------------


Checksum = Callable[[memoryview, int], int]  # crc(chunk, its address): the chunk's checksum


def _load_zlib_ng() -> Checksum | None:
    """zlib-ng's CRC32 (the zlib-ng package): folding with carry-less multiplies (VPCLMULQDQ on AVX-512
    machines), which keeps up with memory: 0.035-0.05 CPU s/GB on cold data on the dev machine (AMD EPYC,
    AVX-512), where google-crc32c's CRC32C costs 0.084 (docs/executor.md). Takes the chunk's memory
    (buffer protocol, no copy) and releases the GIL. None when the package is missing."""
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        return None
    return lambda view, address: zlib_ng.crc32(view)


def _load_crc32c() -> Checksum | None:
    """crc32c(address, nbytes) from the C library that the google-crc32c package ships (its Python binding
    takes only `bytes`, which would copy every chunk; through ctypes the call takes the tensor's memory and
    releases the GIL). None when the package or its library is missing."""
    try:
        import google_crc32c
    except ImportError:
        return None
    pkg = Path(google_crc32c.__file__).parent
    found = glob.glob(str(pkg.parent / "google_crc32c.libs" / "libcrc32c*.so*"))
    found += glob.glob(str(pkg / "libcrc32c*.so*"))
    system = ctypes.util.find_library("crc32c")
    for name in [*found, *([system] if system else [])]:
        try:
            fn = ctypes.CDLL(name).crc32c_value
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t]
        return lambda view, address: fn(address, len(view))
    return None


def _zlib_crc32(view: memoryview, address: int) -> int:
    return zlib.crc32(view)  # CPython's zlib releases the GIL for large buffers


_ZLIB_NG = _load_zlib_ng()
_CRC32C = _load_crc32c()
_warned_crc = False


def chunk_checksum(warn: Callable[[str], None]) -> tuple[str, Checksum]:
    """(name, crc(chunk, address)), the fastest installed: zlib-ng's CRC32, else google-crc32c's CRC32C (in
    hardware, but about twice the CPU per GB on cold memory), else zlib's CRC32 (with one warning per process:
    0.23 CPU s per GB)."""
    global _warned_crc
    if _ZLIB_NG is not None:
        return "crc32", _ZLIB_NG
    if _CRC32C is not None:
        return "crc32c", _CRC32C
    if not _warned_crc:
        _warned_crc = True
        warn("warning: neither zlib-ng nor google-crc32c is installed: the SSD tier checks its chunks with "
             "zlib's CRC32, which costs more CPU per GB (pip install zlib-ng)")
    return "crc32", _zlib_crc32


# -- moving bytes --------------------------------------------------------------------------------------------


class ChunkIo:
    """Moves a host buffer to or from an open file in chunks, one request each, on a thread pool (os.pwritev /
    os.preadv release the GIL), each worker computing the CRC of the chunk it moves. With O_DIRECT, memory
    that is not page-aligned (an unaligned tensor, or the last partial page of one) goes through a per-thread
    aligned staging buffer."""

    def __init__(self, workers: int, direct: bool, crc: Checksum) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierflow-ssd")
        self.workers, self.direct, self.crc = workers, direct, crc
        self.local = threading.local()
        self.cpu_s = 0.0  # CPU seconds of the threads that moved and checksummed chunks, summed
        self.cpu_lock = threading.Lock()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _stage(self, nbytes: int) -> torch.Tensor:
        st = getattr(self.local, "stage", None)
        if st is None or st.numel() < nbytes:
            st = self.local.stage = aligned_empty(max(nbytes, ALIGN))
        return st

    def chunk_bytes(self, nbytes: int) -> int:
        """The chunk size for a tensor of `nbytes`: CHUNKS_PER_WORKER per worker, whole pages, within
        [MIN_CHUNK_BYTES, CHUNK_BYTES]."""
        even = page_round(-(-nbytes // (self.workers * CHUNKS_PER_WORKER)))
        return min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, even))

    def write(self, fd: int, data: torch.Tensor, chunk: int, name: str) -> tuple[int, ...]:
        """Write `data` (uint8, contiguous) at offset 0 in `chunk`-byte requests, zero-padded to whole pages;
        the chunks' CRCs."""
        return self._run(fd, data, data.numel(), chunk, True, name)

    def read(self, fd: int, buf: torch.Tensor, nbytes: int, chunk: int, name: str) -> tuple[int, ...]:
        """Read the file's first `nbytes` (padded to whole pages) into `buf` (uint8, page-aligned, whole
        pages) in `chunk`-byte requests; the chunks' CRCs over the `nbytes` bytes."""
        return self._run(fd, buf, nbytes, chunk, False, name)

    def submit_write(self, fd: int, data: torch.Tensor, chunk: int, name: str) -> list[Future]:
        """Hand `data`'s chunks to the I/O threads and return at once: one future per chunk (its CRC)."""
        if data.numel() == 0:
            return []
        mv = memoryview(data.numpy())
        one = functools.partial(self._timed, self._write_chunk)
        return [self.pool.submit(one, fd, data, mv, lo, min(data.numel(), lo + chunk), name)
                for lo in range(0, data.numel(), chunk)]

    def _run(self, fd: int, buf: torch.Tensor, nbytes: int, chunk: int, write: bool,
             name: str) -> tuple[int, ...]:
        if nbytes == 0:
            return ()
        mv = memoryview(buf.numpy())
        one = functools.partial(self._timed, self._write_chunk if write else self._read_chunk)
        starts = range(0, nbytes, chunk)
        if len(starts) == 1:  # one request: on the caller's thread
            return (one(fd, buf, mv, 0, nbytes, name),)
        futures = [self.pool.submit(one, fd, buf, mv, lo, min(nbytes, lo + chunk), name) for lo in starts]
        return _results(futures)

    def _timed(self, move: Callable[..., int], *args) -> int:
        """`move(*args)`, its thread's CPU seconds added to `cpu_s`."""
        c0 = time.thread_time()
        try:
            return move(*args)
        finally:
            spent = time.thread_time() - c0
            with self.cpu_lock:
                self.cpu_s += spent

    def _write_chunk(self, fd: int, buf: torch.Tensor, mv: memoryview, lo: int, hi: int, name: str) -> int:
        base = buf.data_ptr()
        crc = self.crc(mv[lo:hi], base + lo)
        if not self.direct:
            _full(os.pwritev, fd, mv[lo:hi], lo, name, "write")
            return crc
        body = hi if (base + lo) % ALIGN == 0 else lo  # unaligned memory: all of it goes through the stage
        body = lo + (body - lo) // ALIGN * ALIGN
        if body > lo:
            _full(os.pwritev, fd, mv[lo:body], lo, name, "write")
        if hi > body:
            n = page_round(hi - body)
            stage = self._stage(n)
            ctypes.memmove(stage.data_ptr(), base + body, hi - body)  # a plain memcpy, without the GIL
            ctypes.memset(stage.data_ptr() + hi - body, 0, n - (hi - body))
            _full(os.pwritev, fd, memoryview(stage.numpy())[:n], body, name, "write")
        return crc

    def _read_chunk(self, fd: int, buf: torch.Tensor, mv: memoryview, lo: int, hi: int, name: str) -> int:
        _full(os.preadv, fd, mv[lo: lo + page_round(hi - lo)], lo, name, "read")
        return self.crc(mv[lo:hi], buf.data_ptr() + lo)


def _results(futures: list[Future]) -> tuple[int, ...]:
    """Each future's result, in order, once all of them are done (so that no request still uses the file or
    the buffer when the first error is raised)."""
    wait_all(futures)
    return tuple(f.result() for f in futures)


def _full(call, fd: int, view: memoryview, pos: int, name: str, what: str) -> None:
    """pwritev/preadv `view` at `pos` until all of it moved (an I/O error or end of file: EIO naming the
    tensor)."""
    done, n = 0, len(view)
    while done < n:
        got = call(fd, [view[done:]], pos + done)
        if got <= 0:
            raise OSError(errno.EIO, f"short {what} of {name} at byte {pos + done}")
        done += got


# -- the store -----------------------------------------------------------------------------------------------


@dataclass
class FileRecord:
    """What the store wrote to one file: its size in bytes (the file holds them padded to whole pages) and
    the checksum of each `chunk_bytes` chunk, in order."""

    nbytes: int
    chunk_bytes: int
    chunk_crcs: tuple[int, ...]


@dataclass
class _OpenFile:
    fd: int
    inode: tuple[int, int]
    allocated: int = -1  # the file's size, preallocated (-1: not yet)
    users: int = 0
    dropped: bool = False  # out of the cache: closed when its last user is done


class PendingWrite:
    """A write handed to the I/O threads (`SsdStore.write(..., wait=False)`). It holds the caller's tensor (so
    its memory, a transfer-area view included, is not reused before the chunks are down) and the file's
    descriptor. `wait()` returns once every chunk is written and the store has recorded the file (raising
    the first chunk's error); `done()` says whether the chunks are down without waiting."""

    def __init__(self, store: SsdStore, name: str, file: _OpenFile, tensor: torch.Tensor, nbytes: int,
                 chunk: int, futures: list[Future]) -> None:
        self.store, self.name, self.file, self.nbytes, self.chunk = store, name, file, nbytes, chunk
        self.tensor: torch.Tensor | None = tensor
        self.futures = futures
        self.lock = threading.Lock()
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        with self.lock:
            if not self.finished:
                self.finished = True
                try:
                    self.store._finish(self)
                except BaseException as e:
                    self.error = e
        if self.error is not None:
            raise self.error


class SsdStore:
    """Named tensor files under `root`. `write(name, tensor)` stores a tensor's bytes; `read(name, dtype,
    numel)` returns them as a new aligned host tensor (pinned if asked) or in the caller's buffer (`into`),
    after checking each chunk's CRC recorded at write.

    `write(..., wait=False)` returns as soon as the chunks are queued (a PendingWrite), so that one caller
    keeps the requests of several tensors in flight, with no drain at each tensor's end. A write is complete
    before anything claims it: a read or delete of that name, another write of it, `flush()` and `close()`
    wait for it first; at most MAX_PENDING_WRITES are queued (the next waits for the oldest)."""

    def __init__(self, root: str | os.PathLike[str], *, backend=None, workers: int = DEFAULT_WORKERS,
                 warn: Callable[[str], None] | None = None, direct: bool | None = None,
                 recycle: bool = True) -> None:
        self.root = Path(root)
        self.recycle = recycle  # deleted files become spares that new files of their size are renamed from
        self.spares: OrderedDict[Path, int] = OrderedDict()  # spare file -> its size in bytes, oldest first
        self.spare_seq = 0
        self.peak_bytes = 0  # the most bytes the tensors' files held at once (whole pages)
        self.backend = backend  # DeviceBackend: its host_buffer allocates the read buffers
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr))
        self.records: dict[str, FileRecord] = {}
        self.pending: OrderedDict[str, PendingWrite] = OrderedDict()  # not yet waited for, oldest first
        self.lock = threading.Lock()
        self.fds: OrderedDict[str, _OpenFile] = OrderedDict()
        self.bytes_read = 0
        self.bytes_written = 0
        self.direct = self._probe() if direct is None else direct
        self.checksum, crc = chunk_checksum(self.warn)
        self.io = ChunkIo(workers, self.direct, crc)

    # -- setup -----------------------------------------------------------------------------------------------

    def _probe(self) -> bool:
        """Can this directory do O_DIRECT? (EINVAL on tmpfs and friends: fall back to buffered I/O, once.)"""
        if not hasattr(os, "O_DIRECT"):
            self.warn(f"warning: no O_DIRECT on this OS: the SSD tier under {self.root} uses buffered I/O")
            return False
        if probe_o_direct(self.root):
            return True
        self.warn(f"warning: {self.root} refuses O_DIRECT (tmpfs or similar?): the SSD tier uses buffered "
                  "I/O there, so its reads may come from the page cache")
        return False

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.io.close()
            self._close_files()

    def _close_files(self) -> None:
        with self.lock:
            for f in self.fds.values():
                os.close(f.fd)
            self.fds.clear()
            spares, self.spares = list(self.spares), OrderedDict()
        for path in spares:
            path.unlink(missing_ok=True)

    def path(self, name: str) -> Path:
        return self.root / f"{name}.bin"

    @property
    def cpu_s(self) -> float:
        """CPU seconds the store's I/O has taken so far: its requests and checksums, on whichever thread."""
        return self.io.cpu_s

    # -- the descriptor cache --------------------------------------------------------------------------------

    def _acquire(self, name: str, create: bool) -> _OpenFile:
        """The open file of `name`, from the cache if its path still names the same file (a file deleted or
        replaced behind the store's back is opened again; a missing one raises FileNotFoundError unless
        `create`)."""
        path = self.path(name)
        try:
            st = os.stat(path)
            inode = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            if not create:
                raise
            inode = None
        with self.lock:
            f = self.fds.get(name)
            if f is not None and f.inode == inode:
                self.fds.move_to_end(name)
                f.users += 1
                return f
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags if create else flags & ~os.O_CREAT, 0o600)
        st = os.fstat(fd)
        f = _OpenFile(fd, (st.st_dev, st.st_ino), allocated=st.st_size, users=1)  # reopened: not again
        with self.lock:
            old = self.fds.pop(name, None)
            if old is not None:
                self._drop(old)
            self.fds[name] = f
            while len(self.fds) > FD_CACHE:
                self._drop(self.fds.popitem(last=False)[1])
        return f

    def _release(self, f: _OpenFile) -> None:
        with self.lock:
            f.users -= 1
            if f.dropped and f.users == 0:
                os.close(f.fd)

    @staticmethod
    def _drop(f: _OpenFile) -> None:
        """Out of the cache (under the lock): closed now if unused, else by its last user."""
        f.dropped = True
        if f.users == 0:
            os.close(f.fd)

    def _allocate(self, f: _OpenFile, size: int) -> None:
        """The file is `size` bytes, its blocks allocated (once per size, not per write)."""
        if f.allocated == size:
            return
        os.ftruncate(f.fd, size)
        if size and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(f.fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        f.allocated = size

    # -- I/O -------------------------------------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor, wait: bool = True) -> PendingWrite | None:
        """Store `tensor`'s bytes as `name`. With `wait=False`, return when its chunks are queued: the
        PendingWrite (keep the tensor unchanged until it is done; the store waits for it before anything
        reads, deletes or rewrites `name`)."""
        self._wait_for(name)  # the same file: the previous write first
        while len(self.pending) >= MAX_PENDING_WRITES:
            self._wait_oldest()
        data = _bytes_of(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        nbytes = data.numel()
        with self.lock:
            self.records.pop(name, None)  # the file is being overwritten: its old record no longer holds
        try:
            self._take_spare(name, page_round(nbytes))
            f = self._acquire(name, create=True)
        except FileNotFoundError:  # the directory was deleted: nothing of `name` is written
            raise self._gone(name, "write") from None
        try:
            self._allocate(f, page_round(nbytes))
            chunk = self.io.chunk_bytes(nbytes)
            if not wait:
                futures = self.io.submit_write(f.fd, data, chunk, name)
            else:
                crcs = self.io.write(f.fd, data, chunk, name)
                if not self.direct:
                    os.fsync(f.fd)
        except BaseException:
            self._release(f)
            raise
        if wait:
            self._release(f)
            self._record(name, FileRecord(nbytes, chunk, crcs))
            return None
        p = PendingWrite(self, name, f, data, nbytes, chunk, futures)
        with self.lock:
            self.pending[name] = p
        return p

    def _record(self, name: str, rec: FileRecord) -> None:
        with self.lock:
            self.records[name] = rec
            self.bytes_written += rec.nbytes

    def _finish(self, p: PendingWrite) -> None:
        """(PendingWrite.wait, once) The CRCs recorded once all its chunks are down; the file released."""
        try:
            crcs = _results(p.futures)
            if not self.direct:
                os.fsync(p.file.fd)
        finally:
            self._release(p.file)
            p.tensor = None
            with self.lock:
                if self.pending.get(p.name) is p:
                    del self.pending[p.name]
        self._record(p.name, FileRecord(p.nbytes, p.chunk, crcs))

    def _named_bytes(self) -> int:
        """(under the lock) Bytes of the files that name a tensor, written or being written (whole pages)."""
        return (sum(page_round(r.nbytes) for r in self.records.values())
                + sum(page_round(p.nbytes) for p in self.pending.values()))

    def _take_spare(self, name: str, size: int) -> None:
        """Before a write creates `name`'s file (`size` bytes): a spare file of that size is renamed to it, so
        the write overwrites blocks already allocated and written (a new preallocated file's extents are
        unwritten: ext4 converts them as the writes complete, which made new files 0.7-0.8x as fast to write,
        bench_store_timeline.csv). With no spare of that size, spares are removed until the files on disk
        are within the most bytes the tensors' files held at once."""
        if not self.recycle or size == 0 or self.path(name).exists():
            return
        with self.lock:
            spare = next((p for p, n in self.spares.items() if n == size), None)
            if spare is not None:
                del self.spares[spare]
            named = self._named_bytes()
            self.peak_bytes = max(self.peak_bytes, named + size)
            drop = []
            room = self.peak_bytes - named - size  # for spares
            while spare is None and self.spares and sum(self.spares.values()) > room:
                drop.append(self.spares.popitem(last=False)[0])
        for path in drop:
            path.unlink(missing_ok=True)
        if spare is not None:
            try:
                os.replace(spare, self.path(name))
            except FileNotFoundError:  # removed behind the store's back: a new file, then
                pass

    def _wait_for(self, name: str) -> None:
        with self.lock:
            p = self.pending.get(name)
        if p is not None:
            p.wait()

    def _wait_oldest(self) -> None:
        with self.lock:
            p = next(iter(self.pending.values()), None)
        if p is not None:
            p.wait()

    def flush(self) -> None:
        """Wait for every pending write (raising the first error after all of them are done)."""
        errors = []
        while self.pending:
            try:
                self._wait_oldest()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def read(self, name: str, dtype: torch.dtype, numel: int, pinned: bool = False,
             into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """`into(nbytes)`: the page-aligned uint8 buffer to read into (whole pages; the executor's transfer
        area) instead of a new one."""
        nbytes = numel * dtype.itemsize
        self._wait_for(name)
        rec = self.records.get(name)
        if rec is None or rec.nbytes != nbytes:
            raise ChecksumError(f"ssd tier: {name}: expected {nbytes} bytes, the store wrote "
                                f"{rec.nbytes if rec else None}")
        if into is not None:
            buf = into(nbytes)[: page_round(max(nbytes, 1))]
        else:
            pin = pinned and self.backend is not None and self.backend.pins
            buf = aligned_empty(nbytes, pin, self.backend)
        path = self.path(name)
        try:
            f = self._acquire(name, create=False)
        except FileNotFoundError:
            raise self._gone(name, "read") from None
        try:
            size = os.fstat(f.fd).st_size
            if size < page_round(nbytes):
                raise ChecksumError(f"ssd tier: tensor {name} is truncated ({path}: {size} bytes, expected "
                                    f"{page_round(nbytes)})")
            crcs = self.io.read(f.fd, buf, nbytes, rec.chunk_bytes, name)
        finally:
            self._release(f)
        bad = [i for i, (got, want) in enumerate(zip(crcs, rec.chunk_crcs)) if got != want]
        if bad or len(crcs) != len(rec.chunk_crcs):
            lo = bad[0] * rec.chunk_bytes if bad else 0
            hi = min(nbytes, lo + rec.chunk_bytes)
            raise ChecksumError(f"ssd tier: checksum mismatch in tensor {name} ({path}, bytes {lo}-{hi}): "
                                "the file changed since tierflow wrote it (disk error or another process); "
                                "resume from the last checkpoint")
        with self.lock:
            self.bytes_read += nbytes
        return buf[:nbytes].view(dtype)

    def _gone(self, name: str, op: str) -> SsdFileGone:
        """The one line of a file of the tier found deleted at a read or a write (or its whole directory)."""
        what = (f"the SSD tier's directory {self.root} was deleted during the run" if not self.root.is_dir()
                else f"{self.path(name)} was deleted")
        return SsdFileGone(f"ssd tier: tensor {name} is missing at its {op} ({what}); leave --ssd-dir alone "
                           "while a run uses it, and resume from the last checkpoint")

    def delete(self, name: str) -> None:
        """Remove `name`'s file (after its pending write, whose error, if any, no longer matters). With
        `recycle`, a file the store wrote becomes a spare (renamed; removed at close) for the next new file of
        its size."""
        try:
            self._wait_for(name)
        except Exception:  # the bytes it failed to write are being deleted
            pass
        with self.lock:
            f = self.fds.pop(name, None)
            busy = f is not None and f.users > 0  # a read still on it: not to be rewritten under it
            if f is not None:
                self._drop(f)
            rec = self.records.pop(name, None)
            spare = self.root / f"{SPARE_PREFIX}{self.spare_seq}.bin"
            self.spare_seq += 1
        if self.recycle and rec is not None and rec.nbytes > 0 and not busy:
            try:
                os.replace(self.path(name), spare)
            except FileNotFoundError:
                return
            with self.lock:
                self.spares[spare] = page_round(rec.nbytes)
            return
        self.path(name).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        with self.lock:
            return sum(r.nbytes for r in self.records.values()) + sum(p.nbytes for p in self.pending.values())


FIX_SPACE = "free space, pass a larger directory, or plan with fewer bytes on the SSD"


def check_ssd_dir(path: str | os.PathLike[str] | None, need_bytes: float, what: str, *,
                  needed_by: str = "the plan", fix_space: str = FIX_SPACE) -> Path:
    """The SSD directory, checked before it is used (by `tierflow run` for the plan's SSD tier, by `tierflow
    calibrate` for its test files): exists, is a directory, is writable, has room for `need_bytes` (`what`
    they hold, for `needed_by`). Raises SsdError with one line that names the directory and the fix."""
    if path is None:
        raise SsdError(f"{needed_by} puts {need_bytes / 1e9:.3f} GB on the SSD tier ({what}) but no "
                       "--ssd-dir was given (pass a directory on the SSD array)")
    p = Path(path)
    if not p.exists():
        raise SsdError(f"--ssd-dir {p}: no such directory (create it, or pass a directory on the SSD array)")
    if not p.is_dir():
        raise SsdError(f"--ssd-dir {p}: not a directory (pass a directory on the SSD array, not a file)")
    if not os.access(p, os.W_OK | os.X_OK):
        raise SsdError(f"--ssd-dir {p}: not writable (fix its permissions, or pass another directory)")
    probe = p / f".tierflow-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
    except OSError as e:
        raise SsdError(f"--ssd-dir {p}: cannot write there ({e.strerror}); pass a writable "
                       "directory") from None
    finally:
        probe.unlink(missing_ok=True)
    st = os.statvfs(p)
    free_bytes = st.f_bavail * st.f_frsize
    if free_bytes < need_bytes:
        raise SsdError(f"--ssd-dir {p}: {free_bytes / 1e9:.3f} GB free, {needed_by} needs "
                       f"{need_bytes / 1e9:.3f} GB there ({what}); {fix_space}")
    return p
