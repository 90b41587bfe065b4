"""Predicted vs measured: a plan's simulated times against a trace measured by the executor (`tierflow run
--out`), op by op, summed per op kind and per resource, and the overall iteration time. Works without PyTorch.

The measured trace is the Chrome trace JSON the executor writes (the simulator's own format): one complete
event ("ph": "X") per executed op with the op's id in ``args.id``. Only ops present in both are compared; the
measured run may cover fewer iterations than the plan (a short run), in which case the predicted side is
restricted to the same iterations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.hwprofiles.inputs import GIB, reading
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.graph import LINKS
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.io.planfile import PlanError, simulate_plan
from tierflow.planner.io.tracestream import MAX_VALUE_BYTES, iter_trace


class TraceError(TierflowError, ValueError):
    """A measured trace that cannot be compared with the plan."""


MAX_TRACE_BYTES = 2 * GIB  # the executor writes ~250 bytes per op


def _event_times_s(p: Path, index: int, ev: dict, oid: int) -> tuple[float, float]:
    """(start, end) in seconds of a complete event; refuses what no measurement gives (a negative or
    non-finite time), naming the event."""
    ts, dur = ev.get("ts"), ev.get("dur")
    for key, v in (("ts", ts), ("dur", dur)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise TraceError(f"{p}: traceEvents[{index}] (op {oid}, {ev.get('name', '?')}): {key} {v!r} is "
                             "not a non-negative number of microseconds (pass the trace.json written by "
                             "`tierflow run --out`)")
    return ts / 1e6, (ts + dur) / 1e6


@dataclass
class Comparison:
    by_kind: list[dict]  # kind, resource, ops, predicted_s, measured_s, ratio
    by_resource: list[dict]  # resource, predicted_busy_s, measured_busy_s, ratio
    predicted_iteration_s: float
    measured_iteration_s: float
    iterations: int
    ops: int
    predicted: SimResult
    measured_start_s: np.ndarray
    measured_end_s: np.ndarray
    measured_device_memory: dict | None = None  # the device allocator's peaks in the trace (CUDA, emulation)
    measured_on: dict | None = None  # the device the trace was measured on (otherData.measured_on)
    other_box: str | None = None  # why the plan's profile is not that device (box_mismatch), None: it is

    @property
    def iteration_error(self) -> float:
        return self.measured_iteration_s / self.predicted_iteration_s - 1.0

    def to_dict(self) -> dict:
        return {"predicted_iteration_s": self.predicted_iteration_s,
                "measured_iteration_s": self.measured_iteration_s,
                "iteration_error": self.iteration_error, "iterations": self.iterations, "ops": self.ops,
                "by_kind": self.by_kind, "by_resource": self.by_resource,
                "predicted_gpu_peak_bytes": self.predicted.peak_bytes.get("gpu"),
                "gpu_capacity_bytes": self.predicted.graph.capacity_bytes.get("gpu"),
                "measured_device_memory": self.measured_device_memory, "measured_on": self.measured_on,
                "other_box": self.other_box}


def load_measured(path: str | Path, n_ops: int, plan: Plan | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(start_s, end_s) per op id from a Chrome trace; NaN for ops the trace does not hold."""
    start, end, _ = load_measured_trace(path, n_ops, plan)
    return start, end


def _op_event(p: Path, ev: object, n_ops: int) -> int | None:
    """The op id of a complete event ("ph": "X" with an integer args.id), None for any other event."""
    if not isinstance(ev, dict) or ev.get("ph") != "X":
        return None
    oid = (ev.get("args") or {}).get("id")
    if not isinstance(oid, int):
        return None
    if not 0 <= oid < n_ops:
        raise TraceError(f"{p}: op id {oid} is not in the plan (0..{n_ops - 1}); trace of another plan?")
    return oid


def load_measured_trace(path: str | Path, n_ops: int,
                        plan: Plan | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """load_measured, and what the trace says of its run: {"device_memory": the device memory the executor
    measured (otherData.measured_device_memory) or None, "measured_on": the device it ran on or None}, read
    an event at a time (planner/io/tracestream.py). With `plan`: TraceError when the trace says it ran
    another optimizer-state format (otherData.optimizer_states; a trace that does not say is taken as it
    is)."""
    p = Path(path)
    others: dict = {}
    first: list = []  # the first events: an older trace's device is in its process name (_measured_on)
    start, end = np.full(n_ops, np.nan), np.full(n_ops, np.nan)
    found = 0
    try:
        with reading(str(p), f"one event of at most {MAX_VALUE_BYTES >> 20} MiB at a time"):
            for index, ev in enumerate(iter_trace(p, MAX_TRACE_BYTES, others)):
                if index < 4:
                    first.append(ev)
                oid = _op_event(p, ev, n_ops)
                if oid is not None:
                    start[oid], end[oid] = _event_times_s(p, index, ev, oid)
                    found += 1
    except (OSError, ValueError) as e:  # also InputLimitError: not a regular file, too large, nested too deep
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{p}: cannot read a trace ({e}); pass the trace.json written by `tierflow run "
                         "--out`") from None
    if not isinstance(others.get("traceEvents"), list):
        raise TraceError(f"{p}: no traceEvents list; pass the trace.json written by `tierflow run --out`")
    if plan is not None:
        check_trace_states(p, others.get("otherData"), plan)
    if not found:
        raise TraceError(f"{p}: no op events with args.id; pass the trace.json written by `tierflow run "
                         "--out`")
    d = others
    mem = (d.get("otherData") or {}).get("measured_device_memory")
    if not (isinstance(mem, dict) and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
                                          for v in mem.values())):
        mem = None
    return start, end, {"device_memory": mem, "measured_on": _measured_on(d, first)}


def _measured_on(d: dict, events: list) -> dict | None:
    """The device a trace was measured on: otherData.measured_on, or for a trace written before it, the
    device the process name gives ("tiny-gpt: measured (cpu)")."""
    on = (d.get("otherData") or {}).get("measured_on")
    if isinstance(on, dict) and isinstance(on.get("device_type"), str):
        return on
    for ev in events[:4]:
        name = ((ev.get("args") or {}).get("name") if isinstance(ev, dict) else None) or ""
        m = re.search(r": measured \((cpu|cuda)\S*\)$", str(name))
        if m:
            return {"device_type": m.group(1)}
    return None


def _model_tokens(text: str) -> set[str]:
    """The words of a device name that carry a digit ("RTX 4090" -> {"4090"}, "NVIDIA H200" -> {"h200"})."""
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if any(c.isdigit() for c in w)}


def box_mismatch(hw: HardwareProfile, measured_on: dict | None) -> str | None:
    """Why the plan's profile does not describe the device a trace was measured on (a bundled GPU box's plan
    run on this CPU, a CPU profile's plan run on a GPU, another GPU), with what to do; None when it does or
    the trace does not say."""
    if not measured_on:
        return None
    kind, name = measured_on.get("device_type"), measured_on.get("device_name") or ""
    cpu_profile = hw.gpu.host_cores is not None  # a calibrated CPU device (tierflow calibrate --device cpu)
    if kind == "cpu" and not cpu_profile:
        why = f"the plan's profile {hw.name} models a GPU ({hw.gpu.model}) and this trace ran on the CPU"
    elif kind == "cuda" and cpu_profile:
        why = f"the plan's profile {hw.name} models a CPU device and this trace ran on {name or 'a GPU'}"
    elif kind == "cuda" and name and not _model_tokens(hw.gpu.model) & _model_tokens(name):
        why = f"the plan's profile {hw.name} models a GPU ({hw.gpu.model}) and this trace ran on {name}"
    else:
        return None
    return (f"{why}: the prediction is for that box, not this one; measure this one with `tierflow calibrate "
            f"-o box.yaml --device {kind}` and plan again with `--hw box.yaml`")


def check_trace_states(path: Path, other: object, plan: Plan) -> None:
    """TraceError, one line naming both formats, when the trace's run kept its optimizer states in another
    format than `plan` (the optimizer ops' bytes and times differ: a fit or a comparison would be wrong)."""
    ran = other.get("optimizer_states") if isinstance(other, dict) else None
    want = plan.model.optimizer_states or "fp32"
    if isinstance(ran, str) and ran != want:
        raise TraceError(f"{path}: a trace of a run with {ran} optimizer states, but the plan keeps them in "
                         f"{want}: pass the plan the trace was measured with, or measure this one (tierflow "
                         "run PLAN --out DIR)")


def compare(plan: Plan, trace_path: str | Path) -> Comparison:
    pred = simulate_plan(plan)
    tasks = plan.graph.tasks
    ms, me, meta = load_measured_trace(trace_path, len(tasks), plan)
    ran = ~np.isnan(ms)
    iters = int(max(t.iteration for t, r in zip(tasks, ran) if r)) + 1
    for t, r in zip(tasks, ran):
        if t.iteration < iters and not r:
            raise TraceError(f"{trace_path}: op {t.id} ({t.label}) of iteration {t.iteration} is missing; "
                             "trace of another plan, or an interrupted run?")
    mask = np.array([t.iteration < iters for t in tasks])
    pdur = pred.end_s - pred.start_s
    mdur = me - ms
    rows: dict[tuple[str, str], list[float]] = {}
    for t in tasks:
        if mask[t.id]:
            r = rows.setdefault((t.kind, t.resource), [0, 0.0, 0.0, 0.0])
            r[0] += 1
            r[1] += float(pdur[t.id])
            r[2] += float(mdur[t.id])
            r[3] += t.work if t.resource in LINKS else 0.0  # a link op's work is its bytes
    by_kind = [{"kind": k, "resource": res, "ops": n, "predicted_s": p, "measured_s": m,
                "ratio": m / p if p > 0 else float("nan"), **_link_rates(res, nbytes, p, m)}
               for (k, res), (n, p, m, nbytes) in sorted(rows.items())]
    rows = {key: r[:3] for key, r in rows.items()}
    res_rows: dict[str, list[float]] = {}
    for (_k, res), (_n, p, m) in rows.items():
        r = res_rows.setdefault(res, [0.0, 0.0])
        r[0] += p
        r[1] += m
    by_resource = [{"resource": res, "predicted_busy_s": p, "measured_busy_s": m,
                    "ratio": m / p if p > 0 else float("nan")} for res, (p, m) in sorted(res_rows.items())]
    # one iteration: predicted steady state vs the measured run's time per iteration (whole run / iterations,
    # or the same steady-state definition when it ran at least 3)
    gpu = np.array([t.resource == "gpu" for t in tasks]) & mask
    its = np.array([t.iteration for t in tasks])
    ends = [float(np.nanmax(me[gpu & (its == i)])) for i in range(iters)]
    measured_it = ends[-2] - ends[-3] if iters >= 3 else ends[-1] / iters
    pred_it = pred.iteration_s if iters >= 3 or plan.graph.num_iterations == 1 else \
        float(np.max(pred.end_s[gpu])) / iters
    on = meta["measured_on"]
    return Comparison(by_kind, by_resource, pred_it, measured_it, iters, int(mask.sum()), pred, ms, me,
                      meta["device_memory"], on, box_mismatch(plan.hardware, on))


def _link_rates(resource: str, nbytes: float, predicted_s: float, measured_s: float) -> dict:
    """A link op kind's bytes and the rates it moved them at (GB/s of its op time), predicted and measured;
    compute kinds get None."""
    if resource not in LINKS:
        return {"bytes": None, "predicted_gbps": None, "measured_gbps": None}
    return {"bytes": nbytes, "predicted_gbps": nbytes / predicted_s / 1e9 if predicted_s > 0 else None,
            "measured_gbps": nbytes / measured_s / 1e9 if measured_s > 0 else None}


def format_comparison(c: Comparison) -> str:
    lines = [f"{c.ops} ops over {c.iterations} iteration(s)",
             f"iteration time: predicted {fmt_s(c.predicted_iteration_s, 3, sig=4)}, measured "
             f"{fmt_s(c.measured_iteration_s, 3, sig=4)} ({c.iteration_error:+.1%})",
             *([f"note: {c.other_box}"] if c.other_box else []), "",
             f"{'kind':<22} {'resource':<10} {'ops':>5} {'predicted ms':>13} {'measured ms':>12} "
             f"{'ratio':>8} {'GB/s pred / meas':>17}"]
    for r in c.by_kind:
        rates = (f"{r['predicted_gbps'] or 0:>8,.2f} / {r['measured_gbps'] or 0:,.2f}"
                 if r.get("bytes") is not None else "")
        lines.append(f"{r['kind']:<22} {r['resource']:<10} {r['ops']:>5} {r['predicted_s'] * 1e3:>13,.3f} "
                     f"{r['measured_s'] * 1e3:>12,.3f} {r['ratio']:>7.2f}x {rates}".rstrip())
    lines += ["", f"{'resource':<10} {'predicted busy ms':>18} {'measured busy ms':>17} {'ratio':>8}"]
    for r in c.by_resource:
        lines.append(f"{r['resource']:<10} {r['predicted_busy_s'] * 1e3:>18,.3f} "
                     f"{r['measured_busy_s'] * 1e3:>17,.3f} {r['ratio']:>7.2f}x")
    peak, cap = c.predicted.peak_bytes.get("gpu", 0.0), c.predicted.graph.capacity_bytes.get("gpu", 0.0)
    m = c.measured_device_memory
    lines += ["", f"gpu memory: plan peak {peak / 1e6:,.1f} MB of {cap / 1e6:,.1f} MB; " + (
        f"measured max allocated {m.get('max_allocated_bytes', 0) / 1e6:,.1f} MB "
        f"({m.get('max_allocated_bytes', 0) / peak - 1 if peak else 0:+.1%}), "
        f"max reserved {m.get('max_reserved_bytes', 0) / 1e6:,.1f} MB" if m else
        "not measured (a CPU device: the trace's peaks are the plan's own memory effects)")]
    return "\n".join(lines)


def comparison_figure(c: Comparison):
    """Predicted and measured timelines on one shared time axis (a Gantt row per resource each, coloured by op
    kind, with a legend), and measured / predicted time per op kind as bars (1 = as predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from tierflow.planner.core.trace import op_color

    fig, axes = plt.subplots(3, 1, figsize=(13, 9), gridspec_kw={"height_ratios": [3, 3, 2]})
    tasks = c.predicted.graph.tasks
    RESOURCES = c.predicted.graph.resources()  # noqa: N806  (less `net` for one rank)
    legend: dict[str, str] = {}
    t_max = 0.0
    panels = [(c.predicted.start_s, c.predicted.end_s, "predicted (simulator)"),
              (c.measured_start_s, c.measured_end_s, "measured (executor)")]
    for ax, (start, end, title) in zip(axes[:2], panels):
        bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for t in tasks:
            if t.iteration >= c.iterations or np.isnan(start[t.id]):
                continue
            s, e = float(start[t.id]), float(end[t.id])
            color = op_color(t.kind, t.tensor)
            legend.setdefault(t.kind, color)
            t_max = max(t_max, e)
            bars.setdefault((RESOURCES.index(t.resource), color), []).append((s, max(e - s, 0.0)))
        for (row, color), spans in bars.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=color, linewidth=0)
        ax.set_yticks(range(len(RESOURCES)))
        ax.set_yticklabels(RESOURCES)
        ax.invert_yaxis()
        ax.set_title(title, loc="left")
    for ax in axes[:2]:  # one time axis for both: the longer timeline sets it
        ax.set_xlim(0, t_max * 1.01 if t_max > 0 else 1.0)
    axes[1].set_xlabel("seconds")
    axes[0].legend(handles=[Patch(color=col, label=k) for k, col in sorted(legend.items())], fontsize=7,
                   loc="upper left", bbox_to_anchor=(1.005, 1.0), title="op kind", title_fontsize=7)
    kinds = [r for r in c.by_kind if r["predicted_s"] > 0]
    ratio_ax = axes[2]
    ratio_ax.bar(range(len(kinds)), [r["measured_s"] / r["predicted_s"] for r in kinds],
                 color=[legend.get(r["kind"], "#999999") for r in kinds])
    ratio_ax.axhline(1.0, color="black", lw=1)
    ratio_ax.set_xticks(range(len(kinds)), [r["kind"] for r in kinds], rotation=30, ha="right", fontsize=7)
    ratio_ax.set_ylabel("measured / predicted")
    ratio_ax.set_title(f"per op kind (iteration: {c.iteration_error:+.1%})", loc="left")
    fig.tight_layout()
    return fig


def plot_comparison(c: Comparison, path: str | Path) -> None:
    """Write `comparison_figure` to `path`."""
    fig = comparison_figure(c)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["Comparison", "TraceError", "compare", "comparison_figure", "format_comparison", "load_measured",
           "plot_comparison", "PlanError"]
