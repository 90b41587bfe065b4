"""`tierflow` command line. Subcommands that need PyTorch (run, compare, calibrate) live in the executor
package and register themselves through the `tierflow.commands` entry-point group, so that this module never
imports torch and `tierflow simulate` starts fast."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from tierflow import __version__
from tierflow.hwprofiles import HardwareProfile, ProfileError, list_profiles, load_profile
from tierflow.hwprofiles.inputs import MIB, InputLimitError, loads_json_limited, read_limited_text
from tierflow.planner.core.models import ModelError, get_model, list_models
from tierflow.planner.core.placement import Placement, PlacementError
from tierflow.planner.core.schedules import FAMILIES, RUNTIMES, ScheduleError, make_schedule
from tierflow.planner.core.simulate import DEFAULT_FAMILIES, simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult, SimulationError
from tierflow.planner.io.argtypes import (
    MAX_BATCH,
    MAX_ITERATIONS,
    OneLineParser,
    fraction_below_one,
    non_negative_int,
    positive_float,
    positive_int,
)
from tierflow.planner.io.dsbridge import add_ds_config_args, emit_ds_config, simulate_ds_config
from tierflow.planner.io.logs import add_verbosity_options, configure, level_of, logger
from tierflow.planner.io.progress import Progress

if TYPE_CHECKING:
    from tierflow.planner.io.planfile import Plan, WrittenPlan

USER_ERRORS = (ModelError, ProfileError, ScheduleError, PlacementError, SimulationError, ValueError, OSError)
# PlanError and PlanningError are ValueErrors: one line, exit code 2


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


# ---- formatting -----------------------------------------------------------------------------------------------


def gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def fmt_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _busy(k: str, r: SimResult) -> str:
    return f"{100 * r.busy.get(k, 0.0):.0f}%"


def _link(k: str, r: SimResult) -> str:
    return gb(r.link_bytes.get(k, 0.0))


def _peak(k: str, r: SimResult) -> str:
    return f"{gb(r.peak_bytes[k])} / {r.graph.capacity_bytes[k] / 1e9:,.0f}"


def summary_table(results: dict[str, SimResult | Exception]) -> str:
    names = list(results)
    metrics: list[tuple[str, callable]] = [
        ("iteration time", lambda r: f"{r.iteration_s:,.1f} s"),
        ("tokens/s", lambda r: f"{r.tokens_per_s:,.0f}"),
        ("model TFLOPS", lambda r: f"{r.model_tflops:.1f}"),
        ("hardware TFLOPS", lambda r: f"{r.hw_tflops:.1f}"),
    ]
    many = any(isinstance(r, SimResult) and r.ranks > 1 for r in results.values())
    if many:  # several ranks: the figures above are the world's; per GPU, and the collectives' link
        metrics += [("tokens/s per GPU", lambda r: f"{r.per_gpu()['tokens_per_s_per_gpu']:,.0f}"),
                    ("hardware TFLOPS per GPU", lambda r: f"{r.per_gpu()['hw_tflops_per_gpu']:.1f}")]
    busy = ("gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu") + (("net",) if many else ())
    links = ("cpu->gpu", "gpu->cpu", "ssd->cpu", "cpu->ssd") + (("gpu<->gpu",) if many else ())
    metrics += [(f"busy {k}", partial(_busy, k)) for k in busy]
    metrics += [(f"bytes {k}", partial(_link, k)) for k in links]
    metrics += [(f"peak {k}", partial(_peak, k)) for k in ("gpu", "cpu", "ssd")]
    rows = []
    for label, fn in metrics:
        rows.append([label] + [fn(results[n]) if isinstance(results[n], SimResult) else "-" for n in names])
    return fmt_table(rows, ["", *names])


# ---- simulate -------------------------------------------------------------------------------------------------


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected section.key=value, e.g. --set ssd.count=6")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def load_hw(name: str, overrides: list[str]) -> HardwareProfile:
    hw = load_profile(name)
    ov = parse_overrides(overrides)
    return hw.with_overrides(ov) if ov else hw


_PLACEMENT_EXAMPLE = '\'{"weights": {"gpu": 0, "cpu": 0.5, "ssd": 0.5}}\' or gpu|cpu|ssd'
MAX_PLACEMENT_BYTES = MIB


def load_placement(text: str | None) -> Placement | None:
    """--placement: gpu|cpu|ssd; JSON when the text starts with "{" (so a long inline JSON is never tried as a
    path); else the path of a JSON file."""
    if not text:
        return None
    if text in ("gpu", "cpu", "ssd"):
        return Placement.uniform(text)
    inline = text.lstrip().startswith("{")
    where = "--placement" if inline else f"--placement {text}"
    try:
        data = loads_json_limited(text if inline else read_limited_text(text, MAX_PLACEMENT_BYTES))
    except json.JSONDecodeError as e:
        raise CliError(f"{where}: not JSON ({e.msg} at char {e.pos}); e.g. {_PLACEMENT_EXAMPLE}") from None
    except (InputLimitError, UnicodeDecodeError) as e:
        raise CliError(f"{where}: {e} (give a JSON file of fractions per tensor class)") from None
    except FileNotFoundError:
        raise CliError(f"{where}: no such file, and not gpu|cpu|ssd or JSON starting with '{{'; e.g. "
                       f"{_PLACEMENT_EXAMPLE}") from None
    except OSError as e:
        raise CliError(f"{where}: cannot read: {e.strerror or e} (give a JSON file or inline JSON)") from None
    if not isinstance(data, dict):
        raise CliError(f"{where}: expected a JSON object of tensor classes, got {type(data).__name__}; e.g. "
                       f"{_PLACEMENT_EXAMPLE}")
    base = Placement().as_dict()
    for k, v in data.items():
        if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in v.values()):
            raise CliError(f"{where}: {k}: expected an object of gpu/cpu/ssd fractions, got {json.dumps(v)[:40]}; "
                           'e.g. {"gpu": 0, "cpu": 0.5, "ssd": 0.5}')
        base[k] = v
    try:
        return Placement.from_dict(base)
    except TypeError as e:
        raise CliError(f"--placement: {e}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.plan:
        return simulate_plan_file(args)
    if args.ds_config:
        return simulate_ds_config(args)
    model = get_model(args.model)
    if args.seq is not None:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    families = list(DEFAULT_FAMILIES) if args.schedule == "all" else [args.schedule]
    placement = load_placement(args.placement)
    if args.write_plan and len(families) != 1:
        raise CliError("--write-plan needs one --schedule (a plan file holds one schedule)")
    results: dict[str, SimResult | Exception] = {}
    configs = {}
    prog = Progress(len(families), "simulating")
    for fam in families:
        cfg = make_schedule(fam, model, hw, batch=args.batch, micro_batch=args.micro_batch, seq=model.seq_len,
                            placement=placement, group=args.group, alpha=args.alpha,
                            prefetch_depth=args.prefetch, recompute=not args.no_recompute, runtime=args.runtime,
                            iterations=args.iterations, swap_layers=args.swap_layers, gpus=args.gpus,
                            nodes=args.nodes)
        configs[fam] = cfg
        try:
            results[fam] = simulate_config(model, hw, cfg)
        except CapacityError as e:
            if len(families) == 1:
                raise
            results[fam] = e
        prog.step(fam)
    prog.finish()
    written = None
    if args.write_plan:
        from tierflow.planner.io.planfile import plan_from_graph

        fam = families[0]
        r = results[fam]
        written = write_plan_file(plan_from_graph(model, hw, configs[fam], r.graph, predicted=r), args.write_plan)
    if args.out:
        for fam, r in results.items():
            if isinstance(r, SimResult):
                d = Path(args.out) / fam if len(families) > 1 else Path(args.out)
                from tierflow.planner.core.trace import write_outputs

                write_outputs(r, d, name=f"{model.name} on {hw.name}: {fam}")
    if args.json:
        out = {"model": model.name, "params": model.total_params(), "hw": hw.name, "batch": args.batch,
               "micro_batch": args.micro_batch, "seq": model.seq_len, "world": world_dict(args), "schedules": {}}
        for fam, r in results.items():
            if isinstance(r, SimResult):
                out["schedules"][fam] = {"params": model.total_params(), **r.to_dict(), **r.per_gpu(),
                                         "world": r.world, "schedule": r.meta.get("schedule")}
            else:
                out["schedules"][fam] = {"error": str(r)}
        if len(families) == 1:
            out = {**out, **out["schedules"][families[0]]}
        print(json.dumps(out, indent=2))
        return 0
    W = args.gpus * args.nodes
    M = args.batch // (args.micro_batch * W)
    print(f"{model.describe()}")
    print(f"box: {hw.name}: {hw.summary()}")
    if W == 1:
        print(f"batch {args.batch} sequences x {model.seq_len} tokens = {M} micro-batches of {args.micro_batch}")
    else:
        print(f"{W} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes); global batch {args.batch} "
              f"sequences x {model.seq_len} tokens = {W} ranks x {M} micro-batches of {args.micro_batch}; "
              "throughput below is the world's, per GPU where said")
    for fam, r in results.items():
        if isinstance(r, SimResult):
            print(f"  {fam:<11} placement: {Placement.from_dict(r.meta['schedule']['placement']).describe()}")
    print()
    print(summary_table(results))
    errors = {f: r for f, r in results.items() if not isinstance(r, SimResult)}
    for fam, e in errors.items():
        print(f"\n{fam}: does not fit: {e}")
    ok = {f: r for f, r in results.items() if isinstance(r, SimResult)}
    if len(ok) > 1:
        best = max(ok, key=lambda f: ok[f].tokens_per_s)
        worst = min(ok, key=lambda f: ok[f].tokens_per_s)
        print(f"\nfastest: {best} ({ok[best].tokens_per_s / ok[worst].tokens_per_s:.2f}x {worst})")
    print("model TFLOPS = tokens x (6 x matmul params + 12 x layers x q_dim x seq) / time; "
          "hardware TFLOPS adds the recompute forward")
    if args.out:
        ok_names = [f for f in families if isinstance(results[f], SimResult)]
        where = (f"{args.out}/<schedule>/ for each of {', '.join(ok_names)}" if len(families) > 1 else args.out)
        print(f"wrote timeline.csv, trace.json, gantt.png under {where}")
    if written:
        print(f"wrote plan {written.path} (run it with: tierflow run {written.path})")
    return 0


def world_dict(args: argparse.Namespace) -> dict[str, int]:
    """{gpus, nodes, ranks} of --gpus / --nodes."""
    gpus, nodes = getattr(args, "gpus", 1), getattr(args, "nodes", 1)
    return {"gpus": gpus, "nodes": nodes, "ranks": gpus * nodes}


def add_world_args(p: argparse.ArgumentParser) -> None:
    """--gpus and --nodes: the data-parallel world (tierflow.planner.core.world)."""
    p.add_argument("--gpus", type=positive_int(1024), default=1,
                   help="data-parallel GPUs per box (default 1; at most the profile's topology.gpu_count)")
    p.add_argument("--nodes", type=positive_int(1024), default=1,
                   help="boxes (default 1; more need the profile's network section)")


def write_plan_file(plan: Plan, path: str) -> WrittenPlan:
    """Write a plan for the CLI: large plans are compressed to PATH.gz (planfile.LARGE_PLAN_BYTES), said in one
    line on stderr."""
    from tierflow.planner.io.planfile import LARGE_PLAN_BYTES, write_plan

    written = write_plan(plan, path, compress_over_bytes=LARGE_PLAN_BYTES)
    if written.note():
        logger().warning(f"tierflow: {written.note()}")
    return written


def simulate_plan_file(args: argparse.Namespace) -> int:
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
    print(f"placement: {plan.config.placement.describe()}")
    print()
    print(summary_table({"plan": res}))
    if plan.predicted and "iteration_s" in plan.predicted:
        diff = res.iteration_s / plan.predicted["iteration_s"] - 1
        print(f"\nreplayed iteration {res.iteration_s:,.2f} s vs {plan.predicted['iteration_s']:,.2f} s recorded in the plan ({diff:+.2%})")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import plan_from_graph
    from tierflow.planner.search.explain import explain
    from tierflow.planner.search.plan_search import plan_search
    from tierflow.planner.search.problem import Problem

    model = get_model(args.model)
    if args.seq is not None:
        model = model.with_seq(args.seq)
    hw = load_hw(args.hw, args.set)
    prog = Progress(1, "planning")

    def progress(i: int, n: int, what: str) -> None:
        prog.update(i, n, what)

    mbs = [args.micro_batch] if args.micro_batch else None
    problem = Problem(model, hw, args.batch, model.seq_len, allow_ssd=not args.no_ssd, gpus=args.gpus,
                      nodes=args.nodes)
    rb = problem.rank_batch  # candidates describe one rank's micro-batches
    sr = plan_search(problem, time_limit_s=args.time_limit, micro_batches=mbs, progress=progress,
                     baselines=not args.no_baselines)
    prog.finish()
    best = sr.best
    cfg = best.config
    graph = build_graph(model, hw, cfg)
    solver = best.solver.to_dict() if best.solver else {"status": "BASELINE"}
    solver.update({"search_wall_s": sr.wall_s, "candidates": len(sr.evaluated), "predicted_s": best.predicted_s,
                   "verified_s": best.verified_s, "skipped_by_time_limit": sr.skipped_by_time_limit})
    if best.prediction:
        solver["prediction"] = best.prediction.to_dict()
    if not args.no_window and problem.ranks == 1:  # the window model covers one rank
        from tierflow.planner.search.plan_search import window_check

        solver.update(window_check(problem, cfg, time_limit_s=min(10.0, max(1.0, args.time_limit / 10))))
    written = None
    if args.out:
        written = write_plan_file(plan_from_graph(model, hw, cfg, graph, predicted=best.result, solver=solver), args.out)
    lines = explain(sr) if args.explain else []
    if args.json:
        if args.emit_ds_config:
            emit_ds_config(args.emit_ds_config, model, cfg, stream=sys.stderr)
        print(json.dumps({"model": model.name, "params": model.total_params(), "hw": hw.name,
                          "decisions": cfg.to_dict(), "solver": solver, "predicted": best.result.to_dict(),
                          "candidate": best.candidate.describe(rb), "plan_file": str(written.path) if written else None,
                          "world": problem.world.to_dict(), **best.result.per_gpu(),
                          "explain": lines,
                          "evaluated": [{"candidate": e.candidate.describe(rb),
                                         "verified_s": e.verified_s if e.result else None,
                                         "solver": e.solver.to_dict() if e.solver else None,
                                         "error": e.error} for e in sr.evaluated]}, indent=2))
        return 0
    print(model.describe())
    print(f"box: {hw.name}: {hw.summary()}")
    print(f"batch {args.batch} sequences x {model.seq_len} tokens; searched {len(sr.evaluated)} candidates in {sr.wall_s:.1f} s")
    if sr.skipped_by_time_limit:
        print(f"note: the time limit ({args.time_limit:g} s) left {sr.skipped_by_time_limit} candidate(s) untried, so a "
              f"faster plan may exist (raise --time-limit)")
    if problem.ranks > 1:
        print(f"{problem.ranks} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes): each runs "
              f"{rb} sequences; candidates below are one rank's; tokens/s is the world's")
    rows = []
    ok = sorted((e for e in sr.evaluated if e.result), key=lambda e: e.verified_s)
    for e in ok[:8]:
        s_ = e.solver
        rows.append([e.candidate.describe(rb), f"{e.verified_s:,.1f} s", f"{e.result.tokens_per_s:,.0f}",
                     f"{e.result.hw_tflops:.1f}", s_.status if s_ else "-", f"{s_.objective_s:,.1f} s" if s_ else "-"])
    print()
    print(fmt_table(rows, ["candidate (best first)", "simulated", "tokens/s", "hw TFLOPS", "CP-SAT", "objective"]))
    print()
    print(f"chosen: {best.candidate.describe(rb)}; {cfg.swap_layers} of {model.num_layers} layers swap "
          f"their activations instead of recomputing")
    print(f"placement: {cfg.placement.describe()}")
    if best.solver:
        r = best.solver
        print(f"placement solver: CP-SAT {r.status}, objective {r.objective_s:,.2f} s, best bound "
              f"{r.best_bound_s:,.2f} s, gap {r.gap:.1%}, {r.wall_s:.2f} s")
    if best.prediction:
        r = best.prediction
        print(f"prediction (slot model, {r.constraints:,} windows): {r.solver} {r.status}, {r.objective_s:,.2f} s per "
              f"iteration, {r.wall_s:.2f} s")
    if "window_status" in solver:
        print(f"window check: CP-SAT {solver['window_status']} on a {solver['window_layers']}-layer window "
              f"({solver['window_tasks']} tasks): the schedule's own order takes {solver['window_greedy_s']:.4g} s at "
              f"solo link rates, the best order found {solver['window_makespan_s']:.4g} s, proven bound "
              f"{solver['window_bound_s']:.4g} s (gap {solver['window_gap']:.1%}, {solver['window_wall_s']:.1f} s)")
    res = best.result
    print(f"verified by simulation: {res.iteration_s:,.2f} s per iteration ({res.iteration_s / best.predicted_s - 1:+.1%} "
          f"vs the prediction), {res.tokens_per_s:,.0f} tokens/s, {res.model_tflops:.1f} model / "
          f"{res.hw_tflops:.1f} hardware TFLOPS")
    if sr.baseline:
        name, b = min(sr.baseline.items(), key=lambda kv: kv[1].iteration_s)
        print(f"best fixed schedule with default settings: {name} at {b.iteration_s:,.2f} s -> plan is "
              f"{b.iteration_s / res.iteration_s:.2f}x faster")
    for line in lines:
        print(line)
    if written:
        print(f"wrote {written.path} ({len(graph.tasks):,} ops); replay it with: tierflow simulate --plan {written.path}")
    if args.emit_ds_config:
        emit_ds_config(args.emit_ds_config, model, cfg)
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    from tierflow.planner.search.capacity import FAMILIES as CAP_FAMILIES
    from tierflow.planner.search.capacity import largest_all

    hw = load_hw(args.hw, args.set)
    seq = args.seq or 2048
    jobs = len(CAP_FAMILIES) * (2 if hw.ssd.count else 1)
    prog = Progress(jobs, "capacity")
    # check the world once, up front: one line for a bad --gpus / --nodes (not one per worker)
    from tierflow.planner.core.schedules import check_world

    check_world(hw, args.gpus, args.nodes)
    if args.batch % (args.gpus * args.nodes):
        raise CliError(f"--batch {args.batch} is not divisible by {args.gpus * args.nodes} ranks (use a multiple of it)")
    answers = largest_all(hw, args.batch, seq, gpus=args.gpus, nodes=args.nodes, on_answer=lambda a: prog.step(
        f"{a.family} {'with' if a.with_ssd else 'without'} SSDs"))
    prog.finish()
    checks = []
    for name in args.model or []:
        from tierflow.planner.search.capacity import fits

        m = get_model(name).with_seq(min(seq, get_model(name).max_positions or seq))
        checks.append((name, {s: fits(m, hw, args.batch, seq, s, args.gpus, args.nodes) for s in (True, False)}))
    if args.json:
        print(json.dumps({"hw": hw.name, "batch": args.batch, "seq": seq, "world": world_dict(args), "largest": [
            {"family": a.family, "with_ssd": a.with_ssd, "model": a.model.describe() if a.model else None,
             "params": a.params, "layers": a.model.num_layers if a.model else None,
             "hidden": a.model.hidden if a.model else None,
             "requirements_bytes": a.requirements,
             "tokens_per_s": a.verified.tokens_per_s if a.verified else None, "note": a.note} for a in answers],
            "checks": {n: c for n, c in checks}}, indent=2))
        return 0
    print(f"box: {hw.name}: {hw.summary()}")
    W = args.gpus * args.nodes
    if W > 1:
        print(f"{W} data-parallel ranks ({args.gpus} GPUs per box x {args.nodes} boxes): each holds its 1/{W} shard "
              f"of the states in its 1/{args.gpus} of its box's host memory and SSDs, and runs {args.batch // W} of the "
              f"{args.batch} sequences")
    print(f"batch {args.batch} x seq {seq}; most frugal plan: vertical, micro-batch 1, states and checkpoints "
          f"on the SSDs when used (else in CPU memory)")
    rows = []
    for a in answers:
        rows.append([a.family, "CPU+GPU+SSD" if a.with_ssd else "CPU+GPU", a.model.describe().split(":")[1].strip()
                     if a.model else a.note, f"{a.params / 1e9:,.1f}B",
                     f"{a.verified.tokens_per_s:,.1f}" if a.verified else "-"])
    print(fmt_table(rows, ["family", "tiers", "largest model", "params", "tokens/s (simulated)"]))
    for name, c in checks:
        print(f"{name}: " + ", ".join(f"{'with' if s else 'without'} SSDs: {'fits' if ok else 'does not fit'}"
                                      for s, ok in c.items()))
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from tierflow.planner.search.fit import FitField, fit, load_runs, write_fitted_profile

    fields = [FitField.parse(f) for f in args.field or []]
    runs = load_runs(args.runs)
    hw = load_hw(args.hw or runs[0].hw, args.set)
    prog = Progress(1, "fitting")
    res = fit(runs, hw, fields, loo=args.loo, progress=lambda i, n, what: prog.update(i, n, what))
    prog.finish()
    fitted = write_fitted_profile(hw, res, args.out, Path(args.runs).name) if args.out else None
    if args.json:
        print(json.dumps({**res.to_dict(), "runs_file": str(args.runs), "profile_file": args.out}, indent=2))
        return 0
    pct = lambda v: "-" if v is None else f"{v:+.1%}"  # noqa: E731
    print(f"base: {hw.name}: {hw.summary()}")
    print(f"{len(runs)} runs from {args.runs}; {res.evaluations} evaluations, {res.simulations} simulations, "
          f"{res.wall_s:.1f} s\n")
    print(fmt_table([[f.key, f"{f.lower:g} .. {f.upper:g}", f"{res.initial[f.key]}", f"{res.values[f.key]:.4g}",
                      "unidentified" if f.key in res.unidentified else res.at_bound.get(f.key, "ok")]
                     for f in res.fields], ["field", "bounds", "base", "fitted", "status"]))
    print()
    print(fmt_table([[f"{r.run.row}. {r.run.label()}", r.run.measure, f"{r.measured:.4g}", f"{r.predicted:.4g}",
                      str(r.micro_batch), pct(r.residual), pct(r.loo_residual)] for r in res.runs],
                    ["row. run", "measure", "measured", "predicted", "mb", "residual", "LOO"]))
    print(f"\nRMS relative error {res.rms:.2%} (max {res.max_abs:.2%})"
          + (f"; leave-one-out RMS {res.loo_rms:.2%} (max {res.loo_max_abs:.2%})" if res.loo_rms is not None else ""))
    for note in res.notes():
        print(note)
    if fitted:
        print(f"wrote {args.out} ({fitted.name})")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    for name in list_models():
        print(get_model(name).describe())
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    for name in list_profiles():
        hw = load_profile(name)
        print(f"{name:<16} {hw.summary()}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tierflow.planner.io.compare import compare, format_comparison, plot_comparison
    from tierflow.planner.io.planfile import load_plan

    c = compare(load_plan(args.plan), args.trace)
    if args.plot:
        plot_comparison(c, args.plot)
    if args.json:
        print(json.dumps(c.to_dict(), indent=2))
        return 0
    print(format_comparison(c))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def add_box_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """--model, --hw and --set, shared by the commands that take a model and a box."""
    if model:
        p.add_argument("--model", default="gpt3-175b",
                       help="zoo name (see `tierflow models`), a HF config.json or model directory, or a hub id "
                       "(org/name) in the local HF cache (never downloaded)")
    p.add_argument("--hw", default="rtx4090-lohan", help="profile name (see `tierflow profiles`) or a YAML path")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a profile field, e.g. ssd.count=6")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="tierflow", description="Plan, simulate and run training of models larger than "
                                "GPU memory over GPU memory, CPU memory and NVMe SSDs.")
    p.add_argument("--version", action="version", version=f"tierflow {__version__}")
    add_verbosity_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("simulate", help="simulate schedules of a model on a box and report throughput",
                       description="Simulate training iterations and report the steady state. With no arguments: "
                       "GPT-3 175B on the RTX 4090 box (Fuyou's), every schedule side by side.")
    add_box_args(s)
    s.add_argument("--schedule", default="all", choices=[*FAMILIES, "all"], help="schedule family (default: all)")
    s.add_argument("--batch", type=positive_int(MAX_BATCH), default=64, help="global batch in sequences (default 64)")
    s.add_argument("--micro-batch", type=positive_int(MAX_BATCH), default=2,
                   help="sequences per micro-batch (default 2)")
    s.add_argument("--seq", type=positive_int(), default=None, help="sequence length (default: the model's)")
    s.add_argument("--group", type=positive_int(MAX_BATCH), default=None,
                   help="micro-batches per block sweep (block schedule)")
    s.add_argument("--alpha", type=fraction_below_one, default=None,
                   help="deferred optimizer fraction, within [0, 1) (vertical default 0.25)")
    s.add_argument("--prefetch", type=positive_int(1024), default=1, help="weight buffers fetched ahead (default 1)")
    s.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="how transfers overlap: deepspeed = ZeRO-Infinity as DeepSpeed's code runs it (the default "
                   "of --schedule horizontal), lohan = Fuyou as LoHan's code runs it (the default of --schedule "
                   "fuyou), ideal = as early as the plan allows (every other schedule; tierflow's executor)")
    s.add_argument("--no-recompute", action="store_true", help="keep every activation instead of recomputing")
    s.add_argument("--placement", default=None, help="gpu|cpu|ssd, or JSON / a JSON file of fractions per tensor class")
    s.add_argument("--iterations", type=positive_int(MAX_ITERATIONS), default=3,
                   help="iterations simulated (default 3; the one before the last is reported)")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.add_argument("--out", default=None, help="write timeline.csv, trace.json (Perfetto) and gantt.png here")
    s.add_argument("--plan", default=None, help="replay a plan file written by `tierflow plan` instead")
    s.add_argument("--swap-layers", type=non_negative_int(), default=0,
                   help="the last N layers keep (and swap out) their activations instead of recomputing")
    s.add_argument("--write-plan", default=None, metavar="FILE",
                   help="also write this schedule as a plan file (one --schedule), e.g. for `tierflow run`")
    add_world_args(s)
    add_ds_config_args(s)
    s.set_defaults(func=cmd_simulate)
    pl = sub.add_parser("plan", help="search schedule, micro-batching, placement and recompute; write a plan file",
                        description="Search every decision with the roofline bound, CP-SAT and the simulator; "
                        "every plan is verified by simulating full iterations.")
    add_box_args(pl)
    pl.add_argument("--batch", type=positive_int(MAX_BATCH), default=64, help="global batch in sequences (default 64)")
    pl.add_argument("--seq", type=positive_int(), default=None, help="sequence length (default: the model's)")
    pl.add_argument("--micro-batch", type=positive_int(MAX_BATCH), default=None,
                    help="fix the micro-batch (default: searched)")
    pl.add_argument("--time-limit", type=positive_float(7 * 24 * 3600), default=60.0,
                    help="seconds for the whole search, > 0 (default 60)")
    pl.add_argument("--no-ssd", action="store_true", help="use only GPU and CPU memory")
    pl.add_argument("--no-baselines", action="store_true", help="do not simulate the fixed schedules for comparison")
    pl.add_argument("--explain", action="store_true", help="say what binds and what would help most")
    pl.add_argument("--no-window", action="store_true", help="skip the exact CP-SAT check of a 2-layer window")
    pl.add_argument("-o", "--out", default=None, help="write the plan file here (JSON, docs/plan-format.md)")
    pl.add_argument("--json", action="store_true", help="print the result as JSON")
    pl.add_argument("--emit-ds-config", default=None, metavar="JSON",
                    help="also write the nearest DeepSpeed config for the chosen plan (and say what it cannot express)")
    add_world_args(pl)
    pl.set_defaults(func=cmd_plan)
    ca = sub.add_parser("capacity", help="the largest model of each family that trains on a box")
    add_box_args(ca, model=False)
    ca.add_argument("--batch", type=positive_int(MAX_BATCH), default=16, help="global batch in sequences (default 16)")
    ca.add_argument("--seq", type=positive_int(), default=None, help="sequence length (default 2048)")
    ca.add_argument("--model", action="append", help="also check whether this model fits (repeatable)")
    ca.add_argument("--json", action="store_true", help="print the result as JSON")
    add_world_args(ca)
    ca.set_defaults(func=cmd_capacity)
    co = sub.add_parser("compare", help="predicted vs measured time per op kind and resource (plan vs tierflow run trace)",
                        description="Compare a plan's simulated op times with a trace measured by `tierflow run --out`: "
                        "per op kind, per resource and per iteration, and plot both timelines.")
    co.add_argument("plan", help="the plan file that was run")
    co.add_argument("trace", help="trace.json written by `tierflow run --out DIR`")
    co.add_argument("--plot", default=None, metavar="PNG", help="draw the predicted and measured timelines here")
    co.add_argument("--json", action="store_true", help="print the comparison as JSON")
    co.set_defaults(func=cmd_compare)
    fi = sub.add_parser("fit", help="fit hardware-profile fields to measured runs through the simulator",
                        description="Fit a few profile fields, within bounds, to measured runs (CSV or YAML: "
                        "model, hw, schedule, batch, micro_batch, seq, placement, overrides, measured, measure) by "
                        "minimising the relative error of the simulated values; report residuals, leave-one-out "
                        "errors and unidentified fields, and write the fitted profile.")
    fi.add_argument("runs", help="CSV or YAML file of measured runs")
    fi.add_argument("--hw", default=None, help="base profile name or YAML path (default: the runs' hw column)")
    fi.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a base profile field first")
    fi.add_argument("--field", action="append", metavar="KEY=LOW:HIGH", help="a field to fit within bounds, e.g. "
                    "ssd.read_gbps=0.5:8 (repeatable)")
    fi.add_argument("-o", "--out", default=None, help="write the fitted profile (YAML) here")
    fi.add_argument("--loo", action=argparse.BooleanOptionalAction, default=True,
                    help="leave-one-out refits (default: on)")
    fi.add_argument("--json", action="store_true", help="print the result as JSON")
    fi.set_defaults(func=cmd_fit)
    sub.add_parser("models", help="list the model zoo").set_defaults(func=cmd_models)
    sub.add_parser("profiles", help="list the bundled hardware profiles").set_defaults(func=cmd_profiles)
    for ep in entry_points(group="tierflow.commands"):
        try:
            register = ep.load()
        except ImportError as e:  # e.g. torch missing: the command says so when used
            missing = str(e)
            sp = sub.add_parser(ep.name, help=f"(unavailable: {missing})")
            sp.set_defaults(func=lambda a, m=missing: (_ for _ in ()).throw(CliError(m)))
            continue
        register(sub)
    for sp in set(sub.choices.values()):  # -q / -v after the subcommand too, the registered ones included
        add_verbosity_options(sp, on_subcommand=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        configure(level_of(args))
    except ValueError as e:
        print(f"tierflow: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args) or 0
    except CapacityError as e:
        print(f"tierflow: does not fit: {e}", file=sys.stderr)
        return 3
    except (CliError, *USER_ERRORS) as e:
        print(f"tierflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
