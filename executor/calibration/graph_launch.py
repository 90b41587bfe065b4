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
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from tierflow.executor.calibration.op_costs import (
    CAL_MICRO_BATCHES,
    CAL_SEQS,
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
    GRAPH_MICRO_BATCHES micro-batches (segments of two sizes); each replayed segment's span (its ops share the
    first one's events) less its ops' work, from the moment it could start; over the replays (the eager
    warm-up and the capture left out) the fit fixed = launch + per_op x ops."""
    points: list[tuple[float, float]] = []
    host: list[float] = []
    for mbs in GRAPH_MICRO_BATCHES:
        got = _graph_spans(hw, backend, rounds, seq, mbs)
        if isinstance(got, str):
            return {"graph_launch_us": None, "graph_op_us": None, "graph_launch_note": got}
        points += got[0]
        host += got[1]
    a, c = intercept_fit(points)
    return {"graph_launch_us": max(0.0, a) * 1e6, "graph_op_us": max(0.0, c) * 1e6,
            "graph_replays": len(points), "graph_segment_ops": sorted({int(x) for x, _ in points}),
            "graph_launch_host_us": statistics.median(host) * 1e6}


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
