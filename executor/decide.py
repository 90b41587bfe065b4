"""`tierflow run --adapt`'s decision (no torch: it runs in a child process beside training).

The measured op times of the warm-up are compared with the plan's prediction per resource (each resource's
busy time, and the iteration). Where a resource or the iteration is off by more than the threshold, the fields
of the profile those resources exercise are fitted from the measured trace
(tierflow.planner.fit.trace_fit), the planner searches again on the refit profile (same model, batch and
sequence length; the memory caps are the profile's, which the fit leaves alone), and the old plan is
simulated on the refit profile too. The new plan is switched to if it is predicted faster by more than the
margin. `decide_in_child` is the same, niced, for a process of its own (tierflow.executor.adapt starts it at
the warm-up's end and keeps training under the old plan meanwhile).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from tierflow.executor.options import AdaptOptions
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.fit.trace_fit import (
    ITERATION,
    default_fields,
    fit_trace,
    iteration_seconds,
    observations,
    with_tied,
)
from tierflow.planner.io.planfile import simulate_plan
from tierflow.planner.io.planning import PlanOptions, make_plan

# which fields each resource's ops measure (trace_fit.default_fields keeps those the plan exercises)
RESOURCE_FIELDS = {
    "gpu": ("gpu.",), "h2d": ("pcie.h2d", "pcie.latency"), "d2h": ("pcie.d2h", "pcie.latency"),
    "ssd_read": ("ssd.read", "ssd.latency", "ssd.mixed"),
    "ssd_write": ("ssd.write", "ssd.latency", "ssd.mixed"),
    "cpu": ("cpu.adam",),
}
SLOWDOWN_PREFIX = "cpu."  # the interference factors: refit whenever compute and a host link are both off


@dataclass
class Decision:
    step: int
    measured_iteration_s: float
    predicted_iteration_s: float
    resources: dict[str, float]  # measured / predicted busy time per resource
    refit: dict[str, list[float | None]] = field(default_factory=dict)  # field -> [base, fitted]
    old_plan: str = ""
    new_plan: str = ""
    old_predicted_s: float | None = None  # the old plan on the refit profile
    new_predicted_s: float | None = None
    switched: bool = False
    reason: str = ""
    decide_s: float | None = None  # the comparison, the refit and the re-plan (in the child: its own time)
    # the step boundary the decision took effect at (the first after it arrived; == step with wait), None:
    # the run ended before it arrived
    effective_step: int | None = None
    steps_while_deciding: int = 0  # steps trained under the old plan while the decision was under way
    # the switch's cost: the seconds from the old plan's last step to the new plan's first (wall time outside
    # the steps: the checkpoint at the switch, the old run's end, the new run's start and resume); its parts
    switch_s: float | None = None
    switch_parts: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        res = ", ".join(f"{r} {v - 1:+.0%}" for r, v in self.resources.items())
        when = f"adapt at step {self.step}"
        if self.effective_step != self.step:
            when += (f" (took effect at step {self.effective_step})" if self.effective_step is not None
                     else " (arrived after the last step)")
        head = (f"{when}: measured {fmt_s(self.measured_iteration_s, sig=4)}/iteration vs "
                f"predicted {fmt_s(self.predicted_iteration_s, sig=4)} ({self.error:+.0%}; {res})")
        if not self.refit:
            return f"{head}; {self.reason}"
        fit = ", ".join(f"{k} {_g(a)} -> {_g(b)}" for k, (a, b) in self.refit.items())
        gain = (f"old plan {self.old_plan} predicted {fmt_s(self.old_predicted_s, sig=4)} on the refit "
                f"profile, new plan {self.new_plan} {fmt_s(self.new_predicted_s, sig=4)} "
                f"({self.gain:+.0%})") if self.new_predicted_s else ""
        why = f"{self.reason} at step {self.effective_step}" if self.switched else self.reason
        return f"{head}; refit {fit}; {gain}; {why}"

    @property
    def error(self) -> float:
        return self.measured_iteration_s / self.predicted_iteration_s - 1.0

    @property
    def gain(self) -> float:
        """Predicted fraction of the old plan's iteration time the new plan saves (on the refit profile)."""
        if not self.new_predicted_s or not self.old_predicted_s:
            return 0.0
        return 1.0 - self.new_predicted_s / self.old_predicted_s


def _g(v: float | None) -> str:
    return "unset" if v is None else f"{v:.4g}"


def compare_resources(plan: Plan, start_s: np.ndarray, end_s: np.ndarray) -> tuple[float, float,
                                                                                   dict[str, float]]:
    """(measured, predicted iteration seconds, {resource: measured / predicted busy seconds}) over the
    iterations the trace holds (the first one left out when there are more)."""
    obs, ref = observations(plan, start_s, end_s, "the run")
    pred = simulate_plan(plan)
    pdur = pred.end_s - pred.start_s
    tasks = plan.graph.tasks
    busy: dict[str, list[float]] = {}
    measured_it = next(o.measured for o in obs if o.group == ITERATION)
    for o in obs:
        if o.group == ITERATION:
            continue
        r = busy.setdefault(tasks[o.ops[0]].resource, [0.0, 0.0])
        r[0] += o.measured
        r[1] += float(np.sum(pdur[list(o.ops)]))
    predicted_it = iteration_seconds(ref, tasks, pred.end_s)
    return measured_it, predicted_it, {r: m / p for r, (m, p) in sorted(busy.items()) if p > 0}


def fields_for(plan: Plan, hw: HardwareProfile, off: list[str]) -> list:
    """The default fields of the resources in `off` (and the interference factors when compute and a link
    are both off on a host device)."""
    prefixes = tuple(p for r in off for p in RESOURCE_FIELDS.get(r, ()))
    links = any(r in off for r in ("h2d", "d2h", "ssd_read", "ssd_write"))
    out = []
    for f in default_fields(plan, hw):
        slowdown = "slowdown" in f.key
        if (slowdown and links and "gpu" in off) or (not slowdown and f.key.startswith(prefixes)):
            out.append(f)
    return out


def replan_options(plan: Plan, opts: AdaptOptions) -> PlanOptions:
    """The planning options of the re-plan: `tierflow plan`'s for the plan's world, the run's clipping and
    the re-plan's time limit. The optimizer-state format is the plan's (the model's): the run's states are
    in it."""
    cfg = plan.config
    return PlanOptions(time_limit_s=opts.time_limit_s, allow_ssd=opts.allow_ssd, clip=opts.clip,
                       gpus=cfg.gpus, nodes=cfg.nodes)


def replan(plan: Plan, hw: HardwareProfile, options: PlanOptions) -> Plan:
    """The plan `tierflow plan` makes with `options` for the same model, batch and sequence length on `hw`
    (the one planning function, tierflow.planner.io.planning)."""
    cfg = plan.config
    return make_plan(plan.model, hw, cfg.batch, cfg.seq, options).plan()


def _per_op(plan: Plan, measured) -> tuple[np.ndarray, np.ndarray]:
    """The measured start and end seconds per op id of the plan, NaN for the ops of iterations the measured
    round did not run (it covers the plan's first ops)."""
    n = len(plan.graph.tasks)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    k = len(measured.start_s)
    start[:k], end[:k] = measured.start_s, measured.end_s
    return start, end


def compare(plan: Plan, measured: SimResult, step: int, opts: AdaptOptions) -> tuple[Decision, list[str]]:
    """The comparison at `step` (a simulation of the plan: cheap, done where training runs): the decision so
    far and the resources off by more than the threshold ([] with the decision taken: keep the plan)."""
    start_s, end_s = _per_op(plan, measured)
    measured_it, predicted_it, ratios = compare_resources(plan, start_s, end_s)
    d = Decision(step, measured_it, predicted_it, ratios, old_plan=plan.config.describe())
    off = [r for r, v in ratios.items() if abs(v - 1) > opts.threshold]
    if abs(d.error) <= opts.threshold and not off:
        d.reason = f"within {opts.threshold:.0%}: keeping the plan"
        return d, []
    return d, off or list(ratios)


def refit_replan(plan: Plan, measured: SimResult, d: Decision, off: list[str],
                 opts: AdaptOptions) -> tuple[Decision, Plan | None]:
    """The fields of the resources `off` fitted from the trace, the plan searched again on the refit profile:
    (the decision, the plan to switch to or None)."""
    t0 = time.perf_counter()
    hw = plan.hardware
    fields = fields_for(plan, hw, off)
    if not fields:
        d.reason = "no profile field to refit for the resources that are off: keeping the plan"
        return d, None
    start_s, end_s = _per_op(plan, measured)
    fit = fit_trace(plan, start_s, end_s, hw, fields, source="the run's warm-up",
                    max_evals=opts.fit_evaluations)
    tied = with_tied(fit, hw)  # the duplex rates moved with their solo rates: the refit profile is valid
    refit = hw.with_overrides(tied.values)
    d.refit = {k: [tied.initial[k], v] for k, v in tied.values.items()}
    new = replan(plan, refit, replan_options(plan, opts))
    d.old_predicted_s = simulate_config(plan.model, refit, plan.config).iteration_s
    d.new_predicted_s = float(new.predicted["iteration_s"])
    d.new_plan = new.config.describe()
    d.decide_s = time.perf_counter() - t0
    if d.gain > opts.margin and new.config != plan.config:
        d.switched, d.reason = True, "switching"
        return d, new
    d.reason = f"predicted gain {d.gain:+.0%} within the margin {opts.margin:.0%}: keeping the plan"
    return d, None


def decide(plan: Plan, measured: SimResult, step: int, opts: AdaptOptions) -> tuple[Decision, Plan | None]:
    """The whole decision on the warm-up's measured trace (taken at `step`), here: (what was decided, the
    plan to switch to or None)."""
    d, off = compare(plan, measured, step, opts)
    if not off:
        return d, None
    return refit_replan(plan, measured, d, off, opts)


def refit_in_child(conn, plan: Plan, measured: SimResult, d: Decision, off: list[str],
                   opts: AdaptOptions) -> None:
    """`refit_replan` in a process beside training (niced, so that the steps keep the cores they need); sends
    ("ok", (decision, plan or None)) or ("error", message) on `conn`."""
    try:
        os.nice(10)
    except OSError:  # not allowed here: the same priority
        pass
    try:
        conn.send(("ok", refit_replan(plan, measured, d, off, opts)))
    except Exception as e:  # noqa: BLE001 - the parent reports it in one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
