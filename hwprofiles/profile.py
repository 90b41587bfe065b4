"""Hardware profiles: load, validate, override and save the numbers that describe one training box.

A profile is a small YAML file (see the bundled ``*.yaml`` next to this module) with five sections:
``gpu``, ``pcie``, ``cpu``, ``ssd`` and ``price``. Every value is validated when it is loaded; any problem
raises :class:`ProfileError` whose message is one line of the form

    <file>: <dotted.key>: <problem> (<how to fix>)

Units are in the key names: ``_gib`` = 2**30 bytes, ``_gb`` = 1e9 bytes, ``_gbps`` = 1e9 bytes per second,
``_tflops`` = 1e12 FLOP/s, ``_gflop`` = 1e9 FLOP, ``_usd`` = US dollars.

Only the standard library and PyYAML are imported here, so the planner can load profiles without torch.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tierflow.errors import TierflowError

from . import compute_spec
from .compute_spec import ComputeSpec
from .inputs import MIB, InputLimitError, check_yaml_depth, read_limited_text

SCHEMA_VERSION = 1
RW_SHARING_CHOICES = ("shared", "independent")
P2P_CHOICES = ("nvlink", "pcie", "host")  # how GPUs of one box exchange data (topology.p2p)
# host CPU microarchitectures the CPU Adam model knows by name (cpu.microarchitecture;
# planner/core/hostadam.py has measured per-core costs for some of them)
MICROARCHITECTURES = ("unknown", "zen2", "zen3", "zen4", "skylake-sp", "icelake-sp", "sapphirerapids",
                      "cometlake")
_SECTIONS = ("gpu", "pcie", "cpu", "ssd", "price")
# optional sections (absent: a box with one GPU, no network); to_dict writes them only when present, so a
# profile without them reads, writes and hashes (plan digests) exactly as before they existed
_OPTIONAL_SECTIONS = ("topology", "network", "compute")
_TOP_LEVEL_KEYS = ("schema_version", "name", "description", *_SECTIONS, *_OPTIONAL_SECTIONS)
_REQUIRED_TOP_LEVEL = ("schema_version", "name", "description", *_SECTIONS)
_FIX_FILE = "fix the value in the file"
_FIX_OVERRIDE = "fix the override"
MAX_PROFILE_BYTES = MIB  # a profile is a few KiB of YAML


class ProfileError(TierflowError, ValueError):
    """A hardware profile could not be found, parsed or validated.

    ``str(e)`` is always a single line: ``"<file>: <dotted.key>: <problem> (<how to fix>)"``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def _error(source: str, key: str | None, problem: str, fix: str) -> ProfileError:
    where = f"{source}: {key}: " if key else f"{source}: "
    return ProfileError(f"{where}{problem} ({fix})")


# ------------------------------------------------------------------------------------------------------------
# The dataclasses
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    model: str
    memory_gib: float  # total device memory
    reserved_gib: float  # CUDA context, allocator fragmentation, workspace: not usable for tensors
    peak_tflops: float  # dense bf16/fp16 tensor-core peak with fp32 accumulate
    gemm_efficiency: float  # fraction of peak that large GEMMs reach, (0, 1]
    gemm_half_gflop: float  # GEMM size (GFLOP) at which a GEMM reaches half of gemm_efficiency
    hbm_gbps: float  # peak HBM/GDDR bandwidth, GB/s
    hbm_efficiency: float  # achievable fraction of hbm_gbps for elementwise kernels, (0, 1]
    # the "device" is this host's CPU (tierflow run --device cpu): its compute runs on this many of the host's
    # cores, which CPU Adam and the device<->host copies share (cpu.cores); None: an accelerator
    host_cores: float | None = None
    # software cost per compute op (a block's forward, recompute or backward, the head, a device optimizer
    # step) that its kernels do not hide: Python dispatch, autograd bookkeeping, kernel launches, the
    # executor's thread hand-off; added to every compute op's roofline time. None: not modelled (0)
    op_overhead_us: float | None = None
    # the extra software cost of a compute op that exchanges tensors with another worker (its weights
    # fetched, its saved tensors offloaded or fetched, its gradients offloaded: the executor's path for
    # tensors it does not keep, and the wake-up of the hand-off), on top of op_overhead_us; charged to the
    # compute ops a plan connects to another resource (planner/core/hostcost.py). None: not modelled (0)
    moved_op_overhead_us: float | None = None
    # host cost of one CUDA graph replay (tierflow run --cuda-graphs): what a captured segment of compute ops
    # costs on the host instead of op_overhead_us per op (planner/core/capture.py); measured by
    # executor/calibration/graph_launch.py. None: not modelled (0)
    graph_launch_us: float | None = None
    # host cost per captured op of a graph replay beyond graph_launch_us (a CUDA graph's nodes; the
    # emulation's replay of its recorded aten ops in Python), measured with it. None: not modelled (0)
    graph_op_us: float | None = None
    # causal attention's rate as a fraction of a GEMM of its size on the fitted curve (None: 1, the same rate)
    attention_efficiency: float | None = None
    # bytes/s (read + written) of the MLP's activation function (GELU, SiLU): a transcendental per element
    # (None: as any elementwise kernel, hbm_gbps x hbm_efficiency)
    activation_gbps: float | None = None
    # dense GEMM peaks of the other precisions (tierflow.planner.core.workload.PRECISIONS), TFLOPS, from the
    # datasheet: fp32 on the CUDA cores (PyTorch's default for fp32 matmuls: allow_tf32 is off), and TF32 on
    # the tensor cores (fp32 tensors with allow_tf32 on). None: not known, or the GPU has no such unit (a
    # plan in that precision then stops with a one-line error naming the field)
    fp32_tflops: float | None = None
    tf32_tflops: float | None = None

    @property
    def op_overhead_s(self) -> float:
        return (self.op_overhead_us or 0.0) * 1e-6

    @property
    def moved_op_overhead_s(self) -> float:
        return (self.moved_op_overhead_us or 0.0) * 1e-6

    @property
    def graph_launch_s(self) -> float:
        return (self.graph_launch_us or 0.0) * 1e-6

    @property
    def graph_op_s(self) -> float:
        return (self.graph_op_us or 0.0) * 1e-6

    @property
    def capacity_bytes(self) -> int:
        """Bytes usable for tensors."""
        return int((self.memory_gib - self.reserved_gib) * 2**30)


@dataclass(frozen=True)
class PcieSpec:
    generation: int  # 3, 4, 5
    h2d_gbps: float  # pinned host->device, one direction alone
    d2h_gbps: float  # pinned device->host alone
    duplex_h2d_gbps: float  # H2D rate while a D2H copy runs at the same time
    duplex_d2h_gbps: float  # D2H rate while an H2D copy runs at the same time
    # fixed software cost per transfer op either way (staging, allocation, synchronisation, thread hand-off),
    # before its bytes move at the link rate. None: not modelled (0)
    latency_us: float | None = None
    # a copy from or to pageable (not page-locked) host memory: the driver stages it through its own pinned
    # buffer and the calling host thread waits until it is done (CUDA Programming Guide, "Page-Locked Host
    # Memory"; cudaMemcpy from pageable memory is synchronous). PyTorch makes one whenever a blocking copy_
    # changes the dtype across devices (it converts on the CPU into a pageable temporary). None: not
    # modelled (runtime deepspeed then counts those copies at the pinned rates)
    pageable_h2d_gbps: float | None = None
    pageable_d2h_gbps: float | None = None

    @property
    def latency_s(self) -> float:
        return (self.latency_us or 0.0) * 1e-6


@dataclass(frozen=True)
class CpuSpec:
    model: str
    memory_gib: float  # installed DRAM
    reserved_gib: float  # OS, framework, page cache: not usable for tensors
    memory_gbps: float  # peak DRAM bandwidth (channels x per-channel rate)
    adam_gparams_per_s: float  # CPU Adam update rate alone, 1e9 parameters per second
    # fraction of memory_gbps that the CPU and the DMA engines (PCIe, NVMe) sustain together, as STREAM does;
    # every host-side transfer and CPU Adam share it (None: host memory bandwidth is not modelled)
    memory_efficiency: float | None = None
    # cores of the host shared by compute on a host device, CPU Adam and the copies (None: not modelled)
    cores: float | None = None
    # How the host's threads slow each other when the device is the host CPU (gpu.host_cores), as `tierflow
    # calibrate --device cpu` measures them (None: the proportional share of `cores` instead):
    # device compute's time x (1 + (this - 1) x k) while k host I/O ops (copies, SSD ops) run beside it: an
    # I/O thread takes time slices from one of compute's threads, and a parallel region runs at its slowest
    # thread's pace, so one I/O thread costs compute far more than its share of the cores
    compute_slowdown_per_io_op: float | None = None
    # a device<->host copy's time x this while device compute runs (a memcpy thread time-shares its core)
    copy_slowdown_beside_compute: float | None = None
    # an SSD op's time x this while device compute runs (its thread sleeps on the device between requests, so
    # the scheduler runs it promptly when it wakes)
    ssd_slowdown_beside_compute: float | None = None
    # DeepSpeedCPUAdam's update rate alone (1e9 parameters per second, `tierflow calibrate` where DeepSpeed is
    # installed), beside torch's AdamW in adam_gparams_per_s; None: not measured
    deepspeed_adam_gparams_per_s: float | None = None
    # On a GPU box: a GPU op's time x this while the host optimizer (adam, adam_deferred on the cpu resource)
    # runs: the thread that launches the GPU's kernels waits for a core the optimizer's threads hold, and the
    # GPU idles between launches (`tierflow calibrate --device cuda` measures it with the executor's own
    # optimizer op and thread count; None: not measured, 1)
    gpu_slowdown_beside_host_optimizer: float | None = None
    # the executor's engine's own host cost per op (its workers' hand-offs, event records and stream waits,
    # stream launches, trace recording, its loop: not the op's handler), paid by the worker of the op's
    # resource: added to every op of a plan, on every resource, before its work (`tierflow calibrate`:
    # executor/calibration/dispatch.py). None: not modelled (0)
    executor_op_us: float | None = None
    # The host CPU as the CPU Adam model sees it (planner/core/hostadam.py; None / "unknown": not known, the
    # model cannot say): physical cores the optimizer's threads run on (all sockets), their sustained clock
    # (the base clock the product specification gives), the microarchitecture whose measured per-core costs
    # apply (hostadam.CORE_COSTS), and the DRAM channels behind memory_gbps (all sockets)
    physical_cores: float | None = None
    clock_ghz: float | None = None
    microarchitecture: str = "unknown"
    memory_channels: float | None = None

    @property
    def executor_op_s(self) -> float:
        return (self.executor_op_us or 0.0) * 1e-6

    @property
    def sustained_memory_bps(self) -> float:
        """Bytes/s of DRAM traffic the box sustains (inf when memory_efficiency is not set)."""
        if self.memory_efficiency is None:
            return math.inf
        return self.memory_gbps * self.memory_efficiency * 1e9

    @property
    def capacity_bytes(self) -> int:
        """Bytes of host memory usable for tensors."""
        return int((self.memory_gib - self.reserved_gib) * 2**30)


@dataclass(frozen=True)
class SsdSpec:
    count: int  # drives in the RAID0 array; 0 = no SSD tier
    model: str
    capacity_gb: float  # per drive, decimal GB
    read_gbps: float  # per drive sequential read
    write_gbps: float  # per drive sustained write
    array_read_gbps: float | None  # host-side ceiling for the whole array's reads (None = count * read_gbps)
    array_write_gbps: float | None
    rw_sharing: str  # "shared": reads and writes time-share the array; "independent"
    # while reads and writes run at once, each gets this fraction of its solo rate (flash channels and the
    # controller serve both): 0.5 = they time-share the drives, 1 = they do not interfere; None = from
    # rw_sharing
    mixed_efficiency: float | None = None
    # fixed software cost per SSD op either way (opening the file, allocating aligned buffers, submitting the
    # requests, closing), before its bytes move at the array's rate. None: not modelled (0)
    latency_us: float | None = None
    # the host's serial path every SSD byte crosses, in series with the drives (the software RAID0 layer, the
    # filesystem, the I/O threads that submit and reap requests, the copies out of the DMA buffers): a byte
    # takes 1/(count x per-drive rate) + 1/host_path_gbps, so drives added shorten only the first term.
    # None: not modelled (the array scales linearly up to its ceiling)
    host_path_gbps: float | None = None

    @property
    def latency_s(self) -> float:
        return (self.latency_us or 0.0) * 1e-6

    @property
    def mixed_fraction(self) -> float:
        """The fraction of its solo rate each direction gets while the other runs."""
        if self.mixed_efficiency is not None:
            return self.mixed_efficiency
        return 0.5 if self.rw_sharing == "shared" else 1.0

    @property
    def capacity_bytes(self) -> int:
        return int(self.count * self.capacity_gb * 1e9)

    @property
    def total_read_gbps(self) -> float:
        return _array_rate(self.count, self.read_gbps, self.array_read_gbps, self.host_path_gbps)

    @property
    def total_write_gbps(self) -> float:
        return _array_rate(self.count, self.write_gbps, self.array_write_gbps, self.host_path_gbps)


def _array_rate(count: int, per_drive_gbps: float, ceiling_gbps: float | None,
                host_path_gbps: float | None = None) -> float:
    """The whole array's rate one way: the drives in parallel, in series with the host's path, up to the
    host-side ceiling."""
    if count == 0:
        return 0.0
    rate = count * per_drive_gbps
    if host_path_gbps is not None:
        rate = 1.0 / (1.0 / rate + 1.0 / host_path_gbps)
    return rate if ceiling_gbps is None else min(rate, ceiling_gbps)


@dataclass(frozen=True)
class PriceSpec:
    """Approximate prices in USD; the YAML files say where each estimate comes from."""

    gpu_usd: float
    cpu_memory_usd_per_gib: float
    ssd_usd_each: float
    base_usd: float  # the rest of the box (CPU, board, PSU, case)

    def total_usd(self, profile: HardwareProfile) -> float:
        return (
            self.base_usd
            + self.gpu_usd
            + profile.cpu.memory_gib * self.cpu_memory_usd_per_gib
            + profile.ssd.count * self.ssd_usd_each
        )


@dataclass(frozen=True)
class TopologySpec:
    """The GPUs of one box and how they reach each other and the host (for data-parallel plans)."""

    gpu_count: int  # GPUs in the box
    gpus_per_switch: int  # GPUs sharing one upstream PCIe link (a PCIe switch or a root port)
    switch_uplink_gbps: float | None  # that upstream link per direction; None: not a bottleneck
    # GPU <-> GPU path: "nvlink", "pcie" (peer-to-peer through the PCIe fabric), "host" (staged in DRAM)
    p2p: str
    p2p_gbps: float  # GPU <-> GPU bandwidth per GPU per direction
    p2p_latency_us: float  # fixed cost of one step of a ring collective between two GPUs of the box

    @property
    def p2p_latency_s(self) -> float:
        return self.p2p_latency_us * 1e-6


@dataclass(frozen=True)
class NetworkSpec:
    """The network between boxes (several nodes)."""

    gbps: float  # per box per direction
    latency_us: float  # fixed cost of one step of a collective between two boxes

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpu: GpuSpec
    pcie: PcieSpec
    cpu: CpuSpec
    ssd: SsdSpec
    price: PriceSpec
    source: str = field(default="<dict>", compare=False)  # the file it was loaded from, or "<dict>"
    topology: TopologySpec | None = None  # None: one GPU
    network: NetworkSpec | None = None  # None: no network described (one box)
    compute: ComputeSpec | None = None  # None: GEMMs on the gpu section's size curve (compute_spec)

    @property
    def gpu_count(self) -> int:
        """GPUs in the box (1 without a topology section)."""
        return self.topology.gpu_count if self.topology is not None else 1

    @property
    def tier_capacity_bytes(self) -> dict[str, float]:
        """Usable bytes of each memory tier: {"gpu": ..., "cpu": ..., "ssd": ...}."""
        return {"gpu": float(self.gpu.capacity_bytes), "cpu": float(self.cpu.capacity_bytes),
                "ssd": float(self.ssd.capacity_bytes)}

    def to_dict(self) -> dict[str, Any]:
        """The YAML structure; ``profile_from_dict(p.to_dict()) == p``."""
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
        }
        for section in (*_SECTIONS, *_OPTIONAL_SECTIONS):
            spec = getattr(self, section)
            if spec is not None:
                out[section] = {key: getattr(spec, key) for key in _RULES[section]}
        return out

    def with_overrides(self, overrides: Mapping[str, object]) -> HardwareProfile:
        """A copy with dotted keys replaced, e.g. ``{"ssd.count": 6, "cpu.memory_gib": 256}``; re-validated.

        String values for numeric keys are parsed (``"6"`` -> 6, ``"null"`` -> None), so CLI ``--set k=v``
        pairs can be passed through unchanged. The name gets a suffix such as ``rtx4090-lohan[ssd.count=6]``.
        """
        if not overrides:
            return self
        source = f"{self.source} (overrides)"
        data = self.to_dict()
        known = [f"{s}.{k}" for s in (*_SECTIONS, *_OPTIONAL_SECTIONS) for k in _RULES[s]]
        for dotted, value in overrides.items():
            section, _, key = str(dotted).partition(".")
            if section not in _RULES or key not in _RULES[section]:
                raise _error(
                    source, str(dotted), "unknown key", _did_you_mean(str(dotted), known, "section.key")
                )
            if section not in data:  # an optional section the profile lacks: start from its defaults
                data[section] = _default_section(section, self)
            data[section][key] = _coerce_override(_RULES[section][key], value)
        suffix = ",".join(
            f"{k}={format_value(data[k.split('.')[0]][k.split('.')[1]])}" for k in sorted(overrides)
        )
        data["name"] = f"{self.name}[{suffix}]"
        return _build(data, source, _FIX_OVERRIDE, source_label=self.source)

    def summary(self) -> str:
        """One readable line describing the box."""
        g, p, c, s = self.gpu, self.pcie, self.cpu, self.ssd
        ssd = (
            f"{s.count}x {s.model} ({_num(s.total_read_gbps)}/{_num(s.total_write_gbps)} GB/s)"
            if s.count
            else "no SSD"
        )
        gpus = ""
        if self.topology is not None and self.topology.gpu_count > 1:
            t = self.topology
            gpus = f"{t.gpu_count}x "
            ssd += f", GPU<->GPU {t.p2p} {_num(t.p2p_gbps)} GB/s"
        if self.network is not None:
            ssd += f", network {_num(self.network.gbps)} GB/s"
        return (
            f"{gpus}{g.model} {_num(g.memory_gib)} GiB ({_num(g.peak_tflops)} TFLOPS), "
            f"PCIe {p.generation}.0 {_num(p.h2d_gbps)}/{_num(p.d2h_gbps)} GB/s, "
            f"{_num(c.memory_gib)} GiB DRAM, {ssd}"
        )


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.3g}"


def format_value(value: object) -> str:
    """A profile value as it reads in YAML (None -> null, floats without trailing zeros)."""
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------------------------------------------------
# The schema: one rule per key
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    kind: str  # "str", "int", "number", "optional_number", "choice"
    low: float | None = None  # lower bound
    low_inclusive: bool = False  # False: value > low; True: value >= low
    high: float | None = None  # sanity ceiling, inclusive: above it a value is absurd
    unit: str = ""  # shown in "absurd value" hints
    fraction: bool = False  # (0, 1]: a value like 87 is probably a percentage
    choices: tuple[str, ...] = ()
    default: Any = None  # used for ssd keys when ssd.count == 0
    # sanity floor, inclusive: a non-zero value below it is absurd (a typo or a wrong unit), and would make
    # times overflow or print with hundreds of digits (1e-300 TFLOPS)
    floor: float | None = None


def _pos(high: float, unit: str, floor: float, default: Any = 0.0) -> _Rule:
    return _Rule("number", 0, False, high, unit, default=default, floor=floor)


def _nonneg(high: float, unit: str, floor: float) -> _Rule:
    return _Rule("number", 0, True, high, unit, default=0.0, floor=floor)


def _optional(low: float, low_inclusive: bool, high: float, unit: str, floor: float) -> _Rule:
    return _Rule("optional_number", low, low_inclusive, high, unit, default=None, floor=floor)


_FRACTION = _Rule("number", 0, False, 1, fraction=True, floor=1e-3)
_MIB_IN_GIB = 2**-10

_RULES: dict[str, dict[str, _Rule]] = {
    "gpu": {
        "model": _Rule("str"),
        "memory_gib": _pos(4096, "GiB", _MIB_IN_GIB),
        "reserved_gib": _nonneg(4096, "GiB", _MIB_IN_GIB),
        "peak_tflops": _pos(20000, "TFLOPS", 1e-4),
        "gemm_efficiency": _FRACTION,
        "gemm_half_gflop": _pos(10000, "GFLOP", 1e-6),
        "hbm_gbps": _pos(100000, "GB/s", 1e-2),
        "hbm_efficiency": _FRACTION,
        "host_cores": _optional(0, False, 4096, "cores", 0.1),
        "op_overhead_us": _optional(0, True, 1e6, "microseconds per compute op", 1e-3),
        "moved_op_overhead_us": _optional(0, True, 1e6, "microseconds per compute op", 1e-3),
        "graph_launch_us": _optional(0, True, 1e6, "microseconds per graph replay", 1e-3),
        "graph_op_us": _optional(0, True, 1e6, "microseconds per captured op of a replay", 1e-3),
        "attention_efficiency": _optional(0, False, 1.0, "of a GEMM's rate", 1e-3),
        "activation_gbps": _optional(0, False, 100000, "GB/s", 1e-3),
        "fp32_tflops": _optional(0, False, 20000, "TFLOPS", 1e-4),
        "tf32_tflops": _optional(0, False, 20000, "TFLOPS", 1e-4),
    },
    "pcie": {
        "generation": _Rule("int", 1, True, 7),
        "h2d_gbps": _pos(2000, "GB/s", 1e-3),
        "d2h_gbps": _pos(2000, "GB/s", 1e-3),
        "duplex_h2d_gbps": _pos(2000, "GB/s", 1e-3),
        "duplex_d2h_gbps": _pos(2000, "GB/s", 1e-3),
        "latency_us": _optional(0, True, 1e6, "microseconds per transfer op", 1e-3),
        "pageable_h2d_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
        "pageable_d2h_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
    },
    "cpu": {
        "model": _Rule("str"),
        "memory_gib": _pos(100000, "GiB", _MIB_IN_GIB),
        "reserved_gib": _nonneg(100000, "GiB", _MIB_IN_GIB),
        "memory_gbps": _pos(20000, "GB/s", 1e-2),
        "adam_gparams_per_s": _pos(100, "billion parameters/s", 1e-5),
        "memory_efficiency": _optional(0, False, 1.0, "of memory_gbps", 1e-3),
        "cores": _optional(0, False, 4096, "cores", 0.1),
        "compute_slowdown_per_io_op": _optional(1, True, 100, "x compute time per I/O op beside it", 1e-3),
        "copy_slowdown_beside_compute": _optional(1, True, 100, "x copy time beside compute", 1e-3),
        "ssd_slowdown_beside_compute": _optional(1, True, 100, "x SSD op time beside compute", 1e-3),
        "gpu_slowdown_beside_host_optimizer": _optional(1, True, 100, "x GPU op time beside the host "
                                                        "optimizer", 1e-3),
        "deepspeed_adam_gparams_per_s": _optional(0, False, 100, "billion parameters/s", 1e-5),
        "executor_op_us": _optional(0, True, 1e6, "microseconds per op", 1e-3),
        "physical_cores": _optional(0, False, 4096, "cores", 1),
        "clock_ghz": _optional(0, False, 10, "GHz", 0.1),
        "microarchitecture": _Rule("choice", choices=MICROARCHITECTURES, default="unknown"),
        "memory_channels": _optional(0, False, 256, "DRAM channels", 1),
    },
    "ssd": {
        "count": _Rule("int", 0, True, 64, "drives"),
        "model": _Rule("str", default="none"),
        "capacity_gb": _pos(200000, "GB (decimal, per drive)", 1e-3),
        "read_gbps": _pos(2000, "GB/s per drive", 1e-3),
        "write_gbps": _pos(2000, "GB/s per drive", 1e-3),
        "array_read_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
        "array_write_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
        "rw_sharing": _Rule("choice", choices=RW_SHARING_CHOICES, default="shared"),
        "mixed_efficiency": _optional(0.5, True, 1.0, "of the solo rate", 0.5),
        "latency_us": _optional(0, True, 1e6, "microseconds per SSD op", 1e-3),
        "host_path_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
    },
    "topology": {
        "gpu_count": _Rule("int", 1, True, 1024, "GPUs"),
        "gpus_per_switch": _Rule("int", 1, True, 1024, "GPUs"),
        "switch_uplink_gbps": _optional(0, False, 2000, "GB/s", 1e-3),
        "p2p": _Rule("choice", choices=P2P_CHOICES),
        "p2p_gbps": _pos(10000, "GB/s per GPU per direction", 1e-3),
        "p2p_latency_us": _nonneg(1e6, "microseconds", 1e-3),
    },
    "network": {
        "gbps": _pos(100000, "GB/s per box per direction", 1e-4),
        "latency_us": _nonneg(1e6, "microseconds", 1e-3),
    },
    "compute": {
        "sm_count": _Rule("int", 1, True, 100000, "SMs"),
        "gemm_tile_m": _Rule("int", 1, True, 4096, "rows"),
        "gemm_tile_n": _Rule("int", 1, True, 4096, "columns"),
        "attention_fwd_fraction": _optional(0, False, 1.0, "of peak", 1e-3),
        "attention_bwd_fraction": _optional(0, False, 1.0, "of peak", 1e-3),
        "kernel_launch_us": _optional(0, True, 1e6, "microseconds per kernel", 1e-3),
        "layer_ops": _Rule("choice", choices=compute_spec.LAYER_OPS_CHOICES, default="fused"),
    },
    "price": {
        "gpu_usd": _pos(1e6, "USD", 1e-2),
        "cpu_memory_usd_per_gib": _pos(1000, "USD per GiB", 1e-4),
        "ssd_usd_each": _nonneg(1e6, "USD", 1e-2),
        "base_usd": _nonneg(1e7, "USD", 1e-2),
    },
}
# Keys that may be left out of the ssd section when ssd.count == 0.
_SSD_OPTIONAL_ALWAYS = ("array_read_gbps", "array_write_gbps", "mixed_efficiency", "latency_us",
                        "host_path_gbps")
_OPTIONAL = {"cpu": ("memory_efficiency", "cores", "compute_slowdown_per_io_op",
                     "copy_slowdown_beside_compute", "ssd_slowdown_beside_compute",
                     "gpu_slowdown_beside_host_optimizer",
                     "deepspeed_adam_gparams_per_s", "executor_op_us", "physical_cores", "clock_ghz",
                     "microarchitecture", "memory_channels"),
             "gpu": ("host_cores", "op_overhead_us", "moved_op_overhead_us", "graph_launch_us", "graph_op_us",
                     "attention_efficiency",
                     "activation_gbps", "fp32_tflops", "tf32_tflops"),
             "pcie": ("latency_us", "pageable_h2d_gbps", "pageable_d2h_gbps"),
             "compute": compute_spec.OPTIONAL_KEYS}  # keys a profile may leave out (older files), not ssd's
_SPEC_CLASSES = {"gpu": GpuSpec, "pcie": PcieSpec, "cpu": CpuSpec, "ssd": SsdSpec, "price": PriceSpec,
                 "topology": TopologySpec, "network": NetworkSpec, "compute": ComputeSpec}
# a fixed cost per ring step when an override adds a section the profile lacks (assumption: the order of
# NCCL's per-step latency over PCIe or a network, a few to tens of microseconds)
DEFAULT_LATENCY_US = 10.0


def nullable(key: str) -> bool:
    """Whether profile field `key` ("section.name") may be null (an optional number: not modelled, or not
    measured)."""
    section, _, name = key.partition(".")
    rule = _RULES.get(section, {}).get(name)
    return rule is not None and rule.kind == "optional_number"


def _default_section(section: str, profile: HardwareProfile) -> dict[str, Any]:
    """The values an override starts from when it sets a key of an optional section the profile lacks: one GPU
    per box that reaches the others through host memory at the PCIe rate both directions get at once; a
    network of the PCIe rate."""
    p = profile.pcie
    if section == "compute":
        return compute_spec.default_section()
    if section == "topology":
        return {"gpu_count": 1, "gpus_per_switch": 1, "switch_uplink_gbps": None, "p2p": "host",
                "p2p_gbps": min(p.duplex_h2d_gbps, p.duplex_d2h_gbps), "p2p_latency_us": DEFAULT_LATENCY_US}
    return {"gbps": min(p.h2d_gbps, p.d2h_gbps), "latency_us": DEFAULT_LATENCY_US}


def _did_you_mean(key: str, known: list[str], what: str = "key") -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"known {what}s: {', '.join(known)}"


def type_name(value: object, *, mapping: str = "mapping") -> str:
    """The name of a parsed YAML/JSON value's type for error messages: null, boolean, string, integer, number,
    list, and `mapping` for a dict (a JSON reader passes "object")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "integer", float: "number", list: "list", dict: mapping}.get(
        type(value), type(value).__name__
    )


def _coerce_override(rule: _Rule, value: object) -> object:
    """Parse strings given for numeric keys (from a command line); leave everything else to validation."""
    if not isinstance(value, str) or rule.kind in ("str", "choice"):
        return value
    text = value.strip()
    if rule.kind == "optional_number" and text.lower() in ("null", "none", "~", ""):
        return None
    number = parse_number(text)
    return value if number is None else number


def parse_number(text: str) -> int | float | None:
    """The text as an int, else as a float; None when it is neither."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return None


class _Checker:
    """Validates one section value by value; every failure names the source, the dotted key and a fix."""

    def __init__(self, source: str, fix: str) -> None:
        self.source = source
        self.fix = fix

    def fail(self, key: str | None, problem: str, fix: str | None = None) -> ProfileError:
        return _error(self.source, key, problem, fix or self.fix)

    def value(
        self, dotted: str, rule: _Rule, value: object, relaxed_low: bool = False, when: str = ""
    ) -> Any:
        """Check one value against its rule and return it normalised (numbers as float, ints as int).

        ``relaxed_low`` turns a "> low" bound into ">= low" (ssd keys when there is no SSD); ``when`` is
        appended to the bound's problem text.
        """
        if rule.kind in ("str", "choice"):
            if not isinstance(value, str):
                raise self.fail(
                    dotted, f"expected a string, got {type_name(value)} {value!r}", "put the value in quotes"
                )
            if rule.kind == "choice" and value not in rule.choices:
                choices = ", ".join(f"'{c}'" for c in rule.choices)
                raise self.fail(dotted, f"must be one of {choices}, got {value!r}", f"use one of {choices}")
            if rule.kind == "str" and (not value.strip() or "\n" in value):
                raise self.fail(dotted, "must be a non-empty single-line string", self.fix)
            return value
        if value is None and rule.kind == "optional_number":
            return None
        if rule.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail(
                    dotted, f"expected an integer, got {type_name(value)} {value!r}", "write a whole number"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = "write a plain number such as 25.0"
            if isinstance(value, str) and _looks_numeric(value):
                hint = f"write it as {float(value)!r}: YAML 1.1 reads {value!r} as text"
            nullable = " or null" if rule.kind == "optional_number" else ""
            raise self.fail(dotted, f"expected a number{nullable}, got {type_name(value)} {value!r}", hint)
        if not math.isfinite(value):
            raise self.fail(dotted, f"must be a finite number, got {value}")
        shown = format_value(value)
        if rule.fraction and not 0 < value <= 1:
            hint = f"it is a fraction: write {value / 100:g} for {shown}%" if 1 < value <= 100 else self.fix
            raise self.fail(dotted, f"must be in (0, 1], got {shown}", hint)
        if rule.low is not None:
            inclusive = rule.low_inclusive or relaxed_low
            if value < rule.low or (value == rule.low and not inclusive):
                op = ">=" if inclusive else ">"
                raise self.fail(dotted, f"must be {op} {format_value(rule.low)}{when}, got {shown}")
        if rule.floor is not None and value != 0 and abs(value) < rule.floor:
            raise self.fail(
                dotted,
                f"absurd value {shown}: below the sanity floor {format_value(rule.floor)} "
                f"{rule.unit}".rstrip(),
                f"check the unit: this key is in {rule.unit}" if rule.unit else self.fix,
            )
        if rule.high is not None and value > rule.high:
            raise self.fail(
                dotted,
                f"absurd value {shown}: above the sanity ceiling {format_value(rule.high)} "
                f"{rule.unit}".rstrip(),
                f"check the unit: this key is in {rule.unit}" if rule.unit else self.fix,
            )
        return int(value) if rule.kind == "int" else float(value)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------------------
# Building a profile from a dict
# ------------------------------------------------------------------------------------------------------------


def profile_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> HardwareProfile:
    """Validate a parsed YAML structure and build the profile; raises :class:`ProfileError`."""
    return _build(data, source, _FIX_FILE if source != "<dict>" else "fix the value")


def _build(data: object, source: str, fix: str, source_label: str | None = None) -> HardwareProfile:
    check = _Checker(source, fix)
    if not isinstance(data, Mapping):
        raise check.fail(
            "(top level)",
            f"expected a mapping with keys {', '.join(_TOP_LEVEL_KEYS)}, got {type_name(data)}",
            "see hwprofiles/rtx4090-lohan.yaml for the layout",
        )
    _check_keys(check, "", data, list(_TOP_LEVEL_KEYS), required=list(_REQUIRED_TOP_LEVEL))

    version = data["schema_version"]
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise check.fail(
            "schema_version",
            f"unsupported version {version!r}",
            f"this tierflow reads version {SCHEMA_VERSION}",
        )
    name = check.value("name", _Rule("str"), data["name"])
    description = data["description"]
    if not isinstance(description, str):
        raise check.fail(
            "description", f"expected a string, got {type_name(description)}", "put it in quotes"
        )

    specs: dict[str, Any] = {}
    for section in (*_SECTIONS, *_OPTIONAL_SECTIONS):
        if section in _OPTIONAL_SECTIONS and data.get(section) is None:
            continue  # an optional section left out (or null)
        values = data[section]
        if not isinstance(values, Mapping):
            raise check.fail(
                section,
                f"expected a mapping of keys, got {type_name(values)}",
                f"write the {section} keys indented under '{section}:'",
            )
        specs[section] = _build_section(check, section, values)

    return HardwareProfile(
        name=name,
        description=description,
        source=source_label or source,
        **specs,
    )


def _check_keys(
    check: _Checker, prefix: str, values: Mapping[str, Any], known: list[str], required: list[str]
) -> None:
    for key in values:
        if key not in known:
            hint = _did_you_mean(str(key), known)
            raise check.fail(f"{prefix}{key}", "unknown key", hint)
    for key in required:
        if key not in values:
            raise check.fail(
                f"{prefix}{key}",
                "missing key",
                f"add '{key}:' under '{prefix.rstrip('.')}:'" if prefix else f"add '{key}:' at the top level",
            )


def _build_section(check: _Checker, section: str, values: Mapping[str, Any]) -> Any:
    rules = _RULES[section]
    known = list(rules)
    required = [k for k in known if k not in _OPTIONAL.get(section, ())]
    no_ssd = False
    if section == "ssd":
        required = [k for k in known if k not in _SSD_OPTIONAL_ALWAYS]
        if "count" in values:
            count = check.value("ssd.count", rules["count"], values["count"])
            no_ssd = count == 0
            if no_ssd:
                required = ["count"]
    _check_keys(check, f"{section}.", values, known, required)

    out: dict[str, Any] = {}
    for key, rule in rules.items():
        dotted = f"{section}.{key}"
        if key not in values:
            out[key] = rule.default
            continue
        when = ""
        if section == "ssd" and not no_ssd and key in ("capacity_gb", "read_gbps", "write_gbps"):
            when = " when ssd.count > 0"
        out[key] = check.value(dotted, rule, values[key], relaxed_low=no_ssd, when=when)

    _check_relations(check, section, out)
    return _SPEC_CLASSES[section](**out)


def _check_relations(check: _Checker, section: str, v: dict[str, Any]) -> None:
    """Cross-key rules inside one section."""
    if section in ("gpu", "cpu") and v["reserved_gib"] >= v["memory_gib"]:
        raise check.fail(
            f"{section}.reserved_gib",
            f"must be < {section}.memory_gib ({format_value(v['memory_gib'])}), "
            f"got {format_value(v['reserved_gib'])}",
            f"reserved is the unusable part of memory_gib: lower {section}.reserved_gib or raise memory_gib",
        )
    if section == "topology" and v["gpus_per_switch"] > v["gpu_count"]:
        raise check.fail(
            "topology.gpus_per_switch",
            f"must be <= topology.gpu_count ({v['gpu_count']}), got {v['gpus_per_switch']}",
            "a switch cannot hold more GPUs than the box has",
        )
    if section == "pcie":
        for direction in ("h2d", "d2h"):
            solo, duplex = v[f"{direction}_gbps"], v[f"duplex_{direction}_gbps"]
            if duplex > solo:
                raise check.fail(
                    f"pcie.duplex_{direction}_gbps",
                    f"must be <= pcie.{direction}_gbps ({format_value(solo)}), got {format_value(duplex)}",
                    "a direction cannot get faster while the other one is busy",
                )


# ------------------------------------------------------------------------------------------------------------
# Files: loading, listing, saving
# ------------------------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key: let the normal constructor report it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _bundled_dir() -> Any:
    return resources.files(__package__ or "hwprofiles")


def list_profiles() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return sorted(
        entry.name[: -len(".yaml")] for entry in _bundled_dir().iterdir() if entry.name.endswith(".yaml")
    )


def _parse_yaml(text: str, source: str) -> Any:
    try:
        check_yaml_depth(text)
    except InputLimitError as exc:
        raise _error(source, None, str(exc), "a profile nests two levels: sections and their keys") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark else None
        problem = exc.problem or exc.context or "cannot parse"
        if problem.startswith("duplicate key"):
            raise _error(source, where, problem, "keep only one of them") from exc
        raise _error(
            source,
            where,
            f"malformed YAML: {problem}",
            "fix the YAML syntax: check indentation, colons and quotes",
        ) from exc
    except yaml.YAMLError as exc:
        raise _error(source, None, f"malformed YAML: {exc}", "fix the YAML syntax") from exc


def _load_text(text: str, source: str) -> HardwareProfile:
    data = _parse_yaml(text, source)
    if data is None:
        raise _error(source, None, "file is empty", "see hwprofiles/rtx4090-lohan.yaml for the layout")
    return _build(data, source, _FIX_FILE)


def _looks_like_path(text: str) -> bool:
    return "/" in text or os.sep in text or text.endswith((".yaml", ".yml")) or Path(text).is_file()


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """Load a bundled profile by name (``"rtx4090-lohan"``) or any profile file by path."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ProfileError(
            f"{name_or_path!r}: expected a profile name or a path (pass a string such as 'rtx4090-lohan')"
        )
    text = os.fspath(name_or_path)
    if not isinstance(name_or_path, os.PathLike):
        if text in list_profiles():  # a bundled name wins over a same-named file in the working directory
            resource = _bundled_dir().joinpath(f"{text}.yaml")
            return _load_text(resource.read_text(encoding="utf-8"), f"hwprofiles/{text}.yaml")
        if not _looks_like_path(text):
            raise ProfileError(
                f"{text}: unknown hardware profile (known: {', '.join(list_profiles())}; "
                "or give a path to a .yaml file)"
            )
    path = Path(text)
    try:
        content = read_limited_text(path, MAX_PROFILE_BYTES)
    except InputLimitError as exc:
        raise _error(text, None, str(exc), "give the path of a profile .yaml file") from None
    except FileNotFoundError as exc:
        raise _error(
            text,
            None,
            "file not found",
            f"check the path, or use a bundled profile: {', '.join(list_profiles())}",
        ) from exc
    except IsADirectoryError as exc:
        raise _error(
            text, None, "is a directory, not a profile file", "give the path of a .yaml file"
        ) from exc
    except UnicodeDecodeError as exc:
        raise _error(text, None, "is not UTF-8 text", "save the profile as UTF-8 YAML") from exc
    except OSError as exc:
        raise _error(
            text, None, f"cannot read: {exc.strerror or exc}", "check the file's permissions"
        ) from exc
    return _load_text(content, text)


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._\-\[\]=,]")


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> None:
    """Write ``profile`` as YAML that :func:`load_profile` accepts (used by ``tierflow calibrate``)."""
    header = (
        f"# Hardware profile '{_SAFE_NAME.sub('_', profile.name)}', written by hwprofiles.save_profile "
        f"from {' '.join(profile.source.split())}.\n"
        "# Units: _gib = 2**30 bytes, _gb = 1e9 bytes, _gbps = 1e9 bytes/s, _tflops = 1e12 FLOP/s.\n"
    )
    body = yaml.safe_dump(profile.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)
    Path(path).write_text(header + body, encoding="utf-8")
