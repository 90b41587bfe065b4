"""The slot model's LP: the seconds each window needs (`window_needs`: the largest of its rate terms), the
least iteration time over the slot durations (`solve_slots`: GLOP, by constraint generation), and the
prediction of a schedule whose decisions are all made (`predict_config`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.search.slots.expand import build_slot_model
from tierflow.planner.search.slots.layout import SlotModel
from tierflow.planner.search.slots.terms import (
    chain_needs,
    dram_needs,
    eager_terms,
    runtime_box,
    window_terms,
)


class SlotModelError(TierflowError, RuntimeError):
    """The slot model's LP could not be solved."""


@dataclass
class SolverReport:
    status: str
    objective_s: float
    best_bound_s: float
    gap: float
    wall_s: float
    solver: str = "CP-SAT"
    constraints: int = 0  # the rows the solver needed (slot model: windows added by constraint generation)

    def to_dict(self) -> dict:
        return {"solver": self.solver, "status": self.status, "objective": self.objective_s,
                "best_bound": self.best_bound_s, "gap": self.gap, "wall_s": self.wall_s,
                "constraints": self.constraints}


class WindowNeeds(NamedTuple):
    """What the LP must satisfy (`window_needs`)."""

    need_s: np.ndarray  # (W,) seconds each window needs
    throughput_s: float  # the least iteration any resource's whole load allows


def window_needs(sm: SlotModel, hw: HardwareProfile) -> WindowNeeds:
    """Seconds each window needs (the largest of its terms: each resource alone, both PCIe directions, a
    shared SSD array, a serial chain, a shared link's direction against the other running eagerly beside it),
    and the least iteration any resource's whole load allows. CPU Adam at the rate of the runtime the slot
    model was built for (terms.runtime_box)."""
    hw = runtime_box(sm, hw)
    per_channel, _ = window_terms(hw)
    linear_s = np.einsum("wcv,kc->wkv", sm.work, per_channel)[:, :, 0]  # (W, K): seconds needed by each term
    # a shared link's direction A against B running eagerly beside it: the smaller of two linear branches
    eager = eager_terms(hw)
    eager_s = np.zeros((len(sm.work), len(eager), 2))
    for p, term in enumerate(eager):
        due = sm.work[:, term.channel, 0]
        eager_s[:, p, 0] = due * (term.s_per_byte + term.extra_s_per_byte)
        eager_s[:, p, 1] = due * term.s_per_byte + sm.released[:, term.other, 0] * term.other_extra_s_per_byte
    need_s = np.concatenate([linear_s, eager_s.min(axis=2)], axis=1).max(axis=1)
    need_s = np.maximum(need_s, chain_needs(sm, hw))
    need_s = np.maximum(need_s, dram_needs(sm, hw))
    return WindowNeeds(need_s, float((per_channel @ sm.total[:, 0]).max()))


def solve_slots(sm: SlotModel, hw: HardwareProfile, *, tol: float = 1e-9,
                max_rounds: int = 200) -> SolverReport:
    """The least iteration time of the slot model: the linear program

        min  period . D   s.t.  counts_w . D >= need_w (every window w),  D >= gpu,  period . D >= throughput

    over the slot durations D, solved with GLOP (OR-Tools' simplex) by constraint generation: start from the
    throughput row, add the windows the current solution violates (the 256 worst per round), re-solve warm,
    until no window is violated by more than `tol` (relative). Every window is checked at the end, so the
    objective satisfies the whole model; status OPTIMAL means the LP optimum was reached, FEASIBLE that the
    round limit stopped it first (the objective is then a lower bound of the model's optimum)."""
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    need_s, throughput_s = window_needs(sm, hw)
    T = len(sm.gpu)
    lp = pywraplp.Solver.CreateSolver("GLOP")
    lp.SuppressOutput()
    # dual simplex: rows added to an optimal basis leave it dual feasible, so each round re-solves from it
    # (the primal default also stalled, ABNORMAL, on 256 micro-batches with 17,000 copies of a slot in one
    # window)
    lp.SetSolverSpecificParametersAsString("use_dual_simplex: true")
    D = [lp.NumVar(float(sm.gpu[t]), lp.infinity(), f"D{t}") for t in range(T)]
    iteration_s = lp.Sum([float(sm.period[t]) * D[t] for t in range(T)])
    lp.Add(iteration_s >= throughput_s)
    lp.Minimize(iteration_s)
    inf = lp.infinity()
    rows: set[int] = set()
    durations_s = sm.gpu.astype(float).copy()
    status = "FEASIBLE"
    for _ in range(max_rounds):
        violation_s = need_s - sm.counts @ durations_s
        worst = [int(w) for w in np.argsort(-violation_s)[:256]
                 if violation_s[w] > tol * max(1.0, need_s[w]) and int(w) not in rows]
        if not worst:
            status = "OPTIMAL"
            break
        for w in worst:
            # the row as the natural API's `lp.Add(sum(copies_t * D_t) >= need)` makes it (the same bounds,
            # the coefficients in the same order) without building an expression object per term
            copies = sm.counts[w]
            nz = np.flatnonzero(copies)
            row = lp.RowConstraint(float(need_s[w]), inf, "")
            for t, c in zip(nz.tolist(), copies[nz].tolist(), strict=True):
                row.SetCoefficient(D[t], float(c))
            rows.add(w)
        if lp.Solve() != pywraplp.Solver.OPTIMAL:
            raise SlotModelError("the slot model's LP did not solve (numerical trouble)")
        durations_s = np.array([v.solution_value() for v in D])
    obj = max(float(sm.period @ durations_s), throughput_s)
    return SolverReport(status, obj, obj if status == "OPTIMAL" else 0.0, 0.0 if status == "OPTIMAL" else 1.0,
                        time.perf_counter() - t0, solver="GLOP LP", constraints=len(rows) + 1)


def predict_config(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SolverReport:
    """The slot model's prediction of one steady-state iteration of `cfg`, whose decisions are all made. One
    rank only: a plan of several ranks (collectives on `net`, the box's shares) raises SlotModelError, and the
    search then verifies it in the simulator without the slot model's pruning."""
    if cfg.world.ranks > 1:
        raise SlotModelError("the slot model covers one rank; several ranks are verified by simulation only")
    return solve_slots(build_slot_model(model, hw, cfg), hw)
