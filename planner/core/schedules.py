"""Schedules: the order of every task on every resource, expressed as a task graph with keys.

One generic builder covers every family. Micro-batches are processed in *groups* of k: for each group, every
block runs all k micro-batches before the next block (forward, then backward in reverse block order), in snake
order (the micro-batch direction alternates from one block to the next, so the micro-batch that ends one block
starts the next and its activation stays on the GPU).

- horizontal (ZeRO-Infinity): k = 1; weights fetched for every micro-batch; gradients offloaded per
  micro-batch; the CPU optimizer runs after the whole backward;
- fuyou: horizontal, but the CPU optimizer of a block starts as soon as its gradient is final (overlapped with
  the rest of the backward), and activation checkpoints go GPU -> CPU (-> SSD);
- vertical (GreedySnake): k = all micro-batches; a block's weights cross PCIe once per pass; its gradient is
  accumulated on the GPU and offloaded once; the CPU Adam step overlaps the backward of later blocks and a
  fraction alpha of it is deferred into the next iteration's forward;
- block: 1 < k < all, the hybrid between the two (tierflow's own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clock import Clock, Offset
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.dsruntime import (
    as_runtime_steps,
    deepspeed_host_buffers_bytes,
    ds_weights_copy_s,
)
from tierflow.planner.core.families import (
    DEFAULT_RUNTIME,
    FAMILIES,
    FIXED_GROUP,
    RUNTIME_FAMILY,
    RUNTIMES,
    family_of,
)
from tierflow.planner.core.graph import GraphBuilder, Task, TaskGraph, gc_paused
from tierflow.planner.core.hostcost import charge_moved_ops
from tierflow.planner.core.memory import (
    blocks_of,
    host_reserve_bytes,
    schedule_memory,
    static_bytes,
)
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.opkinds import (
    ADAM,
    ADAM_DEFERRED,
    ADAM_GPU,
    ALL_GATHER_WEIGHTS,
    ALL_REDUCE_GRADS,
    BWD,
    FETCH_WEIGHTS,
    FWD,
    HEAD,
    OFFLOAD_GRADS,
    READ_GRADS,
    READ_OPT_STATES,
    READ_WEIGHTS,
    RECOMPUTE,
    REDUCE_SCATTER_GRADS,
    UPDATE_WEIGHTS,
    WRITE_GRADS,
    WRITE_OPT_STATES,
    entry_kind,
)
from tierflow.planner.core.placement import Placement, Split, fill_split
from tierflow.planner.core.runtimes.deepspeed import DeepSpeedHooks
from tierflow.planner.core.runtimes.lohan import LohanHooks, renumber
from tierflow.planner.core.runtimes.optstep import AdamBlock, OptChain
from tierflow.planner.core.workload import precision_of
from tierflow.planner.core.world import World, rank_capacity_bytes, shard_elems


class ScheduleError(TierflowError, ValueError):
    """A schedule request that cannot be built (bad batch split, unknown family, ...)."""


_IN_CPU, _ON_SSD = Split(gpu=0.0, cpu=1.0, ssd=0.0), Split(gpu=0.0, cpu=0.0, ssd=1.0)


def default_placement(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> Placement:
    """The placement a user of that system would start from: nothing resident on the GPU; fill CPU memory with
    what the schedule holds there (the memory model's gradients, staging and checkpoints: fp32 gradients of a
    horizontal schedule go to the SSD with the optimizer, as ZeRO-Infinity does), then weights, then optimizer
    states; the rest on SSD. Fuyou keeps weights and optimizer states on the SSDs even when host memory could
    hold them (REFERENCE.md section 1: "fp16 weights on SSD read twice per iteration ... fp32 master + m + v
    on SSD", docs/baselines-as-coded.md section B); its gradients and checkpoints stay in host memory. With
    several ranks, one rank's shard of the states in its share of the box's host memory
    (tierflow.planner.core.world)."""
    if model.lora is not None:
        return _lora_placement(model, hw, cfg)
    params = shard_elems(model.total_params(), cfg.world.ranks)
    mem = schedule_memory(model, micro_batch=cfg.micro_batch, seq=cfg.seq,
                          num_micro_batches=cfg.num_micro_batches, group=cfg.group, alpha=cfg.alpha,
                          optimizer_overlap=cfg.optimizer_overlap, prefetch_depth=cfg.prefetch_depth,
                          act_prefetch=cfg.act_prefetch, runtime=cfg.runtime, ranks=cfg.world.ranks, hw=hw)
    # staging buffers for whatever may stream from the SSDs (all of it on a box with SSDs)
    staging = mem.host_staging_bytes if hw.ssd.count > 0 else 0.0
    cpu_cap = rank_capacity_bytes(hw, cfg.gpus)["cpu"]
    budget = float(cpu_cap) - staging - host_reserve_bytes(cpu_cap)
    ssd = hw.ssd.count > 0
    pr_bytes = precision_of(model).compute_bytes
    if cfg.runtime == "deepspeed":  # what DeepSpeed allocates on the host for itself (with its swappers)
        budget -= deepspeed_host_buffers_bytes(params, cfg.ds_knobs, ssd, ssd, pr_bytes)
    if cfg.family == "horizontal" and ssd and not (mem.deepspeed_host or mem.accumulates_on_host):
        # spilled fp32 gradients leave host memory (the memory model's host_grads_bytes)
        grads, budget = fill_split(mem.host_grad_bytes, budget)
    else:
        grads, budget = Split(), budget - mem.host_grads_bytes(Placement())
    ckpt, budget = fill_split(mem.checkpoint_bytes(cfg.swap_layers), budget)
    if cfg.family == "fuyou" and ssd:
        weights = states = Split(cpu=0.0, ssd=1.0)
    else:
        weights, budget = fill_split(precision_of(model).compute_bytes * params, budget)
        state_bytes = precision_of(model).state_bytes * params
        if cfg.runtime == "deepspeed" and ssd:
            # states wholly in host memory make DeepSpeed keep an fp32 gradient buffer per sub-group instead
            # of the swapper's (dsruntime): they stay there only if that fits too
            on_host, swapped = (
                deepspeed_host_buffers_bytes(params, cfg.ds_knobs, ssd, nvme, pr_bytes)
                for nvme in (False, True))
            state_bytes += max(0.0, on_host - swapped)
        states, budget = fill_split(state_bytes, budget)
    if not ssd:  # no SSD tier: everything on the CPU, the simulator reports any overflow
        weights = states = ckpt = grads = Split()
    if cfg.family == "horizontal" and states.ssd == 0:
        grads = Split()
    elif cfg.runtime == "deepspeed" and ssd and states.ssd > 0:
        # ZeRO-Infinity swaps the fp32 gradients out to NVMe with the optimizer states (stage3.py
        # _offload_grad_partition_at_boundary); in host memory only through its own buffer (dsruntime)
        grads = Split(cpu=0.0, ssd=1.0)
    return Placement(weights=weights, master=states, adam_m=states, adam_v=states, grads=grads,
                     checkpoints=ckpt)


def _lora_placement(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> Placement:
    """LoRA's default placement: the adapters and their states on the GPU (memory.adapter_gpu_bytes), the
    checkpoints in host memory, then as much of the frozen base as host memory holds, the rest read from the
    SSDs (which are never written: LoRA writes back nothing)."""
    mem = schedule_memory(model, micro_batch=cfg.micro_batch, seq=cfg.seq,
                          num_micro_batches=cfg.num_micro_batches, group=cfg.group, alpha=cfg.alpha,
                          optimizer_overlap=cfg.optimizer_overlap, prefetch_depth=cfg.prefetch_depth,
                          act_prefetch=cfg.act_prefetch, runtime=cfg.runtime, ranks=cfg.world.ranks, hw=hw)
    cpu_cap = rank_capacity_bytes(hw, cfg.gpus)["cpu"]
    staging = mem.weight_staging_bytes if hw.ssd.count > 0 else 0.0
    budget = float(cpu_cap) - staging - host_reserve_bytes(cpu_cap) - mem.checkpoint_bytes(cfg.swap_layers)
    weights, _ = fill_split(precision_of(model).compute_bytes * model.total_params(), budget)
    if hw.ssd.count == 0:
        weights = Split()
    return Placement(weights=weights, checkpoints=Split())


def check_lora(model: ModelSpec, cfg: ScheduleConfig) -> None:
    """ScheduleError unless a LoRA model's schedule is one the builder models: the ideal runtime (DeepSpeed's
    and LoHan's code train every weight), nothing written to the SSDs. Several ranks are data parallel: the
    frozen base sharded and all-gathered as full fine-tuning's weights, the adapters whole on every rank,
    their gradients all-reduced (_grad_out) and stepped by every rank alike."""
    if model.lora is None:
        return
    if cfg.runtime != "ideal":
        raise ScheduleError(f"runtime {cfg.runtime} models full fine-tuning as its code runs it, not LoRA "
                            "(use --runtime ideal)")
    p = cfg.placement
    if p.checkpoints.ssd > 0 or p.grads.ssd > 0 or p.master.ssd > 0 or p.adam_m.ssd > 0 or p.adam_v.ssd > 0:
        raise ScheduleError("LoRA reads the frozen base from the SSDs and writes nothing there: only weights "
                            "may have an ssd fraction (the adapters and their states live on the GPU)")


def check_world(hw: HardwareProfile, gpus: int, nodes: int) -> None:
    """ScheduleError unless `gpus` ranks per box on `nodes` boxes can run on `hw`."""
    for name, v in (("gpus", gpus), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {v!r} (use --{name} 1 or more)")
    if gpus > hw.gpu_count:
        raise ScheduleError(f"{gpus} GPUs per box, but profile {hw.name} has {hw.gpu_count} (use --gpus <= "
                            f"{hw.gpu_count}, a profile with more GPUs, or --set topology.gpu_count={gpus})")
    if nodes > 1 and hw.network is None:
        raise ScheduleError(f"{nodes} boxes, but profile {hw.name} describes no network between boxes (add a "
                            "network section to the profile, or --set network.gbps=N)")


def make_schedule(family: str, model: ModelSpec, hw: HardwareProfile, *, batch: int, micro_batch: int,
                  seq: int | None = None, placement: Placement | None = None, group: int | None = None,
                  alpha: float | None = None, prefetch_depth: int = 1, recompute: bool = True,
                  swap_layers: int = 0, act_prefetch: int = 2, iterations: int = 3,
                  runtime: str | None = None, gpus: int = 1, nodes: int = 1) -> ScheduleConfig:
    """A schedule of one family with that family's defaults for everything not given. `horizontal` runs as
    DeepSpeed runs ZeRO-Infinity and `fuyou` as LoHan's code runs Fuyou unless `runtime="ideal"` asks for the
    idealised baseline (DEFAULT_RUNTIME). `gpus` ranks per box
    on `nodes` boxes split the global `batch` among them (tierflow.planner.core.world)."""
    if family not in FAMILIES:
        raise ScheduleError(f"unknown schedule {family!r} (known: {', '.join(FAMILIES)}, all)")
    seq = seq or model.seq_len
    M = _rank_micro_batches(model, hw, batch, micro_batch, seq, gpus, nodes)
    g, a, overlap = _family_settings(family, M, group)
    if alpha is not None:
        a = alpha
    _check_settings(model, M, g, a, swap_layers, prefetch_depth)
    runtime = _runtime_of(family, runtime or ("ideal" if model.lora is not None else None))
    cfg = ScheduleConfig(family=family_of(g, M, overlap), batch=batch, micro_batch=micro_batch, seq=seq,
                         placement=placement or Placement(), group=g, alpha=a, optimizer_overlap=overlap,
                         prefetch_depth=prefetch_depth, recompute=recompute, swap_layers=swap_layers,
                         act_prefetch=act_prefetch, iterations=iterations, runtime=runtime, gpus=gpus,
                         nodes=nodes)
    if placement is None:
        cfg = replace(cfg, placement=default_placement(model, hw, cfg))
    check_lora(model, cfg)
    return cfg


def _rank_micro_batches(model: ModelSpec, hw: HardwareProfile, batch: int, micro_batch: int, seq: int,
                        gpus: int, nodes: int) -> int:
    """The micro-batches one rank runs per iteration; ScheduleError unless the batch splits evenly over the
    ranks and micro-batches and `seq` fits the model."""
    if batch <= 0 or micro_batch <= 0:
        raise ScheduleError(f"batch ({batch}) and micro-batch ({micro_batch}) must be positive")
    check_world(hw, gpus, nodes)
    if batch % micro_batch:
        raise ScheduleError(f"batch {batch} is not divisible by micro-batch {micro_batch} (use a micro-batch "
                            "that divides it)")
    world = World(gpus, nodes)
    W = world.ranks
    if batch % (W * micro_batch):
        raise ScheduleError(f"batch {batch} is not divisible by {W} ranks x micro-batch {micro_batch} = "
                            f"{W * micro_batch} (use a batch that is a multiple of it, or a smaller "
                            "micro-batch)")
    if model.max_positions and seq > model.max_positions:
        raise ScheduleError(f"seq {seq} exceeds the {model.max_positions} positions of {model.name} "
                            f"(use --seq <= {model.max_positions})")
    return world.rank_batch(batch) // micro_batch


def _family_settings(family: str, M: int, group: int | None) -> tuple[int, float, bool]:
    """(group, alpha, optimizer overlap) a family runs with over M micro-batches; `group` only for block."""
    if group is not None and FIXED_GROUP[family] is not None:
        raise ScheduleError(f"--group applies to the block schedule only: {family} runs "
                            f"{FIXED_GROUP[family]} micro-batch(es) per block sweep (use --schedule block "
                            f"--group {group})")
    if family == "horizontal":
        return 1, 0.0, False
    if family == "fuyou":
        return 1, 0.0, True
    if family == "vertical":
        return M, 0.25, True
    return (group or max(1, M // 2)), 0.25, True


def _check_settings(model: ModelSpec, M: int, group: int, alpha: float, swap_layers: int,
                    prefetch_depth: int) -> None:
    """ScheduleError unless the group, alpha, swapped layers and prefetch depth are within their ranges."""
    if not 1 <= group <= M or M % group:
        raise ScheduleError(f"group {group} must divide the {M} micro-batches")
    if not 0.0 <= alpha < 1.0:
        raise ScheduleError(f"alpha {alpha} must be within [0, 1)")
    if not 0 <= swap_layers <= model.num_layers:
        raise ScheduleError(f"swap_layers {swap_layers} must be within [0, {model.num_layers}]")
    if prefetch_depth < 1:
        raise ScheduleError(f"prefetch depth {prefetch_depth} must be >= 1")


def _runtime_of(family: str, runtime: str | None) -> str:
    """The runtime asked for (else the family's default); ScheduleError when it does not model the family."""
    runtime = runtime or DEFAULT_RUNTIME[family]
    if runtime not in RUNTIMES:
        raise ScheduleError(f"unknown runtime {runtime!r} (known: {', '.join(RUNTIMES)})")
    if runtime in RUNTIME_FAMILY and family != RUNTIME_FAMILY[runtime]:
        system = {"deepspeed": "ZeRO-Infinity", "lohan": "Fuyou (LoHan)"}[runtime]
        raise ScheduleError(f"runtime {runtime} models {system}: it applies to the {RUNTIME_FAMILY[runtime]} "
                            f"schedule, not {family} (use --runtime ideal)")
    return runtime


# ---- the generic builder
# ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Stored:
    """A tensor parked off the GPU by an offload: which tasks wrote it and how its bytes are split (the parts
    computed once: the builder reads them ~10 times per parked tensor)."""

    nbytes: float
    split: Split
    d2h: Task | None
    write: Task | None
    off: float = field(init=False)  # bytes off the GPU
    to_ssd: float = field(init=False)  # bytes on the SSD
    kept: float = field(init=False)  # bytes kept on the GPU

    def __post_init__(self) -> None:
        self.off = self.nbytes * self.split.off_gpu
        self.to_ssd = self.nbytes * self.split.ssd
        self.kept = self.nbytes * self.split.gpu


@dataclass
class _Step:
    phase: str  # "F" forward, "H" head forward+backward, "B" backward
    block: int
    mb: int
    use: int = -1  # index of the weight use (consecutive steps of one block and phase) it belongs to


def step_sequence(num_blocks: int, num_mb: int, group: int) -> list[_Step]:
    """GPU compute steps of one iteration, in order. num_blocks includes embedding and head."""
    head = num_blocks - 1
    visits = [("F", b) for b in range(head)] + [("H", head)] + [("B", b) for b in range(head - 1, -1, -1)]
    steps: list[_Step] = []
    for g0 in range(0, num_mb, group):
        mbs = list(range(g0, g0 + group))
        for phase, b in visits:
            steps.extend(_Step(phase, b, m) for m in mbs)
            mbs.reverse()  # snake: the next block starts with the micro-batch that ended this one
    return steps


@dataclass
class _Use:
    block: int
    phase: str
    first_step: int  # global step index
    steps: list[int] = field(default_factory=list)
    last_task: int = -1
    fetch_h2d: Task | None = None
    read: Task | None = None  # the SSD read of the use's weights, if any
    gather: Task | None = None  # all_gather_weights of the use (several ranks)
    gpu_bytes: float = 0.0
    first_compute: Task | None = None  # the use's first GPU task (its forward, head or recompute/backward)

    @property
    def ready_task(self) -> Task | None:
        """The task after which the use's weights are complete on the GPU."""
        return self.gather if self.gather is not None else self.fetch_h2d


@dataclass
class _IterState:
    """What the build of one iteration carries from step to step."""

    it: int
    base: int  # global index of the iteration's first step
    seq_steps: list[_Step]
    # tensors waiting between steps: ("x", block, mb) = input of block; ("dx", block, mb) = grad wrt input
    direct: dict[tuple, int] = field(default_factory=dict)  # tensor -> producing task, while on the GPU
    stored: dict[tuple, _Stored] = field(default_factory=dict)  # tensor -> where it was parked
    ckpts: dict[tuple, _Stored] = field(default_factory=dict)  # checkpoints (or saved activations) parked
    grad_first_b: dict[int, int] = field(default_factory=dict)  # block -> first backward task (buffer alloc)
    grad_last: dict[int, list[int]] = field(default_factory=dict)  # block -> tasks that deliver final grads
    host_grad_alloc: set[int] = field(default_factory=set)  # blocks whose host gradient buffer is allocated


class _Builder(DeepSpeedHooks, LohanHooks):
    """The generic builder: every family's graph, with each runtime's behaviour in its hooks
    (tierflow.planner.core.runtimes)."""

    def __init__(self, model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig):
        self.model, self.hw, self.cfg = model, hw, cfg
        self.W = cfg.world.ranks
        self.cost = CostModel(hw, cfg.world)
        self.g = GraphBuilder()
        self.blocks = blocks_of(model, cfg.micro_batch, cfg.seq)
        self.pr = precision_of(model)  # the bytes of each tensor class
        self.lora = model.lora is not None  # frozen base, adapters and their states on the GPU
        self.nb = len(self.blocks)
        self.L = model.num_layers
        self.head = self.nb - 1
        self.p = cfg.placement
        b = self.blocks
        self.t_fwd = [self.cost.forward_s(x) for x in b]
        self.t_bwd = [self.cost.backward_s(x) for x in b]
        self.step_task: list[int] = []  # global step -> id of its last GPU task
        self.step_use: list[int] = []  # global step -> index of its weight use
        self.step_key: list[float] = []
        self.uses: list[_Use] = []
        self.weights_ready: dict[int, list[int]] = {}  # block -> tasks that produce its updated weights
        # block -> tasks that refresh its GPU-resident weights
        self.resident_update: dict[int, list[int]] = {}
        self.states_written: dict[tuple[int, str], list[int]] = {}  # (block, part) -> SSD write of its states
        self._ds_init()

    # -- helpers ---------------------------------------------------------------------------------------------

    def rec(self, b: int) -> bool:
        """Is layer block b recomputed in backward? (ScheduleConfig.recomputes)"""
        return self.cfg.recomputes(b, self.L)

    def shard(self, n: int) -> int:
        """Elements of an n-element block vector that this rank (rank 0) owns."""
        return shard_elems(n, self.W)

    def collective_bytes(self, nbytes: float) -> float:
        """Bytes one rank receives in a ring all-gather or reduce-scatter of a vector of `nbytes`."""
        return (self.W - 1) / self.W * nbytes

    def prev_step_task(self, k: int) -> int:
        return self.step_task[k] if 0 <= k < len(self.step_task) else -1

    def offload(self, producer: Task, nbytes: float, split: Split, tensor: str, it: int, block: int,
                mb: int) -> _Stored:
        g = self.g
        s = _Stored(nbytes, split, None, None)
        g.alloc(producer, "gpu", s.kept)  # the output buffer is taken when the producing kernel starts
        if s.off > 0:
            g.alloc(producer, "gpu", s.off)
            s.d2h = g.add(entry_kind("offload", tensor), "d2h", s.off, tensor=tensor, block=block, mb=mb,
                          iteration=it, key=producer.key + Offset.OFFLOAD, deps=[producer.id])
            g.alloc(s.d2h, "cpu", s.off)
            g.free(s.d2h, "gpu", s.off)
        if s.to_ssd > 0:
            s.write = g.add(entry_kind("write", tensor), "ssd_write", s.to_ssd, tensor=tensor, block=block,
                            mb=mb, iteration=it, key=producer.key + Offset.WRITE_OFFLOADED, deps=[s.d2h.id])
            g.alloc(s.write, "ssd", s.to_ssd)
            g.free(s.write, "cpu", s.to_ssd)
        return s

    def fetch(self, s: _Stored, k: int, consume: bool, tensor: str, it: int, block: int,
              mb: int) -> tuple[list[int], float]:
        """Bring a stored tensor back for step k. Returns (deps for the consumer, GPU bytes it must free)."""
        g, a = self.g, self.cfg.act_prefetch
        key = self.step_key[k]
        read = None
        if s.to_ssd > 0:
            read = g.add(entry_kind("read", tensor), "ssd_read", s.to_ssd, tensor=tensor, block=block, mb=mb,
                         iteration=it, key=key - a - 1, deps=[s.write.id, self.prev_step_task(k - a - 2)])
            g.alloc(read, "cpu", s.to_ssd)
            if consume:
                g.free(read, "ssd", s.to_ssd)
        deps: list[int] = []
        if s.off > 0:
            h = g.add(entry_kind("fetch", tensor), "h2d", s.off, tensor=tensor, block=block, mb=mb,
                      iteration=it, key=key - a,
                      deps=[s.d2h.id, read.id if read else -1, self.prev_step_task(k - a - 1)])
            g.alloc(h, "gpu", s.off)
            g.free(h, "cpu", s.off if consume else s.to_ssd)
            deps.append(h.id)
        return deps, s.off + (s.kept if consume else 0.0)

    # -- weights ---------------------------------------------------------------------------------------------

    def fetch_weights(self, u: int, it: int) -> list[int]:
        """Fetch tasks for weight use u (global index). Returns deps for its first compute step."""
        use = self.uses[u]
        b = use.block
        blk = self.blocks[b]
        w = self.weights_of(b)
        deps = list(self.resident_update.get(b, []))
        # this rank's shard of the block (the whole block with one rank) crosses its links
        mine = blk.weight_bytes if self.W == 1 else self.pr.compute_bytes * self.shard(blk.fetch_params)
        off = mine * w.off_gpu
        if off <= 0 and self.W == 1:
            return deps
        g, d = self.g, self._weight_prefetch_depth(use)
        ready = list(self.weights_ready.get(b, []))
        if b == self.head and self.model.tied_embeddings:
            ready += self.weights_ready.get(0, [])

        def first_key(j: int) -> float:
            if j >= 0:
                return self.step_key[self.uses[j].first_step] + Offset.WEIGHT_FETCH
            return self.step_key[use.first_step] + Offset.WEIGHT_FETCH_AHEAD * (1 + u - j)

        def last_task(j: int) -> int:
            return self.uses[j].last_task if j >= 0 else -1

        floor = -math.inf
        if ready:
            # waiting for last iteration's optimizer: never queue ahead of that iteration's own transfers
            floor = self.clock.step(it, 0) + Offset.OPTIMIZER_FLOOR
        read = None
        to_ssd = mine * w.ssd
        if to_ssd > 0:
            read = g.add(READ_WEIGHTS, "ssd_read", to_ssd, tensor="weights", block=b, mb=-1, iteration=it,
                         key=max(first_key(u - d - 1), floor), deps=[last_task(u - d - 2), *ready])
            g.alloc(read, "cpu", to_ssd)
            use.read = read
        # the device buffer of the full block, less the part of it this rank keeps resident, taken at the
        # fetch
        buffer = off if self.W == 1 else blk.weight_bytes - mine * w.gpu
        h = None
        if off > 0:
            h = g.add(FETCH_WEIGHTS, "h2d", off, tensor="weights", block=b, mb=-1, iteration=it,
                      key=max(first_key(u - d), floor),
                      deps=[read.id if read else -1, last_task(u - d - 1), *ready])
            g.alloc(h, "gpu", buffer)
            g.free(h, "cpu", to_ssd)
            use.fetch_h2d = h
            self._ds_drained_at_next_hook(u, h, d)
        use.gpu_bytes = buffer
        if self.W == 1:
            return deps + [h.id]
        # the other ranks' shards: a ring all-gather into the rest of the buffer
        gather_deps = [h.id] if h is not None else [last_task(u - d - 1), *deps]
        a = g.add(ALL_GATHER_WEIGHTS, "net", self.collective_bytes(blk.weight_bytes), tensor="weights",
                  block=b, mb=-1, iteration=it, key=max(first_key(u - d), floor), deps=gather_deps)
        if h is None:
            g.alloc(a, "gpu", buffer)
        use.gather = a
        return deps + [a.id]


    def weights_of(self, b: int) -> Split:
        """Where block b's weights live: the placement's split, or under runtime deepspeed whole blocks in
        host memory or on NVMe (_ds_cached_blocks)."""
        if self.ds_cached is None:
            return self.p.weights
        return _IN_CPU if b in self.ds_cached else _ON_SSD

    def _weight_prefetch_depth(self, use: _Use) -> int:
        """Weight uses ahead the fetch of `use` may start: the schedule's prefetch depth, but none where the
        modelled runtime fetches SSD-resident weights on demand."""
        if self.cfg.runtime == "deepspeed" and self.weights_of(use.block).ssd > 0:
            # DeepSpeed's parameter prefetch stops at the first parameter still on NVMe; its NVMe read-ahead
            # starts when the previous module's hook runs, its copy to the GPU when this module's hook does
            # (partitioned_param_coordinator.py:460-463, 667-690; partition_parameters.py:1689-1692)
            return 0
        if self.cfg.runtime == "lohan" and self.p.weights.ssd > 0 and use.phase == "B":
            # LoHan prefetches weights only in the forward (its loop needs fw_flag, cleared once module inputs
            # carry a grad_fn): in the recompute and the backward each module reads its weights from NVMe and
            # waits itself, while the GPU runs what is already queued (RC4ML/LoHan ratel_init.py:720-723,
            # 738-744, 774, 838-855; docs/baselines-as-coded.md B3). Its forward prefetch (3 half-layer blocks
            # ahead, ratel_init.py:951-992) is the ideal depth-1 prefetch here
            return 0
        return self.cfg.prefetch_depth

    # -- the iteration
    # ------------------------------------------------------------------------------------------

    def build(self) -> TaskGraph:
        cfg, g = self.cfg, self.g
        M = cfg.num_micro_batches
        seq_steps = step_sequence(self.nb, M, cfg.group)
        S = self.S = len(seq_steps)
        self.clock = Clock(S)
        for it in range(cfg.iterations):
            base = len(self.step_task)
            # weight uses of this iteration
            for i, st in enumerate(seq_steps):
                k = base + i
                if not self.uses or self.uses[-1].block != st.block or self.uses[-1].phase != st.phase or \
                        self.uses[-1].steps[-1] != k - 1:
                    self.uses.append(_Use(st.block, st.phase, k))
                self.uses[-1].steps.append(k)
                st.use = len(self.uses) - 1
            self.step_key.extend(self.clock.steps(it))
            self.build_iteration(it, base, seq_steps)
        if cfg.runtime == "lohan":
            renumber(self.g.tasks)
        charge_moved_ops(g.tasks, self.hw)  # gpu.moved_op_overhead_us (planner/core/hostcost.py)
        static = static_bytes(self.model, self.p, cfg.runtime, self.W, cfg.ds_knobs, hw=self.hw)
        cap = rank_capacity_bytes(self.hw, cfg.gpus)
        meta = {"steps_per_iteration": S, "weight_uses_per_iteration": len(self.uses) // cfg.iterations,
                "runtime": cfg.runtime}  # simulate_graph steps CPU Adam at the runtime's rate too
        if self.W > 1:
            meta["world"] = cfg.world.to_dict()
        return TaskGraph(g.tasks, static, cap, cfg.iterations, self.nb, meta=meta)

    def build_iteration(self, it: int, base: int, seq_steps: list[_Step]) -> None:
        g = self.g
        s = _IterState(it, base, seq_steps, grad_last={b: [] for b in range(self.nb)})
        last_step_of_block: dict[int, int] = {}
        for i, st in enumerate(seq_steps):
            k = base + i
            last_step_of_block[st.block] = k
        self.cur_last_step = last_step_of_block
        first_fwd_idx = {st.block: i for i, st in reversed(list(enumerate(seq_steps))) if st.phase != "B"}

        for i, st in enumerate(seq_steps):
            k = base + i
            use = self.uses[st.use]
            deps: list[int] = []
            n_tasks = len(g.tasks)
            if k == use.first_step:
                deps += self.fetch_weights(st.use, it)
            elif use.ready_task is not None:
                deps.append(use.ready_task.id)
            if self.ds_wait:  # DeepSpeed's host synchronized on its oldest gradient bucket's stream event
                deps += self.ds_wait
                self.ds_wait = []
            if st.phase == "F" and st.block == 0 and self.ds_epilogue:
                deps += self.ds_epilogue  # DeepSpeed's host waited for the last backward's gradient stream
                self.ds_epilogue = []
            if st.phase == "F":
                last = self._forward_step(s, i, st, deps)
            elif st.phase == "H":
                last = self._head_step(s, i, st, deps)
            else:
                last = self._backward_step(s, i, st, deps)
            if k == use.first_step:
                use.first_compute = next((t for t in g.tasks[n_tasks:] if t.resource == "gpu"), None)
            self.step_task.append(last.id)
            self.step_use.append(st.use)
            if k == use.steps[-1]:
                use.last_task = last.id
                if use.gpu_bytes:
                    g.free(last, "gpu", use.gpu_bytes)
        self._optimizer(it, base, seq_steps, s.grad_last, last_step_of_block, first_fwd_idx)

    def _forward_step(self, s: _IterState, i: int, st: _Step, deps: list[int]) -> Task:
        """A decoder layer's (or the embedding's) forward of one micro-batch; its output parked or kept."""
        g, ck, it = self.g, self.p.checkpoints, s.it
        k = s.base + i
        b, m = st.block, st.mb
        blk = self.blocks[b]
        prev = self.prev_step_task(k - 1)
        free_gpu = 0.0
        if b > 0:
            free_gpu += self._take(("x", b, m), not self.rec(b), k, prev, deps, s.direct, s.stored, it)
        t = g.add(FWD, "gpu", self.t_fwd[b], tensor="activations", block=b, mb=m, iteration=it,
                  key=self.step_key[k], deps=deps)
        g.alloc(t, "gpu", blk.fwd_working_bytes)
        g.free(t, "gpu", blk.fwd_working_bytes + free_gpu)
        if b >= 1 and not self.rec(b):
            # a layer that is not recomputed keeps (swaps out) every activation its backward needs
            s.ckpts[("x", b, m)] = self.offload(t, blk.full_activation_bytes, ck, "checkpoint", it, b, m)
        out = ("x", b + 1, m)
        out_bytes = blk.checkpoint_bytes if b > 0 else self.blocks[1].checkpoint_bytes
        if b + 1 <= self.L and self.rec(b + 1):
            # the next layer's input is its activation checkpoint: park it per the placement
            stored = self.offload(t, out_bytes, ck, "checkpoint", it, b + 1, m)
            s.ckpts[out] = s.stored[out] = stored
        else:
            nxt = s.seq_steps[i + 1] if i + 1 < len(s.seq_steps) else None
            if not (nxt and nxt.block == b + 1 and nxt.mb == m):
                s.stored[out] = self.offload(t, out_bytes, ck, "act", it, b + 1, m)
        s.direct[out] = t.id
        return t

    def _head_step(self, s: _IterState, i: int, st: _Step, deps: list[int]) -> Task:
        """The head's forward and backward of one micro-batch."""
        g, it = self.g, s.it
        k = s.base + i
        b, m = st.block, st.mb
        blk = self.blocks[b]
        prev = self.prev_step_task(k - 1)
        free_gpu = self._take(("x", b, m), True, k, prev, deps, s.direct, s.stored, it)
        t = g.add(HEAD, "gpu", self.t_fwd[b] + self.t_bwd[b], tensor="activations", block=b, mb=m,
                  iteration=it, key=self.step_key[k], deps=deps)
        g.alloc(t, "gpu", blk.bwd_working_bytes)
        g.free(t, "gpu", blk.bwd_working_bytes + free_gpu)
        self._grad_out(t, b, self.uses[st.use], k, it, s.grad_first_b, s.grad_last, s.host_grad_alloc)
        self._emit_dx(t, ("dx", b, m), i, s.seq_steps, s.direct, s.stored, it)
        return t

    def _backward_step(self, s: _IterState, i: int, st: _Step, deps: list[int]) -> Task:
        """A decoder layer's (or the embedding's) backward of one micro-batch, after its recompute if any."""
        g, it = self.g, s.it
        k = s.base + i
        key = self.step_key[k]
        b, m = st.block, st.mb
        blk = self.blocks[b]
        prev = self.prev_step_task(k - 1)
        free_gpu = self._take(("dx", b + 1, m), True, k, prev, deps, s.direct, s.stored, it)
        stored = s.ckpts.pop(("x", b, m), None)
        if stored is not None:  # the checkpoint (or the saved activations): its last use
            dd, fb = self.fetch(stored, k, True, "checkpoint", it, b, m)
            deps.extend(dd)
            free_gpu += fb
        first = None
        if b >= 1 and self.rec(b):
            first = g.add(RECOMPUTE, "gpu", self.t_fwd[b], tensor="activations", block=b, mb=m,
                          iteration=it, key=key + Offset.RECOMPUTE, deps=deps)
            g.alloc(first, "gpu", blk.bwd_working_bytes)
        t = g.add(BWD, "gpu", self.t_bwd[b], tensor="activations", block=b, mb=m, iteration=it,
                  key=key, deps=[first.id] if first else deps)
        # a swapped layer's saved activations arrive by fetch (counted there), not by recompute
        work_bytes = blk.bwd_working_bytes - (blk.full_activation_bytes if b >= 1 and not self.rec(b) else 0)
        if first is None:
            g.alloc(t, "gpu", work_bytes)
        g.free(t, "gpu", work_bytes + free_gpu)
        self._grad_out(t, b, self.uses[st.use], k, it, s.grad_first_b, s.grad_last, s.host_grad_alloc)
        if b >= 1:
            self._emit_dx(t, ("dx", b, m), i, s.seq_steps, s.direct, s.stored, it)
        return t

    def _take(self, name: tuple, consume: bool, k: int, prev: int, deps: list[int], direct: dict,
              stored: dict, it: int) -> float:
        """Make tensor `name` available to step k: straight from the previous step if it is still on the GPU,
        else fetched back from where it was parked. Appends to `deps`; returns the GPU bytes step k frees."""
        if name in direct and direct[name] == prev:
            deps.append(direct[name])
            return stored[name].kept if consume and name in stored else 0.0
        if name in stored:
            tensor = "act" if name[0] == "x" else "act_grad"
            dd, fb = self.fetch(stored[name], k, consume, tensor, it, name[1], name[2])
            deps.extend(dd)
            if name in direct:
                deps.append(direct[name])
            return fb
        if name in direct:
            deps.append(direct[name])
        return 0.0

    def _emit_dx(self, t: Task, name: tuple, i: int, seq_steps: list[_Step], direct: dict, stored: dict,
                 it: int) -> None:
        b, m = name[1], name[2]
        direct[name] = t.id
        nxt = seq_steps[i + 1] if i + 1 < len(seq_steps) else None
        if not (nxt and nxt.block == b - 1 and nxt.mb == m and nxt.phase == "B"):
            act_grad_bytes = self.blocks[1].checkpoint_bytes
            stored[name] = self.offload(t, act_grad_bytes, self.p.checkpoints, "act_grad", it, b, m)

    def _grad_out(self, t: Task, b: int, use: _Use, k: int, it: int, grad_first_b: dict, grad_last: dict,
                  host_grad_alloc: set) -> None:
        """Gradient accumulation: on the GPU within a weight use (or a whole iteration with grads.gpu = 1),
        then offloaded to the host where it is accumulated in fp32."""
        g, p = self.g, self.p
        blk = self.blocks[b]
        if self.lora:  # the adapters' gradients accumulate in their own GPU buffers (static bytes)
            grad_last[b] = [t.id]
            if self.W > 1 and k == self.cur_last_step[b] and blk.owned_params > 0:  # summed on every rank
                grad_last[b] = [self._all_reduce_adapters(t, b, it).id]
            return
        accum = len(use.steps) > 1 or p.grads.gpu == 1.0
        grad_gpu_bytes = (self.pr.grad_accum_bytes if accum else self.pr.grad_wire_bytes) * blk.fetch_params
        if b not in grad_first_b:
            grad_first_b[b] = t.id
            g.alloc(t, "gpu", grad_gpu_bytes)  # the accumulation buffer lives until it is offloaded
        elif k == use.steps[0] and p.grads.gpu < 1.0:
            g.alloc(t, "gpu", grad_gpu_bytes)
        if p.gpu_optimizer:
            grad_last[b] = [t.id]
            # the final gradient: sum it, keep this rank's shard
            if self.W > 1 and k == self.cur_last_step[b]:
                grad_last[b] = [self._reduce_scatter(t, b, it).id]
            return
        if k != use.steps[-1]:
            return
        if p.grads.gpu == 1.0 and k != self.cur_last_step[b]:
            return
        if self.cfg.runtime == "deepspeed":  # reduced and copied with its bucket
            self._ds_grad_bucket(t, t, b, k, grad_gpu_bytes, grad_last, host_grad_alloc)
            return
        src = t if self.W == 1 else self._reduce_scatter(t, b, it)
        self._offload_grads(t, src, b, it, self.pr.grad_wire_bytes, grad_gpu_bytes, grad_last,
                            host_grad_alloc)

    def _offload_grads(self, t: Task, src: Task, b: int, it: int, bytes_per_param: float,
                       grad_gpu_bytes: float, grad_last: dict, host_grad_alloc: set) -> Task:
        """Block b's gradient to the host after `src` (keyed after `t`), its GPU buffer freed."""
        g, blk = self.g, self.blocks[b]
        d2h = g.add(OFFLOAD_GRADS, "d2h", bytes_per_param * self.shard(blk.fetch_params), tensor="grads",
                    block=b, mb=-1, iteration=it, key=t.key + Offset.OFFLOAD, deps=[src.id])
        g.free(d2h, "gpu", grad_gpu_bytes)
        if b not in host_grad_alloc:
            host_grad_alloc.add(b)
            self._host_grads(d2h, self.pr.grad_accum_bytes * self.shard(blk.fetch_params))
        grad_last[b] = [d2h.id]
        return d2h


    def _reduce_scatter(self, t: Task, b: int, it: int) -> Task:
        """The ranks' gradients of block b summed, this rank's shard kept (a ring reduce-scatter after
        `t`)."""
        wire = self.pr.grad_wire_bytes * self.blocks[b].fetch_params
        return self.g.add(REDUCE_SCATTER_GRADS, "net", self.collective_bytes(wire), tensor="grads", block=b,
                          mb=-1, iteration=it, key=t.key + Offset.OFFLOAD, deps=[t.id])

    def _all_reduce_adapters(self, t: Task, b: int, it: int) -> Task:
        """LoRA, several ranks: the ranks' fp32 adapter gradients of block b summed on every rank (a ring
        all-reduce after `t`: a reduce-scatter and an all-gather, twice the bytes of either)."""
        wire = self.pr.grad_accum_bytes * self.blocks[b].owned_params
        return self.g.add(ALL_REDUCE_GRADS, "net", 2 * self.collective_bytes(wire), tensor="grads", block=b,
                          mb=-1, iteration=it, key=t.key + Offset.OFFLOAD, deps=[t.id])

    def _optimizer(self, it: int, base: int, seq_steps: list[_Step], grad_last: dict,
                   last_step_of_block: dict, first_fwd_idx: dict) -> None:
        g, p, cfg, model = self.g, self.p, self.cfg, self.model
        barrier = [self.step_task[-1]] if not cfg.optimizer_overlap else []
        order = sorted(range(self.nb), key=lambda b: last_step_of_block[b])
        chain = OptChain()
        S = len(seq_steps)
        end_key = self.step_key[base + S - 1]
        for rank, b in enumerate(order):
            blk = self.blocks[b]
            k_last = last_step_of_block[b]
            # with a barrier the whole optimizer phase comes after the last backward step on every resource
            key = self.step_key[k_last] if cfg.optimizer_overlap else end_key + Offset.TAIL_RANK * rank
            grads_ready = list(grad_last[b])
            if b == 0 and model.tied_embeddings:
                grads_ready += grad_last[self.head]
            owned = self.shard(blk.owned_params)  # this rank's shard of the block's states
            if owned == 0:
                continue
            if self.lora:
                owned = blk.owned_params  # the adapters are whole on every rank
                # the adapters' step on the GPU: the next forward of the block waits for it, the fetch of the
                # frozen base does not
                t = g.add(ADAM_GPU, "gpu", self.cost.gpu_adam_s(owned, self.pr.state_traffic_saved_bytes),
                          tensor="opt_states", block=b, mb=-1, iteration=it, key=key + Offset.ADAM_GPU,
                          deps=grads_ready + barrier)
                self.resident_update[b] = [t.id]
                continue
            if p.gpu_optimizer:
                # an in-place precision steps the weights themselves: no write of a compute copy
                saved = (self.pr.compute_bytes if self.pr.in_place else 0) + self.pr.state_traffic_saved_bytes
                t = g.add(ADAM_GPU, "gpu", self.cost.gpu_adam_s(owned, saved), tensor="opt_states", block=b,
                          mb=-1, iteration=it, key=key + Offset.ADAM_GPU, deps=grads_ready + barrier)
                # the step consumes the (full) gradient buffer
                g.free(t, "gpu", self.pr.grad_accum_bytes * blk.fetch_params)
                self.resident_update[b] = [t.id]
                self.weights_ready[b] = [t.id]
                continue
            step = AdamBlock(b, it, key, k_last, owned, self.shard(blk.fetch_params), base + S)
            self._cpu_adam(step, grads_ready, barrier, chain, first_fwd_idx)

    def _cpu_adam(self, step: AdamBlock, grads_ready: list[int], barrier: list[int], chain: OptChain,
                  first_fwd_idx: dict) -> None:
        """The CPU Adam step of one block: its fp32 gradient through the SSD if placed there, then each part
        (the main step, and the fraction alpha deferred into the next forward) with its states read from and
        written back to the SSD, and its GPU-resident weights updated."""
        g, p, cfg = self.g, self.p, self.cfg
        b, it, owned, fetch_params = step.block, step.it, step.owned, step.fetch_params
        pr = self.pr
        states_ssd = owned * (pr.master_bytes * p.master.ssd
                              + pr.adam_state_bytes * (p.adam_m.ssd + p.adam_v.ssd))
        grads_ssd = self.pr.grad_accum_bytes * fetch_params * p.grads.ssd
        w_ssd = self.pr.compute_bytes * owned * self.weights_of(b).ssd
        w_gpu = self.pr.compute_bytes * owned * p.weights.gpu
        pre: list[int] = []
        if grads_ssd > 0:
            wr = g.add(WRITE_GRADS, "ssd_write", grads_ssd, tensor="grads", block=b, mb=-1, iteration=it,
                       key=step.key + Offset.WRITE_GRADS, deps=grads_ready)
            self._host_grads(wr, -grads_ssd)
            rd = g.add(READ_GRADS, "ssd_read", grads_ssd, tensor="grads", block=b, mb=-1, iteration=it,
                       key=step.key + Offset.READ_GRADS, deps=[wr.id, chain.prev_main] + barrier)
            self._host_grads(rd, grads_ssd)
            pre.append(rd.id)
        parts = [(1.0 - cfg.alpha, step.key + Offset.ADAM, ADAM)]
        if cfg.alpha > 0:
            parts.append((cfg.alpha, self.clock.deferred_adam(it, first_fwd_idx[b]), ADAM_DEFERRED))
        ready: list[int] = []
        prev_part = -1
        for frac, pkey, kind in parts:
            deps = grads_ready + pre + barrier + [prev_part]
            if states_ssd > 0:
                # each part streams its own slice of master, m and v in from the SSD and back out, after the
                # previous iteration wrote that slice back
                deps.append(self._read_states(step, states_ssd * frac, pkey, kind, prev_part, chain).id)
            a = g.add(kind, "cpu", self.cost.cpu_adam_s(owned * frac), tensor="opt_states", block=b, mb=-1,
                      iteration=it, key=pkey, deps=deps)
            ready.append(a.id)
            if kind == ADAM:
                chain.prev_main = a.id
                chain.group_adam[self._ds_sub_group(b)] = a.id
            # each part is done with its slice of the fp32 gradient
            self._host_grads(a, -frac * (pr.grad_accum_bytes * fetch_params * (1 - p.grads.ssd) + grads_ssd))
            prev_part = a.id
            if states_ssd + w_ssd > 0:
                wb = g.add(WRITE_OPT_STATES, "ssd_write", (states_ssd + w_ssd) * frac, tensor="opt_states",
                           block=b, mb=-1, iteration=it, key=pkey + Offset.AFTER_ADAM, deps=[a.id])
                g.free(wb, "cpu", states_ssd * frac)
                self.states_written[(b, kind)] = [wb.id]
                chain.prev_write = wb.id
                if kind == ADAM:
                    chain.group_write[self._ds_sub_group(b)] = wb.id
                if cfg.runtime == "lohan" and kind == ADAM:
                    chain.unwaited_write = wb
                if w_ssd > 0:
                    ready.append(wb.id)
            if w_gpu > 0:
                up = self._update_resident(w_gpu * frac, owned * frac, b, it, pkey, a)
                self.resident_update.setdefault(b, []).append(up.id)
        if w_gpu > 0:
            self.resident_update[b] = self.resident_update[b][-len(parts):]
        self.weights_ready[b] = ready

    def _update_resident(self, nbytes: float, params: float, b: int, it: int, pkey: float,
                         adam: Task) -> Task:
        """The stepped block's new 16-bit weights copied to the GPU: a pinned H2D, or under runtime deepspeed
        where the profile models pageable copies the host's blocking convert-and-copy
        (dsruntime.ds_weights_copy_s) on the CPU's queue, before the next sub-group's step."""
        host_s = ds_weights_copy_s(self.hw, params, self.pr.compute_bytes) \
            if self.cfg.runtime == "deepspeed" else None
        if host_s is None:
            return self.g.add(UPDATE_WEIGHTS, "h2d", nbytes, tensor="weights", block=b, mb=-1, iteration=it,
                              key=pkey + Offset.AFTER_ADAM, deps=[adam.id])
        return self.g.add(UPDATE_WEIGHTS, "cpu", host_s, tensor="weights", block=b, mb=-1, iteration=it,
                          key=pkey + Offset.AFTER_ADAM, deps=[adam.id])

    def _read_states(self, step: AdamBlock, nbytes: float, pkey: float, kind: str, prev_part: int,
                     chain: OptChain) -> Task:
        """The SSD read of one Adam part's slice of a block's fp32 master, m and v. DeepSpeed's default
        optimizer swapper (pipeline_read/write off) reads, steps and writes one sub-group after the other
        (partitioned_optimizer_swapper.py:100-191; offload_config.py:84-94); LoHan's training thread waits for
        the read (_lohan_trigger, _lohan_thread)."""
        cfg = self.cfg
        lohan_main = cfg.runtime == "lohan" and kind == ADAM
        ds = cfg.runtime == "deepspeed"
        # DeepSpeed's pipeline_read issues the next sub-group's read when this one's step starts (after this
        # one's read), pipeline_write lets the read go before the previous write has finished
        # (pipelined_optimizer_swapper.py: swap_in_optimizer_state / swap_out_optimizer_state)
        # only between sub-groups: within one, DeepSpeed reads, steps and writes the whole sub-group at once
        new_group = ds and self._ds_sub_group(step.block) != self._ds_sub_group(chain.prev_block)
        after = chain.prev_read if new_group and cfg.ds_pipeline_read and kind == ADAM else (
            chain.prev_main if kind == ADAM else prev_part)
        pipelined = new_group and (cfg.ds_pipeline_read or cfg.ds_pipeline_write) and kind == ADAM
        bound = self._ds_read_bound(step.block, chain) if pipelined else []
        rs = self.g.add(READ_OPT_STATES, "ssd_read", nbytes, tensor="opt_states", block=step.block, mb=-1,
                        iteration=step.it, key=pkey + Offset.READ_STATES,
                        deps=[after, *bound,
                              *self.states_written.get((step.block, kind), []),
                              chain.prev_write if ds and not (new_group and cfg.ds_pipeline_write) else -1,
                              *(self._lohan_trigger(step.k_last, chain.thread_last) if lohan_main else [])])
        if kind == ADAM:
            chain.prev_read, chain.prev_block = rs.id, step.block
        self.g.alloc(rs, "cpu", nbytes)
        if lohan_main:
            chain.thread_last = self._lohan_thread(rs, chain.unwaited_write, step.k_last, step.end)
            chain.unwaited_write = None
        return rs


    def _host_grads(self, t: Task, nbytes: float) -> None:
        """Host memory of fp32 gradients allocated (nbytes > 0) or freed by task t. Under runtime deepspeed
        none: DeepSpeed's own buffers hold them for the whole run (tierflow.planner.core.dsruntime, counted
        in memory.static_bytes)."""
        if self.cfg.runtime == "deepspeed" and not self.p.gpu_optimizer:
            return
        if nbytes > 0:
            self.g.alloc(t, "cpu", nbytes)
        else:
            self.g.free(t, "cpu", -nbytes)


def build_graph(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> TaskGraph:
    """The task graph of `cfg.iterations` training iterations of `model` on `hw` under schedule `cfg`. The
    host's CPU Adam steps at the rate of the implementation `cfg.runtime` runs (dsruntime.as_runtime_steps,
    applied here, idempotently: a caller passes the profile as it is, whatever the runtime)."""
    hw = as_runtime_steps(hw, cfg.runtime)
    with gc_paused():
        return _Builder(model, hw, cfg).build()
