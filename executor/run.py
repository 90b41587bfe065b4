"""`tierflow run` as a library: the executor's entry points, in one place for a program that trains with a
plan (the command line, tierflow/cli/run.py, is one such caller; the experiments and tests are others).

    run_plan(plan, RunOptions) -> RunResult     train with a loaded plan (train_loop.py)
    run_request(RunRequest) -> RunOutcome       what `tierflow run PLAN` does: the plan file's checks, then
                                                run_plan (launch.py; RunRequest's option groups: options.py)
    adapt_run(plan, RunRequest) -> dict         `--adapt`: a run that corrects its own plan (adapt.py)

Errors are tierflow.errors.TierflowError subclasses (RunError: bad input, exit 2; Diverged: 4; RankLost: 5);
a run that stops early raises RunStopped (train_loop.py) with the steps done so far.
"""

from __future__ import annotations

from tierflow.executor.adapt import adapt_request, adapt_run
from tierflow.executor.dist import RankLost
from tierflow.executor.export import StepRecord
from tierflow.executor.launch import RunOutcome, run_request
from tierflow.executor.options import RunError, RunRequest
from tierflow.executor.train_loop import Diverged, RunOptions, RunResult, RunStopped, run_plan

__all__ = ["Diverged", "RankLost", "RunError", "RunOptions", "RunOutcome", "RunRequest", "RunResult",
           "RunStopped", "StepRecord", "adapt_request", "adapt_run", "run_plan", "run_request"]
