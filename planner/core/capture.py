"""CUDA-graph capture segments, decided from a plan's ops (`capture_plan`): which runs of the GPU compute
queue the executor may capture once and replay with one launch, and the memory pool they need.

A segment is a run of consecutive ops of the gpu queue, all of one iteration, such that
  * every op is a compute op (fwd, recompute, head, bwd): adam_gpu and the transfers stay eager (an optimizer
    step's learning rate and bias corrections are host scalars that change every step; a transfer is a copy
    with host memory and an event another stream waits on);
  * no op depends on an op of another resource and no op of another resource depends on one of them: a
    captured graph cannot wait on an event recorded outside it, and an event recorded inside it cannot be
    waited on from outside, so a segment ends at every transfer the plan places between compute ops;
  * it is closed under the data flow between compute ops: for every dependency between two compute ops,
    both are in the same segment or neither is in any (what one compute op hands another, an activation,
    its gradient, autograd's saved tensors or a recompute's graph, never crosses a segment's boundary; the
    weight-gradient buffers a segment fills are handed to eager ops of the gpu queue, which the executor
    rebinds per iteration).
Ops are removed from candidate runs until all three hold (a fixed point; each pass only removes ops).

Segments of different iterations with the same ops (kind, block, micro-batch, in order) share one `key`: the
executor captures a key once and replays it for every later segment with that key. The pool: every segment's
device memory peak, from the ops' memory effects (the plan's memory model), measured from the segment's start;
one private pool, shared by the segments (captured and replayed in the same order), holds the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierflow.planner.core.graph import TIER_INDEX, Task, TaskGraph
from tierflow.planner.core.opkinds import COMPUTE_KINDS

GPU = TIER_INDEX["gpu"]


@dataclass(frozen=True)
class Segment:
    """One capture segment: its ops (ids, in the gpu queue's order), its iteration, its key and the device
    bytes its ops hold at their peak beyond what was held when it started (its pool)."""

    ops: tuple[int, ...]
    iteration: int
    key: tuple[tuple[str, int, int], ...]  # (kind, block, mb) of each op
    pool_bytes: float


@dataclass(frozen=True)
class CapturePlan:
    """The segments of a plan, the op -> segment map and the pool every segment's graph shares."""

    segments: tuple[Segment, ...]
    segment_of: dict[int, int]  # op id -> index in segments
    pool_bytes: float  # the shared private pool: the largest segment's peak
    iteration_start: tuple[int, ...]  # the first op id of each iteration (ops are ordered by iteration)

    @property
    def captured_ops(self) -> int:
        return len(self.segment_of)

    def twin(self, op: int, iteration: int, tasks: list[Task]) -> int | None:
        """The op of `iteration` at op's place in its own iteration (ops are laid out alike in every
        iteration), or None where that op is not of the same kind, block and micro-batch."""
        t = tasks[op]
        if not 0 <= iteration < len(self.iteration_start) or not 0 <= t.iteration < len(self.iteration_start):
            return None
        other = op - self.iteration_start[t.iteration] + self.iteration_start[iteration]
        if not 0 <= other < len(tasks):
            return None
        u = tasks[other]
        same = (u.iteration, u.kind, u.block, u.mb, u.resource) == (iteration, t.kind, t.block, t.mb,
                                                                     t.resource)
        return other if same else None


def capture_plan(graph: TaskGraph, min_ops: int = 1) -> CapturePlan:
    """The capture segments of `graph` (see the module docstring); runs shorter than `min_ops` stay eager."""
    tasks = graph.tasks
    gpu_queue = graph.resource_order()["gpu"]
    ok = _candidates(tasks)
    while True:
        runs = _runs(tasks, gpu_queue, ok)
        run_of = {op: i for i, run in enumerate(runs) for op in run}
        drop = _open_edges(tasks, ok, run_of)
        if not drop:
            break
        ok -= drop
    segments = tuple(_segment(tasks, run) for run in runs if len(run) >= min_ops)
    segment_of = {op: i for i, s in enumerate(segments) for op in s.ops}
    pool = max((s.pool_bytes for s in segments), default=0.0)
    return CapturePlan(segments, segment_of, pool, _iteration_starts(tasks, graph.num_iterations))


def _candidates(tasks: list[Task]) -> set[int]:
    """Compute ops on the gpu with no dependency on, and no dependent on, another resource."""
    crossing = set()
    for t in tasks:
        for d in t.deps:
            if tasks[d].resource != t.resource:
                crossing.add(d)
                crossing.add(t.id)
    return {t.id for t in tasks if t.kind in COMPUTE_KINDS and t.resource == "gpu" and t.id not in crossing}


def _runs(tasks: list[Task], gpu_queue: list[int], ok: set[int]) -> list[list[int]]:
    """Maximal runs of consecutive candidates of the gpu queue, each within one iteration."""
    runs: list[list[int]] = []
    cur: list[int] = []
    for op in gpu_queue:
        if op in ok and cur and tasks[cur[-1]].iteration == tasks[op].iteration:
            cur.append(op)
            continue
        if cur:
            runs.append(cur)
        cur = [op] if op in ok else []
    if cur:
        runs.append(cur)
    return runs


def _open_edges(tasks: list[Task], ok: set[int], run_of: dict[int, int]) -> set[int]:
    """Candidates at an end of a dependency between two compute ops that are not in the same run."""
    drop = set()
    for t in tasks:
        if t.kind not in COMPUTE_KINDS:
            continue
        for d in t.deps:
            if tasks[d].kind not in COMPUTE_KINDS:
                continue
            a, b = run_of.get(d), run_of.get(t.id)
            if a != b or a is None:
                drop |= {x for x in (d, t.id) if x in ok}
    return drop


def _segment(tasks: list[Task], run: list[int]) -> Segment:
    held = peak = 0.0
    for op in run:
        t = tasks[op]
        for effects in (t.mem_start, t.mem_end):
            held += sum(b for tier, b in effects if tier == GPU)
            peak = max(peak, held)
    key = tuple((tasks[op].kind, tasks[op].block, tasks[op].mb) for op in run)
    return Segment(tuple(run), tasks[run[0]].iteration, key, peak)


def _iteration_starts(tasks: list[Task], iterations: int) -> tuple[int, ...]:
    starts = [len(tasks)] * iterations
    for t in reversed(tasks):
        if 0 <= t.iteration < iterations:
            starts[t.iteration] = t.id
    return tuple(starts)


def peak_with_pool_bytes(graph: TaskGraph, plan: CapturePlan) -> float:
    """An upper bound of the device bytes with graphs: the ops' peak (their memory effects in id order over
    the static bytes) plus the pool, which stays reserved between replays where the plan counted the
    segments' working memory at their own moments only."""
    held = peak = float(graph.static_bytes["gpu"])
    for t in graph.tasks:
        for effects in (t.mem_start, t.mem_end):
            held += sum(b for tier, b in effects if tier == GPU)
            peak = max(peak, held)
    return peak + (plan.pool_bytes if plan.segments else 0.0)


def graphed_graph(graph: TaskGraph, hw, plan: CapturePlan | None = None) -> TaskGraph:
    """The graph as `tierflow run --cuda-graphs` runs it, for the simulator: each capture segment one gpu op
    (one launch: the engine's cost per op, cpu.executor_op_us, is charged once by the simulator, and
    gpu.graph_launch_us once plus gpu.graph_op_us per captured op instead of gpu.op_overhead_us per compute
    op), its work its ops' work less their
    per-op overhead, its memory effects its ops' peak then what they leave (the pool), its dependencies its
    ops' from outside it. Every other op is as it was; ids are renumbered (a trace of this graph is per
    segment, not per op). Where the profile bounds a block by its kernel launches (compute.kernel_launch_us),
    that bound stays in the ops' work (a graph launches its kernels from the device: an over-estimate)."""
    plan = plan or capture_plan(graph)
    if not plan.segments:
        return graph
    tasks, over_s, g = graph.tasks, hw.gpu.op_overhead_s, hw.gpu
    new_id: dict[int, int] = {}
    out: list[Task] = []
    for t in tasks:
        si = plan.segment_of.get(t.id)
        if si is None:
            new_id[t.id] = len(out)
            out.append(Task(len(out), t.kind, t.resource, t.work, t.tensor, t.block, t.mb, t.iteration,
                            list(t.deps), t.key, list(t.mem_start), list(t.mem_end)))
            continue
        seg = plan.segments[si]
        if t.id != seg.ops[0]:
            new_id[t.id] = new_id[seg.ops[0]]
            continue
        new_id[t.id] = len(out)
        out.append(_merged(tasks, seg, len(out), over_s, g.graph_launch_s + g.graph_op_s * len(seg.ops)))
    for u in out:  # every dependency was an original id: now the new op that holds it
        u.deps = sorted({new_id[d] for d in u.deps if new_id[d] != u.id})
    return TaskGraph(out, dict(graph.static_bytes), dict(graph.capacity_bytes), graph.num_iterations,
                     graph.num_blocks, dict(graph.meta))


def _merged(tasks: list[Task], seg: Segment, new: int, over_s: float, launch_s: float) -> Task:
    first = tasks[seg.ops[0]]
    ops = set(seg.ops)
    work = launch_s + sum(max(0.0, tasks[op].work - over_s) for op in seg.ops)
    deps = sorted({d for op in seg.ops for d in tasks[op].deps if d not in ops})
    held: dict[int, float] = {}
    peak: dict[int, float] = {}
    for op in seg.ops:
        for effects in (tasks[op].mem_start, tasks[op].mem_end):
            for tier, b in effects:
                held[tier] = held.get(tier, 0.0) + b
                peak[tier] = max(peak.get(tier, 0.0), held[tier])
    start = [(tier, b) for tier, b in sorted(peak.items()) if b > 0]
    end = [(tier, held[tier] - peak.get(tier, 0.0)) for tier in sorted(held) if held[tier] != peak.get(tier)]
    return Task(new, first.kind, "gpu", work, first.tensor, first.block, first.mb, first.iteration, deps,
                first.key, start, end)
