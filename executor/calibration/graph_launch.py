"""The host cost of a CUDA graph replay (`gpu.graph_launch_us` per replay and `gpu.graph_op_us` per captured
op: what the simulator charges a captured segment instead of gpu.op_overhead_us per compute op,
planner/core/capture.py's `graphed_graph`), measured by the executor itself: calibrate's plan of tiny ops with
every tensor on the device (executor/calibration/op_costs.py) run with --cuda-graphs at two micro-batch
counts, so that its segments (one per iteration) have two sizes; each replayed segment's fixed cost is its
span in the trace (its ops share the first one's events) from the moment it could start, less its ops'
modelled work, and a line through the two sizes splits it into a cost per replay and one per captured op. On
CUDA the launch returns before its kernels run (the span holds the launch and what the kernels do not hide);
on the emulation a replay runs its recorded aten ops one by one in Python in the call, which the per-op term
carries. Where the backend has no graphs, or nothing was replayed, both are None with the reason.

On a device that is the host's CPU (the emulation) the fixed cost is counted in CPU seconds, as op_costs.py
counts an op's (`_graph_cpu_points`): the same plan runs eager and with graphs, alternating round by round;
a replayed segment's fixed cost is the graphed round's process CPU time less its eager ops' (their handlers'
CPU time and each the engine's share per op of the eager round, process CPU less handlers per op), per
segment, less its ops' work; per segment size the best round.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from tierflow.executor.calibration.op_costs import (
    CAL_MICRO_BATCHES,
    CAL_SEQS,
    ITERATIONS,
    CalRun,
    cal_graph,
    intercept_fit,
    load_cal_plan,
    run_rounds,
    work_s,
)
from tierflow.executor.device.base import DeviceBackend

GRAPH_MICRO_BATCHES = (2, CAL_MICRO_BATCHES)  # two segment sizes: a replay's fixed cost and its cost per op


def measure_graph_launch(hw, backend: Callable[[], DeviceBackend], rounds: int = 3,
                         seq: int = CAL_SEQS[0]) -> dict:
    """gpu.graph_launch_us and gpu.graph_op_us: the resident plan at `seq` tokens with graphs on, at
    GRAPH_MICRO_BATCHES micro-batches (segments of two sizes); each replayed segment's fixed cost, its span
    (its ops share the first one's events) less its ops' work from the moment it could start, or on a CPU
    device its CPU time (`_graph_cpu_points`); over the replays (the eager warm-up and the capture left out)
    the fit fixed = launch + per_op x ops."""
    be = backend()
    if be.device.type == "cpu" and be.streams_async and be.graph_pool() is not None:
        got = _graph_cpu_points(hw, backend, rounds, seq)
    else:
        got = _graph_span_points(hw, backend, rounds, seq)
    if isinstance(got, str):
        return {"graph_launch_us": None, "graph_op_us": None, "graph_launch_note": got}
    points, host, replays = got
    a, c = intercept_fit(points)
    return {"graph_launch_us": max(0.0, a) * 1e6, "graph_op_us": max(0.0, c) * 1e6,
            "graph_replays": replays, "graph_segment_ops": sorted({int(x) for x, _ in points}),
            "graph_launch_host_us": statistics.median(host) * 1e6}


def _graph_span_points(hw, backend, rounds: int, seq: int) -> tuple[list, list, int] | str:
    points: list[tuple[float, float]] = []
    host: list[float] = []
    for mbs in GRAPH_MICRO_BATCHES:
        got = _graph_spans(hw, backend, rounds, seq, mbs)
        if isinstance(got, str):
            return got
        points += got[0]
        host += got[1]
    return points, host, len(points)


def _graph_spans(hw, backend, rounds: int, seq: int, num_mb: int) -> tuple[list, list] | str:
    """(ops, fixed seconds) of every replayed segment and the runner's host seconds per replay; or why
    nothing was replayed."""
    from tierflow.planner.core.costmodel import link_rates

    be = backend()
    model, hw2, cfg = cal_graph(hw, "on_device", seq, num_mb, device_kind=be.device.type)
    plan = load_cal_plan(model, hw2, cfg)
    results, ex = run_rounds(plan, be, rounds, cuda_graphs=True)
    runner = ex.graph_runner
    if runner is None:
        return f"{be.name} has no CUDA graphs"
    if not runner.replay_host_s:
        return "no segment of the tiny plan was replayed (see the run's warnings)"
    tasks, rates = plan.graph.tasks, link_rates(hw2)
    points: list[tuple[float, float]] = []
    for r in results:
        start, end = r.start_s, r.end_s
        for seg in runner.capture.segments:
            first = tasks[seg.ops[0]]
            if first.iteration < 1 or seg.ops[-1] >= len(start):
                continue
            ops = set(seg.ops)
            deps = [end[d] for op in seg.ops for d in tasks[op].deps if d not in ops]
            prev = [end[u.id] for u in tasks if u.resource == "gpu" and u.id < first.id
                    and u.iteration == first.iteration and u.id not in ops]
            ready = max(deps + prev, default=start[first.id])
            work = sum(work_s(tasks[op], rates) for op in seg.ops)
            points.append((float(len(seg.ops)), max(end[op] for op in seg.ops) - ready - work))
    if not points:
        return "no replayed segment in the measured rounds"
    return points, list(runner.replay_host_s)


class _GraphCpuRun:
    """The plan of tiny ops at one micro-batch count, run eager and with graphs (a backend each)."""

    def __init__(self, hw, backend, seq: int, num_mb: int) -> None:
        from tierflow.planner.core.costmodel import link_rates

        be = backend()
        model, hw2, cfg = cal_graph(hw, "on_device", seq, num_mb, device_kind=be.device.type)
        plan = load_cal_plan(model, hw2, cfg)
        self.graphed, self.eager = CalRun(plan, be, cuda_graphs=True), CalRun(plan, backend())
        self.runner = self.graphed.ex.graph_runner
        tasks, rates = plan.graph.tasks, link_rates(hw2)
        self.segs = [] if self.runner is None else [s for s in self.runner.capture.segments
                                                    if s.iteration < ITERATIONS]
        self.work_s = sum(work_s(tasks[op], rates) for seg in self.segs for op in seg.ops)
        self.best_s: float | None = None

    def round(self, r: int) -> str:
        """One eager and one graphed round; the segment's fixed CPU seconds kept if the best; or why not."""
        e = self.eager.round_cpu(r)
        share = max(0.0, e.process_s - sum(e.handler_s.values())) / max(1, len(e.handler_s))
        before = len(self.runner.replay_host_s)
        g = self.graphed.round_cpu(r)
        if len(self.runner.replay_host_s) - before < len(self.segs):
            return "no segment of the tiny plan was replayed (see the run's warnings)"
        rest = g.process_s - sum(g.handler_s.values()) - share * len(g.handler_s)
        fixed = (rest - self.work_s) / len(self.segs)
        self.best_s = fixed if self.best_s is None else min(self.best_s, fixed)
        return ""


def _graph_cpu_points(hw, backend, rounds: int, seq: int) -> tuple[list, list, int] | str:
    """(ops, fixed CPU seconds) of the replayed segment of each size in its best round (see the module
    docstring), the runner's host seconds per replay and the replays; or why nothing was replayed. The
    sizes' runs alternate round by round."""
    runs = [_GraphCpuRun(hw, backend, seq, mbs) for mbs in GRAPH_MICRO_BATCHES]
    for run in runs:
        if run.runner is None:
            return "the backend has no CUDA graphs"
        if not run.segs:
            return "no segment of the tiny plan was captured (see the run's warnings)"
    for r in range(rounds):
        for run in runs:
            why = run.round(r)
            if why:
                return why
    points = [(float(len(run.segs[0].ops)), run.best_s) for run in runs]
    host = [x for run in runs for x in run.runner.replay_host_s]
    return points, host, sum(len(run.segs) for run in runs) * rounds
