"""Building a hardware profile from calibration measurements: every field measured, derived, given with
``--set`` or taken from a base profile (`build_profile`), and the record of which (`Calibration`,
`FieldInfo`). Everything a measurement cannot give comes from ``base`` (default: the bundled rtx4090-lohan for
gpu/pcie and prices, and no SSD tier)."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from tierflow.executor.calibration.common import MIB, CalibrationError
from tierflow.executor.calibration.executor_costs import INTERFERENCE_GEMM
from tierflow.executor.calibration.gpu import fit_gemm_half_gflop, pcie_generation_from_rate
from tierflow.hwprofiles import HardwareProfile, load_profile, nullable, profile_from_dict

FALLBACK_BASE = "rtx4090-lohan"
# a CPU device computes and moves fp32 (4 bytes per element) whatever the plan's precision: its rates are
# real bytes moved per second, and its plans say `--precision fp32` (workload.PRECISIONS)
HOST_DEVICE_PRECISION = "fp32"
# Without a datasheet (--base), the best measured GEMM rate is taken to be this fraction of the peak.
NO_BASE_GEMM_EFFICIENCY = 0.9
# Without a datasheet, measured HBM copy bandwidth is taken to be this fraction of the peak (the bundled
# profiles' hbm_efficiency assumption).
NO_BASE_HBM_EFFICIENCY = 0.85
DEFAULT_HOST_DEVICE_GIB = 2.0  # device memory cap of a CPU "device" when --set gpu.memory_gib is not given


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

    def to_json(self, measurements: dict[str, Any] | None = None,
                output: str | None = None) -> dict[str, Any]:
        return {
            "output": output,
            "profile": self.profile.to_dict(),
            "fields": [{"field": f.key, "value": f.value, "source": f.source, "note": f.note}
                       for f in self.fields],
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


@dataclass
class _Builder:
    """A profile being built: the base's values, replaced field by field (`put`), and where each came from."""

    m: dict[str, Any]  # the measurements
    base: HardwareProfile
    explicit_base: bool
    data: dict[str, Any]
    info: dict[str, FieldInfo] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def base_name(self) -> str:
        return self.base.name

    @property
    def from_base(self) -> str:
        return f"from {self.base_name}"

    def put(self, key: str, value: Any, source: str, note: str = "") -> None:
        section, _, k = key.partition(".")
        value = _sig(value) if isinstance(value, float) else value
        self.data[section][k] = value
        self.info[key] = FieldInfo(key, value, source, note)


def build_profile(measurements: dict[str, Any], base: HardwareProfile | None = None,
                  name: str | None = None, device_gib: float | None = None,
                  overrides: dict[str, Any] | None = None) -> Calibration:
    """The profile for ``measurements`` (from :func:`run_measurements`): measured values where there are any,
    the rest from ``base`` (default: the bundled rtx4090-lohan for gpu/pcie/price and no SSD tier)."""
    explicit_base = base is not None
    base = base if base is not None else load_profile(FALLBACK_BASE)
    b = _Builder(measurements, base, explicit_base, base.to_dict())
    g = measurements.get("gpu")
    host_device = measurements.get("device") == "cpu" and g is not None
    if host_device:
        _put_host_device(b, g, device_gib)
    elif g:
        _put_cuda_gpu(b, g)
    if measurements.get("pcie"):
        _put_pcie(b, measurements["pcie"], host_device)
    _put_cpu(b, host_device)
    _put_ssd(b, host_device)
    _put_executor_costs(b)
    _put_overrides(b, overrides, device_gib, host_device)
    _keep_compute_of_same_gpu(b, g, host_device)
    return _finish(b, name)


def _keep_compute_of_same_gpu(b: _Builder, g: dict[str, Any] | None, host_device: bool) -> None:
    """The base's compute section (SMs, GEMM tiles, launch floor) describes the base's GPU: kept only for
    an explicit --base of the GPU measured (or when none was measured), never for a CPU device or the default
    base, whose GEMMs then run on the fitted size curve."""
    same_gpu = b.explicit_base and not host_device and (not g or _gpu_matches(b.base.gpu.model, g["model"]))
    if not same_gpu and b.data.pop("compute", None) is not None:
        b.notes.append(f"the {b.base_name} profile's compute section (its GPU's SMs and tiles) left out: "
                       "GEMMs run on the measured size curve")


def _put_host_device(b: _Builder, g: dict[str, Any], device_gib: float | None) -> None:
    """The gpu section of a CPU device (tierflow run --device cpu): this CPU's fitted GEMM curve and
    bandwidths in real (fp32) bytes per second, and the device memory cap."""
    cap = device_gib if device_gib is not None else DEFAULT_HOST_DEVICE_GIB
    b.put("gpu.model", g["model"], "measured", "the device is this CPU (tierflow run --device cpu)")
    b.put("gpu.memory_gib", cap, "given" if device_gib is not None else "default",
        "the device memory cap (--set gpu.memory_gib=...); the executor enforces it")
    b.put("gpu.reserved_gib", 0.0, "derived", "no CUDA context on a CPU device")
    b.put("gpu.peak_tflops", g["peak_tflops"], "measured",
        f"fit of fp32 GEMM rates at {len(g['gemms'])} sizes: rate = peak x f / (f + half)")
    b.put("gpu.gemm_efficiency", 1.0, "derived", "the fitted peak is what large GEMMs reach")
    b.put("gpu.fp32_tflops", g["peak_tflops"], "measured",
          f"the same fit: a CPU device computes in fp32 (plan it with --precision {HOST_DEVICE_PRECISION})")
    b.put("gpu.tf32_tflops", None, "not measured", "a CPU has no TF32 tensor cores")
    b.put("gpu.gemm_half_gflop", g["half_gflop"], "measured", "same fit")
    b.put("gpu.hbm_gbps", g["elementwise_gbps"], "measured",
        "torch add of large fp32 tensors, bytes read + written per second")
    b.put("gpu.hbm_efficiency", 1.0, "derived", "hbm_gbps above is measured")
    b.put("gpu.host_cores", g["host_cores"], "measured", "torch intra-op threads: compute shares these cores")
    if g.get("activation_gbps"):
        b.put("gpu.activation_gbps", g["activation_gbps"], "measured",
            "tanh GELU of large fp32 tensors, bytes read + written per second")
    if g.get("attention"):
        b.put("gpu.attention_efficiency", min(1.0, g["attention_efficiency"]), "measured",
            "causal scaled_dot_product_attention at " + ", ".join(
                f"{a['shape']}: {a['tflops']:.3g} TFLOPS" for a in g["attention"])
            + ", over a GEMM of its work")


def _put_cuda_gpu(b: _Builder, g: dict[str, Any]) -> None:
    """The gpu section of a CUDA GPU: its size, and its GEMM and HBM rates against the base's datasheet peaks
    (without a base, the peaks are derived from the measured rates)."""
    b.put("gpu.model", g["model"], "measured", "torch.cuda.get_device_properties")
    b.put("gpu.memory_gib", g["memory_gib"], "measured", "torch.cuda.get_device_properties")
    b.put("gpu.reserved_gib", 0.6 + 0.05 * g["memory_gib"], "derived",
        "assumption: 0.6 GiB CUDA context + 5% fragmentation")
    if b.explicit_base and not _gpu_matches(b.base.gpu.model, g["model"]):
        b.notes.append(f"the base's GPU is '{b.base.gpu.model}' but this one is '{g['model']}': "
                       "peak_tflops and hbm_gbps come from the base's datasheet; pass the right --base")
    if "best_tflops" in g:
        _put_gemm(b, g)
    if "hbm_gbps" in g:
        _put_hbm(b, g)


def _put_gemm(b: _Builder, g: dict[str, Any]) -> None:
    """Peak and efficiency of the GEMMs (a datasheet peak from an explicit base), and the half-size fit."""
    best = g["best_tflops"]
    if b.explicit_base:
        peak = b.base.gpu.peak_tflops
        b.put("gpu.peak_tflops", peak, b.from_base, "datasheet peak")
        eff = best / peak
        if eff > 1:
            b.notes.append(f"measured {best:.0f} TFLOPS is above the base's peak {peak:g}: "
                           "gemm_efficiency capped at 1 (is --base the right GPU?)")
        eff = min(eff, 1.0)
    else:
        eff = NO_BASE_GEMM_EFFICIENCY
        b.put("gpu.peak_tflops", best / eff, "derived",
            f"no --base: best measured {best:.0f} TFLOPS / {eff:g}")
        b.notes.append(f"no --base datasheet: gpu.peak_tflops set to the best measured GEMM rate / {eff:g} "
                       f"(gemm_efficiency {eff:g}); pass --base PROFILE to keep a datasheet peak")
    b.put("gpu.gemm_efficiency", eff, "measured" if b.explicit_base else "derived",
        f"best GEMM {best:.0f} TFLOPS / peak")
    peak = b.data["gpu"]["peak_tflops"]
    half = fit_gemm_half_gflop(g["small_gflop"], g["small_tflops"] / peak, b.data["gpu"]["gemm_efficiency"])
    b.put("gpu.gemm_half_gflop", half, "measured",
        f"fit: {g['small_gflop']:.2f} GFLOP GEMM at {g['small_tflops']:.0f} TFLOPS")


def _put_hbm(b: _Builder, g: dict[str, Any]) -> None:
    """HBM bandwidth: the base's datasheet and the measured fraction of it, or derived from the copy rate."""
    hbm = g["hbm_gbps"]
    if b.explicit_base:
        b.put("gpu.hbm_gbps", b.base.gpu.hbm_gbps, b.from_base, "datasheet peak")
        if hbm > b.base.gpu.hbm_gbps:
            b.notes.append(f"measured HBM {hbm:.0f} GB/s is above the base's {b.base.gpu.hbm_gbps:g}: "
                           "hbm_efficiency capped at 1")
        b.put("gpu.hbm_efficiency", min(1.0, hbm / b.base.gpu.hbm_gbps), "measured",
            f"copy at {hbm:.0f} GB/s / datasheet")
    else:
        b.put("gpu.hbm_gbps", hbm / NO_BASE_HBM_EFFICIENCY, "derived",
            f"no --base: measured {hbm:.0f} GB/s / {NO_BASE_HBM_EFFICIENCY:g}")
        b.put("gpu.hbm_efficiency", NO_BASE_HBM_EFFICIENCY, "derived",
              "assumption, as in the bundled profiles")


def _put_pcie(b: _Builder, p: dict[str, Any], host_device: bool) -> None:
    """The pcie section: the measured copies (within host memory for a CPU device)."""
    h2d = p["h2d_gbps"]
    d2h = p["d2h_gbps"]
    what = "copy within host memory (a CPU device)" if host_device else "pinned copy"
    if host_device:
        b.put("pcie.generation", 1, "derived", "no PCIe link: device <-> host copies stay in host memory")
    else:
        b.put("pcie.generation", pcie_generation_from_rate(h2d), "derived", "from the H2D rate, assuming x16")
    b.put("pcie.h2d_gbps", h2d, "measured", what)
    b.put("pcie.d2h_gbps", d2h, "measured", what)
    # rounding must not make a duplex rate exceed its solo rate
    b.put("pcie.duplex_h2d_gbps", min(_sig(p["duplex_h2d_gbps"]), b.data["pcie"]["h2d_gbps"]),
          "measured",
        "H2D while D2H runs (two streams)" if not host_device
        else "two copies at once on two threads, likewise")
    b.put("pcie.duplex_d2h_gbps", min(_sig(p["duplex_d2h_gbps"]), b.data["pcie"]["d2h_gbps"]),
          "measured",
        "D2H while H2D runs (two streams)" if not host_device
        else "two copies at once on two threads, likewise")


# the fixed cost per op that the executor measured on plans of tiny ops
# (executor_costs.measure_executor_costs, op_costs.measure_op_costs), by profile field: (its key in the
# measurements, how it was measured)
_FIXED_COSTS = {
    "gpu.op_overhead_us": ("op_overhead_us", "compute ops whose tensors stay on the device: per op (kind, "
                           "block) the intercept at zero work of (duration - the cost model's time) + "
                           "hand-off over two op sizes, mean over a step's ops (on a CPU device in CPU "
                           "time: the handler's, and the engine's share per op)"),
    "pcie.latency_us": ("pcie_latency_us", "offload and fetch ops of a plan with host checkpoints: the "
                        "intercept at zero bytes of (duration - bytes / rate) + hand-off over two op sizes"),
    "ssd.latency_us": ("ssd_latency_us", "SSD ops: median of (duration - bytes / rate) + hand-off"),
    "gpu.graph_launch_us": ("graph_launch_us", "replayed capture segments (--cuda-graphs) of two sizes: the "
                            "intercept at zero ops of (span - its ops' modelled time) + hand-off (on a CPU "
                            "device the graphed step's CPU time less its eager ops')"),
}


def executor_cost_fields(ex: dict) -> dict[str, float | None]:
    """The profile fields of the executor's measured fixed costs (`ex`: measure_executor_costs's dict): the
    engine's own cost on every op (cpu.executor_op_us), per kind of op the rest of what its ops measured
    beyond their work (taken off: an op is charged what it measured once), the extra of a compute op that
    exchanges tensors with another worker (a difference of two ops' costs: nothing taken off); the fields
    that were not measured left out."""
    own = ex.get("executor_op_us")
    out: dict[str, float | None] = {}
    if own is not None:
        out["cpu.executor_op_us"] = own
    for key, (mkey, _) in _FIXED_COSTS.items():
        if ex.get(mkey) is not None:
            out[key] = max(0.0, ex[mkey] - (own or 0.0))
    for key in ("moved_op_overhead_us", "graph_op_us"):
        if ex.get(key) is not None:
            out[f"gpu.{key}"] = ex[key]
    return out


def _put_executor_costs(b: _Builder) -> None:
    """The executor's fixed costs per op (any device, `executor_cost_fields`), each with how it was measured:
    the engine's own (cpu.executor_op_us), the handlers' Python, the framework's dispatch and the kernel
    launches of a compute op (gpu.op_overhead_us), the links' latencies, a graph replay's, and the extra of a
    compute op connected to another worker."""
    ex = b.m.get("executor") or {}
    fields = executor_cost_fields(ex)
    own = ex.get("executor_op_us")
    device = b.m.get("device") or "cuda"
    if own is not None:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in (ex.get("dispatch_parts_us") or {}).items())
        step = ex.get("step_op_us")
        b.put("cpu.executor_op_us", own, "measured",
              "the engine's own parts per op on a plan of tiny ops (hand-off, events, launch, trace, loop"
              + (f"; us per op: {parts}" if parts else "") + ")"
              + (f"; its whole step less plain PyTorch's: {step:.3g} us per op" if step is not None else ""))
    fitted = f" ({ex['fitted_on']})" if ex.get("fitted_on") else ""
    less = ", less cpu.executor_op_us" if own is not None else ""
    for key, (mkey, how) in _FIXED_COSTS.items():
        if key not in fields or (key.startswith("ssd.") and b.data["ssd"].get("count", 0) == 0):
            continue
        where = fitted if mkey != "ssd_latency_us" else ""
        b.put(key, fields[key], "measured", f"the executor on tiny plans ({device}): {how}{less}{where}")
    if "gpu.moved_op_overhead_us" in fields:
        b.put("gpu.moved_op_overhead_us", fields["gpu.moved_op_overhead_us"], "measured",
              f"the executor on tiny plans ({device}): a compute op connected to another worker (host "
              f"checkpoints) less the same op with every tensor on the device, mean over a step's such ops"
              f"{fitted}")
    if "gpu.graph_op_us" in fields:
        b.put("gpu.graph_op_us", fields["gpu.graph_op_us"], "measured",
              f"the executor on tiny plans ({device}): replayed capture segments of "
              f"{', '.join(map(str, ex.get('graph_segment_ops') or []))} ops: the slope of (span - its ops' "
              "modelled time) + hand-off over the ops per segment")
    if "graph_launch_us" in ex and ex["graph_launch_us"] is None:
        why = ex.get("graph_launch_note") or "no graph replayed"
        b.put("gpu.graph_launch_us", None, "not measured", why)
        b.put("gpu.graph_op_us", None, "not measured", why)


def _put_cpu(b: _Builder, host_device: bool) -> None:
    """The cpu section: memory, bandwidth, Adam rate, cores, and (CPU device) compute beside I/O."""
    g = b.m.get("gpu")
    c = b.m["cpu"]
    b.put("cpu.model", c["model"], "measured", "/proc/cpuinfo")
    b.put("cpu.memory_gib", c["memory_gib"], "measured", "sysconf")
    b.put("cpu.reserved_gib", min(6 + 0.05 * c["memory_gib"], 0.5 * c["memory_gib"]), "derived",
        "assumption: 6 GiB OS + runtime + 5% (at most half)")
    b.put("cpu.memory_gbps", c["memory_gbps"], "measured",
          "large copy, read + write bytes (below datasheet peak)")
    b.put("cpu.memory_efficiency", 1.0, "derived",
        "memory_gbps is a measured copy rate, already what the box sustains (host memory is modelled as "
        "shared)")
    if host_device:
        b.put("cpu.cores", b.m.get("cpu_threads") or g["host_cores"], "measured",
            "torch intra-op threads: compute, CPU Adam and the copies share them")
    else:
        b.put("cpu.cores", None, "derived", "core sharing is modelled only when the device is this CPU")
    itf = b.m.get("interference") if host_device else None
    if itf:
        gemm = INTERFERENCE_GEMM
        b.put("cpu.compute_slowdown_per_io_op", max(1.0, itf["compute_slowdown"]), "measured",
            f"a {gemm[0]}x{gemm[1]}x{gemm[2]} GEMM loop beside one I/O loop on another thread, mean over "
            + ", ".join(f"{k[len('gemm_beside_'):]} {v:.2f}x" for k, v in itf.items()
                        if k.startswith("gemm_beside_")))
        b.put("cpu.copy_slowdown_beside_compute", max(1.0, itf["copy_slowdown"]), "measured",
            "a memcpy loop beside the GEMM loop, against alone")
        if "ssd_slowdown" in itf:
            b.put("cpu.ssd_slowdown_beside_compute", max(1.0, itf["ssd_slowdown"]), "measured",
                "the executor's store reading, then writing, beside the GEMM loop, against alone")
    b.put("cpu.adam_gparams_per_s", c["adam_gparams_per_s"], "measured",
        f"the executor's adam op (torch's {c.get('adam_impl', '?')} AdamW, the gradients zeroed, the compute "
        f"copy written) on {c.get('adam_threads', b.m.get('cpu_threads', '?'))} threads")
    _put_contention(b, host_device)
    _put_cpu_facts(b, c.get("facts"))
    if c.get("deepspeed_adam_gparams_per_s"):
        b.put("cpu.deepspeed_adam_gparams_per_s", c["deepspeed_adam_gparams_per_s"], "measured",
              f"DeepSpeedCPUAdam (adamw_mode) on {b.m.get('cpu_threads', '?')} threads")
    else:
        b.put("cpu.deepspeed_adam_gparams_per_s", None, "not measured",
              c.get("deepspeed_adam_error") or "DeepSpeed is not installed (the [baseline] extra)")


def _put_cpu_facts(b: _Builder, facts: dict[str, Any] | None) -> None:
    """What the CPU Adam model (planner/core/hostadam.py) needs of this host, detected here
    (calibration/cpu.host_cpu_facts), never the base's: a base's CPU is another box's."""
    if not facts:
        why = "not detected (a measurements file without the host's CPU facts)"
        for key in ("physical_cores", "clock_ghz"):
            b.put(f"cpu.{key}", None, "not measured", why)
        b.put("cpu.microarchitecture", "unknown", "not measured", why)
    else:
        arch = facts.get("microarchitecture") or "unknown"
        b.put("cpu.microarchitecture", arch, "measured" if arch != "unknown" else "not measured",
              facts.get("microarchitecture_how", ""))
        cores = facts.get("physical_cores")
        how = "/proc/cpuinfo: distinct (physical id, core id)" if cores else "/proc/cpuinfo lists no core ids"
        b.put("cpu.physical_cores", cores, "measured" if cores else "not measured", how)
        clock = facts.get("clock_ghz")
        b.put("cpu.clock_ghz", clock, "measured" if clock else "not measured", facts.get("clock_how", ""))
    b.put("cpu.memory_channels", None, "not measured",
          "DRAM channels need the firmware's tables (dmidecode, root); cpu.memory_gbps is measured")


def _put_contention(b: _Builder, host_device: bool) -> None:
    """cpu.gpu_slowdown_beside_host_optimizer: measured on a GPU (contention.py), else null with why."""
    k = b.m.get("contention")
    if host_device:
        b.put("cpu.gpu_slowdown_beside_host_optimizer", None, "derived",
              "the device is this CPU: compute beside the host's threads is cpu.compute_slowdown_per_io_op")
    elif k:
        b.put("cpu.gpu_slowdown_beside_host_optimizer", k["slowdown"], "measured",
              f"a burst of small GPU kernels from one thread, {k['beside_s'] * 1e3:.2f} ms beside the "
              f"executor's adam op on {k.get('threads', '?')} threads against {k['alone_s'] * 1e3:.2f} ms "
              "alone")
    else:
        b.put("cpu.gpu_slowdown_beside_host_optimizer", None, "not measured",
              "no GPU measurement (or it failed: see the notes)")


def _put_ssd(b: _Builder, host_device: bool) -> None:
    """The ssd section: the measured directory as one device (the executor's store rates on a CPU device);
    without --ssd-dir, the base's SSDs, or none when there is no explicit base."""
    s = b.m.get("ssd")
    if s:
        where = s.get("dir", "--ssd-dir")
        io = "O_DIRECT" if s.get("direct", True) else "buffered (no O_DIRECT)"
        b.put("ssd.count", 1, "measured",
              "the directory's filesystem measured as ONE device (RAID0 = one drive)")
        b.put("ssd.model", s["model"], "measured", f"block device of {where}")
        b.put("ssd.capacity_gb", s["capacity_gb"], "measured",
              "free space on the filesystem, not the drive size")
        b.put("ssd.read_gbps", s["read_gbps"], "measured",
              f"sequential {io}, {s['block_bytes'] // MIB} MiB blocks")
        b.put("ssd.write_gbps", s["write_gbps"], "measured", f"sequential {io} + fsync")
        b.put("ssd.array_read_gbps", None, "derived", "one device: no separate array ceiling")
        b.put("ssd.array_write_gbps", None, "derived", "one device: no separate array ceiling")
        b.put("ssd.rw_sharing", s["rw_sharing"], "measured",
            f"mixed {s['mixed_read_gbps']:.2f} read + {s['mixed_write_gbps']:.2f} write GB/s vs solo "
            f"{max(s['read_gbps'], s['write_gbps']):.2f}")
        kept = (s["mixed_read_gbps"] / s["read_gbps"] + s["mixed_write_gbps"] / s["write_gbps"]) / 2
        b.put("ssd.mixed_efficiency", min(1.0, max(0.5, kept)), "measured",
            "mean fraction of its solo rate each direction kept in the mixed run (within [0.5, 1])")
        st = s.get("store")
        # on a CPU device, the SSD tier as the executor's own store achieves it (O_DIRECT, CRC32, its pool)
        if host_device and st:
            what = f"the executor's SsdStore, {st['file_bytes'] // MIB} MiB files"
            b.put("ssd.read_gbps", st["read_gbps"], "measured", f"{what} (raw {io}: {s['read_gbps']:.2f})")
            b.put("ssd.write_gbps", st["write_gbps"], "measured", f"{what} (raw {io}: {s['write_gbps']:.2f})")
            kept = (st["mixed_read_gbps"] / st["read_gbps"] + st["mixed_write_gbps"] / st["write_gbps"]) / 2
            b.put("ssd.mixed_efficiency", min(1.0, max(0.5, kept)), "measured",
                f"{what}: mean fraction of its solo rate each direction kept reading and writing at once")
        if not s.get("direct", True):
            b.notes.append(f"{where} refused O_DIRECT: the SSD rates were measured with buffered I/O and may "
                           "be optimistic")
    elif not b.explicit_base:
        b.data["ssd"] = {"count": 0}
        b.info["ssd.count"] = FieldInfo("ssd.count", 0, "no --ssd-dir",
                                        "no SSD tier: pass --ssd-dir to measure one")
        b.notes.append("no --ssd-dir: the profile has no SSD tier (ssd.count = 0); pass --ssd-dir DIR on the "
                       "SSD")


def _put_overrides(b: _Builder, overrides: dict[str, Any] | None, device_gib: float | None,
                   host_device: bool) -> None:
    """--set: the user's values win (and a given CPU memory re-derives the reserve)."""
    for key, value in (overrides or {}).items():
        section, _, k = key.partition(".")
        if section not in b.data or k not in b.data[section]:
            raise CalibrationError(f"--set {key}: unknown profile key (keys are SECTION.KEY as in a profile "
                                   "YAML)")
        b.put(key, value, "given", "--set")
    if "cpu.memory_gib" in (overrides or {}) and "cpu.reserved_gib" not in overrides:
        mem = b.data["cpu"]["memory_gib"]
        b.put("cpu.reserved_gib", min(6 + 0.05 * mem, 0.5 * mem), "derived",
            "assumption: 6 GiB OS + runtime + 5% of the given memory (at most half)")
    if device_gib is not None and not host_device:
        b.put("gpu.memory_gib", device_gib, "given", "--set")


# Why a field calibrate does not measure is left null rather than taken from the base (a base's value of it
# belongs to the base's box: fitted to its runs, or measured there)
NOT_MEASURED_REASONS = {
    "gpu.op_overhead_us": "the executor's ops on a tiny plan did not run (see the notes)",
    "gpu.moved_op_overhead_us": "the executor's ops on a tiny plan did not run (see the notes)",
    "gpu.graph_launch_us": "the executor's ops on a tiny plan did not run (see the notes)",
    "gpu.graph_op_us": "the executor's ops on a tiny plan did not run (see the notes)",
    "cpu.executor_op_us": "the executor's ops on a tiny plan did not run (see the notes)",
    "gpu.attention_efficiency": "measured only for a CPU device",
    "gpu.activation_gbps": "measured only for a CPU device",
    "pcie.latency_us": "the executor's transfer ops on a tiny plan did not run (see the notes)",
    "ssd.latency_us": "measured only with --ssd-dir (the executor's SSD ops on a tiny plan)",
    "ssd.host_path_gbps": "the host path of a multi-drive array is fitted to its own runs (tierflow fit)",
}
# datasheet fields an explicit --base of the same GPU gives (as gpu.peak_tflops)
DATASHEET_FIELDS = ("gpu.fp32_tflops", "gpu.tf32_tflops")


def _null_unmeasured(b: _Builder) -> None:
    """Every nullable field that was not measured: null with its reason, never the base's value (except the
    datasheet peaks of an explicit --base)."""
    for section in ("gpu", "pcie", "cpu", "ssd"):
        for k in list(b.data[section]):
            key = f"{section}.{k}"
            if key in b.info or not nullable(key) or (key in DATASHEET_FIELDS and b.explicit_base):
                continue
            if section == "ssd" and b.data["ssd"].get("count", 0) == 0:
                continue
            b.put(key, None, "not measured", NOT_MEASURED_REASONS.get(key, f"tierflow calibrate does not "
                                                                      f"measure {key}"))


def _finish(b: _Builder, name: str | None) -> Calibration:
    """The rest from the base, the notes of what was not measured, the name and description; the profile."""
    g, p, s = b.m.get("gpu"), b.m.get("pcie"), b.m.get("ssd")
    _null_unmeasured(b)
    for section in ("gpu", "pcie", "cpu", "ssd", "price"):
        for k, v in b.data[section].items():
            key = f"{section}.{k}"
            if key not in b.info:
                b.info[key] = FieldInfo(key, v, b.from_base,
                                        "not measured" if section != "price" else "not measured (price)")
    if not g:
        b.notes.append(f"no CUDA GPU: the gpu and pcie sections are the {b.base_name} profile's "
                       f"({b.base.gpu.model}); run calibrate on the GPU box to measure them, or --device cpu "
                       "to profile this CPU as the device")
    for err in b.m.get("errors", []):
        b.notes.append(f"measurement failed, value taken from {b.base_name}: {err}")
    host = re.sub(r"[^A-Za-z0-9._-]", "-", str(b.m.get("host") or "box"))[:40] or "box"
    b.data["name"] = name or f"calibrated-{host}"
    measured_parts = ["CPU"] + (["GPU"] if g else []) + (["PCIe"] if p else []) + (["SSD"] if s else [])
    b.data["description"] = (f"measured by tierflow calibrate on {host} {time.strftime('%Y-%m-%d')}: "
                             f"{', '.join(measured_parts)} measured; the rest from {b.base_name}")
    profile = profile_from_dict(b.data, source="tierflow calibrate")
    order = [f"{sec}.{k}" for sec in ("gpu", "pcie", "cpu", "ssd", "price") for k in profile.to_dict()[sec]]
    fields = [b.info[k] for k in order if k in b.info]
    return Calibration(profile, fields, b.base_name, b.notes)
