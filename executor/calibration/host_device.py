"""Measuring the CPU as the executor's device (``tierflow run --device cpu``): fp32 GEMM rates at six sizes
fitted to the cost model's curve, elementwise and activation bandwidth, causal attention, and the device <->
host copies (copies within host memory, alone and two at once)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from tierflow.executor.calibration.common import GIB, Sizes, import_torch
from tierflow.executor.calibration.cpu import cpu_memory_gib, cpu_model
from tierflow.planner.io.progress import Progress

HOST_GEMM_SHAPES = [(64, 128, 128), (128, 256, 256), (256, 512, 512), (512, 512, 2048), (1024, 1024, 1024),
                    (1024, 1024, 4096)]
HOST_ATTENTION_SHAPES = [(2, 4, 256, 64), (2, 8, 512, 64)]  # (batch, heads, seq, head_dim)


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
    """Least-squares fit of ``rate = peak * f / (f + half)`` (1/rate linear in 1/f): (peak TFLOPS, half
    GFLOP)."""
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
    torch = import_torch()
    threads = torch.get_num_threads()
    gemms = []
    for m_, k, n in HOST_GEMM_SHAPES:
        progress.step(f"CPU fp32 GEMM {m_}x{k}->{n}")
        x, w = torch.randn(m_, k), torch.randn(n, k)
        out = torch.empty(m_, n)
        wt = w.t()
        s = _cpu_s_per_call(lambda x=x, wt=wt, out=out: torch.mm(x, wt, out=out),
                            min(0.2, sizes.gpu_target_s))
        gemms.append({"shape": [m_, k, n], "gflop": 2 * m_ * k * n / 1e9,
                      "tflops": 2 * m_ * k * n / s / 1e12})
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
        curve = peak * (work / 1e9) / (work / 1e9 + half)  # a GEMM of the same work on the fitted curve
        attention.append({"shape": [b, h, sq, d], "tflops": work / sec / 1e12,
                          "of_gemm": work / sec / 1e12 / curve})
    progress.step("device <-> host copies")
    copies = measure_host_copies(min(sizes.pcie_bytes, int(cpu_memory_gib() * GIB / 32)))
    gpu = {"model": f"{cpu_model()} via torch ({threads} threads)", "host_cores": threads, "gemms": gemms,
           "peak_tflops": peak, "half_gflop": half, "elementwise_gbps": elementwise_gbps,
           "activation_gbps": activation_gbps, "attention": attention,
           "attention_efficiency": sum(a["of_gemm"] for a in attention) / len(attention)}
    return gpu, copies


def measure_host_copies(nbytes: int) -> dict[str, float]:
    """GB/s of one tensor copy within host memory (what an offload or fetch is on a CPU device), alone and two
    at once on two threads."""
    torch = import_torch()
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

