"""`tierflow simulate --ds-config`: its flags and its output. Simulates the DeepSpeed run a config describes
and prints it beside tierflow's own plan for the same model, box and batch, in the summary table of `tierflow
simulate` (the runs themselves: tierflow.planner.io.deepspeed.bridge)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tierflow.cli.argtypes import positive_float
from tierflow.cli.tables import summary_table
from tierflow.hwprofiles import HardwareProfile, load_hw
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.io.deepspeed.bridge import (
    DEFAULT_PLAN_TIME_LIMIT_S,
    DS_COLUMN,
    PLAN_COLUMN,
    plan_beside,
    simulate_ds,
)
from tierflow.planner.io.deepspeed.config import DsConfig, DsConfigError, read_ds_config

if TYPE_CHECKING:
    from tierflow.planner.search.plan_search import Evaluated


def add_ds_config_args(s: argparse.ArgumentParser) -> None:
    """The bridge's options of `tierflow simulate`."""
    s.add_argument("--ds-config", default=None, metavar="JSON",
                   help="simulate the run a DeepSpeed config describes (ZeRO-3 as DeepSpeed runs it) beside "
                   "tierflow's plan; its batch keys set the batch (--batch / --micro-batch only fill "
                   "\"auto\")")
    s.add_argument("--no-plan", action="store_true", help="with --ds-config: skip tierflow's plan")
    s.add_argument("--plan-time-limit", type=positive_float(), default=DEFAULT_PLAN_TIME_LIMIT_S,
                   help="with --ds-config: seconds for tierflow's plan search (default "
                   f"{DEFAULT_PLAN_TIME_LIMIT_S:g})")


def simulate_ds_config(args: argparse.Namespace) -> int:
    """`tierflow simulate --ds-config FILE`: exit 0, or 3 when the DeepSpeed run does not fit the box."""
    _refuse_schedule_flags(args)
    model = get_model(args.model)
    if args.seq:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    ds = read_ds_config(args.ds_config, model, batch_hint=args.batch, micro_batch_hint=args.micro_batch)
    warning = ds.warning_line()
    cfg, ds_result = simulate_ds(model, hw, ds, args.iterations)
    if not isinstance(ds_result, SimResult) and args.no_plan and not args.json:
        raise ds_result  # one line: the config's notes would only bury it
    if warning:
        print(warning, file=sys.stderr)
    best = None
    if not args.no_plan:
        best = plan_beside(model, hw, ds.batch, args.plan_time_limit, allow_ssd=hw.ssd.count > 0)
    if args.json:
        out = {"model": model.name, "params": model.total_params(), "hw": hw.name, "seq": model.seq_len,
               "ds_config": ds.to_dict(), "warning": warning}
        out[DS_COLUMN] = ({**ds_result.to_dict(), "schedule": cfg.to_dict()}
                          if isinstance(ds_result, SimResult)
                          else {"error": str(ds_result), "schedule": cfg.to_dict()})
        out["plan"] = None if best is None else {"candidate": best.candidate.describe(ds.batch),
                                                 "decisions": best.config.to_dict(), **best.result.to_dict()}
        print(json.dumps(out, indent=2))
    else:
        _print_text(model, hw, ds, cfg, ds_result, best)
    return 0 if isinstance(ds_result, SimResult) else 3


def _refuse_schedule_flags(args: argparse.Namespace) -> None:
    flags = (("--schedule", args.schedule != "all"), ("--placement", args.placement),
             ("--group", args.group is not None), ("--alpha", args.alpha is not None),
             ("--runtime", args.runtime), ("--no-recompute", args.no_recompute),
             ("--swap-layers", args.swap_layers), ("--write-plan", args.write_plan), ("--out", args.out),
             ("--precision", args.precision))  # the config's bf16 / fp16 keys set the precision
    clash = [flag for flag, given in flags if given]
    if clash:
        raise DsConfigError(f"--ds-config sets the schedule and placement itself: drop {', '.join(clash)} "
                            "(or simulate without --ds-config)")


def _print_text(model: ModelSpec, hw: HardwareProfile, ds: DsConfig, cfg: ScheduleConfig,
                ds_result: SimResult | CapacityError, best: Evaluated | None) -> None:
    print(model.describe())
    print(f"box: {hw.name}: {hw.summary()}")
    print(ds.describe())
    for note in (*ds.resolved, *(f"{k} (from the command line)" for k in ds.from_command_line)):
        print(f"  auto: {note}")
    print(f"  {DS_COLUMN:<13} {cfg.describe()}")
    print(f"  {'':<13} placement: {cfg.placement.describe()}")
    results: dict[str, SimResult | Exception] = {DS_COLUMN: ds_result}
    if best is not None:
        print(f"  {PLAN_COLUMN:<13} {best.config.describe()}")
        print(f"  {'':<13} placement: {best.config.placement.describe()}")
        results[PLAN_COLUMN] = best.result
    print()
    print(summary_table(results))
    if not isinstance(ds_result, SimResult):
        print(f"\n{DS_COLUMN}: does not fit: {ds_result}")
    elif best is not None:
        speedup = best.result.tokens_per_s / ds_result.tokens_per_s
        print(f"\ntierflow plan ({best.candidate.describe(ds.batch)}) runs at {speedup:.2f}x the tokens/s of "
              "this DeepSpeed config; `tierflow plan --emit-ds-config FILE` writes the nearest DeepSpeed "
              "config for it")
