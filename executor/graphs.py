"""CUDA graphs for the runs of compute ops a plan keeps on the device (`GraphRunner`, `tierflow run
--cuda-graphs`). The segments are the planner's (tierflow.planner.core.capture): which ops, and the pool they
share; nothing here decides a boundary.

A segment's first op, on the gpu worker, runs the whole segment (one launch); the engine launches nothing
for its other ops (`follows`): they take the first op's events, and keep their memory effects and `done`
flags; the trace shares the segment's measured span among its ops (`split_spans`). Per key (the segment's
ops, the same in every iteration), its first occurrence runs eagerly (the
warm-up PyTorch asks for before a capture, on the run's gpu stream, not the default one) and proves that the
segment is closed (nothing of the round's state crosses its boundary but what this runner rebinds); the next
is captured (then replayed at once where a capture runs nothing, as on CUDA) and every later one replayed
with one launch.

What a replay rebinds, since no Python of the captured ops runs again:
    inputs     the iteration's micro-batches (tokens, targets), copied into the static buffers the capture
               read
    loss       the iteration's loss sum, copied into a static scalar before and back after the replay
    gradients  the weight-gradient buffers the segment filled (in the pool), handed to the eager ops that
               take them (adam_gpu, offload_grads) under this iteration's keys; the next replay refuses to
               start while a buffer of the previous one is still untaken (it would overwrite it)

A segment that is not closed, a capture that fails (CUDA's capture error, or what the emulation refuses as
CUDA would) or inputs of another shape run eagerly from then on, with one line on stderr saying why.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierflow.errors import TierflowError
from tierflow.executor.device.base import CaptureError, DeviceBackend, GraphReplayError
from tierflow.executor.ops.context import RoundState
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.core.capture import CapturePlan, Segment, capture_plan, peak_with_pool_bytes
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.graph import Task

WARMUP = 1  # eager occurrences of a key before its capture


class NotClosed(TierflowError, RuntimeError):
    """A segment's ops changed the round's state beyond what a replay rebinds (the segment runs eagerly)."""


@dataclass
class _Graph:
    """One captured key: its graph, static buffers and the gradient buffers it hands out."""

    graph: object
    iteration: int  # the iteration it was captured in (its gradient keys' op ids are of it)
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss: torch.Tensor
    grads: list[tuple[tuple[int, int], torch.Tensor, int]] = field(default_factory=list)  # key, buffer, left


def make_runner(plan: Plan, backend: DeviceBackend, state: TrainState, cuda_graphs: bool | None,
                warn: Callable[[str], None] | None = None) -> GraphRunner | None:
    """The graph runner of a run, or None: `cuda_graphs` None is the default, on for CUDA and off elsewhere
    (the emulation turns it on to test); asked for on a device without graphs, one line and eager launches."""
    on = backend.device.type == "cuda" if cuda_graphs is None else cuda_graphs
    if not on:
        return None
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    if not backend.streams_async or backend.graph_pool() is None:
        warn(f"tierflow: --cuda-graphs: {backend.name} has no CUDA graphs; every op runs eagerly")
        return None
    runner = GraphRunner(plan, backend, state, warn)
    return runner if runner.active else None


class GraphRunner:
    """Runs a plan's capture segments as CUDA graphs (see the module docstring)."""

    def __init__(self, plan: Plan, backend: DeviceBackend, state: TrainState,
                 warn: Callable[[str], None] | None = None) -> None:
        self.plan, self.backend, self.state = plan, backend, state
        self.tasks: list[Task] = plan.graph.tasks
        self.warn = warn or (lambda msg: print(msg, file=sys.stderr))
        self.capture: CapturePlan = capture_plan(plan.graph)
        self.seen: Counter = Counter()
        self.graphs: dict[tuple, _Graph] = {}
        self.eager: set[tuple] = set()
        self.pool = None
        self.handed: tuple[int, list[tuple[int, int]]] | None = None  # (round id, gradient keys) of a replay
        # host seconds of each replay's launch (on CUDA the launch only: its kernels run later), the
        # measurement behind gpu.graph_launch_us (executor/calibration/graph_launch.py)
        self.replay_host_s: list[float] = []
        self.off_reason = self._check_fits()
        if self.off_reason:
            self.warn(f"tierflow: --cuda-graphs: off for this plan: {self.off_reason}")

    @property
    def active(self) -> bool:
        return not self.off_reason and bool(self.capture.segments)

    def _check_fits(self) -> str:
        g = self.plan.graph
        need = peak_with_pool_bytes(g, self.capture)
        cap = float(g.capacity_bytes["gpu"])
        if self.capture.segments and need > cap:
            return (f"the graphs' pool ({self.capture.pool_bytes / 1e6:.1f} MB, held between replays) beside "
                    f"the plan's device peak needs {need / 1e9:.2f} GB of {cap / 1e9:.2f} GB; run with "
                    "--no-cuda-graphs or plan with less device memory")
        return ""

    # -- the hook in the gpu worker ------------------------------------------------------------------------

    def wrap(self, run_op: Callable[[RoundState, Task], None]) -> Callable[[RoundState, Task], None]:
        """The gpu worker's op runner with the segments run as graphs."""
        if not self.active:
            return run_op
        first = {s.ops[0]: s for s in self.capture.segments}

        def run(rs: RoundState, t: Task) -> None:
            seg = first.get(t.id)
            if seg is None:
                return run_op(rs, t)
            self.run_segment(rs, seg, run_op)

        return run

    def split_spans(self, start_s, end_s) -> None:
        """Share each run segment's measured span (its first op's events: CUDA times a replay, not the ops
        in it) among its ops in plan order, in proportion to their modelled work, so that the trace has one
        span per op, the spans tile the segment, and the last ends when the segment did (compare's per-kind
        busy times count the segment once, not once per op). Within a segment the split is the model's; the
        segment's span is measured. Ops past the round's length (NaN) are left alone."""
        n = len(start_s)
        for seg in self.capture.segments:
            lead = seg.ops[0]
            if seg.ops[-1] >= n or math.isnan(start_s[lead]):  # not run this round
                continue
            t0, t1 = float(start_s[lead]), float(end_s[lead])
            work = [max(float(self.tasks[op].work), 0.0) for op in seg.ops]
            if sum(work) <= 0:  # no modelled work: the first op holds the span, the others end with it
                work = [1.0] + [0.0] * (len(work) - 1)
            total, done = sum(work), 0.0
            for op, w in zip(seg.ops, work):
                start_s[op] = t0 + (t1 - t0) * done / total
                done += w
                end_s[op] = t0 + (t1 - t0) * done / total
            end_s[seg.ops[-1]] = t1  # no rounding past the measured end

    @property
    def follows(self) -> dict[int, int]:
        """Every op of a segment but its first -> the first (the engine launches nothing for them)."""
        return {op: s.ops[0] for s in self.capture.segments for op in s.ops[1:]}

    def run_segment(self, rs: RoundState, seg: Segment, run_op) -> None:
        n = self.seen[seg.key]
        self.seen[seg.key] += 1
        if seg.key in self.eager:
            return self._eager(rs, seg, run_op)
        if n < WARMUP:
            return self._warmup(rs, seg, run_op)
        g = self.graphs.get(seg.key)
        if g is None:
            return self._capture(rs, seg, run_op)
        why = self._shape_mismatch(rs, seg, g)
        if why:
            self._fall_back(seg, why)
            return self._eager(rs, seg, run_op)
        self._replay(rs, seg, g)

    # -- eager, warm-up ------------------------------------------------------------------------------------

    def _eager(self, rs: RoundState, seg: Segment, run_op) -> None:
        for op in seg.ops:
            run_op(rs, self.tasks[op])

    def _warmup(self, rs: RoundState, seg: Segment, run_op) -> None:
        before = _Snapshot(rs)
        self._eager(rs, seg, run_op)
        try:
            before.closed(rs)
        except NotClosed as e:
            self._fall_back(seg, str(e))

    def _fall_back(self, seg: Segment, why: str) -> None:
        self.eager.add(seg.key)
        self.graphs.pop(seg.key, None)
        self.warn(f"tierflow: --cuda-graphs: ops {seg.ops[0]}-{seg.ops[-1]} ({len(seg.ops)} compute ops) run "
                  f"eagerly: {why}")

    # -- capture -------------------------------------------------------------------------------------------

    def _persistent(self, g: _Graph) -> Callable[[], dict[int, torch.Tensor]]:
        """The device tensors a capture may read besides its pool: the training state's and its statics."""
        def walk() -> dict[int, torch.Tensor]:
            out = {}
            for t in (*_state_tensors(self.state), *(x for pair in g.batches for x in pair), g.loss):
                if t is not None and t.numel():
                    out[t.untyped_storage().data_ptr()] = t
            return out

        return walk

    def _static(self, x: torch.Tensor) -> torch.Tensor:
        s = self.backend.empty(x.numel(), x.dtype).view(x.shape)
        s.copy_(x)
        return s

    def _capture(self, rs: RoundState, seg: Segment, run_op) -> None:
        it = seg.iteration
        if self.pool is None:
            self.pool = self.backend.graph_pool()
        batches = [(self._static(x), self._static(y)) for x, y in rs.batches[it]]
        g = _Graph(None, it, batches, self._static(rs.loss_sum[it]))
        g.graph = self.backend.new_graph(self.pool, self._persistent(g))
        before = _Snapshot(rs)
        own_batches, own_loss = rs.batches[it], rs.loss_sum[it]
        rs.batches[it], rs.loss_sum[it] = batches, g.loss
        try:
            g.graph.capture(lambda: self._eager(rs, seg, run_op))
            g.grads = before.closed(rs)
        except (CaptureError, NotClosed) as e:
            failed = str(e)
        else:
            failed = ""
        finally:
            rs.batches[it], rs.loss_sum[it] = own_batches, own_loss
        if failed:  # the segment's own state undone, then it runs eagerly, as from now on
            before.restore(rs)
            self._fall_back(seg, f"capture failed: {failed}")
            return self._eager(rs, seg, run_op)
        self.graphs[seg.key] = g
        if not g.graph.capture_executes:
            g.graph.replay()
        own_loss.copy_(g.loss)
        self.handed = (id(rs), [k for k, _b, _left in g.grads])

    # -- replay --------------------------------------------------------------------------------------------

    def _shape_mismatch(self, rs: RoundState, seg: Segment, g: _Graph) -> str:
        now = rs.batches[seg.iteration]
        if len(now) != len(g.batches) or any(a.shape != s.shape or b.shape != t.shape
                                             for (a, b), (s, t) in zip(now, g.batches)):
            return ("dynamic shapes: this iteration's micro-batches are not the shape the graph was "
                    "captured with")
        return ""

    def _replay(self, rs: RoundState, seg: Segment, g: _Graph) -> None:
        it = seg.iteration
        keys = [(self._twin(k[0], it, seg), k[1]) for k, _b, _left in g.grads]
        if self.handed is not None and self.handed[0] == id(rs):
            left = [k for k in self.handed[1] if k in rs.grad_acc]
            if left:
                raise GraphReplayError(f"a replay of ops {seg.ops[0]}-{seg.ops[-1]} would overwrite the "
                                       f"gradient buffer {left[0]} of its previous replay, not yet taken")
        for (x, y), (sx, sy) in zip(rs.batches[it], g.batches):
            sx.copy_(x)
            sy.copy_(y)
        g.loss.copy_(rs.loss_sum[it])
        t0 = time.perf_counter()
        g.graph.replay()
        self.replay_host_s.append(time.perf_counter() - t0)
        rs.loss_sum[it].copy_(g.loss)
        with rs.lock:
            for key, (_k, buf, left) in zip(keys, g.grads):
                rs.grad_acc[key] = buf
                rs.grad_left[key] = left
        self.handed = (id(rs), keys)

    def _twin(self, op: int, it: int, seg: Segment) -> int:
        twin = self.capture.twin(op, it, self.tasks)
        if twin is None:
            raise GraphReplayError(f"ops {seg.ops[0]}-{seg.ops[-1]}: op {op} has no counterpart in iteration "
                                   f"{it} (the plan's iterations are not laid out alike)")
        return twin


class _Snapshot:
    """The round's state before a segment ran: `closed` checks what the segment changed (only new gradient
    buffers), `restore` undoes a failed capture's changes (the segment being closed, they are its own)."""

    def __init__(self, rs: RoundState) -> None:
        self.entries = {k: (id(e), e.users, e.dev_users) for k, e in rs.entries.items()}
        self.grad_acc = {k: id(v) for k, v in rs.grad_acc.items()}
        self.grad_left = dict(rs.grad_left)
        self.graphs, self.fetched = set(rs.graphs), set(rs.fetched)
        self.staged, self.weight_bufs = set(rs.staged), set(rs.weight_bufs)
        self.weight_users = Counter(rs.weight_users)

    def closed(self, rs: RoundState) -> list[tuple[tuple[int, int], torch.Tensor, int]]:
        """The gradient buffers the segment began ([(key, buffer, contributions left)]); NotClosed if it
        changed anything else of the round's state."""
        now = {k: (id(e), e.users, e.dev_users) for k, e in rs.entries.items()}
        for k in sorted(set(now) | set(self.entries), key=str):
            if now.get(k) != self.entries.get(k):
                raise NotClosed(f"entry {tuple(k)} crosses the segment's boundary")
        for name, before, after in (("a recompute's graph", self.graphs, set(rs.graphs)),
                                    ("a fetched tensor", self.fetched, set(rs.fetched)),
                                    ("a staged tensor", self.staged, set(rs.staged)),
                                    ("fetched weights", self.weight_bufs, set(rs.weight_bufs))):
            if before != after:
                raise NotClosed(f"{name} crosses the segment's boundary")
        if Counter(rs.weight_users) != self.weight_users:
            raise NotClosed("the segment reads fetched weights (their buffer is new every iteration)")
        out = []
        for k, v in rs.grad_acc.items():
            if k in self.grad_acc:
                if id(v) != self.grad_acc[k] or rs.grad_left.get(k) != self.grad_left.get(k):
                    raise NotClosed(f"the weight-gradient buffer {k} was begun before the segment")
                continue
            if not isinstance(v, torch.Tensor):
                raise NotClosed(f"the weight gradients {k} are kept as pieces, not in a buffer")
            out.append((k, v, rs.grad_left[k]))
        if set(self.grad_acc) - set(rs.grad_acc):
            raise NotClosed("the segment took a weight-gradient buffer")
        return out

    def restore(self, rs: RoundState) -> None:
        with rs.lock:
            for k in set(rs.entries) - set(self.entries):
                del rs.entries[k]
            for k in set(rs.graphs) - self.graphs:
                del rs.graphs[k]
            for k in set(rs.grad_acc) - set(self.grad_acc):
                del rs.grad_acc[k]
            rs.grad_left.clear()
            rs.grad_left.update(self.grad_left)


def _state_tensors(state: TrainState):
    """The device tensors the training state keeps across iterations: each tier vector's device range, the
    gradient accumulators."""
    for vecs in state.vec.values():
        for v in vecs:
            if v.dev is not None:
                yield v.dev
    for g in state.grads:
        if isinstance(g, torch.Tensor) and g.device == state.device:
            yield g
