"""The names of the training options the planner and the command line know without the executor (no torch):
learning-rate schedules (Hugging Face's, executor/optim/lr_schedule.py runs them) and gradient-clipping modes
(executor/optim/clipping.py runs them; tierflow run --clip states their semantics)."""

from __future__ import annotations

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
# the schedules whose factor depends on the run's total number of steps
USES_TOTAL = frozenset({"linear", "cosine"})
# global: exact, the optimizer waits for the step's last gradient; delayed: the previous step's norm
CLIP_MODES = ("global", "delayed")
