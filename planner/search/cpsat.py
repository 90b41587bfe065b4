"""The CP-SAT settings the planner's two models share: a solve that gives the same answer on every run.

CP-SAT is reproducible only when the work it may do is counted in its own deterministic time (not in wall-
clock seconds, which a loaded machine stretches) and one worker searches with a fixed seed: with two or more
workers the threads exchange solutions and bounds as they find them, so which of several equally good answers
comes back, and how far a search cut short has got, depends on how the threads were scheduled. The interleaved
mode that makes several workers deterministic (`interleave_search`) was measured against one worker on real
windows and was slower to prove them (docs/planning.md, "A reproducible search").

`limit` counts CP-SAT's deterministic time, its unit of work (about one second of one modern core; on the
2-core dev machine one unit took 1.3-1.6 s of CPU time). A search that reaches it stops at the same point on
any machine.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

SEED = 20261129  # CP-SAT's random_seed: any fixed value (the day the search was made reproducible)


def deterministic_solver(limit: float) -> cp_model.CpSolver:
    """A CP-SAT solver that stops after `limit` units of deterministic time and searches with one worker and a
    fixed seed, so that the same model gives the same solution on every run and every machine of one OR-Tools
    version."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = float(limit)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = SEED
    return solver


__all__ = ["SEED", "deterministic_solver"]
