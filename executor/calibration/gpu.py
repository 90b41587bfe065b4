"""Measuring a CUDA GPU (none of this runs without one): bf16 GEMM TFLOPS at transformer shapes (CUDA events
after warm-up, small GEMMs from a CUDA graph), HBM bandwidth, memory size, and pinned H2D / D2H bandwidth
alone and both at once on two streams."""

from __future__ import annotations

import math
from typing import Any

from tierflow.executor.calibration.common import GIB, MIB, Sizes, import_torch
from tierflow.executor.calibration.cpu import cpu_memory_gib
from tierflow.planner.io.progress import Progress

# (tokens, in_features, out_features): the GEMMs of a 4096-wide transformer block and one large square.
GEMM_SHAPES = [(8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096), (8192, 8192, 8192)]
SMALL_GEMM = (1024, 1024, 1024)  # ~2.1 GFLOP: near the half-efficiency size of current GPUs


def _cuda_ms_per_call(fn: Any, target_s: float, max_iters: int = 2000) -> float:
    """Mean milliseconds per call of ``fn`` timed with CUDA events after warm-up, over about ``target_s``."""
    torch = import_torch()
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
    """As _cuda_ms_per_call, but the calls are replayed from a CUDA graph: one launch for all of them, so that
    a kernel shorter than Python's launch overhead (a 1024^3 bf16 GEMM takes ~3 us on an H100) is timed, not
    the launches. Falls back to plain launches where capture fails."""
    torch = import_torch()
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
    """bf16 TFLOPS of ``x[tokens, d_in] @ W[d_out, d_in]^T`` (a Linear layer's forward), timed from a CUDA
    graph (launch overhead would otherwise inflate the small GEMMs that fit gemm_half_gflop)."""
    torch = import_torch()
    x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, d_out, device="cuda", dtype=torch.bfloat16)
    wt = w.t()
    ms = _cuda_graph_ms_per_call(lambda: torch.mm(x, wt, out=out), target_s)
    return 2 * tokens * d_in * d_out / (ms * 1e-3) / 1e12


def measure_hbm_gbps(nbytes: int, target_s: float = 0.1) -> float:
    """Device memory bandwidth in GB/s of a device-to-device copy (read + write bytes)."""
    torch = import_torch()
    free, _ = torch.cuda.mem_get_info()
    nbytes = int(min(nbytes, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _cuda_ms_per_call(lambda: dst.copy_(src), target_s, max_iters=200)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_pcie(nbytes: int, chunks: int = 16) -> dict[str, float]:
    """Pinned H2D and D2H GB/s alone, and each direction's rate while the other runs on a second stream."""
    torch = import_torch()
    nbytes = max(chunks * MIB, nbytes // (chunks * MIB) * chunks * MIB)
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {
        "h2d_gbps": nbytes / (_cuda_ms_per_call(lambda: dev_a.copy_(host_a, non_blocking=True), 0.0, 3)
                              * 1e-3) / 1e9,
        "d2h_gbps": nbytes / (_cuda_ms_per_call(lambda: host_b.copy_(dev_b, non_blocking=True), 0.0, 3)
                              * 1e-3) / 1e9,
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
    torch = import_torch()
    props = torch.cuda.get_device_properties(0)
    return {"model": " ".join(str(props.name).split()) or "unknown GPU",
            "memory_gib": props.total_memory / GIB}


def pcie_generation_from_rate(h2d_gbps: float) -> int:
    """PCIe generation a x16 link with this pinned H2D rate most likely has (3: ~12, 4: ~25, 5: ~50 GB/s)."""
    for gen, ceiling in ((3, 18.0), (4, 37.0), (5, 75.0)):
        if h2d_gbps < ceiling:
            return gen
    return 6


def fit_gemm_half_gflop(small_gflop: float, small_eff: float, e_max: float) -> float:
    """Solve ``small_eff = e_max * f / (f + h)`` for h (GFLOP); a tiny positive h if the small GEMM is as
    fast."""
    if small_eff <= 0 or small_eff >= e_max:
        return 0.001
    return max(0.001, small_gflop * (e_max / small_eff - 1))



def measure_gpu(sizes: Sizes, progress: Progress, errors: list[str]) -> tuple[dict | None, dict | None]:
    """GPU and PCIe numbers; a failing measurement is reported in ``errors`` and left to the base profile."""
    torch = import_torch()
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
