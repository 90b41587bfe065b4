"""`tierflow plan`: search schedule, micro-batching, placement and recompute for a model on a box, verify the
best plan by simulation and write it as a plan file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierflow.cli.args import (
    add_batch_arg,
    add_box_args,
    add_lora_args,
    add_micro_batch_arg,
    add_optimizer_states_arg,
    add_precision_arg,
    add_seq_arg,
    add_world_args,
    check_accept_states,
    in_precision,
)
from tierflow.cli.argtypes import positive_float
from tierflow.cli.planfiles import write_plan_file
from tierflow.cli.tables import fmt_table
from tierflow.errors import UsageError
from tierflow.hwprofiles import load_hw
from tierflow.outputs import check_output_file
from tierflow.planner.core.models import get_model
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.io.deepspeed.bridge import emit_ds_config
from tierflow.planner.io.progress import Progress

if TYPE_CHECKING:
    from tierflow.planner.core.models import ModelSpec
    from tierflow.planner.io.planning import PlanOptions
    from tierflow.planner.search.plan_search import SearchResult
    from tierflow.planner.search.problem import Problem


def add_parser(sub: Any) -> argparse.ArgumentParser:
    pl = sub.add_parser("plan",
                        help="search schedule, micro-batching, placement and recompute; write a plan file",
                        description="Search every decision with the roofline bound, CP-SAT and the "
                        "simulator; every plan is verified by simulating full iterations.")
    add_box_args(pl)
    add_batch_arg(pl, 64)
    add_seq_arg(pl)
    add_micro_batch_arg(pl, None, "fix the micro-batch (default: searched)")
    pl.add_argument("--time-limit", type=positive_float(7 * 24 * 3600), default=60.0,
                    help="seconds for the whole search, > 0 (default 60)")
    pl.add_argument("--no-ssd", action="store_true", help="use only GPU and CPU memory")
    pl.add_argument("--no-baselines", action="store_true",
                    help="do not simulate the fixed schedules for comparison")
    pl.add_argument("--explain", action="store_true", help="say what binds and what would help most")
    pl.add_argument("--no-window", action="store_true",
                    help="skip the exact CP-SAT check of a 2-layer window")
    pl.add_argument("-o", "--out", default=None, help="write the plan file here (JSON, docs/plan-format.md)")
    pl.add_argument("--json", action="store_true", help="print the result as JSON")
    pl.add_argument("--emit-ds-config", default=None, metavar="JSON",
                    help="also write the nearest DeepSpeed config for the chosen plan (and say what it "
                    "cannot express)")
    pl.add_argument("--clip-grad-norm", type=positive_float(), default=None, metavar="X",
                    help="the run will clip gradients by global norm (tierflow run --clip-grad-norm X): "
                    "report what the optimizer's wait for the norm costs and write the plan with it "
                    "(docs/finetuning.md)")
    add_world_args(pl)
    add_precision_arg(pl)
    add_optimizer_states_arg(pl, auto=True)
    add_lora_args(pl)
    return pl


def run(args: argparse.Namespace) -> int:
    from tierflow.planner.io.planning import make_plan
    from tierflow.planner.search.explain import explain

    _check_outputs(args)
    check_accept_states(args)
    model = in_precision(get_model(args.model), args)
    if args.seq is not None:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    prog = Progress(1, "planning")
    planned = make_plan(model, hw, args.batch, model.seq_len, plan_options(args, model),
                        progress=lambda i, n, what: prog.update(i, n, what))
    prog.finish()
    problem, sr, solver, clip, auto = (planned.problem, planned.search, planned.solver, planned.clip,
                                       planned.state_times_s)
    model, cfg, graph = problem.model, planned.config, planned.graph
    written = write_plan_file(planned.plan(), args.out) if args.out else None
    lines = explain(sr) if args.explain else []
    if args.json:
        if args.emit_ds_config:
            emit_ds_config(args.emit_ds_config, model, cfg, stream=sys.stderr)
        out = _to_json(problem, sr, solver, written, lines)
        if auto is not None:
            out["optimizer_states_auto"] = auto
        if clip is not None:
            out["clip"] = clip.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    _print_text(args, problem, sr, solver)
    if auto is not None:
        print("optimizer states: auto chose " + (model.optimizer_states or "fp32") + " ("
              + ", ".join(f"{f} {fmt_s(s, sig=4)}" for f, s in auto.items()) + " an iteration)")
    for line in lines + ([clip.line()] if clip is not None else []):
        print(line)
    if written:
        print(f"wrote {written.path} ({len(graph.tasks):,} ops); replay it with: tierflow simulate --plan "
              f"{written.path}")
    if args.emit_ds_config:
        emit_ds_config(args.emit_ds_config, model, cfg)
    return 0


def plan_options(args: argparse.Namespace, model: ModelSpec) -> PlanOptions:
    """`tierflow plan`'s flags as the planning function's options (--accept-states checked here)."""
    from tierflow.cli.args import accepted_states
    from tierflow.planner.io.planning import PlanOptions

    auto = tuple(accepted_states(args, model)) if args.optimizer_states == "auto" else None
    mbs = (args.micro_batch,) if args.micro_batch else None
    return PlanOptions(time_limit_s=args.time_limit, micro_batches=mbs, allow_ssd=not args.no_ssd,
                       baselines=not args.no_baselines, window=not args.no_window,
                       clip=bool(args.clip_grad_norm), auto_states=auto, gpus=args.gpus, nodes=args.nodes)


def _check_outputs(args: argparse.Namespace) -> None:
    """-o and --emit-ds-config, checked before the search (tierflow.outputs): two different writable files."""
    if args.out:
        check_output_file(args.out, "-o")
    if args.emit_ds_config:
        check_output_file(args.emit_ds_config, "--emit-ds-config")
    if args.out and args.emit_ds_config and Path(args.out).resolve() == Path(args.emit_ds_config).resolve():
        raise UsageError(f"-o and --emit-ds-config name the same file {args.out}: give two file names")


def _to_json(problem: Problem, sr: SearchResult, solver: dict, written: Any, lines: list[str]) -> dict:
    best, model = sr.best, problem.model
    rb = problem.rank_batch  # candidates describe one rank's micro-batches
    return {"model": model.name, "params": model.total_params(), "hw": problem.hw.name,
            "decisions": best.config.to_dict(), "solver": solver, "predicted": best.result.to_dict(),
            "candidate": best.candidate.describe(rb), "plan_file": str(written.path) if written else None,
            "world": problem.world.to_dict(), **best.result.per_gpu(),
            "explain": lines,
            "evaluated": [{"candidate": e.candidate.describe(rb),
                           "verified_s": e.verified_s if e.result else None,
                           "solver": e.solver.to_dict() if e.solver else None,
                           "error": e.error} for e in sr.evaluated]}


def _print_text(args: argparse.Namespace, problem: Problem, sr: SearchResult, solver: dict) -> None:
    model, hw, rb = problem.model, problem.hw, problem.rank_batch
    print(model.describe())
    print(f"box: {hw.name}: {hw.summary()}")
    print(f"batch {args.batch} sequences x {model.seq_len} tokens; searched {len(sr.evaluated)} candidates "
          f"in {fmt_s(sr.wall_s, 1)}")
    if sr.skipped_by_time_limit:
        print(f"note: the time limit ({args.time_limit:g} s) left {sr.skipped_by_time_limit} candidate(s) "
              "untried, so a faster plan may exist (raise --time-limit)")
    ranks = problem.world.ranks
    if ranks > 1:
        print(f"{ranks} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes): each "
              f"runs {rb} sequences; candidates below are one rank's; tokens/s is the world's")
    _print_candidates(sr, rb)
    _print_choice(sr, rb, model.num_layers, solver, lora=model.lora is not None)


def _print_candidates(sr: SearchResult, rb: int) -> None:
    rows = []
    ok = sorted((e for e in sr.evaluated if e.result), key=lambda e: e.verified_s)
    for e in ok[:8]:
        s_ = e.solver
        rows.append([e.candidate.describe(rb), fmt_s(e.verified_s, 1), f"{e.result.tokens_per_s:,.0f}",
                     f"{e.result.hw_tflops:.1f}", s_.status if s_ else "-",
                     fmt_s(s_.objective_s, 1) if s_ else "-"])
    print()
    print(fmt_table(rows, ["candidate (best first)", "simulated", "tokens/s", "hw TFLOPS", "CP-SAT",
                           "objective"]))
    print()


def _print_choice(sr: SearchResult, rb: int, num_layers: int, solver: dict, lora: bool = False) -> None:
    best = sr.best
    cfg = best.config
    print(f"chosen: {best.candidate.describe(rb)}; {cfg.swap_layers} of {num_layers} layers swap "
          f"their activations instead of recomputing")
    print(f"placement: {cfg.placement.describe(lora=lora)}")
    if best.solver:
        r = best.solver
        print(f"placement solver: CP-SAT {r.status}, objective {fmt_s(r.objective_s)}, best bound "
              f"{fmt_s(r.best_bound_s)}, gap {r.gap:.1%}, {fmt_s(r.wall_s)}")
    if best.prediction:
        r = best.prediction
        print(f"prediction (slot model, {r.constraints:,} windows): {r.solver} {r.status}, "
              f"{fmt_s(r.objective_s)} per iteration, {fmt_s(r.wall_s)}")
    if "window_status" in solver:
        print(f"window check: CP-SAT {solver['window_status']} on a {solver['window_layers']}-layer window "
              f"({solver['window_tasks']} tasks): the schedule's own order takes "
              f"{fmt_s(solver['window_greedy_s'], sig=4)} at solo link rates, the best order found "
              f"{fmt_s(solver['window_makespan_s'], sig=4)}, proven bound "
              f"{fmt_s(solver['window_bound_s'], sig=4)} (gap {solver['window_gap']:.1%}, "
              f"{fmt_s(solver['window_wall_s'], 1)})")
    res = best.result
    print(f"verified by simulation: {fmt_s(res.iteration_s)} per iteration "
          f"({res.iteration_s / best.predicted_s - 1:+.1%} vs the prediction), {res.tokens_per_s:,.0f} "
          f"tokens/s, {res.model_tflops:.1f} model / {res.hw_tflops:.1f} hardware TFLOPS")
    if sr.baseline:
        name, b = min(sr.baseline.items(), key=lambda kv: kv[1].iteration_s)
        print(f"best fixed schedule with default settings: {name} at {fmt_s(b.iteration_s)} -> plan is "
              f"{b.iteration_s / res.iteration_s:.2f}x faster")
