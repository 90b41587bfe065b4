"""Timeline outputs of a simulation: CSV, Chrome trace event JSON (opens in Perfetto) and a Gantt chart
PNG."""

from __future__ import annotations

from pathlib import Path

from tierflow.outputs import atomic_path
from tierflow.planner.core.graph import TIERS
from tierflow.planner.core.jsonio import write_json
from tierflow.planner.core.opkinds import ADAM, ADAM_DEFERRED, ADAM_GPU, BWD, FWD, HEAD, RECOMPUTE
from tierflow.planner.core.simulator import SimResult, bytes_text

# Compute (gpu and cpu rows) in saturated colours, transfers (links) in a separate family of light tints drawn
# hatched, so that no op kind shares a colour with the tensor its transfers carry (forward vs weight fetch,
# ...).
KIND_COLORS = {
    FWD: "#1f5fbf", RECOMPUTE: "#7b2fbe", BWD: "#18893a", HEAD: "#d62728", ADAM: "#e6550d",
    ADAM_DEFERRED: "#c99a00", ADAM_GPU: "#e6550d",
}
TENSOR_COLORS = {
    "weights": "#80cdc1", "checkpoint": "#f1b6da", "act": "#d9d9d9", "act_grad": "#a3a3a3",
    "grads": "#c2e699", "opt_states": "#dfc27d",
}
TRANSFER_HATCH = "////"
ZOOM_LAYERS = 2  # the zoomed panel of gantt.png shows this many decoder layers' worth of forward time
MAX_COUNTER_POINTS = 20000
MAX_FLOWS = 4000  # dependency arrows in trace.json (a 175B iteration has ~10^5 cross-resource edges)


def op_color(kind: str, tensor: str) -> str:
    return KIND_COLORS.get(kind) or TENSOR_COLORS.get(tensor, "#999999")


def _is_compute(resource: str) -> bool:
    return resource in ("gpu", "cpu")


def write_timeline_csv(res: SimResult, path: str | Path) -> None:
    """The timeline as CSV, written atomically (tierflow.outputs)."""
    with atomic_path(path) as tmp:
        res.timeline().to_csv(tmp, index=False)


def chrome_trace(res: SimResult, name: str = "tierflow") -> dict:
    """Chrome trace events: one thread (track) per resource, one counter track of bytes per memory tier."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": name}}]
    resources = res.graph.resources()
    for i, r in enumerate(resources):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": r}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": i, "args": {"sort_index": i}})
    tid = {r: i for i, r in enumerate(resources)}
    for t in res.graph.tasks:
        s, e = float(res.start_s[t.id]), float(res.end_s[t.id])
        args = {"id": t.id, "kind": t.kind, "tensor": t.tensor, "block": t.block, "mb": t.mb,
                "iteration": t.iteration}
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
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tool": "tierflow", **res.to_dict()}}


def flow_events(res: SimResult, tid: dict[str, int], max_flows: int | None = None) -> list[dict]:
    """Chrome trace flow arrows ("ph": "s" / "f" pairs) for the dependencies between ops on different
    resources (the ones that make a resource wait for another; a resource's own order is its track). At most
    `max_flows` (default MAX_FLOWS):
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
            ev = {"name": "dep", "cat": "dependency", "ph": ph, "id": i, "pid": 1,
                  "tid": tid[tasks[op].resource], "ts": mid_us}
            if ph == "f":
                ev["bp"] = "e"  # bind to the enclosing slice (the dependent op), not the next one
            out.append(ev)
    return out


def write_chrome_trace(res: SimResult, path: str | Path, name: str = "tierflow") -> None:
    """The Chrome trace as JSON; gzip-compressed when the name ends in .gz (Perfetto opens both)."""
    write_json(path, chrome_trace(res, name))


def zoom_window(res: SimResult, layers: int = ZOOM_LAYERS) -> tuple[float, float]:
    """A window of `layers` decoder layers' worth of forward time inside the steady-state iteration: from the
    first forward step of the middle decoder layer, as long as that layer's forward steps (all micro-batches)
    take `layers` times over. (Over a whole large-model iteration every bar is thinner than a pixel.)"""
    w0, w1 = res.window_s
    mid = max(1, (res.graph.num_blocks - 1) // 2)
    fwd = [t.id for t in res.graph.tasks if t.kind == FWD and t.block == mid and t.resource == "gpu"
           and w0 <= float(res.start_s[t.id]) < w1]
    if not fwd:
        return w0, w1
    start = min(float(res.start_s[i]) for i in fwd)
    width = layers * sum(float(res.end_s[i] - res.start_s[i]) for i in fwd)
    return start, min(start + max(width, 1e-9), w1)


def _draw_bars(ax, res: SimResult, w0: float, w1: float, x0: float, edges: bool = False) -> None:
    """One row per resource: compute ops as solid bars, transfers as hatched light bars; x = time - x0. With
    `edges`, a thin white line between ops (for a zoom, where ops are wider than a pixel)."""
    import matplotlib.colors as mcolors

    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    row_of = {r: i for i, r in enumerate(res.graph.resources())}
    for t in res.graph.tasks:
        s, e = float(res.start_s[t.id]), float(res.end_s[t.id])
        if e < w0 or s > w1 or e <= s:
            continue
        key = (row_of[t.resource], op_color(t.kind, t.tensor), _is_compute(t.resource))
        bars.setdefault(key, []).append((s - x0, e - s))
    for (row, color, compute), spans in bars.items():
        if compute:
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, edgecolor="white",
                           linewidth=0.6 if edges else 0)
        else:
            dark = tuple(0.55 * c for c in mcolors.to_rgb(color))
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, edgecolor=dark, linewidth=0,
                           hatch=TRANSFER_HATCH)
            wide = [sp for sp in spans if sp[1] > (w1 - w0) / 200] if edges else []
            # the hatch takes the edge colour: the white outline is a second, unfilled pass (wide bars only)
            if wide:
                ax.broken_barh(wide, (row - 0.4, 0.8), facecolors="none", edgecolor="white", linewidth=0.6)
    resources = res.graph.resources()
    ax.set_yticks(range(len(resources)))
    ax.set_yticklabels(resources)
    ax.set_ylim(len(resources) - 0.5, -0.5)


def _legend(ax) -> None:
    import matplotlib.colors as mcolors
    from matplotlib.patches import Patch

    kinds = list(KIND_COLORS)[:6]
    handles = [Patch(facecolor=KIND_COLORS[k], label=k) for k in kinds]
    handles += [Patch(facecolor=c, edgecolor=tuple(0.55 * x for x in mcolors.to_rgb(c)), linewidth=0,
                      hatch=TRANSFER_HATCH, label=f"{k} transfer") for k, c in TENSOR_COLORS.items()]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=6, frameon=False,
              borderaxespad=0.2)


def plot_gantt(res: SimResult, path: str | Path | None = None, title: str = "",
               window: tuple[float, float] | None = None, ax=None, zoom: tuple[float, float] | None = None):
    """Gantt chart of every resource over `window` (default: the steady-state iteration); compute in saturated
    colours, transfers hatched in light tints. On a new figure (no `ax`) also a zoomed panel over `zoom`
    (default `zoom_window`: two decoder layers' worth of time, shaded in the full chart) and the memory per
    tier. With `ax`, only the chart over `window`, drawn into that axes."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w0, w1 = window or res.window_s
    if ax is not None:
        _draw_bars(ax, res, w0, w1, w0)
        ax.set_title(title or "simulated timeline", loc="left", pad=40)
        _legend(ax)
        return ax.figure
    fig, (ax, axz, axm) = plt.subplots(3, 1, figsize=(13, 9.5), gridspec_kw={"height_ratios": [3, 3, 1.3]})
    _draw_bars(ax, res, w0, w1, w0)
    ax.set_xlim(0, w1 - w0)
    ax.set_title(title or "simulated timeline (steady-state iteration)", loc="left", pad=40)
    _legend(ax)
    z0, z1 = zoom or zoom_window(res)
    ax.axvspan(z0 - w0, z1 - w0, color="#ffd54f", alpha=0.35, zorder=0, linewidth=0)
    _draw_bars(axz, res, z0, z1, w0, edges=True)
    axz.set_xlim(z0 - w0, z1 - w0)
    what = "" if zoom else (f" ({ZOOM_LAYERS} layers' worth of forward time from the middle layer's first "
                            "forward)")
    axz.set_title(f"zoom: {z0 - w0:,.3g} s to {z1 - w0:,.3g} s{what}, shaded above", loc="left", fontsize=9)
    axz.set_xlabel("seconds into the iteration")
    import numpy as np

    tr = np.array(res.memory_trace)
    top = 0.0
    for i, tier in enumerate(TIERS):
        cap = res.graph.capacity_bytes[tier]
        pct = 100 * tr[:, i + 1] / cap if cap else 0 * tr[:, 0]
        top = max(top, float(pct.max(initial=0.0)))
        axm.step(tr[:, 0] - w0, pct, where="post",
                 label=f"{tier}: peak {bytes_text(float(tr[:, i + 1].max(initial=0.0)))} of "
                       f"{bytes_text(cap)}")
    axm.set_ylabel("% of tier")
    axm.set_xlabel("seconds into the iteration")
    # scaled to the fullest tier, so that a run using a sliver of a big box (a tiny model on a CPU "device")
    # still shows when memory is taken and freed; the legend gives each tier's peak and capacity
    axm.set_ylim(0, 105 if top > 50 else max(top * 1.15, 1e-6))
    axm.set_xlim(0, w1 - w0)
    axm.legend(loc="upper right", fontsize=7)
    if path is not None:
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
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
