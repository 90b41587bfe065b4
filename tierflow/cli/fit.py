"""`tierflow fit`: fit hardware-profile fields, within bounds, to measured runs through the simulator
(tierflow.planner.fit.profile_fit), report the residuals and write the fitted profile."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tierflow.cli.args import add_hw_arg, add_set_arg
from tierflow.cli.tables import fmt_table
from tierflow.hwprofiles import load_hw, parse_overrides
from tierflow.outputs import check_output_file
from tierflow.planner.io.progress import Progress


def add_parser(sub: Any) -> argparse.ArgumentParser:
    fi = sub.add_parser("fit", help="fit hardware-profile fields to measured runs through the simulator",
                        description="Fit a few profile fields, within bounds, to measured runs (CSV or YAML: "
                        "model, hw, schedule, batch, micro_batch, seq, placement, overrides, measured, "
                        "measure) by minimising the relative error of the simulated values; report "
                        "residuals, leave-one-out errors and unidentified fields, and write the fitted "
                        "profile.")
    fi.add_argument("runs", nargs="?", default=None, help="CSV or YAML file of measured runs (or --trace)")
    fi.add_argument("--trace", default=None, metavar="TRACE", help="instead of runs: the trace.json that "
                    "`tierflow run --out` wrote; fits the fields its op kinds measure (needs --plan)")
    fi.add_argument("--plan", default=None, metavar="PLAN", help="the plan file the --trace was measured "
                    "with (its hardware is the base profile unless --hw is given)")
    add_hw_arg(fi, None, "base profile name or YAML path (default: the runs' hw column, or the plan's)")
    add_set_arg(fi, "override a base profile field first")
    fi.add_argument("--field", action="append", metavar="KEY=LOW:HIGH", help="a field to fit within bounds, "
                    "e.g. ssd.read_gbps=0.5:8 (repeatable)")
    fi.add_argument("-o", "--out", default=None, help="write the fitted profile (YAML) here")
    fi.add_argument("--loo", action=argparse.BooleanOptionalAction, default=True,
                    help="leave-one-out refits (default: on)")
    fi.add_argument("--json", action="store_true", help="print the result as JSON")
    return fi


def run(args: argparse.Namespace) -> int:
    from tierflow.planner.fit.profile_fit import FitError, FitField, fit, load_runs, write_fitted_profile

    fields = [FitField.parse(f) for f in args.field or []]
    if (args.trace is None) == (args.runs is None) or (args.trace is None) != (args.plan is None):
        raise FitError("give either a runs file, or --trace TRACE with --plan PLAN (the plan it was measured "
                       "with)")
    if args.out:  # before the fit (tierflow.outputs)
        check_output_file(args.out, "-o")
    if args.trace:
        return _run_trace(args, fields)
    runs = load_runs(args.runs)
    hw = load_hw(args.hw or runs[0].hw, args.set)
    prog = Progress(1, "fitting")
    res = fit(runs, hw, fields, loo=args.loo, progress=lambda i, n, what: prog.update(i, n, what))
    prog.finish()
    fitted = write_fitted_profile(hw, res, args.out, Path(args.runs).name) if args.out else None
    return _report(args, hw, res, fitted, f"{len(runs)} runs from {args.runs}")


def _run_trace(args: argparse.Namespace, fields: list) -> int:
    from tierflow.planner.fit.profile_fit import write_fitted_profile
    from tierflow.planner.fit.trace_fit import fit_trace, with_tied
    from tierflow.planner.io.compare import load_measured
    from tierflow.planner.io.planfile import load_plan

    plan = load_plan(args.plan)
    hw = load_hw(args.hw, args.set) if args.hw else plan.hardware.with_overrides(parse_overrides(args.set))
    prog = Progress(1, "fitting")
    start_s, end_s = load_measured(args.trace, len(plan.graph.tasks), plan)
    res = fit_trace(plan, start_s, end_s, hw, fields or None, source=args.trace,
                    progress=lambda i, n, what: prog.update(i, n, what))
    prog.finish()
    fitted = (write_fitted_profile(hw, with_tied(res, hw), args.out, Path(args.trace).name) if args.out
              else None)
    return _report(args, hw, res, fitted, f"{len(res.runs)} op groups of {args.trace} (plan {args.plan})")


def _report(args: argparse.Namespace, hw: Any, res: Any, fitted: Any, what: str) -> int:
    if args.json:
        print(json.dumps({**res.to_dict(), "runs_file": args.runs, "trace_file": args.trace,
                          "plan_file": args.plan, "profile_file": args.out}, indent=2))
        return 0
    print(f"base: {hw.name}: {hw.summary()}")
    print(f"{what}; {res.evaluations} evaluations, {res.simulations} simulations, {res.wall_s:.1f} s\n")
    print(fmt_table([[f.key, f"{f.lower:g} .. {f.upper:g}", f"{res.initial[f.key]}",
                      f"{res.values[f.key]:.4g}",
                      "unidentified" if f.key in res.unidentified else res.at_bound.get(f.key, "ok")]
                     for f in res.fields], ["field", "bounds", "base", "fitted", "status"]))
    print()
    print(fmt_table([[f"{r.run.row}. {r.run.label()}", r.run.measure, f"{r.measured:.4g}",
                      f"{r.predicted:.4g}", str(r.micro_batch), _pct(r.residual), _pct(r.loo_residual)]
                     for r in res.runs],
                    ["row. run", "measure", "measured", "predicted", "mb", "residual", "LOO"]))
    loo = (f"; leave-one-out RMS {res.loo_rms:.2%} (max {res.loo_max_abs:.2%})" if res.loo_rms is not None
           else "")
    print(f"\nRMS relative error {res.rms:.2%} (max {res.max_abs:.2%})" + loo)
    for note in res.notes():
        print(note)
    if fitted:
        print(f"wrote {args.out} ({fitted.name})")
    return 0


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1%}"
