"""`tierflow simulate`: simulate schedules of a model on a box and report throughput side by side; or replay a
plan file (--plan), or a DeepSpeed config beside tierflow's plan (--ds-config: dsconfig.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tierflow.cli import dsconfig
from tierflow.cli.args import (
    add_batch_arg,
    add_box_args,
    add_lora_args,
    add_micro_batch_arg,
    add_optimizer_states_arg,
    add_precision_arg,
    add_seq_arg,
    add_world_args,
    in_precision,
    world_of,
)
from tierflow.cli.argtypes import (
    MAX_BATCH,
    MAX_ITERATIONS,
    fraction_below_one,
    non_negative_int,
    positive_int,
)
from tierflow.cli.planfiles import write_plan_file
from tierflow.cli.tables import summary_table
from tierflow.errors import UsageError
from tierflow.hwprofiles import HardwareProfile, load_hw
from tierflow.outputs import check_output_dir, check_output_file
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.families import FAMILIES, RUNTIMES
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.placement import Placement, parse_placement
from tierflow.planner.core.schedules import make_schedule
from tierflow.planner.core.simulate import DEFAULT_FAMILIES, simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.io.progress import Progress

Results = dict[str, SimResult | Exception]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser("simulate", help="simulate schedules of a model on a box and report throughput",
                       description="Simulate training iterations and report the steady state. With no "
                       "arguments: GPT-3 175B on the RTX 4090 box (Fuyou's), every schedule side by side.")
    add_box_args(s)
    s.add_argument("--schedule", default="all", choices=[*FAMILIES, "all"],
                   help="schedule family (default: all)")
    add_batch_arg(s, 64)
    add_micro_batch_arg(s, 2, "sequences per micro-batch (default 2)")
    add_seq_arg(s)
    s.add_argument("--group", type=positive_int(MAX_BATCH), default=None,
                   help="micro-batches per block sweep (block schedule)")
    s.add_argument("--alpha", type=fraction_below_one, default=None,
                   help="deferred optimizer fraction, within [0, 1) (vertical default 0.25)")
    s.add_argument("--prefetch", type=positive_int(1024), default=1,
                   help="weight buffers fetched ahead (default 1)")
    s.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="how transfers overlap: deepspeed = ZeRO-Infinity as DeepSpeed's code runs it (the "
                   "default of --schedule horizontal), lohan = Fuyou as LoHan's code runs it (the default of "
                   "--schedule fuyou), ideal = as early as the plan allows (every other schedule; tierflow's "
                   "executor)")
    s.add_argument("--no-recompute", action="store_true", help="keep every activation instead of recomputing")
    s.add_argument("--placement", default=None,
                   help="gpu|cpu|ssd, or JSON / a JSON file of fractions per tensor class")
    s.add_argument("--iterations", type=positive_int(MAX_ITERATIONS), default=3,
                   help="iterations simulated (default 3; the one before the last is reported)")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.add_argument("--out", default=None, help="write timeline.csv, trace.json (Perfetto) and gantt.png here "
                   "(a new or empty directory, or pass --overwrite)")
    s.add_argument("--overwrite", action="store_true",
                   help="let --out write into a directory that is not empty (its files of the same names are "
                   "replaced)")
    s.add_argument("--plan", default=None, help="replay a plan file written by `tierflow plan` instead")
    s.add_argument("--swap-layers", type=non_negative_int(), default=0,
                   help="the last N layers keep (and swap out) their activations instead of recomputing")
    s.add_argument("--write-plan", default=None, metavar="FILE",
                   help="also write this schedule as a plan file (one --schedule), e.g. for `tierflow run`")
    add_world_args(s)
    add_precision_arg(s)
    add_optimizer_states_arg(s)
    add_lora_args(s)
    dsconfig.add_ds_config_args(s)
    return s


def check_outputs(args: argparse.Namespace) -> None:
    """--out and --write-plan, checked before anything is simulated (tierflow.outputs)."""
    if args.out:
        check_output_dir(args.out, "--out", overwrite=args.overwrite)
    if args.write_plan:
        check_output_file(args.write_plan, "--write-plan")


def run(args: argparse.Namespace) -> int:
    if args.ds_config:
        return dsconfig.simulate_ds_config(args)
    check_outputs(args)
    if args.plan:
        return simulate_plan_file(args)
    model = in_precision(get_model(args.model), args)
    if args.seq is not None:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    families = list(DEFAULT_FAMILIES) if args.schedule == "all" else [args.schedule]
    placement = parse_placement(args.placement)
    if args.write_plan and len(families) != 1:
        raise UsageError("--write-plan needs one --schedule (a plan file holds one schedule)")
    configs, results = _simulate(args, model, hw, families, placement)
    written = None
    if args.write_plan:
        from tierflow.planner.io.planfile import plan_from_graph

        fam = families[0]
        r = results[fam]
        plan = plan_from_graph(model, hw, configs[fam], r.graph, predicted=r)
        written = write_plan_file(plan, args.write_plan)
    if args.out:
        _write_outputs(args.out, model, hw, results)
    if args.json:
        print(json.dumps(_to_json(args, model, hw, results), indent=2))
        return 0
    _print_text(args, model, hw, results)
    if written:
        print(f"wrote plan {written.path} (run it with: tierflow run {written.path})")
    return 0


def _schedule(args: argparse.Namespace, fam: str, model: ModelSpec, hw: HardwareProfile,
              placement: Placement | None) -> ScheduleConfig:
    return make_schedule(fam, model, hw, batch=args.batch, micro_batch=args.micro_batch, seq=model.seq_len,
                         placement=placement, group=args.group, alpha=args.alpha,
                         prefetch_depth=args.prefetch, recompute=not args.no_recompute, runtime=args.runtime,
                         iterations=args.iterations, swap_layers=args.swap_layers, gpus=args.gpus,
                         nodes=args.nodes)


def _simulate(args: argparse.Namespace, model: ModelSpec, hw: HardwareProfile, families: list[str],
              placement: Placement | None) -> tuple[dict[str, ScheduleConfig], Results]:
    """Each schedule's config and result; one that does not fit is its CapacityError (raised when it is the
    only one)."""
    configs: dict[str, ScheduleConfig] = {}
    results: Results = {}
    prog = Progress(len(families), "simulating")
    for fam in families:
        configs[fam] = cfg = _schedule(args, fam, model, hw, placement)
        try:
            results[fam] = simulate_config(model, hw, cfg)
        except CapacityError as e:
            if len(families) == 1:
                raise
            results[fam] = e
        prog.step(fam)
    prog.finish()
    return configs, results


def _write_outputs(out: str, model: ModelSpec, hw: HardwareProfile, results: Results) -> None:
    """--out: timeline.csv, trace.json and gantt.png of each schedule that fits (in a folder per schedule when
    there are several)."""
    from tierflow.planner.core.trace import write_outputs

    for fam, r in results.items():
        if isinstance(r, SimResult):
            d = Path(out) / fam if len(results) > 1 else Path(out)
            write_outputs(r, d, name=f"{model.name} on {hw.name}: {fam}")


def _to_json(args: argparse.Namespace, model: ModelSpec, hw: HardwareProfile, results: Results) -> dict:
    out: dict[str, Any] = {"model": model.name, "params": model.total_params(), "hw": hw.name,
                           "batch": args.batch, "micro_batch": args.micro_batch, "seq": model.seq_len,
                           "world": world_of(args).to_dict(), "schedules": {}}
    for fam, r in results.items():
        if isinstance(r, SimResult):
            out["schedules"][fam] = {"params": model.total_params(), **r.to_dict(), **r.per_gpu(),
                                     "world": r.world, "schedule": r.meta.get("schedule")}
        else:
            out["schedules"][fam] = {"error": str(r)}
    if len(results) == 1:
        out = {**out, **next(iter(out["schedules"].values()))}
    return out


def _print_text(args: argparse.Namespace, model: ModelSpec, hw: HardwareProfile, results: Results) -> None:
    world = world_of(args)
    W = world.ranks
    M = world.rank_batch(args.batch) // args.micro_batch
    print(f"{model.describe()}")
    print(f"box: {hw.name}: {hw.summary()}")
    if W == 1:
        print(f"batch {args.batch} sequences x {model.seq_len} tokens = {M} micro-batches of "
              f"{args.micro_batch}")
    else:
        print(f"{W} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes); global batch "
              f"{args.batch} sequences x {model.seq_len} tokens = {W} ranks x {M} micro-batches of "
              f"{args.micro_batch}; throughput below is the world's, per GPU where said")
    for fam, r in results.items():
        if isinstance(r, SimResult):
            placed = Placement.from_dict(r.meta["schedule"]["placement"])
            print(f"  {fam:<11} placement: {placed.describe(lora=model.lora is not None)}")
    print()
    print(summary_table(results))
    for fam, e in results.items():
        if not isinstance(e, SimResult):
            print(f"\n{fam}: does not fit: {e}")
    ok = {f: r for f, r in results.items() if isinstance(r, SimResult)}
    if len(ok) > 1:
        best = max(ok, key=lambda f: ok[f].tokens_per_s)
        worst = min(ok, key=lambda f: ok[f].tokens_per_s)
        print(f"\nfastest: {best} ({ok[best].tokens_per_s / ok[worst].tokens_per_s:.2f}x {worst})")
    print("model TFLOPS = tokens x (6 x matmul params + 12 x layers x q_dim x seq) / time; "
          "hardware TFLOPS adds the recompute forward, attention's causal half only")
    if args.out:
        where = (f"{args.out}/<schedule>/ for each of {', '.join(ok)}" if len(results) > 1 else args.out)
        print(f"wrote timeline.csv, trace.json, gantt.png under {where}")


def simulate_plan_file(args: argparse.Namespace) -> int:
    """`tierflow simulate --plan FILE`: replay a plan file and compare with what the plan recorded."""
    from tierflow.planner.io.planfile import load_plan, simulate_plan

    plan = load_plan(args.plan)
    res = simulate_plan(plan)
    name = f"{plan.model.name} on {plan.hardware.name}: plan {Path(args.plan).name}"
    if args.out:
        from tierflow.planner.core.trace import write_outputs

        write_outputs(res, args.out, name=name)
    if args.json:
        print(json.dumps({"plan": str(args.plan), "params": plan.model.total_params(), **res.to_dict(),
                          "predicted_in_plan": plan.predicted}, indent=2))
        return 0
    print(plan.model.describe())
    print(f"box: {plan.hardware.name}: {plan.hardware.summary()}")
    print(f"plan: {plan.config.describe()}")
    print(f"placement: {plan.config.placement.describe(lora=plan.model.lora is not None)}")
    print()
    print(summary_table({"plan": res}))
    if plan.predicted and "iteration_s" in plan.predicted:
        recorded = plan.predicted["iteration_s"]
        print(f"\nreplayed iteration {fmt_s(res.iteration_s, sig=4)} vs {fmt_s(recorded, sig=4)} recorded in "
              f"the plan ({res.iteration_s / recorded - 1:+.2%})")
    return 0
