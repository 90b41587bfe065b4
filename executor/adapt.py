"""`tierflow run --adapt`: a run that corrects its own plan.

After `warmup` steps under the given plan (ended by a checkpoint), the measured op times are compared with
the plan's prediction per resource (each resource's busy time, and the iteration). Where a resource or the
iteration is off by more than `threshold`, the fields of the profile those resources exercise are fitted
from the measured trace (tierflow.planner.search.trace_fit), the planner searches again on the refit profile
(same model, batch and sequence length; the memory caps are the profile's, which the fit leaves alone), and
the old plan is simulated on the refit profile too. If the new plan is predicted faster by more than
`margin`, the run switches at that step boundary: the checkpoint is resumed under the new plan, which moves
every tensor class to its new tier (tierflow.executor.checkpoint), and training continues to `--steps`.
Otherwise it continues under the old plan from the same checkpoint. One line per decision; the decisions are
in `--json` and in `DIR/adapt.json` with `--out`.

Several ranks (`--nproc N`, or torchrun): every rank warms up, rank 0 decides from its own trace and
broadcasts the decision and the new plan, and every rank resumes the sharded checkpoint under it at the same
step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierflow.executor.checkpoint import candidates, read_manifest
from tierflow.executor.device.factory import make_backend
from tierflow.executor.dist import init_world, rank_device
from tierflow.executor.run import (
    RunOptions,
    RunResult,
    RunStopped,
    check_run_outputs,
    cmd_run,
    leave_world,
    run_options,
    run_plan,
    train_hyper,
    write_run_outputs,
)
from tierflow.executor.tiers.state import StateError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.io.planfile import Plan, load_plan, plan_from_graph, simulate_plan, write_plan
from tierflow.planner.search.trace_fit import (
    ITERATION,
    default_fields,
    fit_trace,
    iteration_seconds,
    observations,
    with_tied,
)

# which fields each resource's ops measure (trace_fit.default_fields keeps those the plan exercises)
RESOURCE_FIELDS = {
    "gpu": ("gpu.",), "h2d": ("pcie.h2d", "pcie.latency"), "d2h": ("pcie.d2h", "pcie.latency"),
    "ssd_read": ("ssd.read", "ssd.latency", "ssd.mixed"),
    "ssd_write": ("ssd.write", "ssd.latency", "ssd.mixed"),
    "cpu": ("cpu.adam",),
}
SLOWDOWN_PREFIX = "cpu."  # the interference factors: refit whenever compute and a host link are both off


@dataclass
class AdaptOptions:
    warmup: int = 3  # steps before the comparison
    threshold: float = 0.10  # measured vs predicted beyond this: refit and re-plan
    margin: float = 0.05  # the new plan must be predicted faster by more than this
    time_limit_s: float = 30.0  # the re-plan's search
    fit_evaluations: int = 800  # the refit's budget of objective evaluations (one simulation each)


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
    decide_s: float | None = None  # the comparison, the refit and the re-plan
    # decide_s and the restart under the chosen plan: the time between the warm-up's last step and the next
    # step, and the end of the run (an upper bound of the switch's cost)
    switch_s: float | None = None

    def line(self) -> str:
        res = ", ".join(f"{r} {v - 1:+.0%}" for r, v in self.resources.items())
        head = (f"adapt at step {self.step}: measured {self.measured_iteration_s * 1e3:,.1f} ms/iteration vs "
                f"predicted {self.predicted_iteration_s * 1e3:,.1f} ms ({self.error:+.0%}; {res})")
        if not self.refit:
            return f"{head}; {self.reason}"
        fit = ", ".join(f"{k} {_g(a)} -> {_g(b)}" for k, (a, b) in self.refit.items())
        gain = (f"old plan {self.old_plan} predicted {self.old_predicted_s * 1e3:,.1f} ms on the refit "
                f"profile, new plan {self.new_plan} {self.new_predicted_s * 1e3:,.1f} ms "
                f"({self.gain:+.0%})") if self.new_predicted_s else ""
        return f"{head}; refit {fit}; {gain}; {self.reason}"

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


def replan(plan: Plan, hw: HardwareProfile, time_limit_s: float) -> Plan:
    """The planner's best plan for the same model, batch and sequence length on `hw`."""
    from tierflow.planner.search.plan_search import plan_search
    from tierflow.planner.search.problem import Problem

    cfg = plan.config
    problem = Problem(plan.model, hw, cfg.batch, cfg.seq, gpus=cfg.gpus, nodes=cfg.nodes)
    best = plan_search(problem, time_limit_s=time_limit_s).best
    return plan_from_graph(plan.model, hw, best.config, build_graph(plan.model, hw, best.config),
                           predicted=best.result)


def _per_op(plan: Plan, measured) -> tuple[np.ndarray, np.ndarray]:
    """The measured start and end seconds per op id of the plan, NaN for the ops of iterations the measured
    round did not run (it covers the plan's first ops)."""
    n = len(plan.graph.tasks)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    k = len(measured.start_s)
    start[:k], end[:k] = measured.start_s, measured.end_s
    return start, end


def decide(plan: Plan, first: RunResult, step: int, opts: AdaptOptions) -> tuple[Decision, Plan | None]:
    """The decision after the warm-up: (what was decided, the plan to switch to or None)."""
    start_s, end_s = _per_op(plan, first.measured)
    measured_it, predicted_it, ratios = compare_resources(plan, start_s, end_s)
    d = Decision(step, measured_it, predicted_it, ratios, old_plan=plan.config.describe())
    off = [r for r, v in ratios.items() if abs(v - 1) > opts.threshold]
    if abs(d.error) <= opts.threshold and not off:
        d.reason = f"within {opts.threshold:.0%}: keeping the plan"
        return d, None
    hw = plan.hardware
    fields = fields_for(plan, hw, off or list(ratios))
    if not fields:
        d.reason = "no profile field to refit for the resources that are off: keeping the plan"
        return d, None
    fit = fit_trace(plan, start_s, end_s, hw, fields, source="the run's warm-up",
                    max_evals=opts.fit_evaluations)
    refit = hw.with_overrides(with_tied(fit, hw).values)
    d.refit = {k: [fit.initial[k], v] for k, v in fit.values.items()}
    new = replan(plan, refit, opts.time_limit_s)
    d.old_predicted_s = simulate_config(plan.model, refit, plan.config).iteration_s
    d.new_predicted_s = float(new.predicted["iteration_s"])
    d.new_plan = new.config.describe()
    if d.gain > opts.margin and new.config != plan.config:
        d.switched, d.reason = True, f"switching at step {step}"
        return d, new
    d.reason = f"predicted gain {d.gain:+.0%} within the margin {opts.margin:.0%}: keeping the plan"
    return d, None


def _run_options(whole: RunOptions, args: argparse.Namespace, steps: int, checkpoint_dir: str,
                 plan: Plan) -> RunOptions:
    """`tierflow run`'s options (`whole`) for one part of the run: checkpoints every --checkpoint-every steps
    (default the plan's iterations) when the user gave --checkpoint-dir; --out is written once, at the end."""
    every = (args.checkpoint_every or plan.graph.num_iterations) if args.checkpoint_dir else 0
    return dataclasses.replace(whole, steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=every,
                               out=None, export_hf=None, profile=False, quiet=args.json)


def _resumed_step(directory: str) -> int:
    """The step of the checkpoint a run in `directory` resumes from (0: none, or unreadable: the run itself
    then says why)."""
    latest, _, _ = candidates(directory)
    try:
        return int(read_manifest(latest)["step"]) if latest is not None else 0
    except (StateError, KeyError, TypeError, ValueError):
        return 0


def adapt_run(plan: Plan, args: argparse.Namespace, opts: AdaptOptions, log=print) -> dict[str, Any]:
    """Warm up, decide, continue (under the new plan if switching). Returns what --json prints. With several
    ranks every rank runs this: rank 0 decides and broadcasts the decision and the plan, so that every rank
    switches (or not) at the same step; the checkpoint directory is rank 0's."""
    ranks = plan.config.world.ranks
    # the world run_plan joins (made once per process): rank 0's checkpoint directory is every rank's
    world = init_world(ranks, make_backend(rank_device(args.device, ranks), args.seed).device)
    tmp = None if args.checkpoint_dir or world.rank else tempfile.mkdtemp(prefix="tierflow-adapt-")
    ck = world.broadcast(args.checkpoint_dir or tmp)
    # the optimizer, schedule (over the whole run's --steps), data and evaluation settings of `tierflow run`,
    # read once (a --ds-config's notes printed once)
    whole = run_options(args, train_hyper(args))
    try:
        warm = min(_resumed_step(ck) + opts.warmup, args.steps)  # the warm-up counts from a resumed step
        o1 = _run_options(whole, args, warm, ck, plan)
        o1.checkpoint_every = warm  # the warm-up ends with a checkpoint: the switch resumes it
        first = run_plan(plan, o1)
        decisions, chosen, second = [], plan, None
        if first.measured is None and args.steps > warm:  # nothing measured (resumed at the end of it)
            second = run_plan(plan, _run_options(whole, args, args.steps, ck, plan))
        elif args.steps > warm:
            t0 = time.perf_counter()
            d, new = world.broadcast(decide(plan, first, warm, opts) if world.rank == 0 else None)
            decisions.append(d)
            if not args.json and world.rank == 0:
                log(f"tierflow run: {d.line()}", flush=True)
            chosen = new or plan
            if new is not None and args.out and world.rank == 0:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                write_plan(new, Path(args.out) / "adapted_plan.json")
            t1 = time.perf_counter()
            second = run_plan(chosen, _run_options(whole, args, args.steps, ck, chosen))
            # the decision (fit, re-plan) and the second run's time outside its steps: building the state,
            # loading the checkpoint onto the new plan's tiers, starting the workers, and the end of the run
            d.decide_s = t1 - t0
            d.switch_s = time.perf_counter() - t0 - sum(r.step_s for r in second.records)
        return _results(args, first, second, decisions, chosen, lead=world.rank == 0)
    finally:
        world.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _results(args: argparse.Namespace, first: RunResult, second: RunResult | None, decisions: list[Decision],
             chosen: Plan, lead: bool = True) -> dict[str, Any]:
    records = first.records + (second.records if second else [])
    measured = (second or first).measured
    out = {"plan": str(args.plan), "first_step": first.first_step, "steps": [asdict(r) for r in records],
           "adapt": [{**asdict(d), "line": d.line()} for d in decisions],
           "final_plan": chosen.config.to_dict(),
           "measured": measured.to_dict() if measured is not None else None}
    if args.out and lead:
        write_run_outputs(measured, records, args.out, f"{chosen.model.name}: measured (adapt)")
        (Path(args.out) / "adapt.json").write_text(json.dumps(out["adapt"], indent=1))
    return out


def cmd_adapt(args: argparse.Namespace) -> int:
    """`tierflow run PLAN --adapt`: errors as `tierflow run` reports them (one line, the error's exit
    code)."""
    from tierflow.errors import TierflowError

    if getattr(args, "nproc", None) is not None:  # torchrun starts the ranks; each comes back here
        return cmd_run(args)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    opts = AdaptOptions(warmup=args.adapt_warmup, threshold=args.adapt_threshold, margin=args.adapt_margin,
                        time_limit_s=args.adapt_time_limit, fit_evaluations=args.adapt_fit_evaluations)
    try:
        check_run_outputs(args)  # before any step, as tierflow run does
        plan = load_plan(args.plan)
        simulate_plan(plan)
        out = adapt_run(plan, args, opts)
    except TierflowError as e:
        print(f"tierflow run: error: {e}", file=sys.stderr)
        return leave_world(e.exit_code)
    except RunStopped as e:
        print(f"tierflow run: {e}", file=sys.stderr)
        return leave_world(e.exit_code)
    if args.json and int(os.environ.get("RANK", "0") or 0) == 0:
        print(json.dumps(out, indent=2))
    return leave_world(0)
