"""CPU Adam's update rate from the host, per implementation: a roofline of each optimizer's loop.

An implementation streams its arrays once per step and runs, per element, a few multiply-adds, one square
root and one or two divisions. Its rate on a host is the lower of two bounds:

- compute: threads x clock / (cycles per element), where a core spends per element what its divide / square
  root unit needs (the one unit of the loop that is not pipelined: `sqrt` + `div` x divisions cycles per
  element, measured for the microarchitecture at its SIMD width; the multiply-adds, loads and stores issue
  beside it);
- memory: the DRAM bytes the loop moves per parameter (counted from its code) at the lower of the socket's
  sustained rate (cpu.memory_gbps x cpu.memory_efficiency) and what its threads can keep in flight
  (threads x one core's streaming rate, measured for the microarchitecture).

The implementations (what each moves and computes per parameter, read from its code):

- `deepspeed`: DeepSpeedCPUAdam (DeepSpeed 0.19.8 csrc/includes/cpu_adam.h `Step_AVX`, csrc/adam/
  cpu_adam_impl.cpp `Step_8`): fp32 p, g, m, v loaded, p, m, v stored (28 B); one `SIMD_SQRT` and one
  `SIMD_DIV` per vector (the bias correction folded into an FMA); `#pragma omp parallel for` over tiles of
  128 Mi elements (simd.h TILE) on every OpenMP thread; AVX-512 or AVX2 width (simd.h SIMD_WIDTH 16 / 8).
- `torch_fused`: torch's fused AdamW on the CPU (aten/src/ATen/native/cpu/FusedAdamKernel.cpp): the same 28 B;
  `sqrt()`, a division by sqrt(bias_correction2) and the division of the update: two divisions per vector;
  at::parallel_for over torch's threads.
- `tierflow`: tierflow's one-pass host kernel (executor/optim/fused_host_adamw.cpp `vector_loop`) as the
  executor's adam op runs it: also writes the bf16 compute copy (non-temporal stores: no read for ownership)
  and leaves the gradient as it is (`zero_grads=False`: the next step's first gradient write overwrites the
  accumulator, executor/ops/grads.py host_grad_writes): 28 + 2 = 30 B; one sqrt, two divisions. (Until
  2026-11-29 it also zeroed the gradient: 34 B.)

Nothing here is fitted on an optimizer's measured rate: the per-microarchitecture figures are measured on
single operations (experiments/host_adam_model.py) and the rates it predicts are checked against measured
optimizer rates there (docs/hardware-profiles.md, "CPU Adam from the host").
"""

from __future__ import annotations

from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile


@dataclass(frozen=True)
class AdamImpl:
    """What one optimizer implementation's loop does per parameter."""

    name: str
    bytes_per_param: float  # DRAM bytes moved per parameter per step (reads + writes)
    divisions: int  # vector divisions per element (each with the one square root on the divide unit)
    source: str


IMPLS: dict[str, AdamImpl] = {
    "deepspeed": AdamImpl("deepspeed", 28.0, 1, "DeepSpeed 0.19.8 csrc/includes/cpu_adam.h Step_AVX"),
    "torch_fused": AdamImpl("torch_fused", 28.0, 2, "aten/src/ATen/native/cpu/FusedAdamKernel.cpp"),
    "tierflow": AdamImpl("tierflow", 30.0, 2, "executor/optim/fused_host_adamw.cpp vector_loop"),
}


@dataclass(frozen=True)
class CoreCosts:
    """One microarchitecture's costs per fp32 element on one core at its vector width: the divide / square
    root unit's cycles per element and one core's streaming copy rate."""

    name: str
    sqrt_cycles: float  # cycles per element of a vector square root
    div_cycles: float  # cycles per element of a vector division
    core_gbps: float  # one core's streaming rate (bytes read + written per second)
    source: str


@dataclass(frozen=True)
class HostCpu:
    """What the model needs of a host: its cores (the optimizer's threads), clock, the microarchitecture's
    per-core costs and the socket's memory."""

    threads: int
    clock_ghz: float
    core: CoreCosts
    memory_gbps: float  # DRAM wire rate (channels x per-channel rate)
    memory_efficiency: float  # the fraction of it a streaming loop sustains (STREAM-like)


@dataclass(frozen=True)
class AdamRate:
    gparams_per_s: float
    compute_gparams_per_s: float
    memory_gparams_per_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_gparams_per_s <= self.memory_gparams_per_s else "memory"


def compute_gparams_per_s(impl: AdamImpl, cpu: HostCpu) -> float:
    cycles = cpu.core.sqrt_cycles + impl.divisions * cpu.core.div_cycles
    return cpu.threads * cpu.clock_ghz / cycles


def memory_gparams_per_s(impl: AdamImpl, cpu: HostCpu) -> float:
    gbps = min(cpu.memory_gbps * cpu.memory_efficiency, cpu.threads * cpu.core.core_gbps)
    return gbps / impl.bytes_per_param


def adam_rate(impl: AdamImpl | str, cpu: HostCpu) -> AdamRate:
    """The implementation's update rate on the host: the lower of its compute and memory bounds."""
    impl = IMPLS[impl] if isinstance(impl, str) else impl
    c, m = compute_gparams_per_s(impl, cpu), memory_gparams_per_s(impl, cpu)
    return AdamRate(min(c, m), c, m)


# Per-core costs measured per microarchitecture (experiments/host_adam_model.py, one thread, CPU time):
# zen3 on the 2-vCPU dev VM (AMD EPYC, family 25 model 1: Milan, KVM; 2.45 GHz TSC, the clock used to turn ns
# into cycles), 2026-11-29 at load 8-10: in-place torch sqrt_ / div_ over 256 KiB-1 MiB (cache-resident)
# 0.51-0.57 / 0.16-0.18 ns per element; streaming add_ / addcmul_ / addcmul(out=) over 128 MiB arrays 27.1 /
# 24.7 / 26.7 GB/s (bytes read + written, no write-allocate counted where the output is an input).
CORE_COSTS: dict[str, CoreCosts] = {
    "zen3": CoreCosts("zen3", sqrt_cycles=0.54 * 2.45, div_cycles=0.17 * 2.45, core_gbps=26.0,
                      source="experiments/host_adam_model.py, dev VM (AMD EPYC Milan, KVM), 2026-11-29"),
}


# A microarchitecture without measured costs gets lower bounds: per element twice zen3's divide-unit cycles,
# and the lowest per-thread streaming rate any box has shown, 7.0 GB/s (the H200 box's fused AdamW, 3.98 G
# params/s x 28 B over 16 threads, itself shared by 16 threads on one socket). With them the model still says
# whether the socket binds: where cores x 7.0 GB/s exceed the socket's sustained rate, the socket's bandwidth
# sets the rate whatever the core (e.g. 2x Xeon Gold 5320: 52 x 7.0 = 364 > 307 GB/s).
LOWER_BOUND_COSTS = CoreCosts("lower bounds", sqrt_cycles=2 * CORE_COSTS["zen3"].sqrt_cycles,
                              div_cycles=2 * CORE_COSTS["zen3"].div_cycles, core_gbps=7.0,
                              source="lower bounds: 2x zen3's cycles; the H200 box's 7.0 GB/s per thread")


def host_cpu(hw: HardwareProfile, threads: float | None = None, share: float = 1.0) -> HostCpu | None:
    """The profile's host as the model sees it, with `threads` optimizer threads (default: every physical
    core) and `share` of its memory bandwidth (1/g for one of g processes on the box); None where the profile
    lacks what the model needs (physical cores, clock, a memory efficiency). A microarchitecture without
    measured costs takes LOWER_BOUND_COSTS."""
    c = hw.cpu
    core = CORE_COSTS.get(c.microarchitecture, LOWER_BOUND_COSTS)
    if c.physical_cores is None or c.clock_ghz is None or c.memory_efficiency is None:
        return None
    n = c.physical_cores if threads is None else threads
    return HostCpu(max(1, int(n)), c.clock_ghz, core, c.memory_gbps * share, c.memory_efficiency)


def profile_rate(hw: HardwareProfile, impl: AdamImpl | str, threads: float | None = None,
                 share: float = 1.0) -> AdamRate | None:
    """`impl`'s rate on the profile's host (None where the profile cannot say: host_cpu)."""
    cpu = host_cpu(hw, threads, share)
    return None if cpu is None else adam_rate(impl, cpu)


# ---- the profiles' rates: one source of truth -------------------------------------------------------------
# A profile's two CPU Adam fields are this model's rates wherever the profile describes its host and carries
# no measured or fitted value: `cpu.adam_gparams_per_s` is tierflow's kernel (what the executor runs),
# `cpu.deepspeed_adam_gparams_per_s` DeepSpeedCPUAdam's loop (what LoHan's child process runs and DeepSpeed's
# ZeRO-3 step calls; the step's copies around it are planner/core/dsruntime.py's). The bundled profiles carry
# the values `experiments/host_adam_model.py --write-profiles` writes from profile_fields (each line's comment
# names the model and its inputs); tests/planner/core/test_hostadam.py fails when a line drifts from it.
PROFILE_FIELDS: dict[str, str] = {"adam_gparams_per_s": "tierflow",
                                  "deepspeed_adam_gparams_per_s": "deepspeed"}
KEPT_SOURCES = ("measured", "fitted")  # a profile line whose comment starts so is never replaced


def _g(x: float) -> str:
    return f"{x:.3g}"


def rate_comment(hw: HardwareProfile, impl: AdamImpl | str) -> tuple[float, str] | None:
    """`impl`'s rate on the profile's host, to 3 significant digits, and the comment that names the model and
    its inputs (None where the profile cannot say: host_cpu)."""
    impl = IMPLS[impl] if isinstance(impl, str) else impl
    cpu = host_cpu(hw)
    if cpu is None:
        return None
    r = adam_rate(impl, cpu)
    c = cpu.core
    socket = cpu.memory_gbps * cpu.memory_efficiency
    cores = cpu.threads * c.core_gbps
    cycles = c.sqrt_cycles + impl.divisions * c.div_cycles
    per_core = f"measured {c.name}" if c.name in CORE_COSTS else "lower bound"
    memory = (f"min({cpu.memory_gbps:g} GB/s x {cpu.memory_efficiency:g}, {cpu.threads} cores x "
              f"{c.core_gbps:g} GB/s {per_core}) / {impl.bytes_per_param:g} B = {_g(r.memory_gparams_per_s)}")
    compute = (f"{cpu.threads} cores x {cpu.clock_ghz:g} GHz / {_g(cycles)} cycles = "
               f"{_g(r.compute_gparams_per_s)}")
    if r.bound == "memory":
        where = "the socket" if socket <= cores else "its cores' streams"
        bounds = f"memory-bound at {where}: {memory}; compute bound {compute}"
    else:
        bounds = f"compute-bound: {compute}; memory bound {memory}"
    text = (f"host model (planner/core/hostadam.py, written by experiments/host_adam_model.py "
            f"--write-profiles): {impl.name} ({impl.source}) {bounds}")
    return float(_g(r.gparams_per_s)), text


def profile_fields(hw: HardwareProfile) -> dict[str, tuple[float, str]]:
    """The CPU Adam fields (cpu section keys) the model gives this profile, with their comments."""
    out = {}
    for key, impl in PROFILE_FIELDS.items():
        line = rate_comment(hw, impl)
        if line is not None:
            out[key] = line
    return out
