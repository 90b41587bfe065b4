"""How chatty a command is: `--quiet` / `--verbose`, through the `logging` module.

Every tierflow module logs to a child of the `tierflow` logger (`logging.getLogger(__name__)`). The CLI sets
that logger's level once, from the global options (`tierflow --quiet plan ...`) or the same options after the
subcommand (`tierflow plan ... --quiet`):

- quiet (WARNING): no progress display and no info lines; warnings, errors and the command's result remain;
- normal (INFO, the default): progress and info lines on stderr;
- verbose (DEBUG): also debug detail, e.g. the solver's status for every candidate of `tierflow plan`.

The progress display (planner/io/progress.py) follows the same level, so a command that shows progress needs
nothing else. What a command prints as its result (tables, JSON) goes to stdout and is never affected.
"""

from __future__ import annotations

import argparse
import logging
import sys

LOGGER_NAME = "tierflow"
QUIET, NORMAL, VERBOSE = logging.WARNING, logging.INFO, logging.DEBUG


class _StderrHandler(logging.StreamHandler):
    """Writes to the current sys.stderr (looked up per record, so a redirected or captured stderr is used and
    a replaced one that was closed is never written to)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        # StreamHandler.__init__ assigns it; the current sys.stderr is used instead
        pass


def logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def configure(level: int = NORMAL) -> None:
    """Set the `tierflow` logger's level and give it one handler printing bare messages on stderr."""
    log = logger()
    log.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.propagate = False


def progress_enabled() -> bool:
    """Whether progress is shown: yes unless the `tierflow` logger was set above INFO (--quiet). A logger
    nobody configured (tierflow used as a library) shows progress, as before there were levels."""
    level = logger().level
    return level == logging.NOTSET or level <= logging.INFO


def add_verbosity_options(parser: argparse.ArgumentParser, *, on_subcommand: bool = False) -> None:
    """-q/--quiet and -v/--verbose. On a subcommand the defaults are suppressed, so that a global option given
    before the subcommand is not reset by the subcommand's parser."""
    group = parser.add_mutually_exclusive_group()
    default = argparse.SUPPRESS if on_subcommand else False
    group.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="no progress display, no info lines (errors, warnings and results remain)")
    group.add_argument("-v", "--verbose", action="store_true", default=default,
                       help="debug detail, e.g. the solver's status for every candidate")


def level_of(args: argparse.Namespace) -> int:
    """The logging level the parsed options ask for (both given: an error raised by the caller)."""
    quiet, verbose = getattr(args, "quiet", False), getattr(args, "verbose", False)
    if quiet and verbose:
        raise ValueError("--quiet and --verbose: give one of them")
    return QUIET if quiet else VERBOSE if verbose else NORMAL
