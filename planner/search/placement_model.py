"""The CP-SAT placement model of one candidate: where weights, optimizer states and checkpoints live, and how
many layers swap their activations instead of recomputing, minimising the busiest resource's time under every
tier's capacity.

Its coefficients are exact: the work of every resource is affine in the placement fractions and the swap
count, and the coefficients are measured on the schedule builder's own task graphs (`linear_loads`, through
tierflow.planner.search.loads), so the solver and the simulator cannot disagree about traffic. Its memory rows
are the one memory model's (tierflow.planner.core.memory), with the GPU's working memory measured on a 2-layer
window. `solve_placement` follows the sections of OR-Tools' own examples: data, variables, constraints,
objective, solve, extract.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

from ortools.sat.python import cp_model

from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.memory import ScheduleMemory, host_reserve_bytes
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.core.simulator import CapacityError, simulate_graph
from tierflow.planner.core.world import rank_capacity_bytes
from tierflow.planner.search.cpsat import deterministic_solver
from tierflow.planner.search.loads import duplex_coefficient, iteration_loads
from tierflow.planner.search.problem import Problem
from tierflow.planner.search.slots import SolverReport

STEPS = 100  # placement fractions are decided in steps of 1/STEPS
# the decision variables, as fractions: weights on GPU / on SSD, optimizer states on SSD, checkpoints on GPU /
# SSD
VARS = ("w_gpu", "w_ssd", "s_ssd", "c_gpu", "c_ssd")
CKPT_VARS = ("c_gpu", "c_ssd")
# memory rows are in KiB, rounded up (in MiB, a tiny model's 75 KiB of activations per 1/STEPS counted 1 MiB:
# keeping them on a 74 MiB device looked 14 times its size; experiments/lora_tiers.py --cpu, docs/lora.md)
KIB = 2**10
TIME_UNIT_S = 1e-6  # time expressions are in microseconds
HORIZON_UNITS = 10**13


@dataclass
class LinearLoads:
    """work_r(x, n) = base_r + sum_v coef_r[v] x_v + n (swap_r + sum_v swap_coef_r[v] x_v), x_v in [0, 1];
    work is seconds on gpu/cpu and bytes on links, per resource r (and per resource and phase, "gpu@F",
    ...)."""

    base: dict[str, float]
    coef: dict[str, dict[str, float]]
    swap: dict[str, float]
    swap_coef: dict[str, dict[str, float]]

    def work(self, x: dict[str, float], n: int) -> dict[str, float]:
        out = {}
        for r, b in self.base.items():
            v = b + sum(self.coef[v_][r] * x[v_] for v_ in VARS)
            v += n * (self.swap[r] + sum(self.swap_coef[v_][r] * x[v_] for v_ in CKPT_VARS))
            out[r] = v
        return out


@dataclass(frozen=True)
class PlacementMemory:
    """The memory model of one candidate as the solver uses it: the schedule's memory (core.memory) with the
    GPU's working memory measured on a 2-layer window (inf when even that does not fit)."""

    schedule: ScheduleMemory
    gpu_working_bytes: float
    gpu_working_swap_bytes: float


def placement_of(x: dict[str, float]) -> Placement:
    """The placement of decision fractions x (gradients accumulate in host memory)."""
    w = Split(gpu=x["w_gpu"], cpu=round(1 - x["w_gpu"] - x["w_ssd"], 6), ssd=x["w_ssd"])
    s = Split(gpu=0.0, cpu=round(1 - x["s_ssd"], 6), ssd=x["s_ssd"])
    c = Split(gpu=x["c_gpu"], cpu=round(1 - x["c_gpu"] - x["c_ssd"], 6), ssd=x["c_ssd"])
    return Placement(weights=w, master=s, adam_m=s, adam_v=s, grads=Split(), checkpoints=c)


def linear_loads(problem: Problem, cfg: ScheduleConfig) -> LinearLoads:
    """Exact affine coefficients of every resource's work in the placement fractions and the swap count."""
    base_cfg = replace(cfg, placement=Placement(), swap_layers=0, iterations=1)
    return problem.memoized(("linear_loads", base_cfg), lambda: _measure_linear_loads(problem, base_cfg))


def _measure_linear_loads(problem: Problem, cfg: ScheduleConfig) -> LinearLoads:
    L = problem.model.num_layers
    zero = dict.fromkeys(VARS, 0.0)
    loads_cache = problem.memoized(("iteration_loads_cache",), dict)

    def at(x: dict[str, float], n: int) -> dict[str, float]:
        c = replace(cfg, placement=placement_of(x), swap_layers=n, recompute=True)
        return iteration_loads(problem.model, problem.hw, c, cache=loads_cache).work

    base0, baseL = at(zero, 0), at(zero, L)
    coef, swap_coef = {}, {}
    for v in VARS:
        x = dict(zero)
        x[v] = 1.0
        w0 = at(x, 0)
        coef[v] = {r: w0[r] - base0[r] for r in base0}
        if v in CKPT_VARS:
            wL = at(x, L)
            swap_coef[v] = {r: ((wL[r] - w0[r]) - (baseL[r] - base0[r])) / L for r in base0}
    swap = {r: (baseL[r] - base0[r]) / L for r in base0}
    return LinearLoads(base=base0, coef=coef, swap=swap, swap_coef=swap_coef)


def placement_memory(problem: Problem, cfg: ScheduleConfig) -> PlacementMemory:
    base_cfg = replace(cfg, placement=Placement(), swap_layers=0, iterations=1)

    def make() -> PlacementMemory:
        return PlacementMemory(schedule=problem.schedule_memory(base_cfg),
                               gpu_working_bytes=_gpu_working_bytes(problem, base_cfg, swapped=False),
                               gpu_working_swap_bytes=_gpu_working_bytes(problem, base_cfg, swapped=True))
    return problem.memoized(("placement_memory", base_cfg), make)


def _gpu_working_bytes(problem: Problem, cfg: ScheduleConfig, swapped: bool) -> float:
    """Peak GPU bytes beyond the resident tensors, simulated on a 2-layer window of the schedule with the real
    GPU capacity (transfers wait for memory as they will in the full run); inf when even that does not fit."""
    small = replace(problem.model, num_layers=min(2, problem.model.num_layers))
    c = replace(cfg, placement=Placement(), iterations=1, swap_layers=small.num_layers if swapped else 0)
    g = build_graph(small, problem.hw, c)
    g.capacity_bytes = {"gpu": g.capacity_bytes["gpu"], "cpu": math.inf, "ssd": math.inf}
    try:
        return simulate_graph(g, problem.hw).peak_bytes["gpu"] - g.static_bytes["gpu"]
    except CapacityError:
        return math.inf


@dataclass
class Solved:
    x: dict[str, float]  # the placement fractions
    n: int  # layers that swap their activations instead of recomputing
    report: SolverReport


def solve_placement(problem: Problem, lin: LinearLoads, mem: PlacementMemory, *, allow_swap: bool = True,
                    time_limit_s: float = 5.0,
                    tighten_bytes: dict[str, float] | None = None,
                    hint: Solved | None = None) -> Solved | None:
    """CP-SAT: minimise the busiest resource's time over placement fractions and the number of swapped layers,
    subject to every tier's capacity (less `tighten_bytes` per tier). Returns None when infeasible."""
    t0 = time.perf_counter()
    data = _placement_data(problem, mem, allow_swap, tighten_bytes or {})
    if data is None:
        return None
    m = cp_model.CpModel()
    v = _placement_variables(m, problem.model.num_layers, data)
    _add_fraction_links(m, problem, v)
    _add_capacities(m, problem, data, v)
    iteration = _add_iteration_time(m, problem, lin, v)
    _add_placement_objective(m, v, iteration, hint)
    return _solve_placement(m, v, iteration, time_limit_s, t0)


class _PlacementData(NamedTuple):
    """The model's constants, in KiB (per step of a fraction where they scale with one)."""

    can_swap: bool
    cap_kib: dict[str, int]
    weight_kib: int
    state_kib: int
    ckpt_recompute_kib: int  # all layers' checkpoints, per step of c_*
    ckpt_swap_kib: int  # per swapped layer and step of c_*
    gpu_work_kib: int
    gpu_swap_extra_kib: int
    host_kib: int
    staging_kib: dict[str, int]


def _placement_data(problem: Problem, mem: PlacementMemory, allow_swap: bool,
                    tighten_bytes: dict[str, float]) -> _PlacementData | None:
    """The capacities and the memory each fraction step takes; None when the working memory alone is
    infinite."""
    hw, L = problem.hw, problem.model.num_layers
    sm = mem.schedule
    if math.isinf(mem.gpu_working_bytes):
        return None
    can_swap = allow_swap and not math.isinf(mem.gpu_working_swap_bytes)
    cap_kib = {t: max(0, int((c - tighten_bytes.get(t, 0.0)) / KIB))
               for t, c in problem.capacity_bytes.items()}
    weight_kib = _kib(sm.precision.compute_bytes * sm.params / STEPS)  # per step of a fraction
    state_kib = _kib(sm.precision.state_bytes * sm.params / STEPS)
    ckpt_recompute_kib = _kib(sm.ckpt_per_layer_bytes * L / STEPS)  # all layers' checkpoints, per step of c_*
    ckpt_swap_kib = _kib(sm.swap_extra_bytes / STEPS)  # per swapped layer and step of c_*
    # working memory, and what the executor's CUDA runtime maps under the cap (static, not placed: devicemem)
    gpu_work_kib = _kib(mem.gpu_working_bytes + sm.cuda_runtime_bytes + sm.adapter_gpu_bytes)
    gpu_swap_extra_kib = max(0, _kib(mem.gpu_working_swap_bytes) - gpu_work_kib) if can_swap else 0
    # the host's gradients and reserve, and the staging buffers of each tensor class the SSDs hold a part of
    host_kib = _kib(sm.host_grad_bytes + host_reserve_bytes(rank_capacity_bytes(hw, problem.gpus)["cpu"])
                    + sm.opt_workspace_bytes)
    staging_kib = {"w_ssd": _kib(sm.weight_staging_bytes), "s_ssd": _kib(sm.state_staging_bytes),
                   "c_ssd": _kib(max(sm.ckpt_staging_bytes, sm.ckpt_staging_swap_bytes))}
    return _PlacementData(can_swap, cap_kib, weight_kib, state_kib, ckpt_recompute_kib, ckpt_swap_kib,
                          gpu_work_kib, gpu_swap_extra_kib, host_kib, staging_kib)


class _PlacementVars(NamedTuple):
    frac: dict  # VARS -> steps of 1/STEPS
    swapped: cp_model.IntVar  # swapped layers
    any_swap: cp_model.IntVar
    swap_frac: dict  # CKPT_VARS -> swapped layers x checkpoint fraction
    swap_on_cpu: cp_model.IntVar
    streams: dict  # does the SSD hold a part of each staged class?


def _placement_variables(m: cp_model.CpModel, L: int, data: _PlacementData) -> _PlacementVars:
    frac = {v: m.NewIntVar(0, STEPS, v) for v in VARS}
    swapped = m.NewIntVar(0, L if data.can_swap else 0, "swap_layers")
    any_swap = m.NewBoolVar("any_swap")
    # swapped layers x checkpoint fraction, per tier that takes checkpoints (CP-SAT multiplication)
    swap_frac = {v: m.NewIntVar(0, STEPS * L, f"swapped_x_{v}") for v in CKPT_VARS}
    swap_on_cpu = m.NewIntVar(0, STEPS * L, "swapped_x_c_cpu")
    # does the SSD hold a part of v's class?
    streams = {v: m.NewBoolVar(f"streams_{v}") for v in data.staging_kib}
    return _PlacementVars(frac, swapped, any_swap, swap_frac, swap_on_cpu, streams)


def _add_fraction_links(m: cp_model.CpModel, problem: Problem, v: _PlacementVars) -> None:
    """Fractions of one class sum to at most the whole; the products and flags follow the fractions."""
    L, frac = problem.model.num_layers, v.frac
    m.Add(frac["w_gpu"] + frac["w_ssd"] <= STEPS)
    m.Add(frac["c_gpu"] + frac["c_ssd"] <= STEPS)
    if not problem.uses_ssd:
        for x in ("w_ssd", "s_ssd", "c_ssd"):
            m.Add(frac[x] == 0)
    elif problem.model.lora is not None:  # LoRA only reads the SSDs (its frozen weights)
        for x in ("s_ssd", "c_ssd"):
            m.Add(frac[x] == 0)
    for x in CKPT_VARS:
        m.AddMultiplicationEquality(v.swap_frac[x], [v.swapped, frac[x]])
    m.Add(v.swapped <= L * v.any_swap)
    m.Add(v.swap_on_cpu == STEPS * v.swapped - v.swap_frac["c_gpu"] - v.swap_frac["c_ssd"])
    for x, flag in v.streams.items():
        m.Add(frac[x] <= STEPS * flag)


def _add_capacities(m: cp_model.CpModel, problem: Problem, d: _PlacementData, v: _PlacementVars) -> None:
    """Every tier's capacity."""
    frac, swap_frac = v.frac, v.swap_frac
    # GPU: resident weights + checkpoints kept there + working memory (higher as soon as one layer swaps)
    m.Add(d.weight_kib * frac["w_gpu"] + d.ckpt_recompute_kib * frac["c_gpu"]
          + d.ckpt_swap_kib * swap_frac["c_gpu"]
          + d.gpu_work_kib + d.gpu_swap_extra_kib * v.any_swap <= d.cap_kib["gpu"])
    # CPU: weights, optimizer states and checkpoints not placed elsewhere + the schedule's host memory +
    # reserve
    m.Add(d.weight_kib * (STEPS - frac["w_gpu"] - frac["w_ssd"]) + d.state_kib * (STEPS - frac["s_ssd"])
          + d.ckpt_recompute_kib * (STEPS - frac["c_gpu"] - frac["c_ssd"]) + d.ckpt_swap_kib * v.swap_on_cpu
          + d.host_kib
          + sum(d.staging_kib[x] * flag for x, flag in v.streams.items()) <= d.cap_kib["cpu"])
    if problem.uses_ssd:
        m.Add(d.weight_kib * frac["w_ssd"] + d.state_kib * frac["s_ssd"]
              + d.ckpt_recompute_kib * frac["c_ssd"] + d.ckpt_swap_kib * swap_frac["c_ssd"]
              <= d.cap_kib["ssd"])


def _add_iteration_time(m: cp_model.CpModel, problem: Problem, lin: LinearLoads,
                        v: _PlacementVars) -> cp_model.IntVar:
    """The iteration lasts at least as long as its busiest resource, and at least as long as the forward
    phase's busiest resource plus the backward phase's (IterationLoads.times_s "phases")."""
    times = _TimeTerms(problem, lin, v.frac, v.swapped, v.swap_frac)
    iteration = m.NewIntVar(0, HORIZON_UNITS, "iteration_time")
    for e in times.resource_bounds(""):
        m.Add(iteration >= e)
    if "gpu@F" in lin.base:
        forward = m.NewIntVar(0, HORIZON_UNITS, "forward_time")
        backward = m.NewIntVar(0, HORIZON_UNITS, "backward_time")
        for e in times.resource_bounds("@F"):
            m.Add(forward >= e)
        for e in times.resource_bounds("@B"):
            m.Add(backward >= e)
        m.Add(iteration >= forward + backward)
    return iteration


def _add_placement_objective(m: cp_model.CpModel, v: _PlacementVars, iteration: cp_model.IntVar,
                             hint: Solved | None) -> None:
    """The bottleneck; among equal ones fewer bytes on the SSD, fewer swapped layers and more checkpoints kept
    on the GPU (fewer bytes over the host links: a copy the bottleneck hides still takes host memory
    bandwidth, and on a CPU device it is a memcpy beside the compute: the profile's
    copy_slowdown_beside_compute); `hint` as the solver's start."""
    frac = v.frac
    m.Minimize(iteration * 1000 + frac["w_ssd"] + frac["s_ssd"] + frac["c_ssd"] + v.swapped
               + (STEPS - frac["c_gpu"]))
    if hint:
        for x in VARS:
            m.AddHint(frac[x], int(round(hint.x[x] * STEPS)))
        m.AddHint(v.swapped, hint.n)


def _solve_placement(m: cp_model.CpModel, v: _PlacementVars, iteration: cp_model.IntVar, time_limit_s: float,
                     t0: float) -> Solved | None:
    """Solve; the fractions, swapped layers and the solver's report, or None when it found no solution."""
    solver = deterministic_solver(time_limit_s)  # the same answer on every run (search/cpsat.py)
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    objective_s = solver.Value(iteration) * TIME_UNIT_S
    bound_s = math.floor(solver.BestObjectiveBound() / 1000) * TIME_UNIT_S
    gap = max(0.0, (objective_s - bound_s) / objective_s) if objective_s > 0 else 0.0
    report = SolverReport(solver.StatusName(status), objective_s, bound_s, gap, time.perf_counter() - t0)
    return Solved(x={x: solver.Value(v.frac[x]) / STEPS for x in VARS}, n=solver.Value(v.swapped),
                  report=report)


def _kib(nbytes: float) -> int:
    return math.ceil(nbytes / KIB)


class _TimeTerms:
    """Linear time expressions (in TIME_UNIT_S) of each resource's work: constant + integer coefficients x the
    integer decision variables."""

    def __init__(self, problem: Problem, lin: LinearLoads, frac: dict, swapped, swap_frac: dict) -> None:
        self.problem, self.lin, self.frac = problem, lin, frac
        self.swapped, self.swap_frac = swapped, swap_frac

    def expr(self, resource: str, rate: float, scale: float = 1.0):
        lin = self.lin
        k = scale / (rate * TIME_UNIT_S)
        e = round(lin.base[resource] * k)
        e += sum(round(lin.coef[v][resource] * k / STEPS) * self.frac[v] for v in VARS)
        e += round(lin.swap[resource] * k) * self.swapped
        e += sum(round(lin.swap_coef[v][resource] * k / STEPS) * self.swap_frac[v] for v in CKPT_VARS)
        return e

    def resource_bounds(self, phase: str) -> list:
        """Expressions whose max bounds the time of the work of `phase` ("" for the whole iteration)."""
        r = self.problem.rates
        terms = [self.expr("gpu" + phase, 1.0), self.expr("cpu" + phase, 1.0),
                 self.expr("h2d" + phase, r.h2d), self.expr("d2h" + phase, r.d2h)]
        terms += self.duplex("h2d" + phase, "d2h" + phase, r.h2d, r.d2h, r.h2d_duplex, r.d2h_duplex)
        if self.problem.uses_ssd:  # the array's reads and writes: the same form (ssd.mixed_efficiency)
            terms += [self.expr("ssd_read" + phase, r.ssd_read), self.expr("ssd_write" + phase, r.ssd_write)]
            terms += self.duplex("ssd_read" + phase, "ssd_write" + phase, r.ssd_read, r.ssd_write,
                                 r.ssd_read_mixed, r.ssd_write_mixed)
        for _, cap_s, use in r.pools():  # host memory and, on a host device, its cores (loads.pool_times_s)
            terms.append(sum(self.expr(k + phase, cap_s / u) for k, u in use.items()))
        return terms

    def duplex(self, a: str, b: str, a_rate: float, b_rate: float, a_mixed: float, b_mixed: float) -> list:
        """Both directions of one link: a/A + b/B + c min(a/Am, b/Bm) (loads.duplex_time_s), a max of two
        linear terms when c < 0."""
        both = self.expr(a, a_rate) + self.expr(b, b_rate)
        c = duplex_coefficient(a_rate, b_rate, a_mixed, b_mixed)
        if c < 0:
            return [both + self.expr(a, a_mixed, c), both + self.expr(b, b_mixed, c)]
        return [both]
