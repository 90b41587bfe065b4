"""`tierflow simulate --ds-config` and `tierflow plan --emit-ds-config`: the command side of the DeepSpeed bridge
(the mapping itself is planner/io/dsconfig.py). Simulates the DeepSpeed run a config describes and prints it
beside tierflow's own plan for the same model, box and batch, in the summary table of `tierflow simulate`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.schedules import ScheduleConfig
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.io.argtypes import positive_float
from tierflow.planner.io.dsconfig import DsConfigError, ds_config_for_plan, read_ds_config, write_ds_config
from tierflow.planner.io.progress import Progress

DS_COLUMN = "deepspeed"
PLAN_COLUMN = "tierflow plan"
DEFAULT_PLAN_TIME_LIMIT_S = 20.0  # a modest search: the plan beside a DeepSpeed run, not the best plan found in 60 s


def add_ds_config_args(s: argparse.ArgumentParser) -> None:
    """The bridge's options of `tierflow simulate`."""
    s.add_argument("--ds-config", default=None, metavar="JSON",
                   help="simulate the run a DeepSpeed config describes (ZeRO-3 as DeepSpeed runs it) beside "
                   "tierflow's plan; its batch keys set the batch (--batch / --micro-batch only fill \"auto\")")
    s.add_argument("--no-plan", action="store_true", help="with --ds-config: skip tierflow's plan")
    s.add_argument("--plan-time-limit", type=positive_float(), default=DEFAULT_PLAN_TIME_LIMIT_S,
                   help=f"with --ds-config: seconds for tierflow's plan search (default {DEFAULT_PLAN_TIME_LIMIT_S:g})")


def simulate_ds_config(args: argparse.Namespace) -> int:
    """`tierflow simulate --ds-config FILE`: exit 0, or 3 when the DeepSpeed run does not fit the box."""
    from tierflow.planner.io.cli import load_hw, summary_table

    clash = [flag for flag, given in (("--schedule", args.schedule != "all"), ("--placement", args.placement),
                                      ("--group", args.group is not None), ("--alpha", args.alpha is not None),
                                      ("--runtime", args.runtime), ("--no-recompute", args.no_recompute),
                                      ("--swap-layers", args.swap_layers), ("--write-plan", args.write_plan),
                                      ("--out", args.out)) if given]
    if clash:
        raise DsConfigError(f"--ds-config sets the schedule and placement itself: drop {', '.join(clash)} (or "
                            "simulate without --ds-config)")
    model = get_model(args.model)
    if args.seq:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    ds = read_ds_config(args.ds_config, model, batch_hint=args.batch, micro_batch_hint=args.micro_batch)
    warning = ds.warning_line()
    if warning:
        print(warning, file=sys.stderr)
    cfg = ds.schedule(model, hw, seq=model.seq_len, iterations=args.iterations)
    results: dict[str, SimResult | Exception] = {}
    try:
        results[DS_COLUMN] = simulate_config(model, hw, cfg)
    except CapacityError as e:
        if args.no_plan and not args.json:
            raise
        results[DS_COLUMN] = e
    best = None
    if not args.no_plan:
        best = _plan(model, hw, ds.batch, args.plan_time_limit, allow_ssd=hw.ssd.count > 0)
        results[PLAN_COLUMN] = best.result
    ds_result = results[DS_COLUMN]
    if args.json:
        out = {"model": model.name, "params": model.total_params(), "hw": hw.name, "seq": model.seq_len,
               "ds_config": ds.to_dict(), "warning": warning}
        out[DS_COLUMN] = ({**ds_result.to_dict(), "schedule": cfg.to_dict()} if isinstance(ds_result, SimResult)
                          else {"error": str(ds_result), "schedule": cfg.to_dict()})
        out["plan"] = None if best is None else {"candidate": best.candidate.describe(ds.batch),
                                                 "decisions": best.config.to_dict(), **best.result.to_dict()}
        print(json.dumps(out, indent=2))
        return 0 if isinstance(ds_result, SimResult) else 3
    print(model.describe())
    print(f"box: {hw.name}: {hw.summary()}")
    print(ds.describe())
    for note in (*ds.resolved, *(f"{k} (from the command line)" for k in ds.from_command_line)):
        print(f"  auto: {note}")
    print(f"  {DS_COLUMN:<13} {cfg.describe()}")
    print(f"  {'':<13} placement: {cfg.placement.describe()}")
    if best is not None:
        print(f"  {PLAN_COLUMN:<13} {best.config.describe()}")
        print(f"  {'':<13} placement: {best.config.placement.describe()}")
    print()
    print(summary_table(results))
    if not isinstance(ds_result, SimResult):
        print(f"\n{DS_COLUMN}: does not fit: {ds_result}")
    elif best is not None:
        speedup = best.result.tokens_per_s / ds_result.tokens_per_s
        print(f"\ntierflow plan ({best.candidate.describe(ds.batch)}) runs at {speedup:.2f}x the tokens/s of this "
              f"DeepSpeed config; `tierflow plan --emit-ds-config FILE` writes the nearest DeepSpeed config for it")
    return 0 if isinstance(ds_result, SimResult) else 3


def _plan(model: ModelSpec, hw, batch: int, time_limit_s: float, allow_ssd: bool):
    """tierflow's plan for the same model, box and batch: plan_search as `tierflow plan` runs it."""
    from tierflow.planner.search.plan_search import plan_search
    from tierflow.planner.search.problem import Problem

    prog = Progress(1, "planning")
    problem = Problem(model, hw, batch, model.seq_len, allow_ssd=allow_ssd)
    sr = plan_search(problem, time_limit_s=time_limit_s, progress=lambda i, n, what: prog.update(i, n, what))
    prog.finish()
    return sr.best


def emit_ds_config(path: str, model: ModelSpec, cfg: ScheduleConfig, stream: TextIO | None = None) -> None:
    """`tierflow plan --emit-ds-config FILE`: write the nearest DeepSpeed config for the chosen plan and say, in
    a few lines, which of its decisions DeepSpeed cannot express."""
    stream = sys.stdout if stream is None else stream
    emitted = ds_config_for_plan(model, cfg)
    write_ds_config(path, emitted)
    nvme = "; set nvme_path to your NVMe mount" if "nvme" in json.dumps(emitted.config) else ""
    print(f"wrote DeepSpeed config {path}: {emitted.summary()}{nvme}", file=stream)
    if emitted.inexpressible:
        print("DeepSpeed cannot express these decisions of the plan:", file=stream)
        for item in emitted.inexpressible:
            print(f"  - {item}", file=stream)
