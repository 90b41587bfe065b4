"""The planner's search: schedule family and group size, micro-batch, placement of every tensor class,
swap-vs-recompute and the deferred optimizer fraction, decided together.

Three layers (see README, "Planner"):
1. candidates (group size k, micro-batch) are enumerated and pruned with the closed-form roofline bound;
2. for each candidate a CP-SAT model chooses the placement fractions (weights, optimizer states, checkpoints over
   GPU / CPU / SSD) and the number of layers that swap their activations instead of recomputing, minimising the
   busiest resource's time under the memory capacity of every tier. Its coefficients are exact: the bytes each
   link carries per unit of each fraction are measured on the schedule builder's own task graphs
   (tierflow.planner.search.loads), so the solver and the simulator cannot disagree about traffic;
3. the best answers are expanded to full iterations and verified by the discrete-event simulator; a plan is
   never returned without that verification. A verification that overflows a tier tightens that tier in the
   CP-SAT model and solves again. Candidates whose CP-SAT objective, and fixed schedules whose slot-model
   prediction, exceed the best verified time by more than PRUNE_TOLERANCE are not simulated;
4. the chosen plan's iteration is predicted by the slot model (tierflow.planner.search.slots), which knows when each transfer
   may run, not only how much each resource works.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ortools.sat.python import cp_model

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import ScheduleConfig, blocks_of, build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult, simulate_graph
from tierflow.planner.core.workload import ADAM_STATE_BYTES, COMPUTE_BYTES, GRAD_ACCUM_BYTES, MASTER_BYTES
from tierflow.planner.search.loads import IterationLoads, iteration_loads
from tierflow.planner.search.slots import SlotModelError, SolverReport, predict_config

Q = 100  # placement fractions are decided in steps of 1/Q
VARS = ("w_gpu", "w_ssd", "s_ssd", "c_gpu", "c_ssd")
STATE_BYTES = MASTER_BYTES + 2 * ADAM_STATE_BYTES
MB = 2**20


class PlanningError(ValueError):
    """No plan fits; the message says which tier overflows by how much and what would make it fit."""


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    group: int
    alpha: float
    prefetch_depth: int = 1

    def describe(self, batch: int) -> str:
        M = batch // self.micro_batch
        fam = "horizontal" if self.group == 1 else "vertical" if self.group == M else f"block k={self.group}"
        return f"{fam}, {M} x {self.micro_batch}, alpha {self.alpha:g}, prefetch {self.prefetch_depth}"


@dataclass
class LinearLoads:
    """work_r(x, n) = base_r + sum_v coef_r[v] x_v + n (swap_r + sum_v swap_coef_r[v] x_v), x_v in [0, 1]."""

    base: dict[str, float]
    coef: dict[str, dict[str, float]]
    swap: dict[str, float]
    swap_coef: dict[str, dict[str, float]]

    def work(self, x: dict[str, float], n: int) -> dict[str, float]:
        out = {}
        for r, b in self.base.items():
            v = b + sum(self.coef[v_][r] * x[v_] for v_ in VARS)
            v += n * (self.swap[r] + sum(self.swap_coef[v_][r] * x[v_] for v_ in ("c_gpu", "c_ssd")))
            out[r] = v
        return out


@dataclass
class Evaluated:
    candidate: Candidate
    config: ScheduleConfig | None
    solver: SolverReport | None  # the placement model's solve (solve_placement)
    result: SimResult | None = None
    error: str = ""
    # the prediction for the decisions: the placement model's (IterationLoads.predict_s), replaced by the slot
    # model's (tierflow.planner.search.slots) for the chosen plan
    predicted_s: float = math.inf
    binding: str = ""
    prediction: SolverReport | None = None  # the slot model's CP-SAT solve behind predicted_s

    @property
    def verified_s(self) -> float:
        return self.result.iteration_s if self.result else math.inf


@dataclass
class SearchResult:
    best: Evaluated
    evaluated: list[Evaluated]
    wall_s: float
    model: ModelSpec
    hw: HardwareProfile
    baseline: dict[str, SimResult] = field(default_factory=dict)  # best fixed schedules with default settings


# ---- the memory model the solver uses (the simulator checks it) ---------------------------------------------


def _base_placement() -> Placement:
    return Placement()  # everything in CPU memory


def _placement(x: dict[str, float]) -> Placement:
    w = Split(gpu=x["w_gpu"], cpu=round(1 - x["w_gpu"] - x["w_ssd"], 6), ssd=x["w_ssd"])
    s = Split(gpu=0.0, cpu=round(1 - x["s_ssd"], 6), ssd=x["s_ssd"])
    c = Split(gpu=x["c_gpu"], cpu=round(1 - x["c_gpu"] - x["c_ssd"], 6), ssd=x["c_ssd"])
    return Placement(weights=w, master=s, adam_m=s, adam_v=s, grads=Split(), checkpoints=c)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes each tier needs besides the placed tensors, for one candidate."""

    P: int
    gpu_dynamic: float  # weight buffers, working memory, gradient buffers (measured on a 2-layer graph)
    gpu_dynamic_swap: float  # the same when layers swap their activations instead of recomputing
    host_fixed: float  # gradients held on the host + staging of blocks in flight
    ckpt_recompute: float  # checkpoint bytes held at the forward/backward turn, per recomputed layer
    ckpt_swap: float  # ... per swapped layer (all its activations)
    L: int


@lru_cache(maxsize=256)
def memory_model(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> MemoryModel:
    P = model.total_params()
    L = model.num_layers
    M = cfg.num_micro_batches
    layer = blocks_of(model, cfg.micro_batch, cfg.seq)[1]
    gpu_dyn = _gpu_dynamic(model, hw, cfg, swapped=False)
    gpu_dyn_swap = _gpu_dynamic(model, hw, cfg, swapped=True)
    grads_all = cfg.group < M or not cfg.optimizer_overlap
    grads = GRAD_ACCUM_BYTES * (P if grads_all else 3 * model.layer_params() + cfg.alpha * P)
    staging = ((cfg.prefetch_depth + 3) * COMPUTE_BYTES + 2 * STATE_BYTES) * model.layer_params()
    held = cfg.group  # micro-batches whose checkpoints are alive at the forward/backward turn
    return MemoryModel(P=P, gpu_dynamic=gpu_dyn, gpu_dynamic_swap=gpu_dyn_swap, host_fixed=grads + staging + 0.02 * hw.cpu.capacity_bytes,
                       ckpt_recompute=held * layer.checkpoint_bytes + held * layer.checkpoint_bytes / max(L, 1),
                       ckpt_swap=held * layer.full_activation_bytes, L=L)


def _gpu_dynamic(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, swapped: bool) -> float:
    """Peak GPU bytes beyond the resident tensors, simulated on a 2-layer window of the schedule with the real GPU
    capacity (transfers wait for memory as they will in the full run); inf when even that does not fit."""
    small = replace(model, num_layers=min(2, model.num_layers))
    c = replace(cfg, placement=_base_placement(), iterations=1, swap_layers=small.num_layers if swapped else 0)
    g = build_graph(small, hw, c)
    g.capacity_bytes = {"gpu": g.capacity_bytes["gpu"], "cpu": math.inf, "ssd": math.inf}
    try:
        return simulate_graph(g, hw).peak_bytes["gpu"] - g.static_bytes["gpu"]
    except CapacityError:
        return math.inf


@lru_cache(maxsize=256)
def linear_loads(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> LinearLoads:
    """Exact affine coefficients of every resource's work in the placement fractions and the swap count."""
    L = model.num_layers
    zero = dict.fromkeys(VARS, 0.0)

    def at(x: dict[str, float], n: int) -> dict[str, float]:
        c = replace(cfg, placement=_placement(x), swap_layers=n, recompute=True)
        return iteration_loads(model, hw, c).work

    base0, baseL = at(zero, 0), at(zero, L)
    coef, swap_coef = {}, {}
    for v in VARS:
        x = dict(zero)
        x[v] = 1.0
        w0 = at(x, 0)
        coef[v] = {r: w0[r] - base0[r] for r in base0}
        if v in ("c_gpu", "c_ssd"):
            wL = at(x, L)
            swap_coef[v] = {r: ((wL[r] - w0[r]) - (baseL[r] - base0[r])) / L for r in base0}
    swap = {r: (baseL[r] - base0[r]) / L for r in base0}
    return LinearLoads(base=base0, coef=coef, swap=swap, swap_coef=swap_coef)


# ---- CP-SAT -----------------------------------------------------------------------------------------------


@dataclass
class Solved:
    x: dict[str, float]
    n: int
    report: SolverReport


def solve_placement(lin: LinearLoads, mem: MemoryModel, hw: HardwareProfile, *, allow_swap: bool = True,
                    allow_ssd: bool = True, time_limit_s: float = 5.0, workers: int = 2,
                    tighten: dict[str, float] | None = None, hint: dict | None = None) -> Solved | None:
    """CP-SAT: minimise the busiest resource's time over placement fractions and the number of swapped layers,
    subject to every tier's capacity. Returns None when infeasible."""
    t0 = time.perf_counter()
    rates = CostModel(hw).rates
    tighten = tighten or {}
    m = cp_model.CpModel()
    x = {v: m.NewIntVar(0, Q, v) for v in VARS}
    m.Add(x["w_gpu"] + x["w_ssd"] <= Q)
    m.Add(x["c_gpu"] + x["c_ssd"] <= Q)
    if not allow_ssd or hw.ssd.count == 0:
        for v in ("w_ssd", "s_ssd", "c_ssd"):
            m.Add(x[v] == 0)
    L = mem.L
    n = m.NewIntVar(0, L if allow_swap else 0, "swap_layers")
    y = {}
    for v in ("c_gpu", "c_ssd"):
        y[v] = m.NewIntVar(0, Q * L, f"n_x_{v}")
        m.AddMultiplicationEquality(y[v], [n, x[v]])
    # time of each resource, in microseconds: constant + sum of integer coefficients x integer variables
    unit = 1e-6

    def expr(resource: str, rate: float, scale: float = 1.0):
        if rate <= 0:
            return None
        k = scale / (rate * unit)
        e = round(lin.base[resource] * k)
        e += sum(round(lin.coef[v][resource] * k / Q) * x[v] for v in VARS)
        e += round(lin.swap[resource] * k) * n
        e += sum(round(lin.swap_coef[v][resource] * k / Q) * y[v] for v in ("c_gpu", "c_ssd"))
        return e

    def resource_terms(suffix: str) -> list:
        """Linear time expressions whose max is a resource-bound on the time of the work keyed `suffix`."""
        terms = [expr("gpu" + suffix, 1.0), expr("cpu" + suffix, 1.0), expr("h2d" + suffix, rates.h2d),
                 expr("d2h" + suffix, rates.d2h)]
        # both PCIe directions: h/H + d/D + c min(h/Hd, d/Dd) (tierflow.planner.search.loads.pcie_time_s): a max of two terms
        both = expr("h2d" + suffix, rates.h2d) + expr("d2h" + suffix, rates.d2h)
        c = 1.0 - rates.h2d_duplex / rates.h2d - rates.d2h_duplex / rates.d2h
        if c < 0:
            terms += [both + expr("h2d" + suffix, rates.h2d_duplex, c), both + expr("d2h" + suffix, rates.d2h_duplex, c)]
        else:
            terms.append(both)
        if hw.ssd.count > 0:
            rd, wr = expr("ssd_read" + suffix, rates.ssd_read), expr("ssd_write" + suffix, rates.ssd_write)
            terms += [rd, wr] + ([rd + wr] if hw.ssd.rw_sharing == "shared" else [])
        return terms

    horizon = 10**13
    T = m.NewIntVar(0, horizon, "T")
    for e in resource_terms(""):
        m.Add(T >= e)
    if "gpu@F" in lin.base:
        # the forward phase's busiest resource plus the backward phase's (IterationLoads.times_s "phases")
        TF, TB = m.NewIntVar(0, horizon, "T_forward"), m.NewIntVar(0, horizon, "T_backward")
        for e in resource_terms("@F"):
            m.Add(TF >= e)
        for e in resource_terms("@B"):
            m.Add(TB >= e)
        m.Add(T >= TF + TB)
    # memory, in MiB (allocations rounded up)
    P = mem.P

    def mib(b: float) -> int:
        return math.ceil(b / MB)

    caps = {"gpu": hw.gpu.capacity_bytes, "cpu": hw.cpu.capacity_bytes, "ssd": hw.ssd.capacity_bytes}
    caps = {t: max(0, int((c - tighten.get(t, 0.0)) / MB)) for t, c in caps.items()}
    ck_r, ck_s = mem.ckpt_recompute * L, mem.ckpt_swap - mem.ckpt_recompute  # per-layer extra when swapped
    # GPU: resident weights + checkpoints kept on the GPU + dynamic (higher as soon as one layer swaps)
    if math.isinf(mem.gpu_dynamic):
        return None
    if math.isinf(mem.gpu_dynamic_swap):
        m.Add(n == 0)
    any_swap = m.NewBoolVar("any_swap")
    m.Add(n <= L * any_swap)
    extra_swap = 0 if math.isinf(mem.gpu_dynamic_swap) else max(0, mib(mem.gpu_dynamic_swap) - mib(mem.gpu_dynamic))
    m.Add(mib(COMPUTE_BYTES * P / Q) * x["w_gpu"] + mib(ck_r / Q) * x["c_gpu"] + mib(ck_s / Q) * y["c_gpu"]
          + mib(mem.gpu_dynamic) + extra_swap * any_swap <= caps["gpu"])
    cpu_swap = m.NewIntVar(0, Q * L, "cpu_swap")
    m.Add(cpu_swap == Q * n - y["c_gpu"] - y["c_ssd"])
    m.Add(mib(COMPUTE_BYTES * P / Q) * (Q - x["w_gpu"] - x["w_ssd"]) + mib(STATE_BYTES * P / Q) * (Q - x["s_ssd"])
          + mib(ck_r / Q) * (Q - x["c_gpu"] - x["c_ssd"]) + mib(ck_s / Q) * cpu_swap + mib(mem.host_fixed)
          <= caps["cpu"])
    if hw.ssd.count > 0:
        m.Add(mib(COMPUTE_BYTES * P / Q) * x["w_ssd"] + mib(STATE_BYTES * P / Q) * x["s_ssd"]
              + mib(ck_r / Q) * x["c_ssd"] + mib(ck_s / Q) * y["c_ssd"] <= caps["ssd"])
    # minimise the bottleneck; among equal bottlenecks prefer fewer bytes on the SSD and fewer swapped layers
    m.Minimize(T * 1000 + x["w_ssd"] + x["s_ssd"] + x["c_ssd"] + n)
    if hint:
        for v in VARS:
            m.AddHint(x[v], int(round(hint["x"][v] * Q)))
        m.AddHint(n, hint["n"])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    name = solver.StatusName(status)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    obj = solver.Value(T) * unit
    bound = math.floor(solver.BestObjectiveBound() / 1000) * unit
    gap = max(0.0, (obj - bound) / obj) if obj > 0 else 0.0
    xs = {v: solver.Value(x[v]) / Q for v in VARS}
    return Solved(x=xs, n=solver.Value(n), report=SolverReport(name, obj, bound, gap, wall))


# ---- the search -------------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(batch: int, *, micro_batches: list[int] | None = None, max_groups: int = 4) -> list[Candidate]:
    out = []
    for mb in micro_batches or divisors(batch):
        M = batch // mb
        ks = sorted({1, M} | {k for k in divisors(M) if k in (2, 4, M // 4, M // 2)})
        if len(ks) > max_groups:
            ks = [ks[0], *ks[len(ks) - max_groups + 1:]]
        for k in ks:
            out.append(Candidate(micro_batch=mb, group=k, alpha=0.25 if k > 1 else 0.0))
    return out


def _config(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, c: Candidate,
            placement: Placement, swap: int, iterations: int = 3) -> ScheduleConfig:
    M = batch // c.micro_batch
    family = "vertical" if c.group == M and M > 1 else "block"
    cfg = make_schedule(family, model, hw, batch=batch, micro_batch=c.micro_batch, seq=seq, placement=placement,
                        group=c.group, alpha=c.alpha, prefetch_depth=c.prefetch_depth, swap_layers=swap,
                        iterations=iterations)
    return cfg


# how far a model's prediction may lie above the simulated time (the placement model's objective: up to +1.1%,
# the slot model's: up to +0.7% over experiments/planner_quality.py and the fixed schedules of
# experiments/bench_planner.py): a candidate predicted slower than the best verified time by more than this
# cannot be the fastest and is not simulated
PRUNE_TOLERANCE = 0.02


def evaluate(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, c: Candidate, *,
             time_limit_s: float = 5.0, allow_ssd: bool = True, verify: bool = True,
             prune_at: float = math.inf) -> Evaluated:
    """Solve one candidate's placement with CP-SAT and verify it in the simulator (unless the solver's
    objective already exceeds `prune_at` x (1 + PRUNE_TOLERANCE): then it cannot win and is not simulated)."""
    cfg0 = _config(model, hw, batch, seq, c, _base_placement(), 0, iterations=1)
    lin = linear_loads(model, hw, cfg0)
    mem = memory_model(model, hw, cfg0)
    tighten: dict[str, float] = {}
    last_error = ""
    solved = None
    for _attempt in range(4):
        solved = solve_placement(lin, mem, hw, allow_ssd=allow_ssd, time_limit_s=time_limit_s, tighten=tighten,
                                 hint=solved and {"x": solved.x, "n": solved.n})
        if solved is None:
            return Evaluated(c, None, None, error=last_error or "no placement fits every tier")
        cfg = _config(model, hw, batch, seq, c, _placement(solved.x), solved.n)
        loads = IterationLoads(work=lin.work(solved.x, solved.n), static_bytes={})
        ev = Evaluated(c, cfg, solved.report, predicted_s=loads.predict_s(hw), binding=loads.binding(hw))
        if solved.report.objective_s > prune_at * (1 + PRUNE_TOLERANCE):
            ev.error = f"pruned: solver objective {solved.report.objective_s:.4g} s > best {prune_at:.4g} s"
            return ev
        if not verify:
            return ev
        try:
            ev.result = simulate_config(model, hw, cfg)
            return ev
        except CapacityError as e:
            last_error = str(e)
            tighten[e.tier] = tighten.get(e.tier, 0.0) + 1.25 * e.over_bytes + 0.01 * _cap(hw, e.tier)
    return Evaluated(c, None, solved.report if solved else None, error=last_error)


def _predict(model: ModelSpec, hw: HardwareProfile, ev: Evaluated) -> Evaluated:
    """Set ev's prediction from the slot model of its (fully decided) configuration. The placement model's
    objective bounds the iteration from below but ignores when each transfer may run; the slot model keeps
    that, and is what the plan reports as its predicted time."""
    try:
        rep = predict_config(model, hw, ev.config)
    except SlotModelError:
        return ev  # keeps the placement model's prediction
    ev.prediction, ev.predicted_s = rep, rep.objective_s
    return ev


def _cap(hw: HardwareProfile, tier: str) -> float:
    return {"gpu": hw.gpu.capacity_bytes, "cpu": hw.cpu.capacity_bytes, "ssd": hw.ssd.capacity_bytes}[tier]


def gpu_floor_s(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, micro_batch: int) -> float:
    """GPU compute of one iteration without any recompute: no plan with this micro-batch can beat it."""
    cm = CostModel(hw)
    blocks = blocks_of(model, micro_batch, seq)
    per_mb = sum(cm.forward_s(b) + cm.backward_s(b) for b in blocks)
    return per_mb * batch // micro_batch


def fits_gpu(model: ModelSpec, hw: HardwareProfile, seq: int, micro_batch: int) -> bool:
    """Can one layer's backward at this micro-batch (plus a few weight buffers) fit on the GPU at all?"""
    blocks = blocks_of(model, micro_batch, seq)
    need = max(b.bwd_working_bytes for b in blocks) + 3 * max(b.weight_bytes for b in blocks)
    return need <= hw.gpu.capacity_bytes


def plan_search(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int | None = None, *,
                time_limit_s: float = 60.0, micro_batches: list[int] | None = None, allow_ssd: bool = True,
                progress: Callable[[int, int, str], None] | None = None, baselines: bool = True) -> SearchResult:
    """Search every candidate (pruned by its roofline floor), return the best verified plan."""
    t0 = time.perf_counter()
    seq = seq or model.seq_len
    cands = [c for c in candidates(batch, micro_batches=micro_batches) if fits_gpu(model, hw, seq, c.micro_batch)]
    if not cands:
        raise PlanningError(infeasible_message(model, hw, batch, seq, allow_ssd))
    # larger micro-batches use the GPU better: try them first so the pruning bound bites early
    cands.sort(key=lambda c: (gpu_floor_s(model, hw, batch, seq, c.micro_batch), -c.group))
    evaluated: list[Evaluated] = []
    best: Evaluated | None = None
    per_solve = max(1.0, min(10.0, time_limit_s / max(4, len(cands)) / 2))
    for i, c in enumerate(cands):
        if progress:
            progress(i, len(cands), c.describe(batch))
        floor = gpu_floor_s(model, hw, batch, seq, c.micro_batch)
        if best is not None and floor >= best.verified_s:
            evaluated.append(Evaluated(c, None, None, error=f"pruned: GPU floor {floor:.3g} s >= best {best.verified_s:.3g} s"))
            continue
        if time.perf_counter() - t0 > time_limit_s and best is not None:
            evaluated.append(Evaluated(c, None, None, error="skipped: time limit"))
            continue
        ev = evaluate(model, hw, batch, seq, c, time_limit_s=per_solve, allow_ssd=allow_ssd,
                      prune_at=best.verified_s if best else math.inf)
        evaluated.append(ev)
        if ev.result and (best is None or ev.verified_s < best.verified_s):
            best = ev
    if best is not None:
        # the decisions that change only the order, not the traffic: one more weight buffer ahead, and the
        # deferred optimizer fraction; each variant is verified like the rest
        for variant in ({"prefetch_depth": 2}, {"alpha": 0.0}, {"alpha": 0.5}):
            if all(getattr(best.config, k) == v for k, v in variant.items()):
                continue
            cfg2 = replace(best.config, **variant)
            try:
                r2 = simulate_config(model, hw, cfg2)
            except CapacityError:
                continue
            if r2.iteration_s < best.verified_s:
                best = Evaluated(replace(best.candidate, **variant), cfg2, best.solver, r2,
                                 predicted_s=best.predicted_s, binding=best.binding)
                evaluated.append(best)
    base = fixed_baselines(model, hw, batch, seq, sorted({c.micro_batch for c in cands}),
                           only_best=True) if baselines else {}
    for name, (cfg_b, res_b) in base.items():
        # the fixed schedules are part of the decision space: a plan is never slower than them
        if best is None or res_b.iteration_s < best.verified_s:
            mb = cfg_b.micro_batch
            c = Candidate(mb, cfg_b.group, cfg_b.alpha, cfg_b.prefetch_depth)
            loads = iteration_loads(model, hw, cfg_b)
            best = Evaluated(c, cfg_b, None, res_b, predicted_s=loads.predict_s(hw), binding=loads.binding(hw),
                             error=f"baseline {name}")
            evaluated.append(best)
    if progress:
        progress(len(cands), len(cands), "done")
    if best is None:
        raise PlanningError(infeasible_message(model, hw, batch, seq, allow_ssd))
    _predict(model, hw, best)
    return SearchResult(best=best, evaluated=evaluated, wall_s=time.perf_counter() - t0, model=model, hw=hw,
                        baseline={k: v[1] for k, v in base.items()})


def fixed_baselines(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, micro_batches: list[int], *,
                    only_best: bool = False) -> dict[str, tuple[ScheduleConfig, SimResult]]:
    """The best of each fixed schedule (horizontal, fuyou, vertical) with its default settings over the
    micro-batches that fit, keyed 'family mb=b'. `only_best`: only the fastest of them all, found by simulating
    them in the order of the slot model's prediction (tierflow.planner.search.slots) and skipping those predicted slower than
    the best simulated one by more than PRUNE_TOLERANCE."""
    cfgs = []
    for family in ("horizontal", "fuyou", "vertical"):
        for mb in micro_batches:
            try:
                cfg = make_schedule(family, model, hw, batch=batch, micro_batch=mb, seq=seq)
            except (CapacityError, ValueError):
                continue
            try:
                pred = predict_config(model, hw, cfg).objective_s if only_best else 0.0
            except SlotModelError:
                pred = 0.0  # no prediction: simulate it among the first
            cfgs.append((pred, family, mb, cfg))
    best: dict[str, tuple[ScheduleConfig, SimResult]] = {}
    for pred, family, _mb, cfg in sorted(cfgs, key=lambda t: (t[0], t[2])):
        key = "all" if only_best else family
        if key in best and pred > best[key][1].iteration_s * (1 + PRUNE_TOLERANCE):
            continue
        try:
            res = simulate_config(model, hw, cfg)
        except (CapacityError, ValueError):
            continue
        if key not in best or res.iteration_s < best[key][1].iteration_s:
            best[key] = (cfg, res)
    return {f"{c.family} mb={c.micro_batch}": (c, r) for c, r in best.values()}


def window_check(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, time_limit_s: float = 5.0,
                 layers: int = 2) -> dict:
    """Solve the exact CP-SAT window model (every task an interval, NoOverlap per resource, a reservoir per memory
    tier; warm-started from the schedule's own order) on a `layers`-layer, one-iteration window of the chosen
    plan. Reports how far the builder's order is from the best order CP-SAT finds and proves for that window."""
    from tierflow.planner.search.window import solve_window

    small = replace(model, num_layers=min(layers, model.num_layers))
    swap = min(cfg.swap_layers, small.num_layers)
    g = build_graph(small, hw, replace(cfg, iterations=1, swap_layers=swap))
    w = solve_window(g, hw, time_limit_s=time_limit_s)
    return {"window_layers": small.num_layers, "window_tasks": w.num_tasks, "window_status": w.status,
            "window_greedy_s": w.greedy_makespan_s, "window_makespan_s": w.makespan_s,
            "window_bound_s": w.best_bound_s, "window_gap": w.gap, "window_wall_s": w.wall_s}


# ---- explanations -------------------------------------------------------------------------------------------


def min_requirements(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, allow_ssd: bool) -> dict[str, float]:
    """The least each tier must hold for the most memory-frugal plan (vertical, micro-batch 1, alpha 0,
    everything that can live on the SSD there)."""
    P = model.total_params()
    layer = blocks_of(model, 1, seq)
    L = model.num_layers
    gpu = max(b.bwd_working_bytes for b in layer) + 2 * max(b.weight_bytes for b in layer) \
        + GRAD_ACCUM_BYTES * max(b.fetch_params for b in layer)
    host_buffers = 3 * GRAD_ACCUM_BYTES * model.layer_params() + (4 * COMPUTE_BYTES + 3 * STATE_BYTES) * model.layer_params()
    ckpt = batch * L * layer[1].checkpoint_bytes
    if allow_ssd and hw.ssd.count > 0:
        cpu = host_buffers + 0.02 * hw.cpu.capacity_bytes
        ssd = (COMPUTE_BYTES + STATE_BYTES) * P + ckpt
    else:
        cpu = host_buffers + (COMPUTE_BYTES + STATE_BYTES) * P + ckpt + 0.02 * hw.cpu.capacity_bytes
        ssd = 0.0
    return {"gpu": gpu, "cpu": cpu, "ssd": ssd}


def infeasible_message(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, allow_ssd: bool) -> str:
    need = min_requirements(model, hw, batch, seq, allow_ssd)
    caps = {"gpu": hw.gpu.capacity_bytes, "cpu": hw.cpu.capacity_bytes, "ssd": hw.ssd.capacity_bytes}
    over = {t: need[t] - caps[t] for t in need if need[t] > caps[t]}
    if not over:
        return (f"{model.name} on {hw.name}: no candidate plan survived verification "
                f"(try a smaller batch or --time-limit; the simulator refused every placement the solver found)")
    parts = []
    for tier, b in over.items():
        fix = {"gpu": "a smaller micro-batch or seq, or a GPU with more memory",
               "cpu": f"+{math.ceil(b / 2**30)} GiB CPU memory" + (
                   f", or {max(1, math.ceil((b) / (hw.ssd.capacity_gb * 1e9)))} SSD(s) to hold states" if hw.ssd.count == 0 else ""),
               "ssd": f"{math.ceil(b / (hw.ssd.capacity_gb * 1e9 or 3.84e12))} more SSD(s) of {hw.ssd.capacity_gb:g} GB"}[tier]
        parts.append(f"{tier} overflows by {b / 1e9:,.1f} GB (needs {need[tier] / 1e9:,.1f} of {caps[tier] / 1e9:,.1f}; fix: {fix})")
    return f"{model.name} does not fit on {hw.name}: " + "; ".join(parts)


def explain(sr: SearchResult, batch: int, seq: int) -> list[str]:
    """What binds, and what change to the box would help most (each re-solved with the same CP-SAT model)."""
    best = sr.best
    model, hw = sr.model, sr.hw
    cfg = best.config
    lin = linear_loads(model, hw, replace(cfg, placement=_base_placement(), swap_layers=0, iterations=1))
    times = IterationLoads(work=_work_of(best.result), static_bytes={}).times_s(hw)
    lines = []
    order = sorted(times.items(), key=lambda kv: -kv[1])
    it = best.verified_s
    lines.append("busiest resources (share of the iteration each would need alone): " +
                 ", ".join(f"{k} {100 * v / it:.0f}%" for k, v in order[:4]))
    bind = order[0][0]
    what = {"gpu": "GPU compute: the plan is compute-bound; only a faster GPU or less recompute helps",
            "cpu": "CPU Adam", "h2d": "PCIe host-to-device", "d2h": "PCIe device-to-host", "pcie": "the PCIe link",
            "ssd_read": "SSD reads", "ssd_write": "SSD writes", "ssd": "the SSD array (reads + writes)"}[bind]
    lines.append(f"binds: {what}")
    peak = best.result.peak_bytes
    caps = best.result.graph.capacity_bytes
    lines.append("memory: " + ", ".join(f"{t} {peak[t] / 1e9:,.1f} of {caps[t] / 1e9:,.0f} GB" for t in ("gpu", "cpu", "ssd")))
    mem = memory_model(model, hw, replace(cfg, placement=_base_placement(), iterations=1))
    what_ifs = [
        ("one more SSD", {"ssd.count": hw.ssd.count + 1} if hw.ssd.count else None),
        ("twice the SSDs", {"ssd.count": 2 * hw.ssd.count} if hw.ssd.count else None),
        ("+50% CPU memory", {"cpu.memory_gib": hw.cpu.memory_gib * 1.5}),
        ("next PCIe generation", {"pcie.h2d_gbps": hw.pcie.h2d_gbps * 2, "pcie.d2h_gbps": hw.pcie.d2h_gbps * 2,
                                  "pcie.duplex_h2d_gbps": hw.pcie.duplex_h2d_gbps * 2,
                                  "pcie.duplex_d2h_gbps": hw.pcie.duplex_d2h_gbps * 2,
                                  "pcie.generation": min(7, hw.pcie.generation + 1)}),
        ("2x CPU Adam rate", {"cpu.adam_gparams_per_s": hw.cpu.adam_gparams_per_s * 2}),
    ]
    base = solve_placement(lin, mem, hw, time_limit_s=2.0)
    gains = []
    for label, ov in what_ifs:
        if ov is None:
            continue
        hw2 = hw.with_overrides(ov)
        mem2 = replace(mem, host_fixed=mem.host_fixed - 0.02 * hw.cpu.capacity_bytes + 0.02 * hw2.cpu.capacity_bytes)
        s = solve_placement(lin, mem2, hw2, time_limit_s=2.0)
        if s and base:
            gains.append((base.report.objective_s / s.report.objective_s, label))
    gains.sort(reverse=True)
    if gains:
        lines.append("what would help most (solver bound, same candidate): " +
                     ", ".join(f"{label} {g:.2f}x" for g, label in gains))
    return lines


def _work_of(res: SimResult) -> dict[str, float]:
    N = res.graph.num_iterations
    w = dict.fromkeys(("gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu"), 0.0)
    for t in res.graph.tasks:
        if t.iteration == N - 1:
            w[t.resource] += t.work
    return w
