"""Measuring the host: DRAM copy bandwidth, the update rate of the executor's CPU AdamW op, memory size and
the CPU's name."""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import time

from tierflow.executor.calibration.common import GIB, import_torch


def measure_dram_gbps(nbytes: int, repeats: int = 3) -> float:
    """DRAM bandwidth in GB/s of a large torch copy, counting read + write bytes (2 x nbytes per copy)."""
    torch = import_torch()
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
    torch = import_torch()
    p = torch.nn.Parameter(torch.zeros(16))
    p.grad = torch.ones(16)
    try:
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return "fused"
    except (RuntimeError, TypeError, ValueError):
        return "foreach"


def measure_cpu_adam(params: int, steps: int = 3, chunk: int | None = None,
                     threads: int | None = None) -> float:
    """The executor's host optimizer op (`adam`, run as a run runs it: optimizer_op.HostAdamOp) in parameters
    per second: blocks of ``chunk`` fp32 parameters (default: one block of ``params``), ``params`` in all,
    each stepped ``steps`` times after a warm-up step; on ``threads`` intra-op threads (default: torch's), as
    the executor's optimizer worker sets them (executor/optim/host_threads.py)."""
    torch = import_torch()
    from tierflow.executor.calibration.optimizer_op import HostAdamOp

    chunk = chunk or params
    sizes = [chunk] * (params // chunk) + ([params % chunk] if params % chunk else [])
    ops = [HostAdamOp(n, seed=i) for i, n in enumerate(sizes)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        for op in ops:  # warm-up: the first touches and the kernels' first dispatch
            op.step()
        t0 = time.perf_counter()
        for _ in range(max(1, steps)):
            for op in ops:
                op.step()
        return params * max(1, steps) / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)


def _adam_params(params: int, chunk: int) -> list:
    """fp32 parameters with gradients, ``params`` in all, in tensors of ``chunk``."""
    torch = import_torch()
    sizes = [chunk] * (params // chunk) + ([params % chunk] if params % chunk else [])
    ps = []
    for s in sizes:
        p = torch.nn.Parameter(torch.full((s,), 0.01))
        p.grad = torch.full((s,), 1e-3)
        ps.append(p)
    return ps


def _update_rate(opt, params: int, steps: int) -> float:
    """Parameters per second of ``opt.step()`` after a warm-up step (which allocates the moments)."""
    opt.step()
    t0 = time.perf_counter()
    for _ in range(max(1, steps)):
        opt.step()
    return params * max(1, steps) / (time.perf_counter() - t0)


def measure_deepspeed_adam(params: int, steps: int = 3, chunk: int = 4 * 2**20) -> tuple[float | None, str]:
    """DeepSpeedCPUAdam's update rate (adamw_mode, as ZeRO-Offload runs it) in parameters per second, and ""
    or, when it cannot run here (DeepSpeed not installed, its C++ op not buildable), None and why."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "DeepSpeed is not installed (the [baseline] extra)"
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(_adam_params(params, chunk), lr=1e-4, weight_decay=0.01, adamw_mode=True)
        return _update_rate(opt, params, steps), ""
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party op build means "not measured"
        return None, f"DeepSpeedCPUAdam failed here: {type(exc).__name__}: {str(exc)[:120]}"


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



# ---- what the CPU Adam model needs of the host (cpu.microarchitecture, physical_cores, clock_ghz) ---------
# x86 (vendor, family) -> [(model range, microarchitecture)] for the names cpu.microarchitecture knows: AMD's
# Zen generations as Linux tells them apart (arch/x86/kernel/cpu/amd.c, bsp_init_amd: family 0x17
# models 0x30-0x4f, 0x60-0x7f, 0x90-0x91, 0xa0-0xaf are Zen 2; family 0x19 models 0x00-0x0f, 0x20-0x5f Zen 3,
# 0x10-0x1f, 0x60-0xaf Zen 4) and Intel's family-6 models as arch/x86/include/asm/intel-family.h names them
# (0x55 SKYLAKE_X, whose core Cascade Lake and Cooper Lake keep; 0x6a ICELAKE_X, 0x6c ICELAKE_D; 0x8f
# SAPPHIRERAPIDS_X; 0xa5 COMETLAKE, 0xa6 COMETLAKE_L). Anything else is "unknown" (hostadam then takes its
# lower bounds), never a guess.
X86_MICROARCHITECTURES: dict[tuple[str, int], list[tuple[int, int, str]]] = {
    ("AuthenticAMD", 0x17): [(0x30, 0x4f, "zen2"), (0x60, 0x7f, "zen2"), (0x90, 0x91, "zen2"),
                             (0xa0, 0xaf, "zen2")],
    ("AuthenticAMD", 0x19): [(0x00, 0x0f, "zen3"), (0x20, 0x5f, "zen3"), (0x10, 0x1f, "zen4"),
                             (0x60, 0xaf, "zen4")],
    ("GenuineIntel", 6): [(0x55, 0x55, "skylake-sp"), (0x6a, 0x6a, "icelake-sp"), (0x6c, 0x6c, "icelake-sp"),
                          (0x8f, 0x8f, "sapphirerapids"), (0xa5, 0xa6, "cometlake")],
}


def _cpuinfo_first(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo's text."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def microarchitecture(cpuinfo: str) -> tuple[str, str]:
    """(cpu.microarchitecture, how it was told) from /proc/cpuinfo's text: the vendor, family and model of its
    first processor looked up in X86_MICROARCHITECTURES, or "unknown" with the reason."""
    f = _cpuinfo_first(cpuinfo)
    vendor, family, model = f.get("vendor_id"), f.get("cpu family"), f.get("model")
    if not (vendor and family and model and family.isdigit() and model.isdigit()):
        return "unknown", "no x86 vendor, family and model in /proc/cpuinfo"
    fam, mod = int(family), int(model)
    for lo, hi, name in X86_MICROARCHITECTURES.get((vendor, fam), []):
        if lo <= mod <= hi:
            return name, f"/proc/cpuinfo: {vendor} family {fam:#x} model {mod:#x} is {name}"
    return "unknown", (f"/proc/cpuinfo: {vendor} family {fam:#x} model {mod:#x} is not one the CPU Adam "
                       "model names (hwprofiles MICROARCHITECTURES)")


def physical_cores(cpuinfo: str) -> int | None:
    """Physical cores: distinct (physical id, core id) pairs of /proc/cpuinfo (None where it has none: a VM
    may hide them)."""
    pairs, phys = set(), None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            pairs.add((phys, value.strip()))
    return len(pairs) or None


def base_clock_ghz(cpuinfo: str, sysfs: str = "/sys/devices/system/cpu/cpu0/cpufreq/base_frequency"
                   ) -> tuple[float | None, str]:
    """The base clock: cpufreq's base_frequency (kHz) where the kernel exposes it, else the "@ x.xxGHz" of an
    Intel model name; else None (a current `cpu MHz` is not the base clock)."""
    try:
        with open(sysfs) as fh:
            return int(fh.read().strip()) / 1e6, sysfs
    except (OSError, ValueError):
        pass
    name = _cpuinfo_first(cpuinfo).get("model name", "")
    at = name.rpartition("@")[2].strip()
    if at.endswith("GHz"):
        try:
            return float(at[:-3]), f"/proc/cpuinfo model name ({name})"
        except ValueError:
            pass
    return None, "no cpufreq base_frequency and no clock in the model name"


def host_cpu_facts(path: str = "/proc/cpuinfo") -> dict[str, object]:
    """What the CPU Adam model needs of this host, each with how it was found."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        text = ""
    arch, arch_how = microarchitecture(text)
    clock, clock_how = base_clock_ghz(text)
    return {"microarchitecture": arch, "microarchitecture_how": arch_how,
            "physical_cores": physical_cores(text), "clock_ghz": clock, "clock_how": clock_how}
