"""The contract between the planner and the executor: the schedule's decisions (ScheduleConfig) and the plan
(Plan: model, hardware, decisions and the task graph). The op vocabulary beside it is
tierflow.planner.core.opkinds; the plan file's writer and validator are tierflow.planner.io.planwrite and
tierflow.planner.io.planvalidate."""

from __future__ import annotations

from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.dsruntime import (
    DS_OPT_BUFFER_COUNT,
    DS_PARAM_BUFFER_COUNT,
    DS_PARAM_BUFFER_ELEMS,
    DS_SUB_GROUP_ELEMS,
    DsKnobs,
)
from tierflow.planner.core.graph import TaskGraph
from tierflow.planner.core.memory import DS_REDUCE_BUCKET_ELEMS
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.world import World


@dataclass(frozen=True)
class ScheduleConfig:
    family: str
    batch: int  # global batch, in sequences
    micro_batch: int  # sequences per micro-batch
    seq: int
    placement: Placement
    group: int  # micro-batches a block runs before the next block (1 = horizontal, M = vertical)
    alpha: float = 0.0  # fraction of each block's CPU Adam deferred into the next iteration's forward
    optimizer_overlap: bool = False  # a block's optimizer may start before the whole backward has finished
    prefetch_depth: int = 1  # weight buffers fetched ahead of the one in use
    act_prefetch: int = 2  # compute steps ahead an activation fetch may start
    recompute: bool = True  # recompute each layer's forward in backward (else keep all its activations)
    swap_layers: int = 0  # the last n layers keep (and swap out) all their activations instead of recomputing
    iterations: int = 3  # iterations simulated; the one before the last is reported as the steady state
    runtime: str = "ideal"  # how transfers overlap: RUNTIMES
    gpus: int = 1  # data-parallel ranks per box (tierflow.planner.core.world)
    nodes: int = 1  # boxes
    # runtime deepspeed, offload_optimizer.pipeline_read / pipeline_write: the next sub-group's states are
    # read while this one steps / this one's are written while the next steps (schedules' _read_states)
    ds_pipeline_read: bool = False
    ds_pipeline_write: bool = False
    # its sub_group_size: the optimizer steps (and pipelines) whole sub-groups of this many elements
    ds_sub_group_elems: int = DS_SUB_GROUP_ELEMS
    # its reduce_bucket_size: gradients leave for the host in buckets of this many elements
    # (runtimes/deepspeed.py)
    ds_reduce_bucket_elems: int = int(DS_REDUCE_BUCKET_ELEMS)
    # its swappers' pinned host buffers (dsruntime): offload_optimizer.buffer_count,
    # offload_param.buffer_count and buffer_size; and contiguous_gradients (the GPU bucket of
    # reduce_bucket_size elements)
    ds_opt_buffer_count: int = DS_OPT_BUFFER_COUNT
    ds_param_buffer_count: int = DS_PARAM_BUFFER_COUNT
    ds_param_buffer_elems: int = DS_PARAM_BUFFER_ELEMS
    ds_contiguous_gradients: bool = True
    ds_param_swapper: bool = False  # offload_param nvme with every parameter kept in host memory (max_in_cpu)
    # offload_optimizer.pin_memory on a CUDA box: DeepSpeed's host gradient buffers page-locked through
    # torch's caching host allocator (dsruntime.DsKnobs.pin_memory)
    ds_pin_memory: bool = False
    # offload_param.max_in_cpu with parameters on NVMe: the elements of the leading whole blocks DeepSpeed
    # keeps in host memory (dsruntime.ds_cached_elems; the placement's weights cpu fraction says the same);
    # 0: the placement's split holds for every block
    ds_cached_elems: int = 0
    # the ZeRO stage of the DeepSpeed config this schedule was read from (`--ds-config`:
    # deepspeed.config.DsConfig.schedule; None: not from a config). Stage 3 with the optimizer's states in
    # host memory makes the accumulation boundary's dtype-changing blocking copy of each 16-bit gradient
    # partition into the fp32 gradient (stage3.py partition_grads), a host wait where the profile models
    # pageable copies (runtimes.deepspeed); not with the states on NVMe (their fp32 gradient is made on the
    # GPU, grad_buffer.float(), and swapped out through pinned buffers) nor in ZeRO-2 (stage_1_and_2.py copies
    # with non_blocking=True, converting on the GPU)
    ds_stage: int | None = None

    @property
    def ds_knobs(self) -> DsKnobs:
        """The DeepSpeed keys that size DeepSpeed's own buffers (runtime deepspeed)."""
        return DsKnobs(sub_group_elems=self.ds_sub_group_elems, opt_buffer_count=self.ds_opt_buffer_count,
                       param_buffer_count=self.ds_param_buffer_count,
                       param_buffer_elems=self.ds_param_buffer_elems,
                       reduce_bucket_elems=self.ds_reduce_bucket_elems,
                       contiguous_gradients=self.ds_contiguous_gradients,
                       param_swapper=self.ds_param_swapper, pin_memory=self.ds_pin_memory)

    @property
    def world(self) -> World:
        return World(self.gpus, self.nodes)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches of ONE rank per iteration: the global batch split over the ranks, then into
        micro-batches."""
        return self.world.rank_batch(self.batch) // self.micro_batch

    def recomputes(self, block: int, num_layers: int) -> bool:
        """Is decoder layer `block` (1..num_layers) recomputed in backward? The last `swap_layers` layers keep
        (and swap out) all their activations instead; the embedding and the head are never recomputed."""
        return self.recompute and 1 <= block <= num_layers - self.swap_layers

    def recomputed_fraction(self, num_layers: int) -> float:
        """The fraction of decoder layers recomputed in backward."""
        return (num_layers - self.swap_layers) / num_layers if self.recompute and num_layers else 0.0

    def describe(self) -> str:
        ranks = self.world.ranks
        world = "" if ranks == 1 else f" over {ranks} ranks ({self.gpus} GPUs x {self.nodes} boxes)"
        per = "" if ranks == 1 else f"{ranks} x "
        swapped = f", {self.swap_layers} layers swapped" if self.swap_layers else ""
        return (f"{self.family}: batch {self.batch} = {per}{self.num_micro_batches} x {self.micro_batch}"
                f"{world}, group {self.group}, alpha {self.alpha:g}, prefetch {self.prefetch_depth}, "
                f"{'recompute' if self.recompute else 'no recompute'}{swapped}"
                f"{'' if self.runtime == 'ideal' else f', as {self.runtime} runs it'}")

    def to_dict(self) -> dict:
        return {
            "family": self.family, "batch": self.batch, "micro_batch": self.micro_batch, "seq": self.seq,
            "group": self.group, "alpha": self.alpha, "optimizer_overlap": self.optimizer_overlap,
            "prefetch_depth": self.prefetch_depth, "act_prefetch": self.act_prefetch,
            "recompute": self.recompute,
            "swap_layers": self.swap_layers,
            "iterations": self.iterations, "runtime": self.runtime, "placement": self.placement.as_dict(),
            # one rank: left out, so that one-GPU plans and their digests stay as they were
            **({"gpus": self.gpus, "nodes": self.nodes} if self.world.ranks != 1 else {}),
            # DeepSpeed's optimizer pipelining: only when set, so that other plans' digests stay as they were
            **{k: True for k in ("ds_pipeline_read", "ds_pipeline_write") if getattr(self, k)},
            **({"ds_stage": self.ds_stage} if self.ds_stage is not None else {}),
            **({"ds_sub_group_elems": self.ds_sub_group_elems}
               if self.ds_sub_group_elems != DS_SUB_GROUP_ELEMS else {}),
            **({"ds_reduce_bucket_elems": self.ds_reduce_bucket_elems}
               if self.ds_reduce_bucket_elems != DS_REDUCE_BUCKET_ELEMS else {}),
            **{k: getattr(self, k) for k, dflt in _DS_BUFFER_DEFAULTS.items() if getattr(self, k) != dflt},
        }

    @classmethod
    def from_dict(cls, d: dict) -> ScheduleConfig:
        d = dict(d)
        d["placement"] = Placement.from_dict(d["placement"])
        return cls(**d)


# DeepSpeed's buffer keys: written to a plan only when set away from DeepSpeed's default, so that other plans'
# digests stay as they were
_DS_BUFFER_DEFAULTS = {"ds_opt_buffer_count": DS_OPT_BUFFER_COUNT,
                       "ds_param_buffer_count": DS_PARAM_BUFFER_COUNT,
                       "ds_param_buffer_elems": DS_PARAM_BUFFER_ELEMS, "ds_contiguous_gradients": True,
                       "ds_param_swapper": False, "ds_cached_elems": 0, "ds_pin_memory": False}



@dataclass
class Plan:
    """One schedule as data: what the simulator plays and the executor runs (docs/plan-format.md)."""

    model: ModelSpec
    hardware: HardwareProfile
    config: ScheduleConfig
    graph: TaskGraph
    predicted: dict | None = None
    solver: dict | None = None
    source: str = "<plan>"
