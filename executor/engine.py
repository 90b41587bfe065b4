"""Replay a plan's operations on real hardware: one worker per resource, each running its queue in the plan's
order, an op starting only when its dependencies have finished. Nothing is scheduled here: every transfer,
compute step and optimizer step is an op of the plan, and the executor only decides *how* to carry it out.

Workers and streams
    gpu, h2d and d2h each own a stream of the device backend (executor/device: CUDA, or its adversarial CPU
    emulation). On a plain CPU there are no streams: a copy is a memcpy on the same cores, so the gpu, h2d and
    d2h queues run in one worker (named gpu), in the plan's order (graph.plan_order), with no hand-off between
    threads; the host resources (cpu, ssd_read, ssd_write, net) keep a worker each. A stream worker enqueues
    its op's handler on its stream (`launch`) and marks the op done once enqueued; a dependency between two
    stream resources is the end event the waiting stream waits on, and a host worker (cpu, ssd_read,
    ssd_write) waiting on a stream op synchronizes on that op's event only. A handler's failure is the op's,
    whichever thread runs it. There is no device-wide synchronization inside an iteration; the only full
    synchronization is at the end of a round (the plan's iterations), to read the losses and the timings.

The rest of the design lives with its code: how ops bind to tensors and the entries' states in binding.py,
the op handlers and their dispatch table in ops/ (table.py; entries.py, compute.py, weights.py, grads.py,
optimizer.py, with the numerics), what a round shares between its workers in ops/context.py (RoundState),
saved-tensor packs in tiers/packs.py.
"""

from __future__ import annotations

import errno
import functools
import socket
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from tierflow.errors import DoesNotFit, TierflowError
from tierflow.executor.binding import OPTIMIZER_PART, Binding, ExecutionError
from tierflow.executor.data import TokenData
from tierflow.executor.device.base import DeviceBackend, RoundAborted, TierOutOfMemory
from tierflow.executor.device.factory import as_backend
from tierflow.executor.graphs import make_runner
from tierflow.executor.ops.context import STREAM_RESOURCES, Hyper, OpContext, RoundState
from tierflow.executor.ops.grads import HostGradAdds
from tierflow.executor.ops.table import Ops
from tierflow.executor.optim.clipping import GradNorms
from tierflow.executor.optim.host_threads import apply_in_this_thread, optimizer_threads, restore
from tierflow.executor.tiers.arena import TransferArena, arena_bytes_for
from tierflow.executor.tiers.host_heap import keep_freed_heap
from tierflow.executor.tiers.ssd_store import ChecksumError, SsdStore
from tierflow.executor.tiers.state import TrainState
from tierflow.executor.worker_pool import WorkerPool
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.graph import TIERS, Task, TaskGraph
from tierflow.planner.core.opkinds import ENTRY_TENSORS, OP_KINDS
from tierflow.planner.core.simulator import SimResult, summarize

__all__ = ["ExecutionError", "Executor", "Hyper", "OutOfMemory", "RoundResult", "UnsupportedPlan",
           "measured_result"]


class OutOfMemory(DoesNotFit, ExecutionError):
    """An op out of memory on a tier (exit 3): the message names the tier, the op and the plan's decision."""

    prefix = ""  # the message says it


class UnsupportedPlan(TierflowError, ValueError):
    """A plan this executor cannot run as written (refused before training starts)."""


@dataclass
class RoundResult:
    iterations: int
    losses: list[float]
    start_s: np.ndarray
    end_s: np.ndarray
    peak_bytes: dict[str, float]  # per tier, by the plan's memory effects (extra["device_memory"]: measured)
    memory_trace: list[tuple[float, float, float, float]]
    wall_s: float
    extra: dict = field(default_factory=dict)


_Aborted = RoundAborted


class Executor:
    """Runs rounds of a plan's ops on the training state: a worker thread per resource, a fresh RoundState per
    round; the ops themselves are in executor/ops. A subclass may extend the round's public steps,
    `new_round`, `worker`, `wait_op` and `apply_mem` (calibration/dispatch.py's TimedExecutor times them)."""

    def __init__(self, plan: Plan, state: TrainState, data: TokenData, device: torch.device | DeviceBackend,
                 hyper: Hyper, ssd: SsdStore | None, profile: bool = False,
                 cuda_graphs: bool | None = None, norms: GradNorms | None = None) -> None:
        self.backend = state.backend if state is not None else as_backend(device)
        self.plan, self.state, self.data, self.hyper, self.ssd = plan, state, data, hyper, ssd
        self.device = self.backend.device
        # each op under a torch.profiler record_function named after it (tierflow run --profile)
        self.profile = profile
        self.cfg = plan.config
        self.tasks: list[Task] = plan.graph.tasks
        unknown = sorted({t.kind for t in self.tasks} - OP_KINDS)
        if unknown:
            raise UnsupportedPlan(f"{plan.source}: op kind {unknown[0]!r} is not implemented by this "
                                  f"executor (it runs {', '.join(sorted(OP_KINDS))}); upgrade tierflow")
        if state is not None:
            try:
                self.backend.check_compute_dtype(state.compute_dtype)
            except ValueError as e:
                raise UnsupportedPlan(str(e)) from None
        # the net worker (several ranks' collectives, ops/net.py) has a stream of its own where the device has
        # streams
        has_net = any(t.resource == "net" for t in self.tasks)
        self.stream_resources = (*STREAM_RESOURCES, "net") if has_net else STREAM_RESOURCES
        self.world = state.world
        if has_net and self.world.single:
            raise UnsupportedPlan(f"{plan.source}: the plan has collectives (ops on resource net) but this "
                                  "run has one rank (launch it with torchrun or --nproc)")
        self.binding = Binding(plan, state.layout)
        if self.device.type == "cpu":  # the device tier is in the C heap: what a step frees serves the next
            keep_freed_heap()
        if self.backend.streams_async:  # the device memory the plan assumes, enforced by the allocator
            self.backend.cap_memory(float(plan.graph.capacity_bytes["gpu"]))
        # the host buffers that cross PCIe: one area, allocated now, sized from the plan (tiers/arena.py)
        area_bytes = arena_bytes_for(plan, self.binding, state, self.backend.streams_async)
        self.arena = TransferArena(self.backend, area_bytes, warn=lambda msg: print(msg, file=sys.stderr))
        self.backend.arena = self.arena
        self.ops = Ops(OpContext(self.binding, state, self.device, hyper, ssd, self.backend, self.arena,
                                 norms))
        # the plan's capture segments as CUDA graphs (executor/graphs.py); None: every op eager. Under
        # --profile the default is off: a replay has no per-op ranges for the profiler to name
        if cuda_graphs is None and profile:
            cuda_graphs = False
        self.graph_runner = make_runner(plan, self.backend, state, cuda_graphs)
        # the host optimizer's intra-op threads (its worker's own setting): one fewer than torch's on CUDA, so
        # that the thread launching GPU work keeps a core (optim/host_threads.py); None: torch's setting
        self.threads = torch.get_num_threads()
        # on a device without streams the compute lane (gpu) runs in the thread that calls run_round, the
        # others on the pool: the compute's intra-op work then runs on that thread's OpenMP team, as plain
        # PyTorch's does
        self.compute_in_caller = not self.backend.streams_async
        self.optimizer_threads = optimizer_threads(self.device.type, any(t.kind in OPTIMIZER_PART
                                                                         for t in self.tasks), self.threads)
        # the workers' queues (`lanes`): a queue per resource, but on a device without streams (a plain CPU)
        # the stream resources' ops in one worker, in one order every dependency and every queue respects (no
        # hand-off between threads for a copy that is a memcpy on the same cores)
        self.lanes = self._lanes()
        self.waits = self._dep_waits()
        self._queues: dict[int, dict[str, list[int]]] = {}  # per number of ops run: the lanes' prefixes
        self._checked: dict[int, int] = {}  # per number of iterations run: its ops (_check_round)
        # the ops another thread waits for (a dependency of another worker's op, an iteration's last gpu op
        # for the reporter): only these get an event per round
        self.waited = {d for ws in self.waits for d, _ in ws} | {t.id for t in self._last_gpu_ops().values()}
        self._waited_sorted = sorted(self.waited)
        self._weight_users: dict[int, dict[int, int]] = {}  # per number of ops run: their fetches' readers
        # the rounds' worker threads, kept from round to round with one rank (worker_pool.py); with several
        # ranks a thread per round (one left in a collective after a failure is left behind: _join)
        self.pool = WorkerPool() if self.world.single else None
        if self.pool is not None:
            # not at the interpreter's exit: a woken daemon thread would find the interpreter finalizing
            weakref.finalize(self, self.pool.close).atexit = False

    def close(self) -> None:
        """The run is over: end the pool's threads (each has finished its round's job) and join them."""
        if self.pool is not None:
            self.pool.close(wait_s=10.0)

    # -- running a round -------------------------------------------------------------------------------------

    def run_round(self, iterations: int, step0: int, on_step=None) -> RoundResult:
        """Run the plan's ops of its first `iterations` iterations as training steps step0 ..
        step0+iterations-1. `on_step(iteration, loss, end_s)` is called (from a reporter thread) as soon as an
        iteration's last GPU op has finished, so that long rounds show progress; it waits on that op's event
        only. An exception it raises stops the round's workers and is raised here (how `tierflow run` stops at
        a non-finite loss)."""
        n = self._check_round(iterations)
        rs = self.new_round(iterations, step0, n)
        queues = self._queues.get(n)
        if queues is None:
            queues = self._queues[n] = {r: [i for i in ids if i < n] for r, ids in self.lanes.items()}
        calls = [(r, self.worker, (rs, r, q)) for r, q in queues.items() if q]
        here = next((c for c in calls if c[0] == "gpu"), None) if self.compute_in_caller else None
        if here is not None:
            calls.remove(here)
        if on_step is not None:
            last = {it: t.id for it, t in self._last_gpu_ops().items() if it < iterations}
            calls.append(("reporter", self._reporter, (rs, last, on_step)))
        if self.pool is not None:  # one rank: the executor's persistent threads (worker_pool.py)
            threads, collective = [], []
        else:
            threads = [threading.Thread(target=fn, args=args, name=f"tierflow-{r}", daemon=True)
                       for r, fn, args in calls]
            # threads that may wait in a collective of several ranks: the net worker, the reporter (the mean
            # loss)
            collective = [th for th in threads if th.name in ("tierflow-net", "tierflow-reporter")]
        try:
            if self.pool is not None:
                for r, fn, args in calls:
                    threads.append(self.pool.submit(r, fn, *args))
            else:
                for th in threads:
                    th.start()
            if here is not None:
                _r, fn, args = here
                fn(*args, caller=True)
            self._join(rs, threads, collective)
            for job in threads:  # a pool job's escaped exception (the worker reports its own: none expected)
                if getattr(job, "error", None) is not None:
                    self._fail(rs, None, job.error)
        except BaseException:  # e.g. Interrupted or KeyboardInterrupt in this (the main) thread: stop every
            rs.abort.set()     # worker and wait for it, so that no thread still runs torch ops at exit
            self._join(rs, [th for th in threads if getattr(th, "ident", True) is not None], collective)
            raise
        finally:
            try:
                # the workers have enqueued every op; the streams run the last ones
                self.backend.synchronize()
                if rs.grad_adds is not None:
                    rs.grad_adds.close()  # after the streams: the last offload_grads submit their adds there
            finally:
                if rs.streams is not None:
                    self.backend.close_streams(rs.streams.values())
                if self.optimizer_threads is not None:
                    restore(self.threads)  # the process-wide value the cpu worker changed
        wall_s = time.perf_counter() - rs.t0_s
        self._fold_mem(rs)
        if rs.errors:
            raise rs.errors[0]
        if rs.streams is not None:
            for tid, ev in rs.ev_start.items():
                rs.start_s[tid] = self.backend.elapsed_s(rs.ev0, ev)
                rs.end_s[tid] = self.backend.elapsed_s(rs.ev0, rs.ev_end[tid])
            if self.graph_runner is not None:  # a segment's ops shared its first op's events
                self.graph_runner.split_spans(rs.start_s, rs.end_s)
        leftover = [tuple(k) for k in rs.entries]
        losses = [float(v) for v in rs.loss_sum]
        return RoundResult(iterations, losses, rs.start_s.copy(), rs.end_s.copy(),
                           {t: rs.peak_bytes[i] for i, t in enumerate(TIERS)}, list(rs.mem_trace), wall_s,
                           extra={"leftover_entries": leftover, "device_memory": self.backend.memory_stats(),
                                  "optimizer_threads": self.optimizer_threads})

    @staticmethod
    def _join(rs: RoundState, threads: list, collective: list[threading.Thread],
              grace_s: float = 5.0) -> None:
        """Join the round's threads (or its pool's jobs: worker_pool.Job). One blocked in a collective
        (`collective`) cannot see the abort: once the round has failed it is given `grace_s` to finish, then
        left behind (a daemon thread; the run is ending with the error, and torchrun stops the other ranks
        when this one exits)."""
        for th in threads:
            if th not in collective:
                th.join()
        for th in collective:
            waited = 0.0
            while th.is_alive() and (not rs.abort.is_set() or waited < grace_s):
                th.join(0.05)
                waited += 0.05 if rs.abort.is_set() else 0.0

    def _check_round(self, iterations: int) -> int:
        """The number of ops in the plan's first `iterations` iterations,
        which must not depend on later ones (checked once per number of iterations)."""
        n = self._checked.get(iterations)
        if n is None:
            n = self._checked[iterations] = self._count_round(iterations)
        return n

    def _count_round(self, iterations: int) -> int:
        n = sum(1 for t in self.tasks if t.iteration < iterations)
        if any(t.iteration >= iterations for t in self.tasks[:n]):
            raise ExecutionError(f"{self.plan.source}: ops are not ordered by iteration; cannot "
                                 f"run {iterations} of its {self.plan.graph.num_iterations} iterations "
                                 "(use whole rounds)")
        for t in self.tasks[:n]:
            for d in t.deps:
                if d >= n:
                    raise ExecutionError(
                        f"{self.plan.source}: op {t.id} depends on a later iteration's op {d}")
        return n

    def new_round(self, iterations: int, step0: int, n: int) -> RoundState:
        """A fresh RoundState: the round's batches on the device, no entries, the memory at the plan's static
        bytes, and (CUDA and its emulation) one stream per stream resource and the event the timings are
        measured from, recorded on the run's device (its gpu stream)."""
        be = self.backend
        be.thread_init()
        loss_sum = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in range(iterations)]
        batches = []
        mb, num_mb = self.cfg.micro_batch, self.cfg.num_micro_batches
        share = self.cfg.world.rank_batch(self.cfg.batch)  # rank r trains on sequences [r*share, (r+1)*share)
        for it in range(iterations):
            x, y = self.data.batch(step0 + it, self.cfg.batch, self.cfg.seq)
            if not self.world.single:
                x, y = (z[self.world.rank * share:(self.world.rank + 1) * share] for z in (x, y))
            batches.append([(x[m * mb:(m + 1) * mb].to(self.device), y[m * mb:(m + 1) * mb].to(self.device))
                            for m in range(num_mb)])
        mem_bytes = [float(self.plan.graph.static_bytes[t]) for t in TIERS]
        rs = RoundState(
            num_ops=n, step0=step0, batches=batches, backend=be,
            weight_users=Counter(self._round_weight_users(n)), loss_sum=loss_sum, done=self._round_events(n),
            start_s=np.full(n, np.nan), end_s=np.full(n, np.nan),
            mem_bytes=mem_bytes, peak_bytes=list(mem_bytes), mem_trace=[(0.0, *mem_bytes)])
        be.start_round(rs.abort, lambda label, e: self._fail(rs, self._task_of(label), e))
        if be.streams_async:
            rs.streams = {r: be.new_stream(r) for r in self.stream_resources}
            be.synchronize()  # the batches' copies (default stream) before any stream reads them
            be.reset_peaks()
            rs.ev0 = be.record(rs.streams["gpu"])
            be.synchronize_event(rs.ev0)
            if not self.state.placement.gpu_optimizer:
                rs.grad_adds = HostGradAdds(be, self.state, rs, lambda t, e: self._fail(rs, t, e))
        rs.t0_s = time.perf_counter()
        return rs

    def _round_weight_users(self, n: int) -> dict[int, int]:
        """The fetch_weights ops among the round's first `n` ops -> the compute ops that read their buffers
        (found once per number of ops; each round counts down a copy)."""
        users = self._weight_users.get(n)
        if users is None:
            users = self._weight_users[n] = {k: v for k, v in self.binding.wfetch_users.items() if k < n}
        return users

    def _round_events(self, n: int) -> list[threading.Event | None]:
        """Per op of the round, an event where another thread waits for it (`waited`), else None."""
        done: list[threading.Event | None] = [None] * n
        for i in self._waited_sorted:
            if i >= n:
                break
            done[i] = threading.Event()
        return done

    def _task_of(self, label: str) -> Task | None:
        """The op of a label given to backend.launch (its id first)."""
        head = label.partition(" ")[0]
        return self.tasks[int(head)] if head.isdigit() and int(head) < len(self.tasks) else None

    def _reporter(self, rs: RoundState, last: dict[int, int], on_step) -> None:
        self.backend.thread_init()
        tid = None
        try:
            for it in sorted(last):
                tid = last[it]
                self.wait_op(rs, tid)
                if rs.streams is not None:
                    self.backend.synchronize_event(rs.ev_end[tid])
                    end_s = self.backend.elapsed_s(rs.ev0, rs.ev_end[tid])
                else:
                    end_s = float(rs.end_s[tid])
                loss = float(rs.loss_sum[it])
                try:
                    on_step(it, loss, end_s)
                except Exception as e:  # noqa: BLE001 - on_step stopped training (e.g. a non-finite loss)
                    rs.errors.insert(0, e)
                    rs.abort.set()
                    return
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001 - the reporter's own failure, passed up with its op
            self._fail(rs, self.tasks[tid] if tid is not None else None, e, "reporting the loss after ")

    def wait_op(self, rs: RoundState, d: int) -> None:
        ev = rs.done[d]
        while not ev.wait(0.05):
            if rs.abort.is_set():
                raise _Aborted()

    def worker(self, rs: RoundState, resource: str, queue: list[int], caller: bool = False) -> None:
        """Run one lane's ops in order (`caller`: in run_round's own thread, where a stop signal's exception
        or a KeyboardInterrupt is run_round's to raise, not an op's failure)."""
        self.backend.thread_init()
        if resource == "cpu":
            apply_in_this_thread(self.optimizer_threads)
        has_stream = rs.streams is not None and resource in self.stream_resources
        stream = rs.streams[resource] if has_stream else None
        # chosen once: no cost when not profiling
        run_op = self._run_op_profiled if self.profile else self.ops.run
        follows = {}  # an op of a capture segment but its first -> that first op, which runs the segment
        if resource == "gpu" and self.graph_runner is not None:
            run_op = self.graph_runner.wrap(run_op)
            follows = self.graph_runner.follows
        t = None
        try:
            tasks, waits, done = self.tasks, self.waits, rs.done
            for tid in queue:
                t = tasks[tid]
                if waits[tid]:
                    self._wait_for_deps(rs, waits[tid], stream)
                if t.mem_start:
                    self.apply_mem(rs, t.mem_start)
                lead = follows.get(tid)
                if lead is not None:  # it ran in its segment's graph (executor/graphs.py): that op's span
                    rs.ev_start[tid], rs.ev_end[tid] = rs.ev_start[lead], rs.ev_end[lead]
                elif stream is not None:
                    rs.ev_start[tid] = self.backend.record(stream)
                    self.backend.launch(stream, functools.partial(self._run_on_stream, rs, t, run_op),
                                        f"{tid} {t.label}")
                    rs.ev_end[tid] = self.backend.record(stream)
                else:
                    rs.start_s[tid] = time.perf_counter() - rs.t0_s
                    run_op(rs, t)
                    rs.end_s[tid] = time.perf_counter() - rs.t0_s
                if t.mem_end:
                    self.apply_mem(rs, t.mem_end)
                if done[tid] is not None:
                    done[tid].set()
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the other workers stop
            if caller and not isinstance(e, Exception):
                rs.abort.set()
                raise
            self._fail(rs, t, e)

    def _run_op_profiled(self, rs: RoundState, t: Task) -> None:
        """The op under a record_function named after the plan's op, e.g. 'op 123 fwd b3 mb1 it0', so that the
        profiler's kernels line up with the plan's trace."""
        with torch.profiler.record_function(f"op {t.id} {t.label}"):
            self.ops.run(rs, t)

    def _run_on_stream(self, rs: RoundState, t: Task, run_op) -> None:
        """An op's handler with its stream current: at once on CUDA (its kernels run later), on the stream's
        thread in the emulation. A failure is the op's, whichever thread runs it."""
        if rs.abort.is_set():
            return
        try:
            run_op(rs, t)
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001
            self._fail(rs, t, e)

    def _fail(self, rs: RoundState, t: Task | None, e: BaseException, prefix: str = "") -> None:
        with rs.lock:
            rs.errors.append(self._explain(t, e, prefix))
        rs.abort.set()

    def _lanes(self) -> dict[str, list[int]]:
        """The workers' queues: each resource's ops in the plan's order; without streams (a plain CPU, where a
        copy is a memcpy of the same cores) the stream resources' ops (gpu, h2d, d2h) in one queue, named gpu:
        a topological order of the dependencies and of every resource's queue (so that no worker waits for
        an op queued behind one of its own), the plan's order (key, id) where both allow."""
        order = self.plan.graph.resource_order()
        if self.backend.streams_async:
            return order
        merged = [r for r in STREAM_RESOURCES if order.get(r)]
        if len(merged) < 2:
            return order
        lanes = {r: ids for r, ids in order.items() if r not in merged}
        lanes["gpu"] = [i for i in self.plan.graph.plan_order() if self.tasks[i].resource in merged]
        return lanes

    def _dep_waits(self) -> list[tuple[tuple[int, bool], ...]]:
        """Per op, the dependencies its worker waits for, found once per plan: every one but an earlier op of
        its own queue (done, and ahead of it on its stream), each with whether its end event is waited on too
        (an op of another stream resource)."""
        pos, lane = {}, {}
        for name, ids in self.lanes.items():
            for i, tid in enumerate(ids):
                pos[tid], lane[tid] = i, name
        out = []
        for t in self.tasks:
            ws = []
            for d in t.deps:
                dep = self.tasks[d].resource
                if lane[d] != lane[t.id] or pos[d] >= pos[t.id]:
                    ws.append((d, dep != t.resource and dep in self.stream_resources))
            out.append(tuple(ws))
        return out

    def _last_gpu_ops(self) -> dict[int, Task]:
        """Each iteration's last gpu op (the reporter waits for it)."""
        last = {}
        for tid in self.plan.graph.resource_order().get("gpu", []):
            last[self.tasks[tid].iteration] = self.tasks[tid]
        return last

    def _wait_for_deps(self, rs: RoundState, waits: tuple[tuple[int, bool], ...], stream) -> None:
        """Until the dependencies `waits` (of _dep_waits) have finished: on the host, then (streams) on the
        stream ops' end events, by this worker's stream or, for a host worker, by the host."""
        for d, event in waits:
            if not rs.done[d].is_set():
                self.wait_op(rs, d)
            if event and rs.streams is not None:
                if stream is not None:
                    self.backend.wait_event(stream, rs.ev_end[d])
                else:
                    self.backend.synchronize_event(rs.ev_end[d])

    def apply_mem(self, rs: RoundState, effects) -> None:
        """An op's memory effects, logged (one append, atomic under the interpreter lock: no lock, no sums on
        the hot path); `_fold_mem` replays the log after the round, in the order the workers logged it."""
        if effects:
            rs.mem_log.append((time.perf_counter() - rs.t0_s, effects))

    @staticmethod
    def _fold_mem(rs: RoundState) -> None:
        """The round's memory per tier, its peaks and its trace from the log of `apply_mem` (the times kept
        non-decreasing: two workers may read the clock and append in either order)."""
        mem, peak, trace = rs.mem_bytes, rs.peak_bytes, rs.mem_trace
        add = trace.append
        last_s = 0.0
        for at_s, effects in rs.mem_log:
            for tier, delta_bytes in effects:
                now = mem[tier] = mem[tier] + delta_bytes
                if now > peak[tier]:
                    peak[tier] = now
            if at_s > last_s:
                last_s = at_s
            add((last_s, *mem))
        rs.mem_log.clear()

    # -- errors ----------------------------------------------------------------------------------------------

    def _explain(self, t: Task | None, e: BaseException, prefix: str = "") -> BaseException:
        what = f"{prefix}op {t.id} ({t.label} on {t.resource})" if t is not None else f"{prefix}the round"
        if isinstance(e, ExecutionError | ChecksumError):
            return e
        tier = oom_tier(e)
        if tier is not None:
            why = self._decision(t) if t is not None else "placement"
            return OutOfMemory(f"{tier} out of memory in {what}: caused by the plan's {why}; "
                               "plan again for this machine (tierflow calibrate, then "
                               "tierflow plan --hw box.yaml)")
        if is_cuda_error(e):
            return ExecutionError(f"CUDA error surfaced in {what}: {' '.join(str(e).split())[:160]}; CUDA "
                                  "reports errors asynchronously, so the failing kernel may belong to an "
                                  "earlier op on any stream: rerun with CUDA_LAUNCH_BLOCKING=1 to name it")
        return ExecutionError(f"{what} failed: {type(e).__name__}: {e}")

    def _decision(self, t: Task) -> str:
        p, cfg = self.cfg.placement, self.cfg

        def split(name: str) -> str:
            s = getattr(p, name)
            return f"placement.{name} (gpu {s.gpu:g}, cpu {s.cpu:g}, ssd {s.ssd:g})"

        if t.resource == "net":  # a collective's full-size buffer: the weights / gradients of a whole block
            return f"world of {self.world.ranks} ranks (the full-size {t.tensor} buffer of block {t.block})"
        if t.tensor == "weights":
            return f"{split('weights')} with prefetch_depth {cfg.prefetch_depth}"
        if t.tensor in ENTRY_TENSORS:
            return (f"{split('checkpoints')} at micro_batch {cfg.micro_batch} with swap_layers "
                    f"{cfg.swap_layers}")
        if t.tensor == "grads":
            return split("grads")
        if t.tensor == "opt_states":
            return f"{split('master')}, {split('adam_m')}, {split('adam_v')} with alpha {cfg.alpha:g}"
        return f"micro_batch {cfg.micro_batch} (the working memory of {t.kind})"


_HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "CPU out of memory")
_PINNED_OOM = ("CachingHostAllocator", "cudaHostAlloc", "pinned memory")


def oom_tier(e: BaseException) -> str | None:
    """The tier an allocation failure is of (torch raises RuntimeError / AcceleratorError, not MemoryError,
    for host and pinned memory), or None if `e` is not an out-of-memory error."""
    if isinstance(e, TierOutOfMemory):
        return e.tier
    if isinstance(e, torch.OutOfMemoryError):
        return "gpu"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "ssd"
    if isinstance(e, MemoryError):
        return "cpu"
    if isinstance(e, RuntimeError):
        msg = str(e)
        if any(k in msg for k in _HOST_OOM):
            return "cpu"
        if "out of memory" in msg:
            return "cpu (pinned)" if any(k in msg for k in _PINNED_OOM) else "gpu"
    return None


def is_cuda_error(e: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", ())
    return (accel and isinstance(e, accel)) or (isinstance(e, RuntimeError) and "CUDA error" in str(e))


def measured_result(plan: Plan, rr: RoundResult, measured_on: dict | None = None) -> SimResult:
    """The measured round as a SimResult over the plan's graph (its first `rr.iterations` iterations), so that
    every output of the simulator (CSV, Chrome trace, Gantt) works on measurements too; `measured_on` (the
    device, its name, the host: `describe_device`) goes into the trace, for `tierflow compare`."""
    g = plan.graph
    n = len(rr.start_s)
    graph = TaskGraph(g.tasks[:n], g.static_bytes, g.capacity_bytes, rr.iterations, g.num_blocks,
                      dict(g.meta))
    res = summarize(graph, rr.start_s, rr.end_s, [rr.peak_bytes[t] for t in TIERS], rr.memory_trace)
    # measured by the device's allocator (CUDA, the emulation), not the plan's
    if rr.extra.get("device_memory"):
        res.meta["device_memory"] = dict(rr.extra["device_memory"])
    if measured_on:
        res.meta["measured_on"] = dict(measured_on)
    res.meta["optimizer_states"] = plan.model.optimizer_states or "fp32"  # fit and compare check it
    return res


def describe_device(device: torch.device) -> dict:
    """What a trace says of the device it was measured on: its type (cpu, cuda), name and the host."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": str(device), "device_type": device.type, "device_name": name,
            "host": socket.gethostname()}
