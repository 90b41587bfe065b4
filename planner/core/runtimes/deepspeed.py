"""Runtime deepspeed: ZeRO-Infinity as DeepSpeed's ZeRO-3 code runs it (docs/baselines-as-coded.md A), as
hooks of the schedule builder (tierflow.planner.core.runtimes)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tierflow.planner.core.dsruntime import deepspeed_setup_peak_bytes, ds_fp32_grad_copy_s
from tierflow.planner.core.graph import Task
from tierflow.planner.core.memory import DS_MAX_PARAM_REDUCE_EVENTS, placed_bytes
from tierflow.planner.core.opkinds import OFFLOAD_GRADS
from tierflow.planner.core.runtimes.optstep import OptChain
from tierflow.planner.core.simulator import CapacityError, bytes_text
from tierflow.planner.core.world import rank_capacity_bytes, shard_elems


@dataclass
class _DsGrad:
    """A block's gradient waiting in DeepSpeed's IPG bucket (DeepSpeedHooks._ds_grad_bucket)."""

    src: Task  # the task that produced it
    block: int
    wire_bytes_per_param: float  # bytes per parameter its copy to the host moves
    gpu_bytes: float  # its GPU buffer, freed by the copy
    grad_last: dict  # the iteration's block -> final-gradient tasks
    host_grad_alloc: set  # the iteration's blocks whose host gradient buffer is allocated
    # the accumulation boundary's copy into the fp32 gradient, when the host waits for it (seconds; None: a
    # pinned copy counted in wire_bytes_per_param)
    fp32_copy_s: float | None = None


class DeepSpeedHooks:
    """The builder's hooks for runtime deepspeed (mixed into tierflow.planner.core.schedules._Builder, whose
    state they read and extend)."""

    def _ds_init(self) -> None:
        """The builder's DeepSpeed state (from _Builder.__init__, after the blocks and the placement)."""
        cfg, b = self.cfg, self.blocks
        # runtime deepspeed: the open gradient bucket (its blocks' offloads, not yet issued) and the offloads
        # of the last backward, which the host waits for before the next forward (_ds_grad_bucket)
        self.ds_bucket: list[_DsGrad] = []
        self.ds_epilogue: list[int] = []
        # the last copy of each bucket still in flight, and what the next step waits for (_ds_flush)
        self.ds_events: deque[int] = deque()
        self.ds_wait: list[int] = []
        self.ds_groups = ds_sub_groups([x.owned_params for x in b], cfg.ds_sub_group_elems)
        self.ds_cached = self._ds_cached_blocks()
        self._ds_check_setup_memory()

    def _ds_check_setup_memory(self) -> None:
        """Runtime deepspeed with `offload_optimizer.pin_memory` on a CUDA box (cfg.ds_pin_memory): the run
        cannot start where the host does not hold, at once, the placed tensors, the swappers' buffers and the
        gradient partitions both pageable and page-locked (rounded up to a power of two by torch's caching
        host allocator) while DeepSpeed pins them (dsruntime.deepspeed_setup_peak_bytes: stage3.py:791-795
        @0.19.8, `get_accelerator().pin_memory(torch.zeros(...))`)."""
        cfg, p = self.cfg, self.p
        if cfg.runtime != "deepspeed" or not cfg.ds_pin_memory or p.gpu_optimizer \
                or self.hw.gpu.host_cores is not None:
            return
        partition = shard_elems(self.model.total_params(), self.W)
        peak = deepspeed_setup_peak_bytes(partition, cfg.ds_knobs, p.weights.ssd > 0, p.master.ssd > 0,
                                          self.pr.compute_bytes)
        peak += placed_bytes(self.model, p, self.W)["cpu"]
        cap = rank_capacity_bytes(self.hw, cfg.gpus)["cpu"]
        if peak > cap:
            grads = self.pr.compute_bytes * partition
            raise CapacityError(
                "cpu", 0.0, peak - cap,
                f"DeepSpeed's set-up: its {bytes_text(grads)} of gradient partitions pageable and "
                f"page-locked at once (offload_optimizer.pin_memory; torch's pinned allocator rounds them "
                f"to a power of two), with its swap buffers and the placed tensors: {bytes_text(peak)} of "
                f"{bytes_text(cap)}; fix: offload_optimizer.pin_memory false, or a host with more memory")

    def _ds_drained_at_next_hook(self, u: int, h: Task, d: int) -> None:
        """Runtime deepspeed on one GPU: the fetch of use u, issued with the prefetch bucket at the hook of
        use u - d, is waited for by the host at the next hook, before the compute of use u - d + 1 is
        launched.
        DeepSpeed's one-rank fetch is an async copy of the pinned partition on the all-gather stream
        (partition_parameters.py:76-77, NoGatherCoalescedHandle: `ds_tensor.data.to(device,
        non_blocking=True)`; the partitions live in the pinned flat buffer, stage3.py:696), and the wait for a
        module's parameters synchronizes that whole stream (partitioned_param_coordinator.py:328-334: the
        handle's wait under `stream(allgather_stream)`, partition_parameters.py:58-60 and 85-86
        `current_stream().synchronize()`), so every copy issued at earlier hooks (the prefetch of
        partitioned_param_coordinator.py:380-413, issued after that wait) lands before the next module runs.
        With a depth of one use nothing changes; deeper buckets do not run ahead of the compute, they hold it.
        Not on a host device (gpu.host_cores: the CPU accelerator resolves data dependencies itself, no
        stream to wait for) nor with several ranks (their all-gather handles wait on their own). Only within
        one forward and backward: each forward starts a new trace (parameter_offload.py:243-245,
        `_start_of_forward_hook` -> reset_step, which waits for what is in flight and restarts the queue), so
        no compute waits for a fetch across the start of a forward."""
        if d < 2 or self.cfg.runtime != "deepspeed" or self.W > 1 or self.hw.gpu.host_cores is not None:
            return
        j = u - d + 1
        if j < 0 or j >= len(self.uses):
            return
        if any(x.block == 0 and x.phase == "F" for x in self.uses[j + 1:u + 1]):
            return
        c = self.uses[j].first_compute
        if c is not None and h.key <= c.key and h.id not in c.deps:
            c.deps.append(h.id)


    def _ds_cached_blocks(self) -> frozenset[int] | None:
        """Runtime deepspeed with parameters on NVMe and part of them in host memory (ds_cached_elems:
        offload_param.max_in_cpu, dsruntime.ds_cached_elems): the leading blocks, in model order, that many
        elements hold whole. DeepSpeed keeps whole sub-groups in host memory and fetches
        them like CPU-offloaded parameters; the others are read from NVMe on demand. None where the
        placement's split holds for every block."""
        w = self.p.weights
        if self.cfg.runtime != "deepspeed" or self.cfg.ds_cached_elems <= 0 or w.ssd <= 0 or w.gpu > 0:
            return None
        room = self.cfg.ds_cached_elems
        out, total = set(), 0
        for b, x in enumerate(self.blocks):
            if total + x.owned_params > room:
                break
            total += x.owned_params
            out.add(b)
        return frozenset(out)


    def _ds_grad_bucket(self, t: Task, src: Task, b: int, k: int, grad_gpu_bytes: float, grad_last: dict,
                        host_grad_alloc: set) -> None:
        """DeepSpeed ZeRO-3 with the optimizer offloaded, as its code runs: a gradient joins the IPG bucket
        (reduce_bucket_size elements, 5e8 by default); when the next one would overflow it, the bucket's
        partitions are copied to the host on the reduce-and-partition stream, and at the end of every
        backward (the epilogue) the rest are, and the host waits for that stream before it goes on
        (stage3.py: reduce_independent_p_g_buckets_and_remove_grads, __reduce_and_partition_ipg_grads,
        independent_gradient_partition_epilogue). At the accumulation boundary (the iteration's last
        micro-batch) each partition is also copied to the optimizer's fp32 gradient: 4 B more per parameter
        (partition_grads -> _offload_grad_partition_at_boundary). On a GPU box that copy is a blocking copy_
        with a dtype change: where the profile has pcie.pageable_d2h_gbps it is the host's wait of
        dsruntime.ds_fp32_grad_copy_s, and the backward's next kernels wait for it (_ds_after_copy_out). Not
        modelled: the copy back of the 16-bit partition to the GPU after each copy out (partition_grads:
        grad_buffer.to(device)), an H2D of 2 B per parameter and micro-batch."""
        elems = self.blocks[b].fetch_params
        open_elems = sum(self.blocks[x.block].fetch_params for x in self.ds_bucket)
        if self.ds_bucket and open_elems + elems > self.cfg.ds_reduce_bucket_elems:
            self._ds_flush(t)  # the full bucket leaves once this gradient is ready
        boundary = k == self.cur_last_step[b]  # the block's last micro-batch of the iteration
        fp32_copy_s = ds_fp32_grad_copy_s(self.hw, self.shard(elems), self.pr.grad_wire_bytes) \
            if boundary and self._ds_blocking_grad_copy() else None
        wire = self.pr.grad_wire_bytes + (self.pr.grad_accum_bytes if boundary and fp32_copy_s is None else 0)
        self.ds_bucket.append(_DsGrad(src, b, wire, grad_gpu_bytes, grad_last, host_grad_alloc, fp32_copy_s))
        if b == 0:  # the backward's last block: the epilogue flushes the rest and the host waits
            self.ds_epilogue = self._ds_flush(t)
            self.ds_events.clear()


    def _ds_flush(self, t: Task) -> list[int]:
        """Issue the open bucket after `t`: with several ranks each gradient reduce-scattered, then every
        partition copied to the host (__reduce_and_partition_ipg_grads). With more than
        DS_MAX_PARAM_REDUCE_EVENTS buckets in flight the host synchronizes on the oldest one's event before it
        issues this one, so the next step waits for that bucket's copies (stage3.py: param_reduce_events,
        max_param_reduce_events = 2); it bounds the gradients waiting on the GPU."""
        if len(self.ds_events) >= DS_MAX_PARAM_REDUCE_EVENTS:
            self.ds_wait.append(self.ds_events.popleft())
        out = []
        for x in self.ds_bucket:
            src = x.src
            if self.W > 1:
                src = self._reduce_scatter(t, x.block, t.iteration)
                if t.id != x.src.id:
                    src.deps.append(x.src.id)
            d2h = self._offload_grads(t, src, x.block, t.iteration, x.wire_bytes_per_param, x.gpu_bytes,
                                      x.grad_last, x.host_grad_alloc)
            if t.id != src.id and t.id not in src.deps:
                d2h.deps.append(t.id)
            out.append(self._ds_after_copy_out(d2h, x).id)
        self.ds_bucket = []
        if out:
            self.ds_events.append(out[-1])
        return out


    def _ds_blocking_grad_copy(self) -> bool:
        """ZeRO-3 with the optimizer's states in host memory (ScheduleConfig.ds_stage)."""
        p = self.p
        return self.cfg.ds_stage == 3 and not p.gpu_optimizer and p.master.ssd == 0 and p.grads.ssd == 0


    def _ds_after_copy_out(self, d2h: Task, x: _DsGrad) -> Task:
        """At the accumulation boundary on a GPU box whose profile models pageable copies: the blocking copy
        of the 16-bit partition into the fp32 gradient (x.fp32_copy_s) after its copy to the host, on the
        host's queue; the host waits for it before it launches the backward's next kernels (ds_wait), and the
        optimizer's step waits for it (grad_last). Returns the bucket's last copy. Not modelled: the 16-bit
        partition's copy back to the GPU after each copy out (partition_grads: `grad_buffer.to(device)`), an
        H2D of 2 B per parameter and micro-batch on the reduce stream, hidden behind the backward here."""
        if x.fp32_copy_s is None:
            return d2h
        last = self.g.add(OFFLOAD_GRADS, "cpu", x.fp32_copy_s, tensor="grads", block=x.block, mb=-1,
                          iteration=d2h.iteration, key=d2h.key, deps=[d2h.id])
        self.ds_wait.append(last.id)
        x.grad_last[x.block] = [last.id]
        return last


    def _ds_read_bound(self, block: int, chain: OptChain) -> list[int]:
        """How far DeepSpeed's pipelined optimizer swapper lets the read of sub-group g run ahead: it is
        issued inside swap_in_optimizer_state of sub-group g-1 (`async_parameter`), which the host reaches
        after swap_out_optimizer_state of g-2, and that first completes the previous asynchronous write,
        g-3's (pipelined_optimizer_swapper.py: swap_out_optimizer_state `if self.swap_ops[ASYNC_SWAP_OUT]:
        self._complete_swap_out(ASYNC_SWAP_OUT)`): so after g-2's CPU step and g-3's write. About one write
        in flight and one read ahead, never the whole optimizer in host memory. With pipeline_write alone the
        read of g is g's own swap-in, after g-1's swap-out completed g-2's write."""
        g = self._ds_sub_group(block)
        adams = [a for k, a in chain.group_adam.items() if k != g]  # in the order the sub-groups stepped
        writes = [w for k, w in chain.group_write.items() if k != g]
        if not self.cfg.ds_pipeline_read:
            return [writes[-2] if len(writes) >= 2 else -1]
        return [adams[-2] if len(adams) >= 2 else -1, writes[-3] if len(writes) >= 3 else -1]


    def _ds_sub_group(self, block: int) -> int:
        """DeepSpeed's optimizer sub-group of `block` (-1 for none)."""
        return self.ds_groups[block] if block >= 0 else -1



def ds_sub_groups(owned_params: list[int], sub_group_elems: int) -> list[int]:
    """DeepSpeed's optimizer sub-group of each block: parameters are packed in model order until a sub-group
    holds `sub_group_elems` or more (stage3.py _create_fp16_sub_groups), at block granularity here."""
    out, filled, group = [], 0, 0
    for n in owned_params:
        out.append(group)
        filled += n
        if filled >= sub_group_elems:
            group, filled = group + 1, 0
    return out

