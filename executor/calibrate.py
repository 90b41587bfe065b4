"""`tierflow calibrate`: measure the machine it runs on and write a hardware profile the planner accepts.

    tierflow calibrate --ssd-dir /mnt/nvme/tmp --base h100-80g -o box.yaml
    tierflow simulate --hw box.yaml

What it measures:

- GPU (``--device cuda``, the default when ``torch.cuda.is_available()``): bf16 GEMM TFLOPS at transformer shapes
  (CUDA events, after warm-up), a small GEMM to fit ``gemm_half_gflop``, HBM bandwidth (device-to-device copy),
  memory size, pinned H2D / D2H bandwidth alone and both at once on two CUDA streams.
- The CPU as the device (``--device cpu``, the default without CUDA: ``tierflow run --device cpu``): fp32 GEMM
  rates at six sizes fitted to the cost model's curve, elementwise bandwidth, copies within host memory alone and
  two at once (what an offload or fetch is there), and the cores that compute, CPU Adam, the copies and the SSD
  ops share (``gpu.host_cores``, ``cpu.cores``); the device memory is a cap (``--set gpu.memory_gib=...``).
- CPU: DRAM copy bandwidth (read + write bytes), memory size, CPU AdamW update rate.
- SSD (with ``--ssd-dir``): sequential O_DIRECT write and read bandwidth, a mixed read + write run on two
  threads (decides ``rw_sharing``) and the free space. The directory's filesystem is measured as ONE device
  (``ssd.count = 1``), so a RAID0 array is reported as one fast drive.

Everything it cannot measure comes from ``--base PROFILE``; without one, the prices (and on a CUDA box whatever a
measurement failed to give) come from the bundled ``rtx4090-lohan`` and, without ``--ssd-dir``, the profile has
no SSD tier. ``--set KEY=VALUE`` fixes a field after measuring. The table it prints says, for every field,
whether it was measured, derived, given or taken from the base.

torch is imported inside the functions, so registering the command does not slow down ``tierflow simulate``.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import mmap
import os
import platform
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierflow.hwprofiles import HardwareProfile, load_profile, profile_from_dict, save_profile
from tierflow.hwprofiles.profile import format_value
from tierflow.planner.io.argtypes import positive_int
from tierflow.planner.io.cli import CliError
from tierflow.planner.io.progress import Progress

FALLBACK_BASE = "rtx4090-lohan"
# plans count activations, weights and their copies in the compute dtype's bytes, bf16 (workload.COMPUTE_BYTES);
# the executor computes in fp32 on a CPU device, so that device's measured rates are converted to plan bytes
PLAN_BYTES_PER_ELEMENT = 2
HOST_DEVICE_BYTES_PER_ELEMENT = 4
MIB = 2**20
GIB = 2**30
# Without a datasheet (--base), the best measured GEMM rate is taken to be this fraction of the peak.
NO_BASE_GEMM_EFFICIENCY = 0.9
# Without a datasheet, measured HBM copy bandwidth is taken to be this fraction of the peak (the bundled
# profiles' hbm_efficiency assumption).
NO_BASE_HBM_EFFICIENCY = 0.85
SHARED_THRESHOLD = 1.3  # mixed read + write sum below 1.3x the faster solo rate -> "shared"

# (tokens, in_features, out_features): the GEMMs of a 4096-wide transformer block and one large square.
GEMM_SHAPES = [(8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096), (8192, 8192, 8192)]
SMALL_GEMM = (1024, 1024, 1024)  # ~2.1 GFLOP: near the half-efficiency size of current GPUs


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does; ``--quick`` keeps the whole run under ~20 s on a small machine."""

    dram_bytes: int
    adam_params: int
    adam_steps: int
    ssd_file_bytes: int
    ssd_block_bytes: int
    ssd_min_s: float  # each solo SSD phase runs at least this long (re-reading / re-writing the file)
    ssd_mixed_s: float
    gpu_target_s: float  # timed span per GEMM shape
    hbm_bytes: int
    pcie_bytes: int


FULL = Sizes(
    dram_bytes=1 * GIB, adam_params=50_000_000, adam_steps=5, ssd_file_bytes=2 * GIB, ssd_block_bytes=4 * MIB,
    ssd_min_s=1.0, ssd_mixed_s=3.0, gpu_target_s=0.3, hbm_bytes=2 * GIB, pcie_bytes=1 * GIB,
)
QUICK = Sizes(
    dram_bytes=256 * MIB, adam_params=5_000_000, adam_steps=3, ssd_file_bytes=256 * MIB,
    ssd_block_bytes=1 * MIB, ssd_min_s=0.3, ssd_mixed_s=1.0, gpu_target_s=0.05, hbm_bytes=512 * MIB,
    pcie_bytes=256 * MIB,
)


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise CliError(f"tierflow calibrate needs PyTorch ({e}): pip install 'tierflow[run]'") from None
    return torch


# --------------------------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------------------------


def measure_dram_gbps(nbytes: int, repeats: int = 3) -> float:
    """DRAM bandwidth in GB/s of a large torch copy, counting read + write bytes (2 x nbytes per copy)."""
    torch = _torch()
    n = max(1, nbytes // 4)
    src = torch.empty(n, dtype=torch.float32)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page of both buffers before timing
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def adam_impl() -> str:
    """"fused" when this torch has a CPU fused AdamW, else "foreach"."""
    torch = _torch()
    p = torch.nn.Parameter(torch.zeros(16))
    p.grad = torch.ones(16)
    try:
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return "fused"
    except (RuntimeError, TypeError, ValueError):
        return "foreach"


def measure_cpu_adam(params: int, steps: int = 3, chunk: int = 4 * 2**20) -> float:
    """CPU AdamW update rate in parameters per second on ``params`` fp32 parameters (in tensors of ``chunk``)."""
    torch = _torch()
    sizes = [chunk] * (params // chunk) + ([params % chunk] if params % chunk else [])
    ps = []
    for s in sizes:
        p = torch.nn.Parameter(torch.full((s,), 0.01))
        p.grad = torch.full((s,), 1e-3)
        ps.append(p)
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **{adam_impl(): True})
    opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
    t0 = time.perf_counter()
    for _ in range(max(1, steps)):
        opt.step()
    return params * max(1, steps) / (time.perf_counter() - t0)


def cpu_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        pass
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    raise OSError("cannot find the memory size (no sysconf, no /proc/meminfo)")


def cpu_model() -> str:
    name, sockets = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = " ".join(value.split())
                elif key == "physical id":
                    sockets.add(value.strip())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    if len(sockets) > 1:
        name = f"{len(sockets)}x {name}"
    return f"{name} ({os.cpu_count()} threads)"


# --------------------------------------------------------------------------------------------------------------
# SSD
# --------------------------------------------------------------------------------------------------------------


def check_ssd_dir(directory: str | os.PathLike[str], need_bytes: int) -> Path:
    """The directory (checked by store.check_ssd_dir, as `tierflow run` checks its own), or a one-line CliError
    naming it and the fix."""
    from tierflow.executor.store import SsdError
    from tierflow.executor.store import check_ssd_dir as check  # imports torch: not at module level

    try:
        return check(directory, need_bytes, "two test files", needed_by="the SSD test",
                     fix_space="free some space, use --quick or a smaller --ssd-file-mib, or give another directory")
    except SsdError as e:
        raise CliError(str(e)) from None


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
    """Sequential blocks over the file, wrapping at its end, until ``min_bytes`` moved and ``until`` passed."""
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
                warn(f"warning: {d} refuses O_DIRECT (tmpfs or similar?): measuring with buffered I/O + fsync + "
                     "posix_fadvise(DONTNEED) instead; rates may include the page cache")
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


# --------------------------------------------------------------------------------------------------------------
# GPU (CUDA only; none of this runs without a GPU)
# --------------------------------------------------------------------------------------------------------------


def _cuda_ms_per_call(fn: Any, target_s: float, max_iters: int = 2000) -> float:
    """Mean milliseconds per call of ``fn`` timed with CUDA events after warm-up, over about ``target_s``."""
    torch = _torch()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end) / 3, 1e-4)
    iters = int(min(max_iters, max(3, target_s * 1e3 / per)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _cuda_graph_ms_per_call(fn: Any, target_s: float, max_iters: int = 2000) -> float:
    """As _cuda_ms_per_call, but the calls are replayed from a CUDA graph: one launch for all of them, so that a
    kernel shorter than Python's launch overhead (a 1024^3 bf16 GEMM takes ~3 us on an H100) is timed, not the
    launches. Falls back to plain launches where capture fails."""
    torch = _torch()
    per_ms = _cuda_ms_per_call(fn, 0.0, max_iters=3)  # warm-up (cuBLAS picks its kernel outside the capture)
    iters = int(min(max_iters, max(3, target_s * 1e3 / max(per_ms, 1e-4))))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except RuntimeError:
        return _cuda_ms_per_call(fn, target_s, max_iters)
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure_gemm_tflops(tokens: int, d_in: int, d_out: int, target_s: float = 0.1) -> float:
    """bf16 TFLOPS of ``x[tokens, d_in] @ W[d_out, d_in]^T`` (a Linear layer's forward), timed from a CUDA graph
    (launch overhead would otherwise inflate the small GEMMs that fit gemm_half_gflop)."""
    torch = _torch()
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, d_out, device="cuda", dtype=torch.bfloat16)
    wt = w.t()
    ms = _cuda_graph_ms_per_call(lambda: torch.mm(x, wt, out=out), target_s)
    return 2 * tokens * d_in * d_out / (ms * 1e-3) / 1e12


def measure_hbm_gbps(nbytes: int, target_s: float = 0.1) -> float:
    """Device memory bandwidth in GB/s of a device-to-device copy (read + write bytes)."""
    torch = _torch()
    free, _ = torch.cuda.mem_get_info()
    nbytes = int(min(nbytes, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _cuda_ms_per_call(lambda: dst.copy_(src), target_s, max_iters=200)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_pcie(nbytes: int, chunks: int = 16) -> dict[str, float]:
    """Pinned H2D and D2H GB/s alone, and each direction's rate while the other runs on a second stream."""
    torch = _torch()
    nbytes = max(chunks * MIB, nbytes // (chunks * MIB) * chunks * MIB)
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {
        "h2d_gbps": nbytes / (_cuda_ms_per_call(lambda: dev_a.copy_(host_a, non_blocking=True), 0.0, 3) * 1e-3) / 1e9,
        "d2h_gbps": nbytes / (_cuda_ms_per_call(lambda: host_b.copy_(dev_b, non_blocking=True), 0.0, 3) * 1e-3) / 1e9,
    }
    # Both at once: chunked copies on two streams, an event after each chunk; each direction's rate is taken
    # over the time both were running (up to the end of the one that finishes first).
    c = nbytes // chunks
    s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)  # hold both streams back until every copy is queued
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    done: dict[str, list[Any]] = {"h2d": [], "d2h": []}
    for name, stream, dst, src in (("h2d", s_h2d, dev_a, host_a), ("d2h", s_d2h, host_b, dev_b)):
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            for i in range(chunks):
                dst[i * c:(i + 1) * c].copy_(src[i * c:(i + 1) * c], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                done[name].append(ev)
    torch.cuda.synchronize()
    ms = {k: [start.elapsed_time(e) for e in evs] for k, evs in done.items()}
    window = min(ms["h2d"][-1], ms["d2h"][-1])
    for k, times in ms.items():
        k_done = sum(1 for t in times if t <= window * 1.0001) or 1
        rate = k_done * c / (times[k_done - 1] * 1e-3) / 1e9
        out[f"duplex_{k}_gbps"] = min(rate, out[f"{k}_gbps"])  # noise must not make duplex beat solo
    return out


def gpu_info() -> dict[str, Any]:
    torch = _torch()
    props = torch.cuda.get_device_properties(0)
    return {"model": " ".join(str(props.name).split()) or "unknown GPU", "memory_gib": props.total_memory / GIB}


def pcie_generation_from_rate(h2d_gbps: float) -> int:
    """PCIe generation a x16 link with this pinned H2D rate most likely has (3: ~12, 4: ~25, 5: ~50 GB/s)."""
    for gen, ceiling in ((3, 18.0), (4, 37.0), (5, 75.0)):
        if h2d_gbps < ceiling:
            return gen
    return 6


def fit_gemm_half_gflop(small_gflop: float, small_eff: float, e_max: float) -> float:
    """Solve ``small_eff = e_max * f / (f + h)`` for h (GFLOP); a tiny positive h if the small GEMM is as fast."""
    if small_eff <= 0 or small_eff >= e_max:
        return 0.001
    return max(0.001, small_gflop * (e_max / small_eff - 1))


# --------------------------------------------------------------------------------------------------------------
# The CPU as the device (tierflow run --device cpu)
# --------------------------------------------------------------------------------------------------------------

# fp32 GEMMs (tokens, in, out) from small to large: the executor computes in fp32 on a CPU device
HOST_GEMM_SHAPES = [(64, 128, 128), (128, 256, 256), (256, 512, 512), (512, 512, 2048), (1024, 1024, 1024),
                    (1024, 1024, 4096)]
HOST_ATTENTION_SHAPES = [(2, 4, 256, 64), (2, 8, 512, 64)]  # (batch, heads, seq, head_dim)
DEFAULT_HOST_DEVICE_GIB = 2.0  # device memory cap of a CPU "device" when --set gpu.memory_gib is not given


def _cpu_s_per_call(fn: Any, target_s: float, max_iters: int = 10_000) -> float:
    """Best-of-three mean seconds per call of ``fn`` on the CPU, each timing over about ``target_s``."""
    fn()
    t0 = time.perf_counter()
    fn()
    per = max(time.perf_counter() - t0, 1e-7)
    iters = int(min(max_iters, max(1, target_s / per)))
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def fit_gemm_curve(gflops: list[float], tflops: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``rate = peak * f / (f + half)`` (1/rate linear in 1/f): (peak TFLOPS, half GFLOP)."""
    import numpy as np

    x, y = 1.0 / np.asarray(gflops), 1.0 / np.asarray(tflops)
    slope, icept = np.polyfit(x, y, 1)
    if icept <= 0 or 1.0 / icept > 2 * max(tflops):  # still getting faster at the largest size: the best
        return float(max(tflops)), 0.001  # measured rate is the peak, the half size unidentified
    return float(1.0 / icept), float(max(0.001, slope / icept))


def measure_host_device(sizes: Sizes, progress: Progress) -> tuple[dict, dict]:
    """The CPU as the executor uses it for a CPU "device": fp32 GEMM rates over sizes (on torch's intra-op
    threads), elementwise bandwidth, and the device <-> host copies (a memcpy within host memory: one copy
    alone, and two at once on two threads)."""
    torch = _torch()
    threads = torch.get_num_threads()
    gemms = []
    for m_, k, n in HOST_GEMM_SHAPES:
        progress.step(f"CPU fp32 GEMM {m_}x{k}->{n}")
        x, w = torch.randn(m_, k), torch.randn(n, k)
        out = torch.empty(m_, n)
        wt = w.t()
        s = _cpu_s_per_call(lambda x=x, wt=wt, out=out: torch.mm(x, wt, out=out), min(0.2, sizes.gpu_target_s))
        gemms.append({"shape": [m_, k, n], "gflop": 2 * m_ * k * n / 1e9, "tflops": 2 * m_ * k * n / s / 1e12})
    peak, half = fit_gemm_curve([g["gflop"] for g in gemms], [g["tflops"] for g in gemms])
    progress.step("CPU elementwise bandwidth")
    n = max(1, min(sizes.dram_bytes, int(cpu_memory_gib() * GIB / 32)) // 4)
    xs = [torch.ones(n), torch.ones(n), torch.empty(n)]
    elementwise_gbps = 3 * n * 4 / _cpu_s_per_call(lambda: torch.add(xs[0], xs[1], out=xs[2]), 0.1) / 1e9
    progress.step("CPU activation function and attention")
    activation_gbps = 2 * n * 4 / _cpu_s_per_call(
        lambda: torch.nn.functional.gelu(xs[0], approximate="tanh"), 0.1) / 1e9  # the GPT blocks' GELU
    attention = []
    for b, h, sq, d in HOST_ATTENTION_SHAPES:  # causal SDPA, as the executor's blocks call it
        q, k, v = (torch.randn(b, h, sq, d) for _ in range(3))
        sec = _cpu_s_per_call(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True), min(0.2, sizes.gpu_target_s))
        work = 2 * b * h * sq * sq * d  # the causal half of 4 b h s^2 d (costmodel.CAUSAL_ATTENTION_WORK)
        curve = peak * (work / 1e9) / (work / 1e9 + half)  # a GEMM of the same work on the fitted curve, TFLOPS
        attention.append({"shape": [b, h, sq, d], "tflops": work / sec / 1e12, "of_gemm": work / sec / 1e12 / curve})
    progress.step("device <-> host copies")
    copies = measure_host_copies(min(sizes.pcie_bytes, int(cpu_memory_gib() * GIB / 32)))
    gpu = {"model": f"{cpu_model()} via torch ({threads} threads)", "host_cores": threads, "gemms": gemms,
           "peak_tflops": peak, "half_gflop": half, "elementwise_gbps": elementwise_gbps,
           "activation_gbps": activation_gbps, "attention": attention,
           "attention_efficiency": sum(a["of_gemm"] for a in attention) / len(attention)}
    return gpu, copies


def measure_host_copies(nbytes: int) -> dict[str, float]:
    """GB/s of one tensor copy within host memory (what an offload or fetch is on a CPU device), alone and two at
    once on two threads."""
    torch = _torch()
    n = max(1, nbytes // 4)
    bufs = [torch.ones(n) for _ in range(4)]
    solo = n * 4 / _cpu_s_per_call(lambda: bufs[1].copy_(bufs[0]), 0.1) / 1e9
    spans: list[float] = [0.0, 0.0]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        src, dst = bufs[2 * i], bufs[2 * i + 1]
        barrier.wait()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src)
        spans[i] = (time.perf_counter() - t0) / 3

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    both = min(solo, n * 4 / max(spans) / 1e9)
    return {"h2d_gbps": solo, "d2h_gbps": solo, "duplex_h2d_gbps": both, "duplex_d2h_gbps": both}


# --------------------------------------------------------------------------------------------------------------
# Running everything and building the profile
# --------------------------------------------------------------------------------------------------------------


def measurement_plan(device: str, sizes: Sizes = FULL, ssd: bool = False) -> list[str]:
    """What `tierflow calibrate` measures, in order, for `device` ("cuda" or "cpu") and with or without
    --ssd-dir: the progress display's steps (its total) and what `tierflow env` says calibrate would measure."""
    if device == "cuda":
        steps = [f"GPU GEMM {a}x{b}->{c}" for a, b, c in GEMM_SHAPES]
        steps += ["GPU small GEMM", "GPU memory bandwidth", "PCIe H2D / D2H / duplex"]
    else:
        steps = [f"CPU fp32 GEMM {a}x{b}->{c}" for a, b, c in HOST_GEMM_SHAPES]
        steps += ["CPU elementwise bandwidth", "CPU activation function and attention", "device <-> host copies"]
    steps += ["CPU memory bandwidth", f"CPU AdamW ({sizes.adam_params / 1e6:g}M params)"]
    if ssd:
        mib = sizes.ssd_file_bytes / MIB
        steps += [f"SSD write ({mib:.0f} MiB)", f"SSD read ({mib:.0f} MiB)", f"SSD read + write ({sizes.ssd_mixed_s:g} s)"]
    if device == "cpu":
        if ssd:
            steps += ["SSD through the executor's store"]
        steps += ["compute beside the host's I/O threads", "the executor's fixed cost per op (a tiny plan)"]
    return steps


def run_measurements(sizes: Sizes = QUICK, ssd_dir: str | os.PathLike[str] | None = None,
                     progress: Progress | None = None, gpu: bool | None = None,
                     device: str | None = None) -> dict[str, Any]:
    """Every measurement this machine allows; the raw numbers as a JSON-able dict. ``device="cpu"`` measures the
    CPU as the executor's device (``tierflow run --device cpu``) instead of a CUDA GPU."""
    torch = _torch()
    gpu = torch.cuda.is_available() if gpu is None else gpu
    device = device or ("cuda" if gpu else "cpu")
    progress = progress or Progress(0, "calibrate", enabled=False)
    m: dict[str, Any] = {"host": socket.gethostname(), "torch": torch.__version__,
                         "cpu_threads": torch.get_num_threads(), "gpu": None, "pcie": None, "ssd": None,
                         "device": device, "errors": []}
    if device == "cpu":
        m["gpu"], m["pcie"] = measure_host_device(sizes, progress)
    elif gpu:
        m["gpu"], m["pcie"] = _measure_gpu(sizes, progress, m["errors"])
    progress.step("CPU memory bandwidth")
    cpu: dict[str, Any] = {"model": cpu_model(), "memory_gib": cpu_memory_gib()}
    cpu["memory_gbps"] = measure_dram_gbps(min(sizes.dram_bytes, int(cpu["memory_gib"] * GIB / 16)))
    progress.step(f"CPU AdamW ({sizes.adam_params / 1e6:g}M params)")
    adam_params = int(min(sizes.adam_params, cpu["memory_gib"] * GIB / 16 / 4))
    cpu["adam_impl"] = adam_impl()
    cpu["adam_gparams_per_s"] = measure_cpu_adam(adam_params, sizes.adam_steps) / 1e9
    m["cpu"] = cpu
    if ssd_dir is not None:
        m["ssd"] = measure_ssd(ssd_dir, sizes.ssd_file_bytes, sizes.ssd_block_bytes, sizes.ssd_min_s,
                               sizes.ssd_mixed_s, warn=progress.message, step=progress.step)
        m["ssd"]["dir"] = str(ssd_dir)
    if device == "cpu":
        if ssd_dir is not None:
            progress.step("SSD through the executor's store")
            m["ssd"]["store"] = measure_store(ssd_dir, sizes.ssd_file_bytes // 2, sizes.ssd_mixed_s)
        progress.step("compute beside the host's I/O threads")
        m["interference"] = measure_io_interference(ssd_dir, seconds=min(0.4, sizes.ssd_mixed_s),
                                                     copy_bytes=min(64 * MIB, sizes.pcie_bytes))
        progress.step("the executor's fixed cost per op (a tiny plan)")
        m["executor"] = measure_executor_costs(build_profile(m).profile, device, ssd_dir)
    progress.clear()
    return m


def measure_store(directory: str | os.PathLike[str], total_bytes: int, mixed_s: float = 1.0,
                  files: int = 4) -> dict[str, float]:
    """GB/s of the SSD tier as the executor uses it (executor.store.SsdStore: O_DIRECT from aligned buffers, 8 MiB
    requests on its thread pool, a CRC32 per file): write `files` files of `total_bytes` together, read them back,
    then read them again while writing a second set on another thread for about `mixed_s` seconds."""
    torch = _torch()
    from tierflow.executor.store import SsdStore

    store = SsdStore(directory, warn=lambda msg: None)
    n = max(1, total_bytes // files // 4)
    data = [torch.full((n,), float(i)) for i in range(files)]
    names_a, names_b = [f"calibrate-a{i}" for i in range(files)], [f"calibrate-b{i}" for i in range(files)]
    try:
        t0 = time.perf_counter()
        for name, d in zip(names_a, data):
            store.write(name, d)
        write_gbps = files * n * 4 / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for name in names_a:
            store.read(name, torch.float32, n)
        read_gbps = files * n * 4 / (time.perf_counter() - t0) / 1e9
        moved = {"read": 0, "write": 0}
        spans = {"read": 0.0, "write": 0.0}
        start = time.perf_counter()

        def loop(kind: str) -> None:
            i = 0
            while time.perf_counter() - start < mixed_s or i == 0:
                if kind == "read":
                    store.read(names_a[i % files], torch.float32, n)
                else:
                    store.write(names_b[i % files], data[i % files])
                moved[kind] += n * 4
                i += 1
            spans[kind] = time.perf_counter() - start

        threads = [threading.Thread(target=loop, args=(k,)) for k in ("read", "write")]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for name in names_a + names_b:
            store.delete(name)
        store.close()
    return {"read_gbps": read_gbps, "write_gbps": write_gbps, "file_bytes": n * 4,
            "mixed_read_gbps": moved["read"] / spans["read"] / 1e9,
            "mixed_write_gbps": moved["write"] / spans["write"] / 1e9, "direct": store.direct}


INTERFERENCE_GEMM = (512, 512, 512)  # a GEMM on torch's intra-op threads: compute as the executor's blocks run it


def measure_io_interference(directory: str | os.PathLike[str] | None, seconds: float = 0.4,
                            copy_bytes: int = 64 * MIB) -> dict[str, float]:
    """How device compute on a host device and the host's I/O threads slow each other: a GEMM loop on torch's
    intra-op threads timed alone and beside one I/O loop on another thread (a memcpy, as a fetch or offload is
    on a CPU device; an SSD read and an SSD write through the executor's store when `directory` is given), and
    each I/O loop alone and beside the GEMM loop. Returns each rate ratio (alone / beside) and their means:
    `compute_slowdown` (the GEMM's, over the I/O kinds), `copy_slowdown`, `ssd_slowdown`."""
    torch = _torch()
    m_, k, n_ = INTERFERENCE_GEMM
    a, b = torch.randn(m_, k), torch.randn(k, n_)
    out = torch.empty(m_, n_)
    elems = max(1, copy_bytes // 4)
    src, dst = torch.randn(elems), torch.empty(elems)
    store = None
    io: dict[str, Callable[[], int]] = {"copy": lambda: (dst.copy_(src), elems * 4)[1]}
    if directory is not None:
        from tierflow.executor.store import SsdStore

        store = SsdStore(directory, warn=lambda msg: None)
        store.write("interference-r", src)
        io["ssd_read"] = lambda: (store.read("interference-r", torch.float32, elems), elems * 4)[1]
        io["ssd_write"] = lambda: (store.write("interference-w", src), elems * 4)[1]

    def rate(fn: Callable[[], int], stop: threading.Event | None = None, windows: int = 4,
             counted: threading.Event | None = None) -> float:
        """Units of fn per second, after one call: the best of `windows` spans of seconds / windows (as calibrate
        keeps its best timings: on a shared machine a span is only ever slowed by others), or, with `stop`, the
        mean until it is set, over at least one call (`counted` is set once one is timed)."""
        fn()
        if stop is not None:
            t0, done = time.perf_counter(), fn()
            if counted is not None:
                counted.set()
            while not stop.is_set():
                done += fn()
            return done / (time.perf_counter() - t0)
        best = 0.0
        for _ in range(windows):
            t0, done = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds / windows:
                done += fn()
            best = max(best, done / (time.perf_counter() - t0))
        return best

    def gemm() -> int:
        torch.mm(a, b, out=out)
        return 1

    def beside(fg: Callable[[], int], bg: Callable[[], int]) -> tuple[float, float]:
        """(rate of fg, rate of bg) with both running, bg on its own thread."""
        stop, counted, got = threading.Event(), threading.Event(), {}
        th = threading.Thread(target=lambda: got.setdefault("bg", rate(bg, stop, counted=counted)))
        th.start()
        try:
            fg_rate = rate(fg)
            while not counted.is_set() and th.is_alive():  # fg keeps bg company until bg has timed a call
                fg()
        finally:
            stop.set()
            th.join()
        return fg_rate, got["bg"]

    try:
        rate(gemm)  # warm-up (on this project's VM the first seconds of load after a pause ran 10x slower)
        out_d: dict[str, float] = {}
        for kind, fn in io.items():
            gemm_alone, io_alone = rate(gemm), rate(fn)
            gemm_beside, io_beside = beside(gemm, fn)
            out_d[f"gemm_beside_{kind}"] = gemm_alone / gemm_beside
            out_d[f"{kind}_beside_gemm"] = io_alone / io_beside
    finally:
        if store is not None:
            for name in ("interference-r", "interference-w"):
                store.delete(name)
            store.close()
    kinds = list(io)
    out_d["compute_slowdown"] = sum(out_d[f"gemm_beside_{k}"] for k in kinds) / len(kinds)
    out_d["copy_slowdown"] = out_d["copy_beside_gemm"]
    ssd = [out_d[f"{k}_beside_gemm"] for k in ("ssd_read", "ssd_write") if k in io]
    if ssd:
        out_d["ssd_slowdown"] = sum(ssd) / len(ssd)
    return out_d


def measure_executor_costs(profile: HardwareProfile, device: str,
                           ssd_dir: str | os.PathLike[str] | None) -> dict[str, float]:
    """The executor's fixed software cost per op, on each resource: a tiny plan (2 layers x 64, 4 micro-batches of
    32 tokens: every op's work near zero; weights and checkpoints in host memory, optimizer states on the SSD tier
    when there is one) is trained by the executor itself for two rounds, and for every op of the second round its
    measured duration less the cost model's time for its work (`profile`, which has no fixed costs yet), plus the
    hand-off delay (its start less the later of its dependencies' ends and its queue predecessor's end): the
    median per resource, in microseconds. What `gpu.op_overhead_us`, `pcie.latency_us` and `ssd.latency_us` add
    to every op of a plan."""
    import statistics
    import tempfile
    from dataclasses import replace

    from tierflow.executor.run import RunOptions, run_plan
    from tierflow.planner.core.costmodel import link_rates
    from tierflow.planner.core.models import get_model
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

    tiny = replace(get_model("tiny-gpt"), name="calibrate-tiny", num_layers=2, hidden=64, num_heads=2,
                   num_kv_heads=2, head_dim=32, ffn_hidden=256, vocab_size=256, seq_len=32, max_positions=32)
    host, ssd = Split(0.0, 1.0, 0.0), Split(0.0, 0.0, 1.0)
    states = ssd if ssd_dir is not None else host
    placement = Placement(weights=host, master=states, adam_m=states, adam_v=states, grads=host, checkpoints=host)
    hw = profile.with_overrides({"gpu.memory_gib": max(profile.gpu.memory_gib, 0.05),
                                 "cpu.memory_gib": max(profile.cpu.memory_gib, 8.0),
                                 "ssd.count": 1 if ssd_dir is not None else 0})
    cfg = make_schedule("horizontal", tiny, hw, batch=4, micro_batch=1, seq=32, placement=placement,
                        runtime="ideal", iterations=3)
    rates = link_rates(hw)
    with tempfile.TemporaryDirectory(prefix="tierflow-calibrate-") as tmp:
        path = Path(tmp) / "tiny.json"
        write_plan(plan_from_graph(tiny, hw, cfg, build_graph(tiny, hw, cfg)), path)
        res = run_plan(load_plan(path), RunOptions(steps=6, device=device, quiet=True,
                                                   ssd_dir=str(ssd_dir) if ssd_dir is not None else None))
    m = res.measured
    tasks, start, end = m.graph.tasks, m.start_s, m.end_s
    prev: dict[str, int] = {}
    fixed: dict[str, list[float]] = {}
    for t in sorted(tasks, key=lambda t: start[t.id]):
        ready = max([end[d] for d in t.deps] + ([end[prev[t.resource]]] if t.resource in prev else [0.0]))
        prev[t.resource] = t.id
        if t.iteration < 1:  # the round's first iteration waits for its setup
            continue
        work_s = t.work if t.resource in ("gpu", "cpu") else t.work / getattr(rates, t.resource)
        fixed.setdefault(t.resource, []).append((end[t.id] - start[t.id] - work_s) + max(0.0, start[t.id] - ready))

    def med_us(*resources: str) -> float | None:
        xs = [x for r in resources for x in fixed.get(r, [])]
        return max(0.0, statistics.median(xs)) * 1e6 if xs else None

    return {"op_overhead_us": med_us("gpu"), "pcie_latency_us": med_us("h2d", "d2h"),
            "ssd_latency_us": med_us("ssd_read", "ssd_write"),
            "ops": {r: len(v) for r, v in fixed.items()}}


def _measure_gpu(sizes: Sizes, progress: Progress, errors: list[str]) -> tuple[dict | None, dict | None]:
    """GPU and PCIe numbers; a failing measurement is reported in ``errors`` and left to the base profile."""
    torch = _torch()
    gpu: dict[str, Any] = gpu_info()
    try:
        gemms = []
        for shape in GEMM_SHAPES:
            progress.step(f"GPU GEMM {shape[0]}x{shape[1]}->{shape[2]}")
            gemms.append({"shape": list(shape), "gflop": 2 * math.prod(shape) / 1e9,
                          "tflops": measure_gemm_tflops(*shape, target_s=sizes.gpu_target_s)})
            torch.cuda.empty_cache()
        progress.step("GPU small GEMM")
        gpu["gemms"] = gemms
        gpu["best_tflops"] = max(g["tflops"] for g in gemms)
        gpu["small_gflop"] = 2 * math.prod(SMALL_GEMM) / 1e9
        gpu["small_tflops"] = measure_gemm_tflops(*SMALL_GEMM, target_s=sizes.gpu_target_s)
    except RuntimeError as e:
        errors.append(f"GPU GEMM: {' '.join(str(e).split())[:200]}")
    try:
        progress.step("GPU memory bandwidth")
        gpu["hbm_gbps"] = measure_hbm_gbps(sizes.hbm_bytes, sizes.gpu_target_s)
    except RuntimeError as e:
        errors.append(f"GPU memory bandwidth: {' '.join(str(e).split())[:200]}")
    torch.cuda.empty_cache()
    pcie = None
    try:
        progress.step("PCIe H2D / D2H / duplex")
        pcie = measure_pcie(min(sizes.pcie_bytes, int(cpu_memory_gib() * GIB / 16)))
    except RuntimeError as e:
        errors.append(f"PCIe: {' '.join(str(e).split())[:200]}")
    torch.cuda.empty_cache()
    return gpu, pcie


@dataclass
class FieldInfo:
    key: str  # dotted, e.g. "gpu.peak_tflops"
    value: Any
    source: str  # "measured", "derived", "from <base>", "no --ssd-dir"
    note: str = ""


@dataclass
class Calibration:
    profile: HardwareProfile
    fields: list[FieldInfo]
    base_name: str
    notes: list[str] = field(default_factory=list)

    @property
    def not_measured(self) -> list[str]:
        return [f.key for f in self.fields if not f.source.startswith(("measured", "derived"))]

    def to_json(self, measurements: dict[str, Any] | None = None, output: str | None = None) -> dict[str, Any]:
        return {
            "output": output,
            "profile": self.profile.to_dict(),
            "fields": [{"field": f.key, "value": f.value, "source": f.source, "note": f.note} for f in self.fields],
            "not_measured": self.not_measured,
            "base": self.base_name,
            "notes": self.notes,
            "measurements": measurements,
        }


def _sig(x: float, digits: int = 4) -> float:
    """Round to ``digits`` significant digits (readable YAML)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def _gpu_matches(base_model: str, measured: str) -> bool:
    tokens = [t.lower() for t in re.findall(r"[A-Za-z]*\d+[A-Za-z0-9]*", base_model)]
    return not tokens or any(t in measured.lower() for t in tokens)


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE pairs: numbers as numbers, null as None, the rest as text (validated with the profile)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or "." not in key:
            raise CliError(f"--set {pair}: expected SECTION.KEY=VALUE, e.g. --set gpu.memory_gib=2")
        value: Any = text.strip()
        if value.lower() in ("null", "none"):
            value = None
        else:
            for parse in (int, float):
                try:
                    value = parse(value)
                    break
                except ValueError:
                    pass
        out[key.strip()] = value
    return out


def build_profile(measurements: dict[str, Any], base: HardwareProfile | None = None,
                  name: str | None = None, device_gib: float | None = None,
                  overrides: dict[str, Any] | None = None) -> Calibration:
    """The profile for ``measurements`` (from :func:`run_measurements`): measured values where there are any,
    the rest from ``base`` (default: the bundled rtx4090-lohan for gpu/pcie/price and no SSD tier)."""
    explicit_base = base is not None
    base = base if base is not None else load_profile(FALLBACK_BASE)
    base_name = base.name
    from_base = f"from {base_name}"
    data = base.to_dict()
    info: dict[str, FieldInfo] = {}
    notes: list[str] = []

    def put(key: str, value: Any, source: str, note: str = "") -> None:
        section, _, k = key.partition(".")
        value = _sig(value) if isinstance(value, float) else value
        data[section][k] = value
        info[key] = FieldInfo(key, value, source, note)

    # ---- GPU
    g = measurements.get("gpu")
    host_device = measurements.get("device") == "cpu" and g is not None
    if host_device:
        cap = device_gib if device_gib is not None else DEFAULT_HOST_DEVICE_GIB
        put("gpu.model", g["model"], "measured", "the device is this CPU (tierflow run --device cpu)")
        put("gpu.memory_gib", cap, "given" if device_gib is not None else "default",
            "the device memory cap (--set gpu.memory_gib=...); the executor enforces it")
        put("gpu.reserved_gib", 0.0, "derived", "no CUDA context on a CPU device")
        put("gpu.peak_tflops", g["peak_tflops"], "measured",
            f"fit of fp32 GEMM rates at {len(g['gemms'])} sizes: rate = peak x f / (f + half)")
        put("gpu.gemm_efficiency", 1.0, "derived", "the fitted peak is what large GEMMs reach")
        put("gpu.gemm_half_gflop", g["half_gflop"], "measured", "same fit")
        per_plan_byte = PLAN_BYTES_PER_ELEMENT / HOST_DEVICE_BYTES_PER_ELEMENT
        plan_bytes = (f"in plan bytes: plans count {PLAN_BYTES_PER_ELEMENT} per element, the CPU device computes "
                      f"in fp32 ({HOST_DEVICE_BYTES_PER_ELEMENT}), so the measured GB/s x {per_plan_byte:g}")
        put("gpu.hbm_gbps", g["elementwise_gbps"] * per_plan_byte, "measured",
            f"torch add of large fp32 tensors ({g['elementwise_gbps']:.3g} GB/s), {plan_bytes}")
        put("gpu.hbm_efficiency", 1.0, "derived", "hbm_gbps above is measured")
        put("gpu.host_cores", g["host_cores"], "measured", "torch intra-op threads: compute shares these cores")
        if g.get("activation_gbps"):
            put("gpu.activation_gbps", g["activation_gbps"] * per_plan_byte, "measured",
                f"tanh GELU of large fp32 tensors ({g['activation_gbps']:.3g} GB/s read + written), {plan_bytes}")
        if g.get("attention"):
            put("gpu.attention_efficiency", min(1.0, g["attention_efficiency"]), "measured",
                "causal scaled_dot_product_attention at " + ", ".join(
                    f"{a['shape']}: {a['tflops']:.3g} TFLOPS" for a in g["attention"]) + ", over a GEMM of its work")
        ex = measurements.get("executor") or {}
        if ex.get("op_overhead_us") is not None:
            put("gpu.op_overhead_us", ex["op_overhead_us"], "measured",
                "the executor's compute ops on a tiny plan: median of (duration - the cost model's time) + hand-off")
    elif g:
        put("gpu.model", g["model"], "measured", "torch.cuda.get_device_properties")
        put("gpu.memory_gib", g["memory_gib"], "measured", "torch.cuda.get_device_properties")
        put("gpu.reserved_gib", 0.6 + 0.05 * g["memory_gib"], "derived",
            "assumption: 0.6 GiB CUDA context + 5% fragmentation")
        if explicit_base and not _gpu_matches(base.gpu.model, g["model"]):
            notes.append(f"the base's GPU is '{base.gpu.model}' but this one is '{g['model']}': "
                         "peak_tflops and hbm_gbps come from the base's datasheet; pass the right --base")
        if "best_tflops" in g:
            best = g["best_tflops"]
            if explicit_base:
                peak = base.gpu.peak_tflops
                put("gpu.peak_tflops", peak, from_base, "datasheet peak")
                eff = best / peak
                if eff > 1:
                    notes.append(f"measured {best:.0f} TFLOPS is above the base's peak {peak:g}: "
                                 "gemm_efficiency capped at 1 (is --base the right GPU?)")
                eff = min(eff, 1.0)
            else:
                eff = NO_BASE_GEMM_EFFICIENCY
                put("gpu.peak_tflops", best / eff, "derived",
                    f"no --base: best measured {best:.0f} TFLOPS / {eff:g}")
                notes.append(f"no --base datasheet: gpu.peak_tflops set to the best measured GEMM rate / {eff:g} "
                             f"(gemm_efficiency {eff:g}); pass --base PROFILE to keep a datasheet peak")
            put("gpu.gemm_efficiency", eff, "measured" if explicit_base else "derived",
                f"best GEMM {best:.0f} TFLOPS / peak")
            peak = data["gpu"]["peak_tflops"]
            half = fit_gemm_half_gflop(g["small_gflop"], g["small_tflops"] / peak, data["gpu"]["gemm_efficiency"])
            put("gpu.gemm_half_gflop", half, "measured",
                f"fit: {g['small_gflop']:.2f} GFLOP GEMM at {g['small_tflops']:.0f} TFLOPS")
        if "hbm_gbps" in g:
            hbm = g["hbm_gbps"]
            if explicit_base:
                put("gpu.hbm_gbps", base.gpu.hbm_gbps, from_base, "datasheet peak")
                if hbm > base.gpu.hbm_gbps:
                    notes.append(f"measured HBM {hbm:.0f} GB/s is above the base's {base.gpu.hbm_gbps:g}: "
                                 "hbm_efficiency capped at 1")
                put("gpu.hbm_efficiency", min(1.0, hbm / base.gpu.hbm_gbps), "measured",
                    f"copy at {hbm:.0f} GB/s / datasheet")
            else:
                put("gpu.hbm_gbps", hbm / NO_BASE_HBM_EFFICIENCY, "derived",
                    f"no --base: measured {hbm:.0f} GB/s / {NO_BASE_HBM_EFFICIENCY:g}")
                put("gpu.hbm_efficiency", NO_BASE_HBM_EFFICIENCY, "derived", "assumption, as in the bundled profiles")
    p = measurements.get("pcie")
    if p:
        h2d = p["h2d_gbps"]
        d2h = p["d2h_gbps"]
        what = "copy within host memory (a CPU device)" if host_device else "pinned copy"
        if host_device:
            put("pcie.generation", 1, "derived", "no PCIe link: device <-> host copies stay in host memory")
        else:
            put("pcie.generation", pcie_generation_from_rate(h2d), "derived", "from the H2D rate, assuming x16")
        scale = PLAN_BYTES_PER_ELEMENT / HOST_DEVICE_BYTES_PER_ELEMENT if host_device else 1.0
        if host_device:  # what crosses this "link" (weights, activations, gradients) is in the compute dtype
            what += (f", in plan bytes (plans count {PLAN_BYTES_PER_ELEMENT} per element, the CPU device moves fp32: "
                     f"the measured GB/s x {scale:g})")
        put("pcie.h2d_gbps", h2d * scale, "measured", what)
        put("pcie.d2h_gbps", d2h * scale, "measured", what)
        # rounding must not make a duplex rate exceed its solo rate
        put("pcie.duplex_h2d_gbps", min(_sig(p["duplex_h2d_gbps"] * scale), data["pcie"]["h2d_gbps"]), "measured",
            "H2D while D2H runs (two streams)" if not host_device else "two copies at once on two threads, likewise")
        put("pcie.duplex_d2h_gbps", min(_sig(p["duplex_d2h_gbps"] * scale), data["pcie"]["d2h_gbps"]), "measured",
            "D2H while H2D runs (two streams)" if not host_device else "two copies at once on two threads, likewise")
        ex = measurements.get("executor") or {}
        if host_device and ex.get("pcie_latency_us") is not None:
            put("pcie.latency_us", ex["pcie_latency_us"], "measured",
                "the executor's transfer ops on a tiny plan: median of (duration - bytes / rate) + hand-off")

    # ---- CPU
    c = measurements["cpu"]
    put("cpu.model", c["model"], "measured", "/proc/cpuinfo")
    put("cpu.memory_gib", c["memory_gib"], "measured", "sysconf")
    put("cpu.reserved_gib", min(6 + 0.05 * c["memory_gib"], 0.5 * c["memory_gib"]), "derived",
        "assumption: 6 GiB OS + runtime + 5% (at most half)")
    put("cpu.memory_gbps", c["memory_gbps"], "measured", "large copy, read + write bytes (below datasheet peak)")
    put("cpu.memory_efficiency", 1.0, "derived",
        "memory_gbps is a measured copy rate, already what the box sustains (host memory is modelled as shared)")
    if host_device:
        put("cpu.cores", measurements.get("cpu_threads") or g["host_cores"], "measured",
            "torch intra-op threads: compute, CPU Adam and the copies share them")
    else:
        put("cpu.cores", None, "derived", "core sharing is modelled only when the device is this CPU")
    itf = measurements.get("interference") if host_device else None
    if itf:
        gemm = INTERFERENCE_GEMM
        put("cpu.compute_slowdown_per_io_op", max(1.0, itf["compute_slowdown"]), "measured",
            f"a {gemm[0]}x{gemm[1]}x{gemm[2]} GEMM loop beside one I/O loop on another thread, mean over "
            + ", ".join(f"{k[len('gemm_beside_'):]} {v:.2f}x" for k, v in itf.items() if k.startswith("gemm_beside_")))
        put("cpu.copy_slowdown_beside_compute", max(1.0, itf["copy_slowdown"]), "measured",
            "a memcpy loop beside the GEMM loop, against alone")
        if "ssd_slowdown" in itf:
            put("cpu.ssd_slowdown_beside_compute", max(1.0, itf["ssd_slowdown"]), "measured",
                "the executor's store reading, then writing, beside the GEMM loop, against alone")
    put("cpu.adam_gparams_per_s", c["adam_gparams_per_s"], "measured",
        f"torch AdamW ({c.get('adam_impl', '?')}) on {measurements.get('cpu_threads', '?')} threads")

    # ---- SSD
    s = measurements.get("ssd")
    if s:
        where = s.get("dir", "--ssd-dir")
        io = "O_DIRECT" if s.get("direct", True) else "buffered (no O_DIRECT)"
        put("ssd.count", 1, "measured", "the directory's filesystem measured as ONE device (RAID0 = one drive)")
        put("ssd.model", s["model"], "measured", f"block device of {where}")
        put("ssd.capacity_gb", s["capacity_gb"], "measured", "free space on the filesystem, not the drive size")
        put("ssd.read_gbps", s["read_gbps"], "measured", f"sequential {io}, {s['block_bytes'] // MIB} MiB blocks")
        put("ssd.write_gbps", s["write_gbps"], "measured", f"sequential {io} + fsync")
        put("ssd.array_read_gbps", None, "derived", "one device: no separate array ceiling")
        put("ssd.array_write_gbps", None, "derived", "one device: no separate array ceiling")
        put("ssd.rw_sharing", s["rw_sharing"], "measured",
            f"mixed {s['mixed_read_gbps']:.2f} read + {s['mixed_write_gbps']:.2f} write GB/s vs solo "
            f"{max(s['read_gbps'], s['write_gbps']):.2f}")
        kept = (s["mixed_read_gbps"] / s["read_gbps"] + s["mixed_write_gbps"] / s["write_gbps"]) / 2
        put("ssd.mixed_efficiency", min(1.0, max(0.5, kept)), "measured",
            "mean fraction of its solo rate each direction kept in the mixed run (within [0.5, 1])")
        st = s.get("store")
        if host_device and st:  # the SSD tier as the executor's own store achieves it (O_DIRECT, CRC32, its pool)
            what = f"the executor's SsdStore, {st['file_bytes'] // MIB} MiB files"
            put("ssd.read_gbps", st["read_gbps"], "measured", f"{what} (raw {io}: {s['read_gbps']:.2f})")
            put("ssd.write_gbps", st["write_gbps"], "measured", f"{what} (raw {io}: {s['write_gbps']:.2f})")
            kept = (st["mixed_read_gbps"] / st["read_gbps"] + st["mixed_write_gbps"] / st["write_gbps"]) / 2
            put("ssd.mixed_efficiency", min(1.0, max(0.5, kept)), "measured",
                f"{what}: mean fraction of its solo rate each direction kept reading and writing at once")
        ex = measurements.get("executor") or {}
        if host_device and ex.get("ssd_latency_us") is not None:
            put("ssd.latency_us", ex["ssd_latency_us"], "measured",
                "the executor's SSD ops on a tiny plan: median of (duration - bytes / rate) + hand-off")
        if not s.get("direct", True):
            notes.append(f"{where} refused O_DIRECT: the SSD rates were measured with buffered I/O and may be "
                         "optimistic")
    elif not explicit_base:
        data["ssd"] = {"count": 0}
        info["ssd.count"] = FieldInfo("ssd.count", 0, "no --ssd-dir", "no SSD tier: pass --ssd-dir to measure one")
        notes.append("no --ssd-dir: the profile has no SSD tier (ssd.count = 0); pass --ssd-dir DIR on the SSD")

    for key, value in (overrides or {}).items():  # --set: the user's values win
        section, _, k = key.partition(".")
        if section not in data or k not in data[section]:
            raise CliError(f"--set {key}: unknown profile key (keys are SECTION.KEY as in a profile YAML)")
        put(key, value, "given", "--set")
    if "cpu.memory_gib" in (overrides or {}) and "cpu.reserved_gib" not in overrides:
        mem = data["cpu"]["memory_gib"]
        put("cpu.reserved_gib", min(6 + 0.05 * mem, 0.5 * mem), "derived",
            "assumption: 6 GiB OS + runtime + 5% of the given memory (at most half)")
    if device_gib is not None and not host_device:
        put("gpu.memory_gib", device_gib, "given", "--set")

    # ---- the rest from the base
    for section in ("gpu", "pcie", "cpu", "ssd", "price"):
        for k, v in data[section].items():
            key = f"{section}.{k}"
            if key not in info:
                info[key] = FieldInfo(key, v, from_base, "not measured" if section != "price" else "not measured (price)")
    if not g:
        notes.append(f"no CUDA GPU: the gpu and pcie sections are the {base_name} profile's "
                     f"({base.gpu.model}); run calibrate on the GPU box to measure them, or --device cpu to "
                     "profile this CPU as the device")
    for err in measurements.get("errors", []):
        notes.append(f"measurement failed, value taken from {base_name}: {err}")

    host = re.sub(r"[^A-Za-z0-9._-]", "-", str(measurements.get("host") or "box"))[:40] or "box"
    data["name"] = name or f"calibrated-{host}"
    measured_parts = ["CPU"] + (["GPU"] if g else []) + (["PCIe"] if p else []) + (["SSD"] if s else [])
    data["description"] = (f"measured by tierflow calibrate on {host} {time.strftime('%Y-%m-%d')}: "
                           f"{', '.join(measured_parts)} measured; the rest from {base_name}")
    profile = profile_from_dict(data, source="tierflow calibrate")
    order = [f"{sec}.{k}" for sec in ("gpu", "pcie", "cpu", "ssd", "price") for k in profile.to_dict()[sec]]
    fields = [info[k] for k in order if k in info]
    return Calibration(profile, fields, base_name, notes)


# --------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------


def format_table(cal: Calibration) -> str:
    rows = [[f.key, format_value(f.value), f.source, f.note] for f in cal.fields]
    header = ["field", "value", "source", "note"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    line = lambda r: "  ".join([r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].ljust(widths[2]), r[3]]).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths] + ["----"]), *map(line, rows)])


def write_profile(cal: Calibration, path: str | os.PathLike[str]) -> None:
    """save_profile, then a comment per field (measured / derived / from base); plain if comments would break it."""
    save_profile(cal.profile, path)
    plain = Path(path).read_text(encoding="utf-8")
    notes = {f.key: f"{f.source}{': ' + f.note if f.note else ''}" for f in cal.fields}
    lines = plain.splitlines()
    printable = lambda text: re.sub(r"[^\x20-\x7e]", "?", text)  # noqa: E731
    out, section = [], ""
    key_re, section_re = re.compile(r"^  ([a-z0-9_]+): \S"), re.compile(r"^([a-z_]+):\s*$")
    for i, text in enumerate(lines):
        if section_re.match(text):
            section = section_re.match(text).group(1)
        m = key_re.match(text)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        single_line = not nxt.startswith("   ") and "#" not in text
        if m and single_line and f"{section}.{m.group(1)}" in notes:
            comment = printable(notes[f"{section}.{m.group(1)}"])
            text = f"{text}  # {comment}"
        out.append(text)
    header = [f"# not measured (taken from {cal.base_name}): {', '.join(cal.not_measured) or 'none'}"]
    header += [f"# note: {printable(n)}" for n in cal.notes]
    annotated = "\n".join([*out[:2], *header, *out[2:]]) + "\n"
    Path(path).write_text(annotated, encoding="utf-8")
    try:
        ok = load_profile(Path(path)).to_dict() == cal.profile.to_dict()
    except ValueError:
        ok = False
    if not ok:
        Path(path).write_text(plain, encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    torch = _torch()
    sizes = QUICK if args.quick else FULL
    if args.ssd_file_mib is not None:
        if args.ssd_file_mib < 1:
            raise CliError(f"--ssd-file-mib {args.ssd_file_mib}: must be at least 1")
        sizes = Sizes(**{**sizes.__dict__, "ssd_file_bytes": args.ssd_file_mib * MIB,
                         "ssd_block_bytes": min(sizes.ssd_block_bytes, args.ssd_file_mib * MIB)})
    out = Path(args.out)
    if out.is_dir():
        raise CliError(f"-o {out}: is a directory (give a file name such as {out / 'box.yaml'})")
    if not out.parent.is_dir():
        raise CliError(f"-o {out}: directory {out.parent} does not exist (create it or choose another path)")
    if not os.access(out.parent, os.W_OK):
        raise CliError(f"-o {out}: directory {out.parent} is not writable (choose another path)")
    base = load_profile(args.base) if args.base else None
    ssd_dir = None
    if args.ssd_dir is not None:
        ssd_dir = check_ssd_dir(args.ssd_dir, ssd_need_bytes(sizes.ssd_file_bytes))
    gpu = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if gpu else "cpu")
    if device == "cuda" and not gpu:
        raise CliError("--device cuda: no CUDA device is available here (use --device cpu to profile this CPU "
                       "as the device)")
    overrides = _parse_sets(args.set or [])
    progress = Progress(len(measurement_plan(device, sizes, ssd_dir is not None)), "calibrate")
    try:
        m = run_measurements(sizes, ssd_dir, progress, gpu=gpu, device=device)
    except OSError as e:
        if ssd_dir is None:
            raise
        raise CliError(f"--ssd-dir {ssd_dir}: {e.strerror or e} while measuring (check the directory, its free "
                       "space and permissions, or give another one)") from None
    finally:
        progress.clear()
    cal = build_profile(m, base, name=args.name, device_gib=overrides.pop("gpu.memory_gib", None),
                        overrides=overrides)
    write_profile(cal, out)
    if args.json:
        print(json.dumps(cal.to_json(m, str(out)), indent=2))
        return 0
    print(f"tierflow calibrate on {m['host']} (torch {m['torch']}, {m['cpu_threads']} CPU threads"
          f"{', quick' if args.quick else ''})")
    print()
    print(format_table(cal))
    print()
    for n in cal.notes:
        print(f"note: {n}")
    print(f"not measured (taken from {cal.base_name}): {', '.join(cal.not_measured) or 'none'}")
    print(f"wrote {out}: {cal.profile.summary()}")
    print(f"use it with: tierflow simulate --hw {out}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine (GPU, PCIe, CPU, SSD) and write a hardware profile",
        description="Measure this machine and write a hardware profile for `tierflow simulate --hw FILE`. "
        "Measures the GPU (when CUDA is available), PCIe copies, DRAM bandwidth, CPU Adam and, with --ssd-dir, "
        "the SSD. What it cannot measure comes from --base (default: the bundled rtx4090-lohan for gpu/pcie "
        "and prices, and no SSD tier).")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="profile YAML to write, e.g. box.yaml")
    p.add_argument("--ssd-dir", default=None, metavar="DIR",
                   help="a directory on the SSD (array) to measure; needs 2x the test file free (4.1 GB, or "
                   "0.6 GB with --quick)")
    p.add_argument("--base", default=None, metavar="PROFILE",
                   help="profile name or YAML for what cannot be measured and for datasheet peaks "
                   "(gpu.peak_tflops, gpu.hbm_gbps) and prices")
    p.add_argument("--quick", action="store_true", help="smaller, shorter measurements (under ~20 s)")
    p.add_argument("--ssd-file-mib", type=positive_int(1 << 20), default=None, metavar="N",
                   help="size of the SSD test file in MiB (default 2048, 256 with --quick)")
    p.add_argument("--name", default=None, help="profile name (default calibrated-<hostname>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="the device tierflow run will train on: cuda measures the GPU and PCIe; cpu measures this "
                   "CPU as the device (fp32 GEMMs over sizes, elementwise bandwidth, copies within host memory, "
                   "its cores shared with CPU Adam); auto: cuda when available, else cpu")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="set a profile field after measuring, e.g. --set gpu.memory_gib=2 (the device memory cap "
                   "of a CPU device; default 2) or --set cpu.memory_gib=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the fields, sources and raw measurements as JSON")
    p.set_defaults(func=cmd_calibrate)
