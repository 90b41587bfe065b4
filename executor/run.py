"""`tierflow run` as a library: the executor's entry points, in one place for a program that trains with a
plan (the command line, tierflow/cli/run.py, is one such caller; the experiments and tests are others).

    RunConfig(steps=..., ...)                 the run's configuration, one frozen tree (options.py)
    run_plan(plan, RunConfig) -> RunResult    train with a loaded plan (train_loop.py; its Trainer holds the
                                              run's state: the step, the records, the gradient norms)
    run_file(RunConfig) -> RunResult          what `tierflow run PLAN` does: the plan file's checks, then
                                              run_plan (launch.py)
    adapt_file(RunConfig) -> dict             `--adapt`: a run that corrects its own plan (adapt.py)

Errors are tierflow.errors.TierflowError subclasses (RunError: bad input, exit 2; Diverged: 4; RankLost: 5);
a run that stops early raises RunStopped (train_loop.py) with the steps done so far. The library never ends
the process: the command maps what it raises to exit codes (tierflow/cli/exits.py).
"""

from __future__ import annotations

from tierflow.executor.adapt import adapt_file, adapt_run
from tierflow.executor.dist import RankLost
from tierflow.executor.export import StepRecord
from tierflow.executor.launch import run_file
from tierflow.executor.options import (
    AdaptOptions,
    CheckpointOptions,
    DistOptions,
    EvalOptions,
    ModelDataOptions,
    OptimizerOptions,
    OutputOptions,
    RunConfig,
    RunError,
)
from tierflow.executor.train_loop import Diverged, RunResult, RunStopped, Trainer, run_plan

__all__ = ["AdaptOptions", "CheckpointOptions", "Diverged", "DistOptions", "EvalOptions", "ModelDataOptions",
           "OptimizerOptions", "OutputOptions", "RankLost", "RunConfig", "RunError", "RunResult",
           "RunStopped", "StepRecord", "Trainer", "adapt_file", "adapt_run", "run_file", "run_plan"]
