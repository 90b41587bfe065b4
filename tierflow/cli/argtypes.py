"""Argument types for every numeric flag of every `tierflow` subcommand, in one place: argparse calls them on
the text, and a bad value (0 or -3 for a count, nan, inf or -5 for a time) is refused before any work starts,
with one line naming the flag (argparse adds "argument --flag:") and exit code 2.

    p.add_argument("--iterations", type=positive_int(limit=1000), default=3)
    p.add_argument("--time-limit", type=positive_float(), default=60.0)

Upper limits are generous but finite: a value past them would build a task graph larger than memory.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from tierflow.planner.io.deepspeed.config import MAX_BATCH

# the most micro-batches (MAX_BATCH: a DeepSpeed config's batch keys are held to it too) / iterations /
# sequences a flag accepts: generous, but a graph past these would not fit in memory (ops grow with layers x
# micro-batches x iterations)
MAX_ITERATIONS = 1000
MAX_STEPS = 10**9


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_in(low: int, high: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An integer within [low, high] (high None: no upper limit)."""

    def parse(text: str) -> int:
        value = _int(text, what)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:,}, got {value:,}")
        return value

    parse.__name__ = what  # argparse names the type in "invalid <name> value" messages
    return parse


def positive_int(limit: int | None = None) -> Callable[[str], int]:
    return int_in(1, limit, "a positive integer")


def non_negative_int(limit: int | None = None) -> Callable[[str], int]:
    return int_in(0, limit, "a non-negative integer")


def positive_float(limit: float | None = None) -> Callable[[str], float]:
    """A finite number > 0 (and <= limit)."""

    def parse(text: str) -> float:
        value = _float(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if limit is not None and value > limit:
            raise argparse.ArgumentTypeError(f"must be <= {limit:g}, got {text}")
        return value

    parse.__name__ = "a positive number"
    return parse


def non_negative_float(limit: float | None = None) -> Callable[[str], float]:
    """A finite number >= 0 (and <= limit)."""

    def parse(text: str) -> float:
        value = _float(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        if limit is not None and value > limit:
            raise argparse.ArgumentTypeError(f"must be <= {limit:g}, got {text}")
        return value

    parse.__name__ = "a non-negative number"
    return parse


def fraction_below_one(text: str) -> float:
    """A number within [0, 1) (the deferred optimizer fraction alpha)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1), got {text}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (what, which flag, where to look)
    and exit code 2, instead of the usage block and the message; subparsers inherit the class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")
        sys.exit(2)


__all__ = ["MAX_BATCH", "MAX_ITERATIONS", "MAX_STEPS", "OneLineParser", "fraction_below_one", "int_in",
           "non_negative_float", "non_negative_int", "positive_float", "positive_int"]
