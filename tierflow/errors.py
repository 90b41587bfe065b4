"""The one base of tierflow's errors. Every error a user can cause derives from `TierflowError`; its
`exit_code` is the code the `tierflow` command exits with after printing the error as one line (2 unless the
class says otherwise). This module imports nothing, so every layer can derive from it."""

from __future__ import annotations


class TierflowError(Exception):
    """A tierflow error: printed as one line that says what, where and how to fix it."""

    exit_code = 2  # bad input: the documented code of every user error
    prefix = "error"  # printed as "tierflow: <prefix>: <message>"


class DoesNotFit(TierflowError):
    """Something does not fit in a memory tier: the message names the tier and the amount."""

    exit_code = 3
    prefix = "does not fit"


class UsageError(TierflowError):
    """Bad command-line input that no library error covers (a flag's value, a combination of flags): printed
    as one line, exit code 2."""
