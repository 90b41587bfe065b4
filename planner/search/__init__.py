"""The search: the planning problem, per-iteration loads, the CP-SAT placement model, the candidate search,
the slot model's prediction, the window check, capacity and explanations (profile fitting is planner/fit)."""
