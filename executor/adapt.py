"""`tierflow run --adapt`: a run that corrects its own plan.

At the first step boundary after `warmup` steps the measured op times of the last round are compared with
the plan's prediction (tierflow.executor.decide). Where they differ by more than the threshold, the refit and
the re-plan run in a child process (niced) while training goes on under the old plan; at the first step
boundary after the decision arrived the run switches if the new plan is predicted faster by more than the
margin: a checkpoint at that step, resumed under the new plan, which moves every tensor class to its new
tier (tierflow.executor.checkpoint), and training continues to `--steps`. Otherwise it never stops. With
`decide_within` K the run waits for the decision at the latest K steps after the warm-up's end (0: at the
warm-up's end, where the switch then takes effect). One line per decision (the step it was taken at and
the step it took effect); the decisions are in `--json` and in `DIR/adapt.json` with `--out`.

Several ranks (`--nproc N`, or torchrun): rank 0 compares and decides from its own trace; at every step
boundary while the decision is under way it broadcasts whether it arrived (and the decision and new plan when
it has), so that every rank stops, checkpoints its shard and resumes under the new plan at the same step.
"""


from __future__ import annotations

import json
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tierflow.executor.checkpoint import candidates, read_manifest
from tierflow.executor.decide import Decision, compare, decide, refit_in_child, refit_replan
from tierflow.executor.device.factory import make_backend
from tierflow.executor.dist import DistWorld, init_world, rank_device
from tierflow.executor.export import write_run_outputs
from tierflow.executor.launch import check_run_outputs
from tierflow.executor.options import AdaptOptions, RunConfig, RunError
from tierflow.executor.tiers.state import StateError
from tierflow.executor.train_loop import RunResult, Trainer, default_device, run_plan, save_step_checkpoint
from tierflow.planner.io.planfile import Plan, load_plan, simulate_plan, write_plan

__all__ = ["AdaptOptions", "Decision", "adapt_file", "adapt_run", "decide"]


def _part_config(config: RunConfig, checkpoint_dir: str, plan: Plan) -> RunConfig:
    """The run's configuration for one part of the run: checkpoints every --checkpoint-every steps (default
    the plan's iterations) when the user gave --checkpoint-dir (else the last step's only, for the switch);
    --out is written once, at the end."""
    ck, out = config.checkpoint, config.output
    every = (ck.every or plan.graph.num_iterations) if ck.directory else 0
    return replace(config, checkpoint=replace(ck, directory=checkpoint_dir, every=every),
                   output=replace(out, out=None, export_hf=None, profile=False, quiet=out.json), adapt=None)


def _resumed_step(directory: str) -> int:
    """The step of the checkpoint a run in `directory` resumes from (0: none, or unreadable: the run itself
    then says why)."""
    latest, _, _ = candidates(directory)
    try:
        return int(read_manifest(latest)["step"]) if latest is not None else 0
    except (StateError, KeyError, TypeError, ValueError):
        return 0


class Deciding:
    """The run's `on_round` under --adapt: at the first step boundary at or after `warm` it compares (rank 0)
    and, when a resource is off, starts the refit and re-plan (in a child process, or here with `wait`); at
    each boundary after that rank 0 broadcasts whether the decision arrived; when it says switch, every rank
    checkpoints there and the run ends at that step (True), to go on under the new plan."""

    def __init__(self, plan: Plan, opts: AdaptOptions, warm: int, world: DistWorld, log) -> None:
        self.plan, self.opts, self.warm, self.world, self.log = plan, opts, warm, world, log
        self.started = False
        self.pending: tuple | None = None  # rank 0: ("ok", (decision, plan | None)) once known
        self.child: tuple | None = None  # rank 0: (process, connection) of the refit under way
        self.first: Decision | None = None  # rank 0: the comparison while the refit is under way
        self.decision: Decision | None = None  # every rank, once it arrived
        self.new: Plan | None = None
        self.parts: dict[str, float] = {}  # the switch's parts measured here
        self.stop_t: float | None = None  # perf_counter at the switch's start (after the last old step)

    def __call__(self, tr: Trainer) -> bool:
        if self.decision is not None or tr.step >= tr.steps:  # decided, or nothing left to switch for
            return False
        if not self.started:
            if tr.step < self.warm or tr.measured is None:
                return False
            self.started = True
            if self.world.rank == 0:
                self._start(tr.measured, tr.step)
        late = self.opts.decide_within is not None and tr.step >= self.warm + self.opts.decide_within
        got = self.world.broadcast(self._ready(block=late) if self.world.rank == 0 else None)
        return got is not None and self._arrived(tr, got)

    def _start(self, measured, step: int) -> None:
        d, off = compare(self.plan, measured, step, self.opts)
        if not off:
            self.pending = ("ok", (d, None))
        elif self.opts.decide_within == 0:
            self.pending = ("ok", refit_replan(self.plan, measured, d, off, self.opts))
        else:
            ctx = multiprocessing.get_context("spawn")  # the child imports no torch and shares no threads
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=refit_in_child, args=(send, self.plan, measured, d, off, self.opts),
                               daemon=True)
            proc.start()
            send.close()
            self.child, self.first = (proc, recv), d

    def _ready(self, block: bool) -> tuple | None:
        if self.pending is None and self.child is not None:
            proc, recv = self.child
            if recv.poll(None if block else 0):
                try:
                    self.pending = recv.recv()
                except EOFError:
                    self.pending = ("error", f"the decision's process ended with exit code {proc.exitcode}")
                proc.join()
                self.child = None
            elif not proc.is_alive():
                self.pending = ("error", f"the decision's process ended with exit code {proc.exitcode}")
                self.child = None
        return self.pending

    def _arrived(self, tr: Trainer, got: tuple) -> bool:
        kind, value = got
        if kind != "ok":
            raise RunError(f"--adapt: the refit and re-plan failed ({value}); run without --adapt, or fit "
                           "the profile with tierflow fit --trace and plan again")
        d, new = value
        d.effective_step, d.steps_while_deciding = tr.step, tr.step - d.step
        self.decision = d
        if self.world.rank == 0 and not tr.quiet:
            self.log(f"tierflow run: {d.line()}", flush=True)
        if new is None:
            return False
        self.new, self.stop_t = new, time.perf_counter()
        every = tr.checkpoint_every
        if not (every and tr.step % every == 0):  # not written at this step yet
            save_step_checkpoint(tr)
        self.parts["checkpoint_write_s"] = time.perf_counter() - self.stop_t
        return True

    def close(self) -> Decision | None:
        """After the run: the decision (the comparison alone, if the run ended before the refit arrived); a
        refit still under way is stopped."""
        if self.child is not None:
            proc, recv = self.child
            proc.terminate()  # the child this object started
            proc.join()
            recv.close()
            self.child = None
            self.first.reason = "the run ended before the refit and re-plan finished: kept the plan"
            return self.first
        return self.decision


def adapt_run(plan: Plan, config: RunConfig, log=print) -> dict[str, Any]:
    """Train under `plan`, decide beside it (`config.adapt`), and continue under the new plan if switching.
    Returns what --json prints. With several ranks every rank runs this: rank 0 decides and broadcasts, so
    that every rank switches (or not) at the same step; the checkpoint directory is rank 0's."""
    ranks, opts, out = plan.config.world.ranks, config.adapt, config.output.out
    device, seed = default_device(config.device), config.model_data.seed
    # the world run_plan joins (made once per process): rank 0's checkpoint directory is every rank's
    world = init_world(ranks, make_backend(rank_device(device, ranks), seed).device)
    directory = config.checkpoint.directory
    tmp = None if directory or world.rank else tempfile.mkdtemp(prefix="tierflow-adapt-")
    ck = world.broadcast(directory or tmp)
    deciding = Deciding(plan, opts, min(_resumed_step(ck) + opts.warmup, config.steps), world, log)
    try:
        first = run_plan(plan, _part_config(config, ck, plan), on_round=deciding)
        second = None
        if deciding.new is not None:
            t1 = time.perf_counter()
            started = _FirstRound()
            second = run_plan(deciding.new, _part_config(config, ck, deciding.new), on_round=started)
            _switch_cost(deciding, t1, started)
        d = deciding.close()
        if d is not None and world.rank == 0 and d.effective_step is None and not config.output.json:
            log(f"tierflow run: {d.line()}", flush=True)
        if deciding.new is not None and out and world.rank == 0:
            Path(out).mkdir(parents=True, exist_ok=True)
            write_plan(deciding.new, Path(out) / "adapted_plan.json")
        return _results(config, first, second, [d] if d else [], deciding.new or plan, lead=world.rank == 0)
    finally:
        deciding.close()
        world.barrier()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


class _FirstRound:
    """The new run's on_round: when its first round ended and what its steps took, so that the switch's cost
    ends where the new plan's first step starts."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.steps_s = 0.0

    def __call__(self, tr: Trainer) -> bool:
        if self.at is None:
            self.at, self.steps_s = time.perf_counter(), sum(r.step_s for r in tr.records)
        return False


def _switch_cost(deciding: Deciding, t1: float, started: _FirstRound) -> None:
    """The switch's cost and parts: the checkpoint at the switch, the old run's end (its workers and SSD tier
    closed), the new run's start (its state, SSD tier and workers built, the checkpoint read onto the new
    tiers) up to its first step."""
    d, parts = deciding.decision, deciding.parts
    parts["old_run_end_s"] = t1 - deciding.stop_t - parts["checkpoint_write_s"]
    parts["new_run_start_s"] = (started.at or time.perf_counter()) - t1 - started.steps_s
    d.switch_parts = {k: round(v, 4) for k, v in parts.items()}
    d.switch_s = sum(parts.values())


def _results(config: RunConfig, first: RunResult, second: RunResult | None, decisions: list[Decision],
             chosen: Plan, lead: bool = True) -> dict[str, Any]:
    records = first.records + (second.records if second else [])
    measured = (second or first).measured
    out = {"plan": str(config.plan), "first_step": first.first_step, "steps": [asdict(r) for r in records],
           "adapt": [{**asdict(d), "line": d.line()} for d in decisions],
           "final_plan": chosen.config.to_dict(),
           "measured": measured.to_dict() if measured is not None else None}
    where = config.output.out
    if where and lead:
        write_run_outputs(measured, records, where, f"{chosen.model.name}: measured (adapt)")
        (Path(where) / "adapt.json").write_text(json.dumps(out["adapt"], indent=1))
    return out


def adapt_file(config: RunConfig, log=print) -> dict[str, Any]:
    """`tierflow run PLAN --adapt` on this process (one rank of several, or the only one): the outputs checked
    as `tierflow run` checks them, the plan loaded and checked against its tiers, then `adapt_run`. Raises the
    run's errors (TierflowError) and RunStopped; returns what --json prints."""
    check_run_outputs(config)  # before any step, as tierflow run does
    plan = load_plan(config.plan)
    simulate_plan(plan)
    return adapt_run(plan, config, log)
