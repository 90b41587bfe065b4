"""Host memory DeepSpeed's ZeRO-3 allocates for itself when it offloads (runtime deepspeed), beyond the
tensors a placement puts in host memory: read in DeepSpeed 0.19.8's code (docs/baselines-as-coded.md A5, A6).

- The gradient partitions: `grad_partitions_flat_buffer`, one element of the gradient accumulation dtype (the
  model's 16-bit dtype by default) per parameter of this rank's partition, on the host whenever the optimizer
  is offloaded (stage3.py: `self.device` is cpu with offload_optimizer; the buffer is allocated at set-up,
  pinned with `pin_memory`), for the whole run.
- The optimizer's fp32 gradient (stage3.py initialize_optimizer_states): with the states in host memory
  one pinned buffer per sub-group, 4 B for every parameter of the partition, for the whole run; with the
  states on NVMe one buffer of the largest sub-group's elements, through which every sub-group's fp32
  gradient is swapped out at the accumulation boundary (_offload_grad_partition_at_boundary ->
  swap_out_gradients) and back in for its step. The 16-bit partitions accumulate the micro-batches'
  gradients; no other host buffer holds a gradient, so the schedule's fp32 gradients take no host memory of
  their own under this runtime.
- The optimizer swapper's pinned buffers (optimizer states on NVMe): `buffer_count` (4) buffers of the largest
  sub-group's elements in fp32 (swap_tensor/optimizer_utils.py: SwapBufferManager(num_elems=largest_numel,
  count=swap_config.buffer_count)).
- The parameter swapper's pinned buffers (parameters on NVMe): `buffer_count` (5) x `buffer_size` (1e8)
  elements of the 16-bit dtype (swap_tensor/partitioned_param_swapper.py: self.buffers).
- The parameters `offload_param.max_in_cpu` keeps in host memory with parameters on NVMe: whole sub-groups, in
  model order, while their running total stays within max_in_cpu elements (stage3.py
  _create_param_groups_fp16_flat_cpu_memory, _create_fp16_partitions_with_defragmentation: a sub-group that
  fits the pinned flat buffer is swapped in once, permanently, `final_location = 'not-nvme'`); they are
  fetched and prefetched like CPU-offloaded parameters and never read from NVMe (`ds_cached_blocks`).
- Pinned with `offload_optimizer.pin_memory` on a CUDA box (DsKnobs.pin_memory): the gradient partitions
  (and, with the states in host memory, each sub-group's fp32 gradient) are made pageable with `torch.zeros`
  and then copied into page-locked memory by `get_accelerator().pin_memory(...)` (stage3.py:791-795 @0.19.8;
  :400-404 @0.9.5; :547-551 @0.16.9), which is torch's `Tensor.pin_memory()`
  (accelerator/abstract_accelerator.py:275-276, 328-339 @0.19.8, unless DS_PIN_MEMORY_BACKEND=native).
  torch's caching host allocator rounds every pinned allocation up to a power of two
  (ATen/core/CachingHostAllocator.h:300-309 @torch 2.13: `PowerOf2Ceil(size)` below
  `pinned_max_round_threshold`, unlimited by default), and the pageable original is alive while the copy is
  made: `pinned_alloc_bytes`, `deepspeed_setup_peak_bytes`. On DeepSpeed's CPU accelerator `pin_memory` is a
  no-op (cpu_accelerator.py:283-291), so nothing is rounded there.
Defaults are offload_config.py's. Not measured here: the CPU accelerator cannot build the NVMe swapper in this
sandbox's time (its async_io op compiles for minutes); the sizes are the code's.

Also here: the copies DeepSpeed's host thread waits for, and the CPU Adam each runtime runs (DeepSpeedCPUAdam
for runtimes deepspeed and lohan: as_runtime_steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from tierflow.planner.core.workload import COMPUTE_BYTES, MASTER_BYTES

if TYPE_CHECKING:
    from tierflow.hwprofiles import HardwareProfile

DS_SUB_GROUP_ELEMS = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default (zero/config.py)
DS_OPT_BUFFER_COUNT = 4  # offload_optimizer.buffer_count
DS_PARAM_BUFFER_COUNT = 5  # offload_param.buffer_count
DS_PARAM_BUFFER_ELEMS = 100_000_000  # offload_param.buffer_size
DS_MAX_IN_CPU_ELEMS = 1_000_000_000  # offload_param.max_in_cpu
DS_REDUCE_BUCKET_ELEMS = 500_000_000  # zero_optimization.reduce_bucket_size (zero/config.py)


@dataclass(frozen=True)
class DsKnobs:
    """The DeepSpeed config keys that size DeepSpeed's own buffers (ScheduleConfig.ds_knobs)."""

    sub_group_elems: int = DS_SUB_GROUP_ELEMS
    opt_buffer_count: int = DS_OPT_BUFFER_COUNT
    param_buffer_count: int = DS_PARAM_BUFFER_COUNT
    param_buffer_elems: int = DS_PARAM_BUFFER_ELEMS
    # the GPU's gradient bucket: reduce_bucket_size elements, allocated only with contiguous_gradients
    # (stage3.py __init__: `if self.contiguous_gradients: bucket.buffer = torch.empty(reduce_bucket_size)`)
    reduce_bucket_elems: int = DS_REDUCE_BUCKET_ELEMS
    contiguous_gradients: bool = True
    # offload_param.device nvme: the parameter swapper's buffers exist even when max_in_cpu keeps every
    # parameter in host memory (no weights on the SSDs)
    param_swapper: bool = False
    # offload_optimizer.pin_memory on a CUDA box: the host gradient buffers are page-locked by torch's caching
    # host allocator (rounded up to a power of two; pinned_alloc_bytes). DeepSpeed's default is True at 0.19.8
    # (offload_config.py:75) and False at 0.9.5 and 0.16.9 (offload_config.py:70, :72); False here, so that a
    # schedule not read from a config keeps its host memory as before (the bridge sets it from the config)
    pin_memory: bool = False

    @property
    def gpu_bucket_elems(self) -> int:
        return self.reduce_bucket_elems if self.contiguous_gradients else 0


def pinned_alloc_bytes(nbytes: float) -> float:
    """Host bytes a page-locked allocation of `nbytes` through torch's caching host allocator holds: the next
    power of two (ATen/core/CachingHostAllocator.h:300-309 @torch 2.13, `c10::llvm::PowerOf2Ceil(size)`
    while the size is below `pinned_max_round_threshold` and `pinned_max_cached_size`, both unlimited by
    default)."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 1 else float(nbytes)


def _sub_group_sizes(partition_params: int, sub_group_elems: int) -> list[int]:
    """Sub-group sizes of a partition cut into sub_group_elems pieces (the last one smaller)."""
    whole, rest = divmod(partition_params, max(1, sub_group_elems))
    return [sub_group_elems] * whole + ([rest] if rest else [])


def deepspeed_host_buffers_bytes(partition_params: int, knobs: DsKnobs | int, params_on_nvme: bool,
                                 states_on_nvme: bool, compute_bytes: int = COMPUTE_BYTES) -> float:
    """Host bytes DeepSpeed holds for the whole run with the optimizer offloaded, for a rank whose partition
    has `partition_params` parameters of a model trained in `compute_bytes` per element (its dtype: the
    gradient partitions' and the parameter swapper's, 4 B when it trains in fp32). `knobs`: the config's
    buffer keys (an int: the sub-group size, the other keys at their defaults)."""
    k = knobs if isinstance(knobs, DsKnobs) else DsKnobs(sub_group_elems=knobs)
    held = pinned_alloc_bytes if k.pin_memory else float
    out = held(compute_bytes * partition_params)  # grad_partitions_flat_buffer
    largest_sub_group = min(k.sub_group_elems, partition_params)
    # the fp32 gradient: one buffer per sub-group in host memory (each pinned on its own with pin_memory:
    # initialize_optimizer_states, stage3.py:1337-1339 @0.19.8), one shared buffer when they are swapped
    if states_on_nvme:
        out += MASTER_BYTES * largest_sub_group
    else:
        out += sum(held(MASTER_BYTES * n) for n in _sub_group_sizes(partition_params, k.sub_group_elems))
    if states_on_nvme:
        out += k.opt_buffer_count * MASTER_BYTES * largest_sub_group
    if params_on_nvme or k.param_swapper:
        out += k.param_buffer_count * k.param_buffer_elems * compute_bytes
    return out


def deepspeed_setup_peak_bytes(partition_params: int, knobs: DsKnobs, params_on_nvme: bool,
                               states_on_nvme: bool, compute_bytes: int = COMPUTE_BYTES) -> float:
    """Host bytes DeepSpeed holds for itself at the moment it pins the gradient partitions at set-up, with
    `offload_optimizer.pin_memory` (knobs.pin_memory; 0 without it): the pageable `torch.zeros` buffer and its
    page-locked copy (pinned_alloc_bytes) at once (stage3.py:791-795 @0.19.8: the pageable tensor is the
    argument of `pin_memory` until it returns), beside the swappers' pinned buffers, which exist by then (the
    parameter swapper's from zero.Init, the optimizer swapper's from _configure_tensor_swapping,
    stage3.py:449, before _setup_for_real_optimizer, :499). A box whose host memory is below this cannot
    start the run."""
    if not knobs.pin_memory:
        return 0.0
    grads = float(compute_bytes * partition_params)
    out = grads + pinned_alloc_bytes(grads)
    if states_on_nvme:
        out += knobs.opt_buffer_count * MASTER_BYTES * min(knobs.sub_group_elems, partition_params)
    if params_on_nvme or knobs.param_swapper:
        out += knobs.param_buffer_count * knobs.param_buffer_elems * compute_bytes
    return out


def ds_cached_elems(owned_params: list[int], sub_groups: list[int], max_in_cpu_elems: float) -> int:
    """Parameters `offload_param.max_in_cpu` keeps in host memory with parameters on NVMe: the leading whole
    sub-groups (`sub_groups[i]`: block i's, ds_sub_groups) whose running total stays within max_in_cpu
    (stage3.py _create_fp16_partitions_with_defragmentation: `flat_offset + total_elements <= buffer`)."""
    per_group: dict[int, int] = {}
    for n, g in zip(owned_params, sub_groups):
        per_group[g] = per_group.get(g, 0) + n
    total = 0
    for g in sorted(per_group):
        if total + per_group[g] > max_in_cpu_elems:
            break
        total += per_group[g]
    return total


# ---- the CPU Adam each runtime runs ------------------------------------------------------------------------
# The runtimes whose optimizer is DeepSpeedCPUAdam (DeepSpeed's C++ AVX kernel, csrc/includes/cpu_adam.h):
# ZeRO-3 with the optimizer offloaded (stage3.py builds it from deepspeed.ops.adam; docs/baselines-as-coded.md
# A7), and LoHan, whose child process runs `DeepSpeedCPUAdam.step` on each sub-group (RC4ML/LoHan
# main.py:14-54; baselines-as-coded.md B2). The ideal runtime (tierflow's executor) steps with its own AdamW.
DEEPSPEED_ADAM_RUNTIMES = ("deepspeed", "lohan")


def adam_rate_key(hw: HardwareProfile, runtime: str | None) -> str:
    """The profile field whose rate `runtime`'s CPU Adam steps at: `cpu.deepspeed_adam_gparams_per_s` for a
    runtime that runs DeepSpeedCPUAdam (DEEPSPEED_ADAM_RUNTIMES) where the profile has that rate (measured,
    fitted or the host model's), else `cpu.adam_gparams_per_s` (tierflow's kernel: what the executor runs)."""
    if runtime in DEEPSPEED_ADAM_RUNTIMES and hw.cpu.deepspeed_adam_gparams_per_s is not None:
        return "cpu.deepspeed_adam_gparams_per_s"
    return "cpu.adam_gparams_per_s"


def as_runtime_steps(hw: HardwareProfile, runtime: str | None) -> HardwareProfile:
    """The box as `runtime`'s optimizer sees it: `cpu.adam_gparams_per_s` set to the rate of the
    implementation the runtime runs (adam_rate_key). Idempotent (the box it returns steps at that rate
    already, so it comes back unchanged), and applied where every caller passes: schedules.build_graph (the
    adam ops' durations) and simulator.simulate_graph (CPU Adam's DRAM traffic, from the graph's
    meta["runtime"]), so a graph built on the bare profile and simulate_config agree for every runtime. With
    several ranks per box the rate is still divided among them (costmodel.link_rates)."""
    key = adam_rate_key(hw, runtime)
    rate = hw.cpu.deepspeed_adam_gparams_per_s
    if key == "cpu.adam_gparams_per_s" or rate == hw.cpu.adam_gparams_per_s:
        return hw
    return _stepping_at(hw, rate)


@lru_cache(maxsize=32)
def _stepping_at(hw: HardwareProfile, rate: float) -> HardwareProfile:
    """`hw` with its CPU Adam at `rate` (cached: build_graph and simulate_graph ask for the same box on every
    call of a search; a profile is frozen, so the copy can be shared)."""
    return hw.with_overrides({"cpu.adam_gparams_per_s": rate})


# ---- copies DeepSpeed's host thread waits for (runtime deepspeed on a GPU box) -----------------------------
# PyTorch's copy_ between the CPU and a GPU with a dtype change and non_blocking=False converts on the CPU
# through a temporary in pageable memory (aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda: "If
# non_blocking is true - type conversions are performed on the GPU for CPU-GPU copies, otherwise type
# conversions are performed on the CPU"): the device copy is then a pageable cudaMemcpy, which the calling
# thread waits for.


def _host_convert_s(hw: HardwareProfile, nbytes: float) -> float:
    """The CPU's dtype conversion of a copy: its bytes read and written at the host's sustained memory rate
    (0 where host memory bandwidth is not modelled)."""
    bps = hw.cpu.sustained_memory_bps
    return 0.0 if math.isinf(bps) else nbytes / bps


def ds_fp32_grad_copy_s(hw: HardwareProfile, params: float, grad_bytes: int) -> float | None:
    """Host seconds of DeepSpeed's copy of `params` 16-bit gradient elements into the optimizer's fp32
    gradient at the accumulation boundary (stage3.py partition_grads: `fp32_grad_tensor.copy_(grad_buffer)`,
    no non_blocking, inside the reduce-and-partition stream): a pageable D2H of the 16-bit partition, then the
    CPU's conversion to fp32 (2 B read, 4 B written per element). The host waits for it, so the backward's
    next kernels wait too. None where the profile does not model pageable copies or no dtype changes
    (fp32)."""
    rate = hw.pcie.pageable_d2h_gbps
    if rate is None or grad_bytes >= MASTER_BYTES:
        return None
    return params * grad_bytes / (rate * 1e9) + _host_convert_s(hw, params * (grad_bytes + MASTER_BYTES))


def ds_weights_copy_s(hw: HardwareProfile, params: float, compute_bytes: int) -> float | None:
    """Host seconds of DeepSpeed's copy of a sub-group's updated fp32 partition into its 16-bit GPU partition
    after the CPU step (stage3.py _reassign_or_swap_out_partitioned_parameters:
    `fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data)`): the CPU's conversion
    to 16 bits into a pageable temporary (4 B read, 2 B written), then a pageable H2D, before the next
    sub-group's step. None where the profile does not model pageable copies or no dtype changes (fp32)."""
    rate = hw.pcie.pageable_h2d_gbps
    if rate is None or compute_bytes >= MASTER_BYTES:
        return None
    convert_s = _host_convert_s(hw, params * (compute_bytes + MASTER_BYTES))
    return params * compute_bytes / (rate * 1e9) + convert_s
