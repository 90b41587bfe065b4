"""Measuring the SSD tier's filesystem (``--ssd-dir``): sequential O_DIRECT write and read bandwidth, a mixed
read + write run on two threads (decides ``rw_sharing``), the free space and the block device's name. The
directory's filesystem is measured as ONE device, so a RAID0 array is reported as one fast drive."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from tierflow.executor.calibration.common import MIB

SHARED_THRESHOLD = 1.3  # mixed read + write sum below 1.3x the faster solo rate -> "shared"


def check_ssd_dir(directory: str | os.PathLike[str], need_bytes: int) -> Path:
    """The directory, checked by store.check_ssd_dir as `tierflow run` checks its own: a missing directory, a
    file or too little free space raises its one-line SsdError naming it and the fix."""
    from tierflow.executor.tiers.ssd_store import check_ssd_dir as check  # imports torch: not at module level

    return check(directory, need_bytes, "two test files", needed_by="the SSD test",
                 fix_space="free some space, use --quick or a smaller --ssd-file-mib, or give another "
                 "directory")


def ssd_need_bytes(file_bytes: int) -> int:
    """Free space the SSD test needs: two test files and some slack."""
    return 2 * file_bytes + 64 * MIB


def block_device_name(directory: str | os.PathLike[str]) -> str:
    """Best effort: the model or name of the block device holding ``directory`` ("unknown device" if none)."""
    try:
        st = os.stat(directory)
        sys_dir = Path(os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
        if not sys_dir.exists():
            return "unknown device"
        disk = sys_dir.parent if (sys_dir / "partition").exists() else sys_dir
        for candidate in (disk / "device" / "model", disk / "dm" / "name"):
            if candidate.exists():
                text = " ".join(candidate.read_text().split())
                if text:
                    return f"{text} ({disk.name})"
        return disk.name
    except (OSError, ValueError):
        return "unknown device"


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # anonymous mappings are page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(nbytes, 4 * MIB)) * (nbytes // min(nbytes, 4 * MIB)))  # incompressible data
    return buf


def _open(path: Path, write: bool, direct: bool) -> int:
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _stream(fd: int, buf: mmap.mmap, write: bool, file_bytes: int, min_bytes: int, until: float,
            direct: bool) -> int:
    """Sequential blocks over the file, wrapping at its end, until ``min_bytes`` moved and ``until``
    passed."""
    block = len(buf)
    done = pos = 0
    while True:
        if pos >= file_bytes:
            os.lseek(fd, 0, os.SEEK_SET)
            pos = 0
            if not write and not direct:
                _drop_cache(fd)
        n = os.write(fd, buf) if write else os.readv(fd, [buf])
        if n != block:
            raise OSError(errno.EIO, f"short {'write' if write else 'read'} ({n} of {block} bytes)")
        pos += n
        done += n
        if done >= min_bytes and time.perf_counter() >= until:
            return done


def _timed(path: Path, buf: mmap.mmap, write: bool, file_bytes: int, min_bytes: int, seconds: float,
           direct: bool, start: float | None = None) -> tuple[int, float]:
    """(bytes, seconds) of one sequential phase; writes include the final fsync."""
    fd = _open(path, write, direct)
    try:
        if not write and not direct:
            _drop_cache(fd)
        t0 = time.perf_counter() if start is None else start
        n = _stream(fd, buf, write, file_bytes, min_bytes, t0 + seconds, direct)
        if write:
            os.fsync(fd)
        return n, time.perf_counter() - t0
    finally:
        os.close(fd)


def _preallocate(path: Path, nbytes: int, direct: bool) -> None:
    fd = _open(path, True, direct)
    try:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


def measure_ssd(directory: str | os.PathLike[str], file_bytes: int, block_bytes: int, min_s: float = 0.0,
                mixed_s: float = 1.0, warn: Any = None, step: Any = None) -> dict[str, Any]:
    """Sequential write / read GB/s of the filesystem holding ``directory``, and a mixed read + write run.

    Uses O_DIRECT with page-aligned buffers; where the filesystem refuses O_DIRECT (EINVAL, e.g. tmpfs) it
    falls back to buffered I/O + fsync + posix_fadvise(DONTNEED) and calls ``warn(message)`` once. The test
    files are always removed. ``step(label)`` is called before each phase (progress display).
    """
    step = step or (lambda label: None)
    if block_bytes <= 0 or block_bytes % mmap.PAGESIZE:
        raise ValueError(f"block size {block_bytes} must be a positive multiple of {mmap.PAGESIZE} bytes")
    file_bytes = max(block_bytes, file_bytes // block_bytes * block_bytes)
    d = Path(directory)
    stem = f".tierflow-calibrate-{os.getpid()}-{threading.get_ident()}"
    file_a, file_b = d / f"{stem}-a.bin", d / f"{stem}-b.bin"
    buf_r, buf_w = _aligned_buffer(block_bytes), _aligned_buffer(block_bytes)
    direct = hasattr(os, "O_DIRECT")
    out: dict[str, Any] = {"file_bytes": file_bytes, "block_bytes": block_bytes}
    try:
        step(f"SSD write ({file_bytes / MIB:.0f} MiB)")
        try:
            _preallocate(file_a, file_bytes, direct)
            wrote, t_write = _timed(file_a, buf_w, True, file_bytes, file_bytes, min_s, direct)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            direct = False
            if warn:
                warn(f"warning: {d} refuses O_DIRECT (tmpfs or similar?): measuring with buffered I/O + "
                     "fsync + posix_fadvise(DONTNEED) instead; rates may include the page cache")
            _preallocate(file_a, file_bytes, direct)
            wrote, t_write = _timed(file_a, buf_w, True, file_bytes, file_bytes, min_s, direct)
        step(f"SSD read ({file_bytes / MIB:.0f} MiB)")
        read, t_read = _timed(file_a, buf_r, False, file_bytes, file_bytes, min_s, direct)
        out.update(direct=direct, write_gbps=wrote / t_write / 1e9, read_gbps=read / t_read / 1e9)

        step(f"SSD read + write ({mixed_s:g} s)")
        _preallocate(file_b, file_bytes, direct)
        results: dict[str, tuple[int, float]] = {}
        errors: list[BaseException] = []
        start = time.perf_counter() + 0.05  # both threads start together and share one clock

        def run(name: str, path: Path, buf: mmap.mmap, write: bool) -> None:
            try:
                while time.perf_counter() < start:
                    time.sleep(0.001)
                results[name] = _timed(path, buf, write, file_bytes, 0, mixed_s, direct, start=start)
            except BaseException as e:  # re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=("read", file_a, buf_r, False)),
                   threading.Thread(target=run, args=("write", file_b, buf_w, True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        out["mixed_read_gbps"] = results["read"][0] / results["read"][1] / 1e9
        out["mixed_write_gbps"] = results["write"][0] / results["write"][1] / 1e9
        faster = max(out["read_gbps"], out["write_gbps"])
        mixed = out["mixed_read_gbps"] + out["mixed_write_gbps"]
        out["rw_sharing"] = "shared" if mixed < SHARED_THRESHOLD * faster else "independent"
        out["capacity_gb"] = (shutil.disk_usage(d).free + _size(file_a) + _size(file_b)) / 1e9
        out["model"] = block_device_name(d)
        return out
    finally:
        for path in (file_a, file_b):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        buf_r.close()
        buf_w.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0

