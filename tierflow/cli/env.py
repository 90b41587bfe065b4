"""`tierflow env`: what this machine offers tierflow, as DeepSpeed's `ds_report` does for DeepSpeed (the
report itself: tierflow.executor.env, imported when the command runs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tierflow.errors import UsageError


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "env",
        help="report versions, CUDA/GPUs, O_DIRECT, pinned-memory limits and what calibrate would measure",
        description="Report what this machine offers tierflow (as DeepSpeed's ds_report): versions, CUDA and "
        "the GPUs, whether --ssd-dir takes O_DIRECT, the pinned-memory limit, cores, memory and what "
        "`tierflow calibrate` would measure. Never fails for a missing part: it says what is missing.")
    p.add_argument("--ssd-dir", default=".", metavar="DIR",
                   help="directory to probe for O_DIRECT and free space (default: the current one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from tierflow.executor.env import collect, format_report

    d = Path(args.ssd_dir)
    if not d.is_dir():
        what = "not a directory (a file)" if d.exists() else "no such directory"
        raise UsageError(f"--ssd-dir {args.ssd_dir}: {what} (give an existing directory on the SSD to probe, "
                         "or leave it out for the current one)")
    report = collect(args.ssd_dir)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0
