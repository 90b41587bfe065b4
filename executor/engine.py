"""Replay a plan's operations on real hardware: one worker per resource, each running its queue in the plan's
order, an op starting only when its dependencies have finished. Nothing is scheduled here: every transfer,
compute step and optimizer step is an op of the plan, and the executor only decides *how* to carry it out.

Workers and streams
    gpu, h2d and d2h each own a CUDA stream (on a CPU "device" they are plain threads); a dependency between
    two stream resources is a CUDA event the waiting stream waits on, and a host worker (cpu, ssd_read,
    ssd_write) waiting on a stream op synchronizes on that op's event only. There is no device-wide
    synchronization inside an iteration; the only full synchronization is at the end of a round (the plan's
    iterations), to read the losses and the timings.

The rest of the design lives with its code: how ops bind to tensors and the entries' states in binding.py,
the op handlers and their dispatch table in ops.py (ops_entries.py, ops_compute.py, ops_state.py, with the
numerics), what a round shares between its workers in context.py (RoundState), saved-tensor packs in packs.py.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from tierflow.executor.binding import Binding, ExecutionError
from tierflow.executor.context import STREAM_RESOURCES, Hyper, OpContext, RoundState
from tierflow.executor.data import TokenData
from tierflow.executor.ops import KINDS, Ops
from tierflow.executor.state import TrainState
from tierflow.executor.store import ChecksumError, SsdStore
from tierflow.planner.core.graph import TIERS, Task, TaskGraph
from tierflow.planner.core.simulator import SimResult, summarize
from tierflow.planner.io.planfile import Plan

__all__ = ["ExecutionError", "Executor", "Hyper", "OutOfMemory", "RoundResult", "UnsupportedPlan", "measured_result"]


class OutOfMemory(ExecutionError):
    pass


class UnsupportedPlan(ValueError):
    """A plan this executor cannot run as written (refused before training starts)."""


@dataclass
class RoundResult:
    iterations: int
    losses: list[float]
    start_s: np.ndarray
    end_s: np.ndarray
    peak_bytes: dict[str, float]
    memory_trace: list[tuple[float, float, float, float]]
    wall_s: float
    extra: dict = field(default_factory=dict)


class _Aborted(Exception):
    pass


class Executor:
    """Runs rounds of a plan's ops on the training state: a worker thread per resource, a fresh RoundState per
    round; the ops themselves are in ops.py."""

    def __init__(self, plan: Plan, state: TrainState, data: TokenData, device: torch.device, hyper: Hyper,
                 ssd: SsdStore | None, profile: bool = False) -> None:
        self.plan, self.state, self.data, self.device, self.hyper, self.ssd = plan, state, data, device, hyper, ssd
        self.profile = profile  # each op under a torch.profiler record_function named after it (tierflow run --profile)
        self.cfg = plan.config
        self.tasks: list[Task] = plan.graph.tasks
        self.cuda = device.type == "cuda"
        unknown = sorted({t.kind for t in self.tasks} - KINDS)
        if unknown:
            raise UnsupportedPlan(f"{plan.source}: op kind {unknown[0]!r} is not implemented by this executor "
                                 f"(it runs {', '.join(sorted(KINDS))}); upgrade tierflow")
        self.binding = Binding(plan, state.layout)
        self.ops = Ops(OpContext(self.binding, state, device, hyper, ssd))

    # -- running a round ---------------------------------------------------------------------------------------

    def run_round(self, iterations: int, step0: int, on_step=None) -> RoundResult:
        """Run the plan's ops of its first `iterations` iterations as training steps step0 .. step0+iterations-1.
        `on_step(iteration, loss, end_s)` is called (from a reporter thread) as soon as an iteration's last GPU
        op has finished, so that long rounds show progress; it waits on that op's event only. An exception it
        raises stops the round's workers and is raised here (how `tierflow run` stops at a non-finite loss)."""
        n = self._check_round(iterations)
        rs = self._new_round(iterations, step0, n)
        queues = {r: [i for i in ids if i < n] for r, ids in self.plan.graph.resource_order().items()}
        threads = [threading.Thread(target=self._worker, args=(rs, r, q), name=f"tierflow-{r}", daemon=True)
                   for r, q in queues.items() if q]
        if on_step is not None:
            last = {}
            for tid in queues["gpu"]:
                last[self.tasks[tid].iteration] = tid
            threads.append(threading.Thread(target=self._reporter, args=(rs, last, on_step), daemon=True,
                                            name="tierflow-reporter"))
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        except BaseException:  # e.g. Interrupted or KeyboardInterrupt in this (the main) thread: stop every
            rs.abort.set()     # worker and wait for it, so that no thread still runs torch ops at exit
            for th in threads:
                if th.ident is not None:
                    th.join()
            raise
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
        wall_s = time.perf_counter() - rs.t0_s
        if rs.errors:
            raise rs.errors[0]
        if self.cuda:
            for tid, ev in rs.ev_start.items():
                rs.start_s[tid] = rs.ev0.elapsed_time(ev) / 1e3
                rs.end_s[tid] = rs.ev0.elapsed_time(rs.ev_end[tid]) / 1e3
        leftover = [tuple(k) for k in rs.entries]
        losses = [float(v) for v in rs.loss_sum]
        return RoundResult(iterations, losses, rs.start_s.copy(), rs.end_s.copy(),
                           {t: rs.peak_bytes[i] for i, t in enumerate(TIERS)}, list(rs.mem_trace), wall_s,
                           extra={"leftover_entries": leftover})

    def _check_round(self, iterations: int) -> int:
        """The number of ops in the plan's first `iterations` iterations, which must not depend on later ones."""
        n = sum(1 for t in self.tasks if t.iteration < iterations)
        if any(t.iteration >= iterations for t in self.tasks[:n]):
            raise ExecutionError(f"{self.plan.source}: ops are not ordered by iteration; cannot run "
                                 f"{iterations} of its {self.plan.graph.num_iterations} iterations (use whole rounds)")
        for t in self.tasks[:n]:
            for d in t.deps:
                if d >= n:
                    raise ExecutionError(f"{self.plan.source}: op {t.id} depends on a later iteration's op {d}")
        return n

    def _new_round(self, iterations: int, step0: int, n: int) -> RoundState:
        """A fresh RoundState: the round's batches on the device, no entries, the memory at the plan's static
        bytes, and (CUDA) one stream per stream resource and the event the timings are measured from."""
        loss_sum = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in range(iterations)]
        batches = []
        mb, num_mb = self.cfg.micro_batch, self.cfg.num_micro_batches
        for it in range(iterations):
            x, y = self.data.batch(step0 + it, self.cfg.batch, self.cfg.seq)
            batches.append([(x[m * mb:(m + 1) * mb].to(self.device), y[m * mb:(m + 1) * mb].to(self.device))
                            for m in range(num_mb)])
        mem_bytes = [float(self.plan.graph.static_bytes[t]) for t in TIERS]
        rs = RoundState(
            num_ops=n, step0=step0, batches=batches,
            weight_users=Counter({k: v for k, v in self.binding.wfetch_users.items() if k < n}),
            loss_sum=loss_sum,
            done=[threading.Event() for _ in range(n)], start_s=np.full(n, np.nan), end_s=np.full(n, np.nan),
            mem_bytes=mem_bytes, peak_bytes=list(mem_bytes), mem_trace=[(0.0, *mem_bytes)])
        if self.cuda:
            rs.streams = {r: torch.cuda.Stream(self.device) for r in STREAM_RESOURCES}
            torch.cuda.synchronize(self.device)
            rs.ev0 = torch.cuda.Event(enable_timing=True)
            rs.ev0.record()
            torch.cuda.synchronize(self.device)
        rs.t0_s = time.perf_counter()
        return rs

    def _reporter(self, rs: RoundState, last: dict[int, int], on_step) -> None:
        try:
            for it in sorted(last):
                tid = last[it]
                self._wait(rs, tid)
                if self.cuda:
                    rs.ev_end[tid].synchronize()
                    end_s = rs.ev0.elapsed_time(rs.ev_end[tid]) / 1e3
                else:
                    end_s = float(rs.end_s[tid])
                on_step(it, float(rs.loss_sum[it]), end_s)
        except _Aborted:
            return
        except Exception as e:  # noqa: BLE001 - on_step stopped training (e.g. a non-finite loss): stop the workers
            rs.errors.insert(0, e)
            rs.abort.set()

    def _wait(self, rs: RoundState, d: int) -> None:
        ev = rs.done[d]
        while not ev.wait(0.05):
            if rs.abort.is_set():
                raise _Aborted()

    def _worker(self, rs: RoundState, resource: str, queue: list[int]) -> None:
        stream = rs.streams[resource] if rs.streams is not None and resource in STREAM_RESOURCES else None
        run_op = self._run_op_profiled if self.profile else self.ops.run  # chosen once: no cost when not profiling
        try:
            for tid in queue:
                t = self.tasks[tid]
                self._wait_for_deps(rs, t, stream)
                self._apply_mem(rs, t.mem_start)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(stream)
                        rs.ev_start[tid] = ev
                        run_op(rs, t)
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(stream)
                        rs.ev_end[tid] = ev
                else:
                    rs.start_s[tid] = time.perf_counter() - rs.t0_s
                    run_op(rs, t)
                    rs.end_s[tid] = time.perf_counter() - rs.t0_s
                self._apply_mem(rs, t.mem_end)
                rs.done[tid].set()
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the other workers stop
            rs.errors.append(self._explain(t, e))
            rs.abort.set()

    def _run_op_profiled(self, rs: RoundState, t: Task) -> None:
        """The op under a record_function named after the plan's op, e.g. 'op 123 fwd b3 mb1 it0', so that the
        profiler's kernels line up with the plan's trace."""
        with torch.profiler.record_function(f"op {t.id} {t.label}"):
            self.ops.run(rs, t)

    def _wait_for_deps(self, rs: RoundState, t: Task, stream: torch.cuda.Stream | None) -> None:
        """Until t's dependencies have finished: on the host, then (CUDA) on the stream ops' end events, by this
        worker's stream or, for a host worker, by the host."""
        for d in t.deps:
            self._wait(rs, d)
            if self.cuda and self.tasks[d].resource in STREAM_RESOURCES:
                if stream is not None:
                    stream.wait_event(rs.ev_end[d])
                else:
                    rs.ev_end[d].synchronize()

    def _apply_mem(self, rs: RoundState, effects) -> None:
        if not effects:
            return
        with rs.lock:
            for tier, delta_bytes in effects:
                rs.mem_bytes[tier] += delta_bytes
                rs.peak_bytes[tier] = max(rs.peak_bytes[tier], rs.mem_bytes[tier])
            rs.mem_trace.append((time.perf_counter() - rs.t0_s, *rs.mem_bytes))

    # -- errors ------------------------------------------------------------------------------------------------

    def _explain(self, t: Task, e: BaseException) -> BaseException:
        what = f"op {t.id} ({t.label} on {t.resource})"
        if isinstance(e, ExecutionError | ChecksumError):
            return e
        oom_gpu = isinstance(e, torch.OutOfMemoryError)
        full_disk = isinstance(e, OSError) and e.errno == errno.ENOSPC
        if oom_gpu or isinstance(e, MemoryError) or full_disk:
            tier = "gpu" if oom_gpu else "ssd" if full_disk else "cpu"
            return OutOfMemory(f"{tier} out of memory in {what}: caused by the plan's {self._decision(t)}; "
                               f"plan again for this machine (tierflow calibrate, then tierflow plan --hw box.yaml)")
        return ExecutionError(f"{what} failed: {type(e).__name__}: {e}")

    def _decision(self, t: Task) -> str:
        p, cfg = self.cfg.placement, self.cfg

        def split(name: str) -> str:
            s = getattr(p, name)
            return f"placement.{name} (gpu {s.gpu:g}, cpu {s.cpu:g}, ssd {s.ssd:g})"

        if t.tensor == "weights":
            return f"{split('weights')} with prefetch_depth {cfg.prefetch_depth}"
        if t.tensor in ("checkpoint", "act", "act_grad"):
            return f"{split('checkpoints')} at micro_batch {cfg.micro_batch} with swap_layers {cfg.swap_layers}"
        if t.tensor == "grads":
            return split("grads")
        if t.tensor == "opt_states":
            return f"{split('master')}, {split('adam_m')}, {split('adam_v')} with alpha {cfg.alpha:g}"
        return f"micro_batch {cfg.micro_batch} (the working memory of {t.kind})"


def measured_result(plan: Plan, rr: RoundResult) -> SimResult:
    """The measured round as a SimResult over the plan's graph (its first `rr.iterations` iterations), so that
    every output of the simulator (CSV, Chrome trace, Gantt) works on measurements too."""
    g = plan.graph
    n = len(rr.start_s)
    graph = TaskGraph(g.tasks[:n], g.static_bytes, g.capacity_bytes, rr.iterations, g.num_blocks, dict(g.meta))
    return summarize(graph, rr.start_s, rr.end_s, [rr.peak_bytes[t] for t in TIERS], rr.memory_trace)
