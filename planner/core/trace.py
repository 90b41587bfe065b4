"""Timeline outputs of a simulation: CSV, Chrome trace event JSON (opens in Perfetto) and a Gantt chart PNG."""

from __future__ import annotations

import json
from pathlib import Path

from tierflow.planner.core.graph import RESOURCES, TIERS
from tierflow.planner.core.simulator import SimResult

KIND_COLORS = {
    "fwd": "#4C72B0", "recompute": "#8172B2", "bwd": "#55A868", "head": "#C44E52", "adam": "#DD8452",
    "adam_deferred": "#E5AE38", "adam_gpu": "#DD8452",
}
TENSOR_COLORS = {
    "weights": "#4C72B0", "checkpoint": "#8172B2", "act": "#64B5CD", "act_grad": "#8C8C8C", "grads": "#55A868",
    "opt_states": "#DD8452",
}
MAX_COUNTER_POINTS = 20000
MAX_FLOWS = 4000  # dependency arrows in trace.json (a 175B iteration has ~10^5 cross-resource edges)


def _color(kind: str, tensor: str) -> str:
    return KIND_COLORS.get(kind) or TENSOR_COLORS.get(tensor, "#999999")


def write_timeline_csv(res: SimResult, path: str | Path) -> None:
    res.timeline().to_csv(path, index=False)


def chrome_trace(res: SimResult, name: str = "tierflow") -> dict:
    """Chrome trace events: one thread (track) per resource, one counter track of bytes per memory tier."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": name}}]
    for i, r in enumerate(RESOURCES):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": r}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": i, "args": {"sort_index": i}})
    tid = {r: i for i, r in enumerate(RESOURCES)}
    for t in res.graph.tasks:
        s, e = float(res.start_s[t.id]), float(res.end_s[t.id])
        args = {"id": t.id, "kind": t.kind, "tensor": t.tensor, "block": t.block, "mb": t.mb, "iteration": t.iteration}
        args["bytes" if t.resource not in ("gpu", "cpu") else "work_s"] = t.work
        events.append({"name": t.label, "cat": t.kind, "ph": "X", "pid": 1, "tid": tid[t.resource],
                       "ts": s * 1e6, "dur": max(e - s, 0.0) * 1e6, "args": args})
    events += flow_events(res, tid)
    trace = res.memory_trace
    step = max(1, len(trace) // MAX_COUNTER_POINTS)
    for i in range(0, len(trace), step):
        time_s, *tiers = trace[i]
        events.append({"name": "memory_GB", "ph": "C", "pid": 1, "ts": time_s * 1e6,
                       "args": {tier: round(v / 1e9, 4) for tier, v in zip(TIERS, tiers)}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"tool": "tierflow", **res.to_dict()}}


def flow_events(res: SimResult, tid: dict[str, int], max_flows: int | None = None) -> list[dict]:
    """Chrome trace flow arrows ("ph": "s" / "f" pairs) for the dependencies between ops on different resources
    (the ones that make a resource wait for another; a resource's own order is its track). At most `max_flows`
    (default MAX_FLOWS):
    when there are more, those into the ops of the steady-state window first, in time order, so that the
    arrows stay readable in Perfetto for a whole 175B run. Each end point lies inside its op's slice (its
    midpoint), so a viewer binds it to that op."""
    max_flows = MAX_FLOWS if max_flows is None else max_flows
    tasks = res.graph.tasks
    start, end = res.start_s, res.end_s
    edges = [(d, t.id) for t in tasks for d in t.deps if tasks[d].resource != t.resource]
    if len(edges) > max_flows:
        w0, w1 = res.window_s
        edges.sort(key=lambda e: (not (w0 <= float(start[e[1]]) <= w1), float(start[e[1]])))
        edges = sorted(edges[:max_flows], key=lambda e: float(start[e[1]]))
    out = []
    for i, (src, dst) in enumerate(edges):
        for ph, op in (("s", src), ("f", dst)):
            mid_us = (float(start[op]) + float(end[op])) / 2 * 1e6
            ev = {"name": "dep", "cat": "dependency", "ph": ph, "id": i, "pid": 1, "tid": tid[tasks[op].resource],
                  "ts": mid_us}
            if ph == "f":
                ev["bp"] = "e"  # bind to the enclosing slice (the dependent op), not the next one
            out.append(ev)
    return out


def write_chrome_trace(res: SimResult, path: str | Path, name: str = "tierflow") -> None:
    Path(path).write_text(json.dumps(chrome_trace(res, name)))


def plot_gantt(res: SimResult, path: str | Path | None = None, title: str = "", window: tuple[float, float] | None = None,
               ax=None):
    """Gantt chart of every resource over `window` (default: the steady-state iteration), with memory per tier."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w0, w1 = window or res.window_s
    if ax is None:
        fig, (ax, axm) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    else:
        fig, axm = ax.figure, None
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for t in res.graph.tasks:
        s, e = float(res.start_s[t.id]), float(res.end_s[t.id])
        if e < w0 or s > w1 or e <= s:
            continue
        bars.setdefault((RESOURCES.index(t.resource), _color(t.kind, t.tensor)), []).append((s - w0, e - s))
    for (row, color), spans in bars.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, linewidth=0)
    ax.set_yticks(range(len(RESOURCES)))
    ax.set_yticklabels(RESOURCES)
    ax.invert_yaxis()
    ax.set_title(title or "simulated timeline (steady-state iteration)", loc="left", pad=40)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in list(KIND_COLORS.values())[:6] + list(TENSOR_COLORS.values())]
    labels = list(KIND_COLORS)[:6] + [f"{k} transfer" for k in TENSOR_COLORS]
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=6, frameon=False,
              borderaxespad=0.2)
    if axm is not None:
        import numpy as np

        tr = np.array(res.memory_trace)
        for i, tier in enumerate(TIERS):
            cap = res.graph.capacity_bytes[tier]
            axm.step(tr[:, 0] - w0, 100 * tr[:, i + 1] / cap if cap else 0 * tr[:, 0], where="post", label=tier)
        axm.set_ylabel("% of tier")
        axm.set_xlabel("seconds into the iteration")
        axm.set_ylim(0, 105)
        axm.set_xlim(0, w1 - w0)
        axm.legend(loc="upper right", fontsize=7)
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def write_outputs(res: SimResult, out_dir: str | Path, name: str = "tierflow") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timeline.csv", out / "trace.json", out / "gantt.png"]
    write_timeline_csv(res, paths[0])
    write_chrome_trace(res, paths[1], name)
    plot_gantt(res, paths[2], title=name)
    return paths
