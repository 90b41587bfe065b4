"""The `tierflow` command: its parser, the command table and the one mapping of errors to exit codes.

Every command is a module of this package with the same two functions: `add_parser(subparsers)` declares its
flags (the shared ones come from `args`) and returns its parser, and `run(args) -> int` runs it. `COMMANDS`
lists them in help order. Building the parser imports no torch: the executor's commands (run, calibrate,
env) import the executor inside their `run`, so that `tierflow simulate` starts fast. A command that needs an
extra (its module's `EXTRA`: `run` and `calibrate` need torch) checks it before it does anything
(`tierflow.extras.require`): without it, one line with the install command for this install, exit code 2.

Errors: every `tierflow.errors.TierflowError` is printed as one line, ``tierflow: <prefix>: <message>``, and
exits with its `exit_code` (2 for bad input, 3 when something does not fit); a plain ValueError or OSError
exits 2, an interrupt 130 - the one mapping, `exits.exit_code`, which `tierflow run` also uses for its own
errors (its lines say ``tierflow run: ...``) before a rank of several ends.
"""

from __future__ import annotations

import argparse
import sys

from tierflow import __version__
from tierflow.cli import calibrate, capacity, compare, env, fit, models, plan, profiles, run, simulate
from tierflow.cli.argtypes import OneLineParser
from tierflow.cli.exits import exit_code
from tierflow.errors import TierflowError
from tierflow.extras import require
from tierflow.logs import add_verbosity_options, configure, level_of

COMMANDS = (simulate, plan, capacity, compare, fit, models, profiles, calibrate, env, run)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="tierflow", description="Plan, simulate and run training of models larger than "
                      "GPU memory over GPU memory, CPU memory and NVMe SSDs.")
    p.add_argument("--version", action="version", version=f"tierflow {__version__}")
    add_verbosity_options(p)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        sp = command.add_parser(sub)
        sp.set_defaults(func=command.run, needs_extra=getattr(command, "EXTRA", None))
        add_verbosity_options(sp, on_subcommand=True)  # -q / -v after the subcommand too
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
        if args.needs_extra:
            require(args.needs_extra, f"tierflow {args.command}")  # one line and exit 2, before any work
        return args.func(args) or 0
    except (TierflowError, ValueError, OSError, KeyboardInterrupt, MemoryError) as e:
        return exit_code(e)
