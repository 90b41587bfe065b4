"""Running every measurement this machine allows, in order (`run_measurements`), and the list of them
(`measurement_plan`: the progress display's steps and what `tierflow env` says calibrate would measure)."""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any

from tierflow.executor.calibration.common import FULL, GIB, MIB, QUICK, Sizes, import_torch
from tierflow.executor.calibration.cpu import (
    adam_impl,
    cpu_memory_gib,
    cpu_model,
    host_cpu_facts,
    measure_cpu_adam,
    measure_deepspeed_adam,
    measure_dram_gbps,
)
from tierflow.executor.calibration.executor_costs import (
    measure_executor_costs,
    measure_executor_dispatch,
    measure_graph_costs,
    measure_io_interference,
    measure_store,
)
from tierflow.executor.calibration.gpu import GEMM_SHAPES, measure_gpu
from tierflow.executor.calibration.host_device import HOST_GEMM_SHAPES, measure_host_device
from tierflow.executor.calibration.profile_builder import build_profile
from tierflow.executor.calibration.ssd import measure_ssd
from tierflow.planner.io.progress import Progress


def measurement_plan(device: str, sizes: Sizes = FULL, ssd: bool = False) -> list[str]:
    """What `tierflow calibrate` measures, in order, for `device` ("cuda" or "cpu") and with or without
    --ssd-dir: the progress display's steps (its total) and what `tierflow env` says calibrate would
    measure."""
    if device == "cuda":
        steps = [f"GPU GEMM {a}x{b}->{c}" for a, b, c in GEMM_SHAPES]
        steps += ["GPU small GEMM", "GPU memory bandwidth", "PCIe H2D / D2H / duplex"]
    else:
        steps = [f"CPU fp32 GEMM {a}x{b}->{c}" for a, b, c in HOST_GEMM_SHAPES]
        steps += ["CPU elementwise bandwidth", "CPU activation function and attention",
                  "device <-> host copies"]
    steps += ["CPU memory bandwidth", f"CPU AdamW ({sizes.adam_params / 1e6:g}M params)"]
    if importlib.util.find_spec("deepspeed") is not None:
        steps += [f"DeepSpeedCPUAdam ({sizes.adam_params / 1e6:g}M params)"]
    if device == "cuda":
        steps += ["GPU launches beside the host optimizer"]
    if ssd:
        mib = sizes.ssd_file_bytes / MIB
        steps += [f"SSD write ({mib:.0f} MiB)", f"SSD read ({mib:.0f} MiB)",
                  f"SSD read + write ({sizes.ssd_mixed_s:g} s)"]
    if device == "cpu":
        if ssd:
            steps += ["SSD through the executor's store"]
        steps += ["compute beside the host's I/O threads"]
    steps += ["the executor's fixed cost per op (a tiny plan)"]
    return steps


def run_measurements(sizes: Sizes = QUICK, ssd_dir: str | os.PathLike[str] | None = None,
                     progress: Progress | None = None, gpu: bool | None = None,
                     device: str | None = None) -> dict[str, Any]:
    """Every measurement this machine allows; the raw numbers as a JSON-able dict. ``device="cpu"`` measures
    the CPU as the executor's device (``tierflow run --device cpu``) instead of a CUDA GPU."""
    torch = import_torch()
    gpu = torch.cuda.is_available() if gpu is None else gpu
    device = device or ("cuda" if gpu else "cpu")
    progress = progress or Progress(0, "calibrate", enabled=False)
    m: dict[str, Any] = {"host": socket.gethostname(), "torch": torch.__version__,
                         "cpu_threads": torch.get_num_threads(), "gpu": None, "pcie": None, "ssd": None,
                         "device": device, "errors": []}
    if device == "cpu":
        m["gpu"], m["pcie"] = measure_host_device(sizes, progress)
    elif gpu:
        m["gpu"], m["pcie"] = measure_gpu(sizes, progress, m["errors"])
    progress.step("CPU memory bandwidth")
    cpu: dict[str, Any] = {"model": cpu_model(), "memory_gib": cpu_memory_gib(), "facts": host_cpu_facts()}
    cpu["memory_gbps"] = measure_dram_gbps(min(sizes.dram_bytes, int(cpu["memory_gib"] * GIB / 16)))
    progress.step(f"CPU AdamW ({sizes.adam_params / 1e6:g}M params)")
    adam_params = int(min(sizes.adam_params, cpu["memory_gib"] * GIB / 16 / 4))
    cpu["adam_impl"] = adam_impl()
    # the executor's own op, on the threads its optimizer worker uses on this device (optim/host_threads.py)
    from tierflow.executor.optim.host_threads import (
        optimizer_threads,  # imports torch: here, not at module level
    )

    cpu["adam_threads"] = optimizer_threads(device, True) or torch.get_num_threads()
    cpu["adam_gparams_per_s"] = measure_cpu_adam(adam_params, sizes.adam_steps,
                                                 threads=cpu["adam_threads"]) / 1e9
    if importlib.util.find_spec("deepspeed") is not None:
        progress.step(f"DeepSpeedCPUAdam ({sizes.adam_params / 1e6:g}M params)")
    rate, why = measure_deepspeed_adam(adam_params, sizes.adam_steps)
    cpu["deepspeed_adam_gparams_per_s"] = None if rate is None else rate / 1e9
    cpu["deepspeed_adam_error"] = why
    m["cpu"] = cpu
    if device != "cpu" and m["gpu"] is not None:
        progress.step("GPU launches beside the host optimizer")
        m["contention"] = _contention(device, cpu["adam_threads"], sizes, m["errors"])
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
    if device == "cpu":
        m["executor"] = measure_executor_costs(build_profile(m).profile, device, ssd_dir)
    elif gpu:  # on CUDA too, each part on its own: a failure leaves its fields null, the reason in the notes
        m["executor"] = {}
        parts = {"the executor's fixed cost per op":
                 lambda: measure_executor_costs(build_profile(m).profile, device, ssd_dir, dispatch_rounds=0,
                                                graphs=False),
                 "the host cost of a CUDA graph replay":
                 lambda: measure_graph_costs(build_profile(m).profile, device),
                 "the executor's own cost per op": lambda: measure_executor_dispatch(device)}
        for what, measure in parts.items():
            try:
                m["executor"].update(measure())
            except Exception as e:  # noqa: BLE001 - any failure of a tiny run: reported, not fatal
                m["errors"].append(f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    progress.clear()
    return m


def _contention(device: str, threads: int, sizes: Sizes, errors: list[str]) -> dict | None:
    """How the executor's host optimizer slows a thread launching GPU kernels (contention.py); None and a
    note in `errors` if it cannot run."""
    from tierflow.executor.calibration.contention import measure_gpu_beside_host_optimizer

    try:
        k = measure_gpu_beside_host_optimizer(device, threads, adam_params=min(sizes.adam_params, 32 * 2**20))
    except Exception as e:  # noqa: BLE001 - one field left null, with the reason
        errors.append(f"GPU launches beside the host optimizer: {type(e).__name__}: {str(e)[:120]}")
        return None
    return {**k, "threads": threads}
