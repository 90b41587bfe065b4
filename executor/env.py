"""`tierflow env`: what this machine offers tierflow, as DeepSpeed's `ds_report` does for DeepSpeed.

Versions (python, tierflow, torch, ortools, numpy), CUDA and the GPUs (name, memory, compute capability) when
torch sees CUDA, whether a directory (--ssd-dir, default the current one) takes O_DIRECT (the SSD tier's own
probe, direct_io.py) and its free space, the pinned-memory limit (`ulimit -l`, /proc/meminfo), cores, memory,
and what `tierflow calibrate` would measure here (the command and its `--json`: tierflow/cli/env.py).

It never fails because a part is missing: torch that cannot be imported, no CUDA, no /proc are reported as
such. Only the standard library is imported at start-up; torch is imported when the command runs, inside a
guard.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tierflow.extras import install_command

GIB = 2**30


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_bytes: int
    capability: str  # "9.0"


@dataclass
class SsdDirInfo:
    path: str
    o_direct: bool | None  # None: could not be probed (see error)
    free_bytes: int | None
    device: str
    error: str = ""


@dataclass
class PinnedInfo:
    memlock_soft_bytes: int | None  # `ulimit -l` (None = unlimited)
    memlock_hard_bytes: int | None
    mem_total_bytes: int | None  # /proc/meminfo
    mem_available_bytes: int | None
    mlocked_bytes: int | None


@dataclass
class EnvReport:
    versions: dict[str, str]
    torch_error: str
    cuda: str  # CUDA runtime version of torch's build, or why there is none
    gpus: list[GpuInfo]
    ssd_dir: SsdDirInfo
    pinned: PinnedInfo
    cpu: str
    cores_online: int
    cores_usable: int  # this process's CPU affinity
    memory_bytes: int | None
    calibrate_device: str
    calibrate_measures: list[str] = field(default_factory=list)
    host_optimizer: str = ""  # which way the host AdamW op runs (executor/optim/fused_host_adamw.py status)
    # every optional accelerator (planner/core/numba_once.py), built: what really runs, by name
    accelerators: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- collecting
# ---------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_info() -> tuple[str | None, str, str, list[GpuInfo]]:
    """(torch version or None, import error, CUDA line, GPUs). Any failure of torch is reported, not
    raised."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch install must not fail the report
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return None, error, "unknown (torch not importable)", []
    gpus: list[GpuInfo] = []
    try:
        if not torch.cuda.is_available():
            built = torch.version.cuda
            cuda = (f"not available (torch built with CUDA {built}, but no GPU is visible)" if built
                    else "not available (a CPU-only build of torch)")
        else:
            cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(GpuInfo(i, p.name, int(p.total_memory), f"{p.major}.{p.minor}"))
    except Exception as e:  # noqa: BLE001 - a broken driver is reported, not raised
        cuda = f"error: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return torch.__version__, "", cuda, gpus


def ssd_dir_info(directory: str | os.PathLike[str]) -> SsdDirInfo:
    """Whether `directory` takes O_DIRECT (the SSD tier's probe), its free space and block device."""
    from tierflow.executor.calibration.ssd import block_device_name
    from tierflow.executor.tiers.direct_io import probe_o_direct

    path = Path(directory).resolve()
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = None
    if not path.is_dir():
        return SsdDirInfo(str(path), None, free, "unknown device", "not a directory")
    try:
        direct = probe_o_direct(path)
        error = ""
    except OSError as e:
        direct, error = None, f"cannot probe: {e.strerror or e}"
    return SsdDirInfo(str(path), direct, free, block_device_name(path), error)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's fields in bytes ({} where there is none)."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def pinned_info() -> PinnedInfo:
    soft = hard = None
    try:
        import resource

        lim_soft, lim_hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        soft = None if lim_soft == resource.RLIM_INFINITY else int(lim_soft)
        hard = None if lim_hard == resource.RLIM_INFINITY else int(lim_hard)
    except (ImportError, AttributeError, OSError, ValueError):
        soft = hard = -1  # unknown
    mi = meminfo()
    return PinnedInfo(soft, hard, mi.get("MemTotal"), mi.get("MemAvailable"), mi.get("Mlocked"))


# the modules that make an optional accelerator (numba_once.OptionalKernel) at import: a new one adds its own
ACCELERATOR_MODULES = ("tierflow.planner.core.simkernel", "tierflow.executor.optim.fused_host_adamw")


def accelerator_status() -> dict[str, str]:
    """What runs for every optional accelerator, each built (or its build tried) here, by name; a module
    that does not import (no torch: said elsewhere in the report) adds none."""
    from tierflow.planner.core.numba_once import ACCELERATORS

    for m in ACCELERATOR_MODULES:
        try:
            importlib.import_module(m)
        except Exception:  # noqa: BLE001 - torch missing or broken: the report's versions say it
            continue
    return {name: k.status().line for name, k in ACCELERATORS.items()}


def collect(ssd_dir: str | os.PathLike[str] = ".") -> EnvReport:
    from tierflow import __version__
    from tierflow.executor.calibration import FULL, cpu_model, measurement_plan

    torch_version, torch_error, cuda, gpus = _torch_info()
    versions = {"python": platform.python_version(), "tierflow": __version__,
                "torch": torch_version or "not importable", "ortools": _version("ortools"),
                "numpy": _version("numpy"),
                "os": f"{platform.system()} {platform.release()} {platform.machine()}"}
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    device = "cuda" if gpus else "cpu"
    mi = meminfo()
    host_optimizer = ""
    if torch_version:
        from tierflow.executor.optim.fused_host_adamw import status
        from tierflow.executor.optim.host_adamw import MIN_KERNEL_ELEMENTS

        host_optimizer = status(MIN_KERNEL_ELEMENTS)  # built (or its build tried) here: what really runs
    return EnvReport(versions=versions, torch_error=torch_error, cuda=cuda, gpus=gpus,
                     ssd_dir=ssd_dir_info(ssd_dir), pinned=pinned_info(), cpu=cpu_model(),
                     cores_online=os.cpu_count() or 1, cores_usable=usable, memory_bytes=mi.get("MemTotal"),
                     calibrate_device=device,
                     calibrate_measures=measurement_plan(device, FULL, ssd=True) if torch_version else [],
                     host_optimizer=host_optimizer, accelerators=accelerator_status())


# ---- formatting
# ---------------------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / GIB:,.1f} GiB"


def _limit(n: int | None) -> str:
    if n is None:
        return "unlimited"
    if n < 0:
        return "unknown"
    return f"{n / 2**10:,.0f} KiB" if n < 2**20 else f"{n / 2**20:,.0f} MiB"


def format_report(r: EnvReport) -> str:
    v = r.versions
    lines = ["tierflow env", "", "versions"]
    lines += [f"  {k:<10} {v[k]}" for k in ("python", "tierflow", "torch", "ortools", "numpy", "os")]
    if r.torch_error:
        lines.append(f"  torch import failed: {r.torch_error} (tierflow run and calibrate need it; "
                     f"{install_command('run')})")
    lines += ["", f"CUDA: {r.cuda}"]
    for g in r.gpus:
        lines.append(f"  GPU {g.index}: {g.name}, {_gib(g.memory_bytes)}, compute capability {g.capability}")
    s = r.ssd_dir
    direct = {True: "yes", False: "no (buffered I/O: reads may come from the page cache)",
              None: "unknown"}[s.o_direct]
    lines += ["", f"SSD directory {s.path} ({s.device})",
              f"  O_DIRECT   {direct}" + (f"; {s.error}" if s.error else ""),
              f"  free       {_gib(s.free_bytes)}"]
    p = r.pinned
    lines += ["", "pinned host memory",
              f"  ulimit -l  {_limit(p.memlock_soft_bytes)} (hard {_limit(p.memlock_hard_bytes)}): the "
              "locked-memory limit of this process",
              f"  meminfo    total {_gib(p.mem_total_bytes)}, available {_gib(p.mem_available_bytes)}, "
              f"locked {_gib(p.mlocked_bytes)}"]
    lines += ["", f"CPU: {r.cpu}", f"  cores      {r.cores_usable} usable of {r.cores_online} online",
              f"  memory     {_gib(r.memory_bytes)}"]
    if r.host_optimizer:
        lines.append(f"  host AdamW {r.host_optimizer}")
    if r.accelerators:
        lines += ["", "optional accelerators (each built here: what really runs)"]
        lines += [f"  {name}: {line}" for name, line in r.accelerators.items()]
    lines += ["", f"tierflow calibrate here measures (--device {r.calibrate_device}, with --ssd-dir):"]
    if r.calibrate_measures:
        lines += [f"  {m}" for m in r.calibrate_measures]
    else:
        lines.append("  nothing: it needs torch")
    return "\n".join(lines)
