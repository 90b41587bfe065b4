"""The memory model: the bytes a schedule needs on each tier (GPU, CPU memory, SSD), in closed form.

One model serves every estimate: each family's default placement (tierflow.planner.core.schedules), the CP-SAT
placement model and `min_requirements` of the search, `tierflow capacity` and the message for a model that
does not fit. The simulator is the judge: tests/planner/core/test_memory.py checks on random configurations
that each tier's estimate is at least the simulated peak and at most MARGIN above it.

A tier holds
- the placed tensors (static for the whole run): bf16 weights, fp32 master and Adam moments where the
  placement puts them, and the SSD space of spilled fp32 gradients (`placed_bytes`);
- what the schedule holds besides them (`ScheduleMemory`): on the host the fp32 gradients that wait for their
  optimizer step and the staging buffers of the blocks in flight; on the tier the placement gives checkpoints,
  the activation checkpoints (and the activations and activation gradients parked between layers) held at the
  turn from forward to backward; on the GPU the weight buffers, working memory and gradient buffers.

On the GPU, a plan the executor runs also holds what its CUDA runtime maps under the allocator's cap (cuBLAS
workspaces, the allocator's pages: tierflow.planner.core.devicemem) among its static bytes; each op's working
memory is workload.py's (fwd_working_bytes, bwd_working_bytes), measured against the executor's op code by
experiments/device_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
from tierflow.planner.core.dsruntime import (  # noqa: F401 (DS_REDUCE_BUCKET_ELEMS: imported from here too)
    DS_REDUCE_BUCKET_ELEMS,
    DS_SUB_GROUP_ELEMS,
    DsKnobs,
    deepspeed_host_buffers_bytes,
)
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.workload import (
    ADAM_STATE_BYTES,
    DEFAULT_PRECISION,
    MASTER_BYTES,
    PRECISIONS,
    BlockCost,
    Precision,
    embed_cost,
    head_cost,
    layer_cost,
    precision_of,
)
from tierflow.planner.core.world import shard_elems

STATE_BYTES = MASTER_BYTES + 2 * ADAM_STATE_BYTES  # fp32 master + Adam m + v, per parameter (every precision)
# Host memory the planner leaves free on every box, for what no model counts: the runtime's own allocations,
# page cache of the SSD files, the allocator's rounding. One constant, used wherever host memory is budgeted.
HOST_RESERVE_FRACTION = 0.02
# How far above the simulated peak (with the box's full capacity) an estimate may lie, as a fraction of that
# peak (tests/planner/core/test_memory.py; on the CPU plus the staging of the blocks in flight). The bounds
# count the blocks in flight as the largest blocks of the model (for small models the embedding and a tied
# head, not layers) and every swapped layer's activations at once; on random small configurations the GPU
# estimate is up to 1.6x the peak, the SSD's up to 2.1x (two layers, both swapping), the CPU's (less staging)
# up to 1.3x. For large models the terms that make the difference (a few blocks against L layers) vanish.
MARGIN = 1.5


# DeepSpeed ZeRO-3 defaults that hold GPU memory for the whole step (docs/baselines-as-coded.md, A2 and A4):
# gradient buckets whose reduce and copy may be in flight before the host waits for the oldest (stage3.py:
# max_param_reduce_events)
DS_MAX_PARAM_REDUCE_EVENTS = 2
# parameters kept on the GPU at the forward/backward turn (zero/config.py:244)
DS_MAX_REUSE_DISTANCE_ELEMS = 1e9


def deepspeed_gpu_buffers_bytes(model: ModelSpec, knobs: DsKnobs | None = None) -> float:
    """GPU bytes DeepSpeed's ZeRO-3 holds besides what the schedule's tasks allocate: its gradient bucket
    (with contiguous_gradients, of the config's reduce_bucket_size: DsKnobs) and the parameters its reuse
    distance keeps resident where the forward turns into the backward."""
    bucket = (knobs or DsKnobs()).gpu_bucket_elems
    resident = min(model.total_params(), DS_MAX_REUSE_DISTANCE_ELEMS)
    return precision_of(model).compute_bytes * (bucket + resident)



def deepspeed_inflight_grads_bytes(model: ModelSpec, blocks: list[BlockCost]) -> float:
    """GPU bytes of the gradients that wait for DeepSpeed's reduce-and-copy stream: those of the buckets in
    flight (DS_MAX_PARAM_REDUCE_EVENTS of them, then the one filling; a bucket holds one block when a block
    exceeds reduce_bucket_size), at most every block's."""
    largest = max(b.fetch_params for b in blocks)
    bound = (DS_MAX_PARAM_REDUCE_EVENTS + 1) * max(DS_REDUCE_BUCKET_ELEMS, largest) + largest
    return precision_of(model).grad_accum_bytes * min(bound, sum(b.fetch_params for b in blocks))


def blocks_of(model: ModelSpec, micro_batch: int, seq: int) -> list[BlockCost]:
    """The embedding, every decoder layer and the head, for one micro-batch."""
    layer = layer_cost(model, micro_batch, seq)
    return ([embed_cost(model, micro_batch, seq)] + [layer] * model.num_layers
            + [head_cost(model, micro_batch, seq)])


def placed_bytes(model: ModelSpec, placement: Placement, ranks: int = 1) -> dict[str, float]:
    """Bytes resident on each tier for the whole run: weights and optimizer states where the placement puts
    them, plus the SSD space reserved for spilled gradients; with several ranks, one rank's shard of them.
    Under LoRA the placement places the frozen base weights (no states, no gradients) and the adapters live
    on the GPU (adapter_gpu_bytes)."""
    out = placed_bytes_of(shard_elems(model.total_params(), ranks), placement, placed_precision(model))
    out["gpu"] += adapter_gpu_bytes(model)
    return out


def placed_precision(model: ModelSpec) -> Precision:
    """The bytes per parameter of the placed (base) parameters: the model's precision, or under LoRA a
    frozen base's: its compute-dtype weights only (no master, no moments, no gradient)."""
    pr = precision_of(model)
    if model.lora is None:
        return pr
    return replace(pr, master_bytes=0.0, adam_state_bytes=0.0, grad_accum_bytes=0)


def adapter_gpu_bytes(model: ModelSpec) -> float:
    """LoRA's adapters on the GPU for the whole run: their compute-dtype weights, master copy (none for an
    in-place precision), Adam moments and fp32 gradient (0 without LoRA)."""
    pr = precision_of(model)
    per_param = pr.compute_bytes + pr.master_bytes_at(True) + 2 * pr.adam_state_bytes + pr.grad_accum_bytes
    return float(model.adapter_params() * per_param)


def placed_bytes_of(params: int, placement: Placement,
                    precision: Precision = PRECISIONS[DEFAULT_PRECISION]) -> dict[str, float]:
    p, pr = placement, precision
    out = {}
    for tier in ("gpu", "cpu", "ssd"):
        out[tier] = params * (pr.compute_bytes * getattr(p.weights, tier)
                              + pr.master_bytes_at(p.gpu_optimizer) * getattr(p.master, tier)
                              + pr.adam_state_bytes * (getattr(p.adam_m, tier) + getattr(p.adam_v, tier)))
    out["ssd"] += pr.grad_accum_bytes * params * p.grads.ssd
    return out


def static_bytes(model: ModelSpec, placement: Placement, runtime: str = "ideal",
                 ranks: int = 1, ds: DsKnobs | int = DS_SUB_GROUP_ELEMS,
                 hw: HardwareProfile | None = None) -> dict[str, float]:
    """Bytes resident on each tier for the whole run: the placed tensors (one rank's shard of them), plus the
    GPU and host buffers DeepSpeed's runtime holds while the optimizer states are offloaded
    (tierflow.planner.core.dsruntime; `ds`: its config's buffer keys, ScheduleConfig.ds_knobs, or only the
    sub-group size), or for a plan the executor runs on a GPU (`hw`'s), what its CUDA runtime maps under the
    device cap (tierflow.planner.core.devicemem: cuBLAS workspaces, the allocator's pages)."""
    out = placed_bytes(model, placement, ranks)
    out["gpu"] += runtime_gpu_reserve_bytes(runtime, ranks, hw)
    if runtime == "deepspeed" and not placement.gpu_optimizer:
        knobs = ds if isinstance(ds, DsKnobs) else DsKnobs(sub_group_elems=ds)
        out["gpu"] += deepspeed_gpu_buffers_bytes(model, knobs)
        partition = shard_elems(model.total_params(), ranks)
        out["cpu"] += deepspeed_host_buffers_bytes(partition, knobs, placement.weights.ssd > 0,
                                                   placement.master.ssd > 0,
                                                   precision_of(model).compute_bytes)
    return out


def host_reserve_bytes(cpu_capacity_bytes: float) -> float:
    return HOST_RESERVE_FRACTION * cpu_capacity_bytes


def holds_every_gradient(num_micro_batches: int, group: int, optimizer_overlap: bool) -> bool:
    """Does the host hold every block's fp32 gradient at once? A block's gradient is final only after its last
    micro-batch's backward: with several groups of micro-batches (group < M), or with the optimizer after the
    whole backward, every block's gradient waits on the host; else only the blocks between their backward and
    their optimizer step (and the deferred fraction alpha of every block)."""
    return group < num_micro_batches or not optimizer_overlap


@dataclass(frozen=True)
class ScheduleMemory:
    """Bytes a schedule needs besides the placed tensors, by where they live. Checkpoint bytes are per layer
    and go to the tiers the placement gives checkpoints; `swap_extra_bytes` is what a layer that keeps all its
    activations (instead of recomputing) holds beyond a recomputed one."""

    layers: int
    params: int
    host_grad_bytes: float  # fp32 gradients waiting on the host for their optimizer step
    weight_staging_bytes: float  # host buffers of weights read from the SSDs ahead of their fetch
    state_staging_bytes: float  # host buffers of optimizer states streamed from and to the SSDs
    grad_staging_bytes: float  # host buffers of spilled gradients read back for the optimizer
    ckpt_staging_bytes: float  # host buffers of checkpoints on their way to and from the SSDs
    ckpt_staging_swap_bytes: float  # ... when layers swap all their activations
    # checkpoints (+ parked activations / activation gradients) per recomputed layer
    ckpt_per_layer_bytes: float
    swap_extra_bytes: float  # ... extra per swapped layer
    # closed-form GPU bytes beyond resident tensors (weight buffers, work, gradients)
    gpu_working_bytes: float
    gpu_working_swap_bytes: float  # ... when layers keep their activations (their prefetched activations)
    runtime_gpu_bytes: float = 0.0  # GPU buffers the runtime holds while states are offloaded (DeepSpeed's)
    cuda_runtime_bytes: float = 0.0  # what the executor's CUDA runtime maps under the cap (devicemem)
    deepspeed_host: bool = False  # DeepSpeed's own host buffers (tierflow.planner.core.dsruntime) are counted
    # every block's fp32 gradient is offloaded more than once per iteration (group < micro-batches): its host
    # buffer lives from the first offload to its step, so spilling it to the SSD (after its last micro-batch)
    # does not lower the host's peak
    accumulates_on_host: bool = False
    precision: Precision = PRECISIONS[DEFAULT_PRECISION]  # the bytes of the placed tensors
    # compressed optimizer states (optstates): the fp32 copies of the master and moments of the block being
    # stepped (executor/optim/qstate.py decodes, updates and encodes a part at once), where the optimizer runs
    opt_workspace_bytes: float = 0.0
    adapter_gpu_bytes: float = 0.0  # LoRA's adapters, their gradients and states, on the GPU (placed_bytes)

    @property
    def host_staging_bytes(self) -> float:
        """Staging for every tensor class streamed from the SSDs (an upper bound for any placement)."""
        return self.weight_staging_bytes + self.state_staging_bytes + self.grad_staging_bytes \
            + max(self.ckpt_staging_bytes, self.ckpt_staging_swap_bytes)

    def staging_bytes(self, placement: Placement, swap_layers: int = 0) -> float:
        """Staging of the tensor classes this placement streams from the SSDs."""
        p = placement
        ckpt = self.ckpt_staging_swap_bytes if swap_layers else self.ckpt_staging_bytes
        return (self.weight_staging_bytes * (p.weights.ssd > 0)
                + self.state_staging_bytes * (p.master.ssd > 0)
                + self.grad_staging_bytes * (p.grads.ssd > 0) + ckpt * (p.checkpoints.ssd > 0))

    def host_grads_bytes(self, placement: Placement) -> float:
        """Host bytes the schedule's fp32 gradients take at their peak (the graph's offload, spill and step
        tasks): none under DeepSpeed, whose own buffers hold them (dsruntime), nor with the optimizer on the
        GPU; all of them while they accumulate over micro-batches; else what the placement does not spill."""
        if placement.gpu_optimizer or self.deepspeed_host:
            return 0.0
        return self.host_grad_bytes * (1.0 if self.accumulates_on_host else 1.0 - placement.grads.ssd)

    def checkpoint_bytes(self, swap_layers: int) -> float:
        return self.ckpt_per_layer_bytes * self.layers + self.swap_extra_bytes * swap_layers

    def tier_bytes(self, placement: Placement, swap_layers: int, cpu_capacity_bytes: float = 0.0,
                   gpu_working_bytes: float | None = None) -> dict[str, float]:
        """The estimate of each tier's peak for this placement and swap count (plus the host reserve of a box
        with `cpu_capacity_bytes`); `gpu_working_bytes` replaces the closed form with a measured value."""
        placed = placed_bytes_of(self.params, placement, self.precision)
        ck = self.checkpoint_bytes(swap_layers)
        c = placement.checkpoints
        if gpu_working_bytes is None:
            gpu_working_bytes = self.gpu_working_swap_bytes if swap_layers else self.gpu_working_bytes
        gpu_work = (gpu_working_bytes + (0.0 if placement.gpu_optimizer else self.runtime_gpu_bytes)
                    + self.cuda_runtime_bytes)
        grads_on_host = self.host_grads_bytes(placement)
        if self.deepspeed_host and not placement.gpu_optimizer:  # as static_bytes counts them
            grads_on_host += deepspeed_host_buffers_bytes(self.params, DS_SUB_GROUP_ELEMS,
                                                          placement.weights.ssd > 0, placement.master.ssd > 0,
                                                          self.precision.compute_bytes)
        on_gpu = placement.gpu_optimizer
        return {
            "gpu": placed["gpu"] + self.adapter_gpu_bytes + gpu_work + ck * c.gpu
            + (self.opt_workspace_bytes if on_gpu else 0.0),
            "cpu": placed["cpu"] + grads_on_host + self.staging_bytes(placement, swap_layers) + ck * c.cpu
            + host_reserve_bytes(cpu_capacity_bytes) + (0.0 if on_gpu else self.opt_workspace_bytes),
            "ssd": placed["ssd"] + ck * c.ssd,
        }


def schedule_memory(model: ModelSpec, *, micro_batch: int, seq: int, num_micro_batches: int, group: int,
                    alpha: float, optimizer_overlap: bool, prefetch_depth: int, act_prefetch: int = 2,
                    runtime: str = "ideal", ranks: int = 1,
                    hw: HardwareProfile | None = None) -> ScheduleMemory:
    """The memory a schedule with these settings needs besides its placed tensors (see the module doc). With
    several ranks (`ranks` > 1, `num_micro_batches` per rank), one rank's: its shard of the gradients, states
    and weights on the host and the SSDs; full blocks on the GPU (gathered weights, full gradients)."""
    blocks = blocks_of(model, micro_batch, seq)
    pr = placed_precision(model)  # under LoRA: no states, no gradients of the base (none on the host)
    layer = blocks[1] if model.num_layers else blocks[0]
    params = shard_elems(model.total_params(), ranks)
    L = max(model.num_layers, 1)
    # n blocks in flight at once hold at most the n largest blocks' bytes (for small models the embedding and
    # a tied head are far larger than a layer, and counting every block in flight at the largest size
    # overstates it)
    owned = sorted((b.owned_params for b in blocks), reverse=True)
    fetched = sorted((b.fetch_params for b in blocks), reverse=True)

    def largest(sizes: list[int], n: int) -> float:
        return float(sum(sizes[:n]))

    if holds_every_gradient(num_micro_batches, group, optimizer_overlap):
        grads = pr.grad_accum_bytes * sum(b.grad_params for b in blocks)
    else:
        # the block whose Adam runs, the next ones whose backward finished meanwhile, and alpha of every block
        # (a CPU Adam slower than the backward lets more wait: the simulator then delays offloads or
        # overflows)
        grads = pr.grad_accum_bytes * (largest(fetched, 3) + alpha * model.total_params())
    # in flight at once: weights read from the SSD ahead of their fetch (prefetch_depth + 2 uses), optimizer
    # states of three blocks (read next, updated now, written back), a spilled gradient read back
    weight_staging = pr.compute_bytes * largest(fetched, prefetch_depth + 2)
    state_staging = pr.state_bytes * largest(owned, 3)
    fp32_states = MASTER_BYTES + 2 * ADAM_STATE_BYTES
    compressed = pr.state_bytes != fp32_states and model.lora is None
    workspace = fp32_states * largest(owned, 1) / ranks if compressed else 0.0
    grad_staging = pr.grad_accum_bytes * largest(fetched, 2)
    if ranks > 1:  # the host and the SSDs hold and stream one rank's shard of every block
        grads, weight_staging, state_staging, grad_staging = (
            x / ranks for x in (grads, weight_staging, state_staging, grad_staging))
    # checkpoints pass through host memory on their way to the SSDs and back: the one being written, the one
    # read back for the step in use and those read ahead for the next act_prefetch steps
    ckpt_staging = (act_prefetch + 2) * layer.checkpoint_bytes
    ckpt_staging_swap = (act_prefetch + 2) * layer.full_activation_bytes
    # at the turn from forward to backward every micro-batch of the group holds each layer's checkpoint, and
    # one more activation per micro-batch waits between two blocks (the head's input, then an activation
    # gradient)
    ckpt = group * layer.checkpoint_bytes * (L + 1) / L
    swap_extra = group * max(0, layer.full_activation_bytes - layer.checkpoint_bytes)
    # GPU: the largest backward with its weights and gradient buffer, the weight buffers fetched ahead, the
    # step's own input and the activation gradient it hands on, and the activations fetched ahead for the next
    # act_prefetch steps (a checkpoint each, or a swapped layer's saved
    # activations)
    gpu = max(b.bwd_working_bytes + b.weight_bytes + pr.grad_accum_bytes * b.grad_params
              for b in blocks) \
        + prefetch_depth * max(b.weight_bytes for b in blocks) + 2 * layer.checkpoint_bytes
    gpu_recompute = gpu + act_prefetch * layer.checkpoint_bytes
    gpu_swap = gpu + act_prefetch * layer.full_activation_bytes
    return ScheduleMemory(layers=model.num_layers, params=params, host_grad_bytes=grads,
                          weight_staging_bytes=weight_staging, state_staging_bytes=state_staging,
                          grad_staging_bytes=grad_staging, ckpt_staging_bytes=ckpt_staging,
                          ckpt_staging_swap_bytes=ckpt_staging_swap,
                          ckpt_per_layer_bytes=ckpt, swap_extra_bytes=swap_extra,
                          gpu_working_bytes=gpu_recompute, gpu_working_swap_bytes=gpu_swap,
                          runtime_gpu_bytes=(deepspeed_gpu_buffers_bytes(model)
                                             + deepspeed_inflight_grads_bytes(model, blocks)
                                             if runtime == "deepspeed" else 0.0),
                          cuda_runtime_bytes=runtime_gpu_reserve_bytes(runtime, ranks, hw),
                          precision=pr, deepspeed_host=runtime == "deepspeed",
                          accumulates_on_host=group < num_micro_batches, opt_workspace_bytes=workspace,
                          adapter_gpu_bytes=adapter_gpu_bytes(model))
