"""Measuring the executor itself on this machine: the SSD tier through its own store
(executor.tiers.ssd_store.SsdStore), how device compute and the host's I/O threads slow each other on a CPU
device, and the executor's fixed cost per op on a tiny plan."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tierflow.executor.calibration.common import MIB, import_torch
from tierflow.hwprofiles import HardwareProfile


def measure_store(directory: str | os.PathLike[str], total_bytes: int, mixed_s: float = 1.0,
                  files: int = 4) -> dict[str, float]:
    """GB/s of the SSD tier as the executor uses it (executor.tiers.ssd_store.SsdStore: O_DIRECT from aligned
    memory, 1-8 MiB requests on its thread pool, a CRC32C per request): write `files` files of `total_bytes`
    together, read them back, then read them again while writing a second set on another thread for about
    `mixed_s` seconds."""
    torch = import_torch()
    from tierflow.executor.tiers.ssd_store import SsdStore

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


# a GEMM on torch's intra-op threads: compute as the executor's blocks run it
INTERFERENCE_GEMM = (512, 512, 512)


def measure_io_interference(directory: str | os.PathLike[str] | None, seconds: float = 0.4,
                            copy_bytes: int = 64 * MIB) -> dict[str, float]:
    """How device compute on a host device and the host's I/O threads slow each other: a GEMM loop on torch's
    intra-op threads timed alone and beside one I/O loop on another thread (a memcpy, as a fetch or offload is
    on a CPU device; an SSD read and an SSD write through the executor's store when `directory` is given), and
    each I/O loop alone and beside the GEMM loop. Returns each rate ratio (alone / beside) and their means:
    `compute_slowdown` (the GEMM's, over the I/O kinds), `copy_slowdown`, `ssd_slowdown`."""
    torch = import_torch()
    m_, k, n_ = INTERFERENCE_GEMM
    a, b = torch.randn(m_, k), torch.randn(k, n_)
    out = torch.empty(m_, n_)
    elems = max(1, copy_bytes // 4)
    src, dst = torch.randn(elems), torch.empty(elems)
    store = None
    io: dict[str, Callable[[], int]] = {"copy": lambda: (dst.copy_(src), elems * 4)[1]}
    if directory is not None:
        from tierflow.executor.tiers.ssd_store import SsdStore

        store = SsdStore(directory, warn=lambda msg: None)
        store.write("interference-r", src)
        io["ssd_read"] = lambda: (store.read("interference-r", torch.float32, elems), elems * 4)[1]
        io["ssd_write"] = lambda: (store.write("interference-w", src), elems * 4)[1]

    def rate(fn: Callable[[], int], stop: threading.Event | None = None, windows: int = 4,
             counted: threading.Event | None = None) -> float:
        """Units of fn per second, after one call: the best of `windows` spans of seconds / windows (as
        calibrate keeps its best timings: on a shared machine a span is only ever slowed by others), or, with
        `stop`, the mean until it is set, over at least one call (`counted` is set once one is timed)."""
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


def measure_executor_costs(profile: HardwareProfile, device: str, ssd_dir: str | os.PathLike[str] | None,
                           dispatch_rounds: int = 5, op_rounds: int = 4, graphs: bool | None = None) -> dict:
    """The executor's fixed software cost per op, measured by the executor itself on plans of tiny ops
    (`profile` has no fixed costs yet: the ops' work is the cost model's), on any device (`cuda`: the ops'
    spans from CUDA events, the hand-offs from host clocks; `cpu-adversarial`, the emulation of CUDA without
    its random delays, runs the same code on a CPU):

      * per compute op and per transfer (executor/calibration/op_costs.py, `op_rounds` rounds per plan):
        `op_overhead_us` (a compute op whose tensors stay on the device: the intercept at zero work over two
        op sizes), `moved_op_overhead_us` (the extra of one that exchanges tensors with another worker),
        `pcie_latency_us` (offload and fetch ops), `graph_launch_us` (one replayed capture segment, where the
        device has graphs and `graphs` is not False; else None and `graph_launch_note` says why);
      * per SSD op and host optimizer op: a tiny plan with its weights and checkpoints in host memory and its
        optimizer states on the SSD tier when there is one, trained for two rounds; every op's measured
        duration less the cost model's time for its work plus its hand-off delay, the median per resource
        (`ssd_latency_us`, `cpu_op_us`; `host_plan_op_us`, its compute ops', for the notes);
      * the engine's own part, the same on every op (`measure_executor_dispatch`, unless `dispatch_rounds` is
        0).

    What `cpu.executor_op_us` adds to every op of a plan, and `gpu.op_overhead_us`,
    `gpu.moved_op_overhead_us`, `pcie.latency_us`, `ssd.latency_us` and `gpu.graph_launch_us` (each the rest
    of its ops' fixed cost) to theirs."""
    from tierflow.executor.calibration.op_costs import measure_op_costs

    out = _host_plan_costs(profile, device, ssd_dir)
    out.update(measure_op_costs(profile, lambda: executor_backend(device), rounds=op_rounds))
    if device != "cpu" and graphs is not False:
        out.update(measure_graph_costs(profile, device, op_rounds))
    elif device == "cpu":
        out.update(graph_launch_us=None, graph_op_us=None,
                   graph_launch_note="a CPU device has no CUDA graphs")
    if dispatch_rounds > 0:
        out.update(measure_executor_dispatch(device, rounds=dispatch_rounds))
    return out


def executor_backend(device: str):
    """The backend the executor's cost measurements run on: `device`'s, the emulation of CUDA without its
    random delays (an adversary, not a cost)."""
    from tierflow.executor.device.emulated import AdversarialCpuBackend
    from tierflow.executor.device.factory import make_backend

    if device.startswith("cpu-adversarial"):
        return AdversarialCpuBackend(max_delay_s=0.0)
    return make_backend(device)


def _host_plan_costs(profile: HardwareProfile, device: str,
                     ssd_dir: str | os.PathLike[str] | None) -> dict:
    """The SSD ops' and the host optimizer's fixed cost per op (see measure_executor_costs)."""
    import statistics
    import tempfile
    from dataclasses import replace

    from tierflow.executor.options import OutputOptions, RunConfig
    from tierflow.executor.train_loop import run_plan
    from tierflow.planner.core.costmodel import link_rates
    from tierflow.planner.core.models import get_model
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

    tiny = replace(get_model("tiny-gpt"), name="calibrate-tiny", num_layers=2, hidden=64, num_heads=2,
                   num_kv_heads=2, head_dim=32, ffn_hidden=256, vocab_size=256, seq_len=32, max_positions=32,
                   # a CPU device's profile is in fp32 bytes (the emulation of CUDA computes on the CPU too)
                   precision="fp32" if device.startswith("cpu") else None)
    host, ssd = Split(0.0, 1.0, 0.0), Split(0.0, 0.0, 1.0)
    states = ssd if ssd_dir is not None else host
    placement = Placement(weights=host, master=states, adam_m=states, adam_v=states, grads=host,
                          checkpoints=host)
    hw = profile.with_overrides({"gpu.memory_gib": max(profile.gpu.memory_gib, 0.05),
                                 "cpu.memory_gib": max(profile.cpu.memory_gib, 8.0),
                                 "ssd.count": 1 if ssd_dir is not None else 0})
    cfg = make_schedule("horizontal", tiny, hw, batch=4, micro_batch=1, seq=32, placement=placement,
                        runtime="ideal", iterations=3)
    rates = link_rates(hw)
    with tempfile.TemporaryDirectory(prefix="tierflow-calibrate-") as tmp:
        path = Path(tmp) / "tiny.json"
        write_plan(plan_from_graph(tiny, hw, cfg, build_graph(tiny, hw, cfg)), path)
        res = run_plan(load_plan(path), RunConfig(steps=6, device=device, output=OutputOptions(quiet=True),
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
        fixed.setdefault(t.resource, []).append((end[t.id] - start[t.id] - work_s)
                                                + max(0.0, start[t.id] - ready))

    def med_us(*resources: str) -> float | None:
        xs = [x for r in resources for x in fixed.get(r, [])]
        return max(0.0, statistics.median(xs)) * 1e6 if xs else None

    return {"host_plan_op_us": med_us("gpu"), "ssd_latency_us": med_us("ssd_read", "ssd_write"),
            "cpu_op_us": med_us("cpu"), "ops": {r: len(v) for r, v in fixed.items()}}


def measure_executor_dispatch(device: str, rounds: int = 5) -> dict:
    """The engine's own cost per op on `device` (executor/calibration/dispatch.py: the engine with clocks on a
    plan of tiny ops with its checkpoints in host memory, so that ops hand over between workers; the emulation
    of CUDA without its random delays): `executor_op_us`, the sum of its parts but the handler's (at most
    `step_op_us`), and the parts, in microseconds per op; `step_op_us`, the executor's step less plain
    PyTorch's per op (the smaller of the wall-time and the CPU-time figure: a loaded machine inflates the one,
    spinning waits the other), handlers included."""
    from tierflow.executor.calibration.dispatch import measure_dispatch

    d = measure_dispatch(lambda: executor_backend(device), rounds=rounds, placement="checkpoints_host")
    step_op_us = min(d.executor_op_us, d.executor_op_cpu_us)
    # the parts are wall time: on a loaded machine a woken worker also waits for a core; no more than the
    # whole step's difference per op is the executor's
    return {"executor_op_us": min(d.engine_op_us, step_op_us), "dispatch_parts_us": dict(d.parts_us),
            "step_op_us": step_op_us, "dispatch_ops_per_step": d.ops_per_step}


def measure_graph_costs(profile: HardwareProfile, device: str, rounds: int = 4) -> dict:
    """`graph_launch_us` and `graph_op_us` alone (graph_launch.measure_graph_launch on `device`'s backend):
    calibrate's separate step on CUDA, so that a failed capture leaves only those fields null."""
    from tierflow.executor.calibration.graph_launch import measure_graph_launch

    return measure_graph_launch(profile, lambda: executor_backend(device), rounds)
