"""The records of one block's optimizer step that the schedule builder and the runtime hooks share."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierflow.planner.core.graph import Task


@dataclass
class AdamBlock:
    """One block's optimizer step in one iteration: where it is keyed and this rank's shard of the block."""

    block: int
    it: int
    key: float  # the step's position in the resources' queues
    k_last: int  # the block's last backward step
    owned: int  # elements of the block's states this rank owns
    fetch_params: int  # elements of the block's gradient this rank keeps
    end: int  # global index of the step after the iteration's last


@dataclass
class OptChain:
    """What the optimizer steps of successive blocks chain on within one iteration.

    LoHan steps each sub-group from the gradient hook that sees the backward enter the next one, on the
    training thread: it reads the group's fp32 p, m, v from NVMe and waits, hands them to the CPU-Adam
    process, then writes back the group stepped before it (fp16 weights and p, m, v) and waits; only then does
    the backward go on (RC4ML/LoHan ratel_optimizer.py:530-534, 1047-1089;
    nvme_ds/pipelined_optimizer_swapper.py:160-216; docs/baselines-as-coded.md B2). Here a layer block stands
    for a sub-group; the GPU is not waited for, it runs ahead on what the thread launched before
    (_Builder._lohan_trigger, _Builder._lohan_thread)."""

    prev_main: int = -1  # the previous block's main CPU Adam step
    prev_write: int = -1  # DeepSpeed: a sub-group's states are read only after the previous one's are written
    prev_read: int = -1  # DeepSpeed with pipeline_read: the previous sub-group's read
    prev_block: int = -1  # the block stepped before (DeepSpeed: is this one in a new sub-group?)
    # DeepSpeed with pipeline_read: each sub-group's last CPU Adam step and last write, in the order they were
    # stepped, which bound how far the reads run ahead (_Builder._ds_read_bound)
    group_adam: dict = field(default_factory=dict)
    group_write: dict = field(default_factory=dict)
    unwaited_write: Task | None = None  # LoHan: the write-back the thread issues at the next boundary
    thread_last: Task | None = None  # LoHan: the thread's last wait

