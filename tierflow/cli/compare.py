"""`tierflow compare`: a plan's predicted op times against a trace measured by `tierflow run --out`, per op
kind, per resource and per iteration, and both timelines drawn."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    co = sub.add_parser("compare",
                        help="predicted vs measured time per op kind and resource (plan vs tierflow "
                        "run trace)",
                        description="Compare a plan's simulated op times with a trace measured by `tierflow "
                        "run --out`: per op kind, per resource and per iteration, and plot both timelines.")
    co.add_argument("plan", help="the plan file that was run")
    co.add_argument("trace", help="trace.json written by `tierflow run --out DIR`")
    co.add_argument("--plot", default=None, metavar="PNG",
                    help="draw the predicted and measured timelines here")
    co.add_argument("--json", action="store_true", help="print the comparison as JSON")
    return co


def run(args: argparse.Namespace) -> int:
    from tierflow.outputs import check_output_file
    from tierflow.planner.io.compare import compare, format_comparison, plot_comparison
    from tierflow.planner.io.planfile import load_plan

    if args.plot:
        check_output_file(args.plot, "--plot")  # before the comparison (tierflow.outputs)
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
