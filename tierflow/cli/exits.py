"""The one mapping of errors to exit codes, for every command (`tierflow.cli.main`, and `tierflow run`, which
must end a rank of several after it): an error is printed as one line on stderr, ``<who>: <prefix>:
<message>`` (``<who>: <message>`` when its class has no prefix: its message says what it is), and its code
returned.

- a `tierflow.errors.TierflowError`: its `exit_code` (2 bad input, 3 does not fit, 1 the executor failed, 4
  diverged, 5 another rank died) and `prefix`; an error that names its rank (`rank`) is said as
  ``<who> [rank R]: ...``;
- a run that stopped early (tierflow.executor.train_loop.RunStopped: diverged, a stop signal, a checkpoint
  that could not be written): its `exit_code`;
- a plain ValueError or OSError: 2; an interrupt (KeyboardInterrupt): 130;
- a MemoryError: 3, one line naming the input being read and its bound when one was
  (`hwprofiles.inputs.reading`; such a reader raises `InputMemoryError`, a TierflowError, itself).

With several ranks an error every rank meets alike (`agreed`: a bad launch, a stop) is said by rank 0 only.
"""

from __future__ import annotations

import os
import sys

from tierflow.errors import TierflowError
from tierflow.hwprofiles.inputs import memory_error_line


def lead_rank() -> bool:
    """Is this process rank 0 of its run (or a run of one)? torchrun sets RANK for every rank."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def exit_code(e: BaseException, who: str = "tierflow") -> int:
    """Print `e` as one line on stderr (unless another rank says it) and return its exit code. Raises `e` when
    it is none of the above (a bug: the traceback is wanted)."""
    if isinstance(e, KeyboardInterrupt):
        line, code = "interrupted", 130
    elif isinstance(e, TierflowError) or isinstance(getattr(e, "exit_code", None), int):
        prefix = getattr(e, "prefix", "")
        line, code = (f"{prefix}: {e}" if prefix else str(e)), e.exit_code
    elif isinstance(e, MemoryError):
        line, code = f"out of memory: {memory_error_line()}", 3
    elif isinstance(e, (ValueError, OSError)):
        line, code = f"error: {e}", 2
    else:
        raise e
    if lead_rank() or not getattr(e, "agreed", False):
        rank = getattr(e, "rank", None)
        print(f"{who}{'' if rank is None else f' [rank {rank}]'}: {line}", file=sys.stderr)
    return code
