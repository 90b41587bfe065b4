"""The SSD tier: one file per tensor segment in a directory on the SSD (array), read and written with O_DIRECT
from page-aligned host buffers, in chunks on a thread pool, with a CRC32 per file so that a corrupted file is
reported by name instead of silently training on garbage.

Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems: EINVAL), the store falls back to
buffered I/O and warns once. Reads that go to the device (weights, activations) land in a page-aligned buffer
the caller hands in (`into`: the executor's transfer area, tiers/arena.py); the others come from the device
backend's host allocator, pageable (optimizer states, gradients)."""

from __future__ import annotations

import errno
import os
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierflow.errors import TierflowError
from tierflow.executor.tiers.direct_io import ALIGN, probe_o_direct

CHUNK_BYTES = 8 << 20  # one I/O request; several run at once on the pool so that an SSD array is kept busy


class ChecksumError(TierflowError, RuntimeError):
    """A file of the SSD tier does not hold what was written to it."""


class SsdError(TierflowError, RuntimeError):
    """The SSD directory cannot be used (missing, read-only, full)."""


def split_counts(n: int, gpu: float, ssd: float) -> tuple[int, int, int]:
    """Elements of an n-element tensor on (gpu, cpu, ssd): [0, g) on the GPU, [g, g+c) in host memory, the
    rest on the SSD. The planner's placement fractions are of bytes; rounding to elements is the
    executor's."""
    g = min(n, int(round(n * gpu)))
    s = min(n - g, int(round(n * ssd)))
    return g, n - g - s, s


def aligned_empty(nbytes: int, pinned: bool = False, backend=None) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` (rounded up to ALIGN) whose address is ALIGN-aligned, from `backend`'s
    host allocator (plain torch.empty without one). Pinned memory is page-aligned: no extra page is asked
    for."""
    padded = -(-max(nbytes, 1) // ALIGN) * ALIGN

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


class SsdStore:
    """Named tensor files under `root`. `write(name, tensor)` stores a tensor's bytes; `read(name, dtype,
    numel)` returns them as a new aligned host tensor (pinned if asked), after checking the CRC32 recorded at
    write."""

    def __init__(self, root: str | os.PathLike[str], *, backend=None, workers: int = 4,
                 warn: Callable[[str], None] | None = None, direct: bool | None = None) -> None:
        self.root = Path(root)
        self.backend = backend  # DeviceBackend: its host_buffer allocates the read buffers
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr))
        self.crc: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierflow-ssd")
        self.bytes_read = 0
        self.bytes_written = 0
        self.direct = self._probe() if direct is None else direct

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
        self.pool.shutdown(wait=True)

    def path(self, name: str) -> Path:
        return self.root / f"{name}.bin"

    # -- I/O -------------------------------------------------------------------------------------------------

    def _open(self, path: Path, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def _chunks(self, fd: int, buf: torch.Tensor, write: bool, name: str) -> None:
        mv = memoryview(buf.numpy())
        n = len(mv)

        def one(lo: int) -> None:
            hi = min(n, lo + CHUNK_BYTES)
            pos = lo
            while pos < hi:
                done = os.pwrite(fd, mv[pos:hi], pos) if write else os.preadv(fd, [mv[pos:hi]], pos)
                if done <= 0:
                    raise OSError(errno.EIO, f"short {'write' if write else 'read'} of {name} at byte {pos}")
                pos += done

        futures = [self.pool.submit(one, lo) for lo in range(0, n, CHUNK_BYTES)]
        for f in futures:
            f.result()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        data = _bytes_of(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        nbytes = data.numel()
        buf = aligned_empty(nbytes)
        buf[:nbytes].copy_(data)
        if len(buf) > nbytes:
            buf[nbytes:].zero_()
        crc = zlib.crc32(memoryview(buf[:nbytes].numpy()))
        path = self.path(name)
        fd = self._open(path, True)
        try:
            self._chunks(fd, buf, True, name)
            if not self.direct:
                os.fsync(fd)
        finally:
            os.close(fd)
        with self.lock:
            self.crc[name] = crc
            self.nbytes[name] = nbytes
            self.bytes_written += nbytes

    def read(self, name: str, dtype: torch.dtype, numel: int, pinned: bool = False,
             into: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """`into(nbytes)`: the page-aligned uint8 buffer to read into (whole pages; the executor's transfer
        area) instead of a new one."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self.nbytes.get(name) != nbytes:
            raise ChecksumError(f"ssd tier: {name}: expected {nbytes} bytes, the store wrote "
                                f"{self.nbytes.get(name)}")
        if into is not None:
            buf = into(nbytes)
            buf = buf[: -(-max(nbytes, 1) // ALIGN) * ALIGN]
        else:
            pin = pinned and self.backend is not None and self.backend.pins
            buf = aligned_empty(nbytes, pin, self.backend)
        path = self.path(name)
        try:
            fd = self._open(path, False)
        except FileNotFoundError:
            raise ChecksumError(f"ssd tier: tensor {name} is missing ({path} was deleted)") from None
        try:
            if os.fstat(fd).st_size < len(buf):
                raise ChecksumError(f"ssd tier: tensor {name} is truncated ({path}: {os.fstat(fd).st_size} "
                                    f"bytes, expected {len(buf)})")
            self._chunks(fd, buf, False, name)
        finally:
            os.close(fd)
        crc = zlib.crc32(memoryview(buf[:nbytes].numpy()))
        if crc != self.crc[name]:
            raise ChecksumError(f"ssd tier: checksum mismatch in tensor {name} ({path}): the file changed "
                                "since tierflow wrote it (disk error or another process); resume from the "
                                "last checkpoint")
        with self.lock:
            self.bytes_read += nbytes
        return buf[:nbytes].view(dtype)

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        with self.lock:
            self.crc.pop(name, None)
            self.nbytes.pop(name, None)

    def used_bytes(self) -> int:
        with self.lock:
            return sum(self.nbytes.values())


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
