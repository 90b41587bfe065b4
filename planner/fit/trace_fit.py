"""Fit hardware-profile fields to one measured trace, op kind by op kind (`tierflow fit --trace --plan`).

`tierflow fit` fits to end-to-end times of several runs; a trace written by `tierflow run --out` holds far
more: the measured duration of every op of the plan. Here each observation is one op group of the plan (same
kind, resource and tensor class, e.g. every `fetch_weights` on h2d) with its measured time summed over the
steady iterations (the first iteration is left out when there are two or more: it pays the warm-up), plus
the measured iteration time. The plan's graph is rebuilt on the candidate profile (the compute ops' seconds
depend on it, the transfers' bytes do not) and simulated; each group's simulated time is the sum of its ops'
simulated durations, which include what the simulator models of contention (duplex links, shared SSD array,
host memory and cores, the measured interference factors). So the groups identify the fields they exercise:

- compute ops (fwd, recompute, bwd, head on gpu; their sizes differ, embedding and head against decoder
  layers): the large-GEMM rate (`gpu.peak_tflops` at the profile's `gpu.gemm_efficiency`: only their
  product is measured, and a fraction cannot exceed 1), `gpu.gemm_half_gflop` (GEMM efficiency by size),
  `gpu.hbm_efficiency`, `gpu.attention_efficiency`, `gpu.activation_gbps`, `gpu.op_overhead_us`;
- transfers (h2d, d2h, ssd_read, ssd_write; tensor classes of different sizes): each link's rate and fixed
  cost (`pcie.h2d_gbps`, `pcie.d2h_gbps`, `pcie.latency_us`, `ssd.read_gbps`, `ssd.write_gbps`,
  `ssd.latency_us`), `ssd.mixed_efficiency` where reads and writes overlap;
- CPU Adam: the rate the plan's runtime steps at (`cpu.adam_gparams_per_s`, or
  `cpu.deepspeed_adam_gparams_per_s` for a DeepSpeedCPUAdam runtime where the profile has it:
  dsruntime.adam_rate_key; build_graph applies the runtime's, so fitting the other would move nothing);
- on a host device, the interference factors `cpu.compute_slowdown_per_io_op`,
  `cpu.copy_slowdown_beside_compute`, `cpu.ssd_slowdown_beside_compute`.

`default_fields` picks the fields the plan's op kinds exercise (optional fields only where the base
profile sets them, and the fixed costs op_overhead_us and latency_us also where it leaves them unset), each
within [value / 1000, value x 1000] (fractions up to 1, slowdowns from 1). A fitted
solo PCIe rate carries its duplex rate along in proportion (the profile requires duplex <= solo) unless the
duplex rate is fitted itself. The optimiser, the identifiability checks (unidentified, collinear, at a
bound) and the written profile are those of tierflow.planner.fit.profile_fit: the report has the same form,
with one row per op group instead of one per run. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierflow.hwprofiles import HardwareProfile, ProfileError
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.dsruntime import adam_rate_key
from tierflow.planner.core.opkinds import ADAM_GPU, COMPUTE_KINDS, CPU_ADAM_KINDS
from tierflow.planner.core.schedules import ScheduleError, build_graph
from tierflow.planner.core.simulator import CapacityError, SimulationError, simulate_graph
from tierflow.planner.fit.profile_fit import (
    FitError,
    FitField,
    FitProblem,
    FitResult,
    Progress,
    Run,
    RunFit,
    identify,
)

# default bounds: [value / SPAN, value x SPAN]; a bundled profile of another box is off by up to ~1000x on a
# host device (rtx4090-lohan's 165 TFLOPS against a 2-core CPU's 0.19)
SPAN = 1000.0
# fixed costs a profile may leave unset (0): fitted from the middle of these bounds (microseconds)
UNSET_FIXED_COSTS = {"gpu.op_overhead_us": (1.0, 1e5), "pcie.latency_us": (1.0, 1e5),
                     "ssd.latency_us": (1.0, 1e5)}
ITERATION = "iteration"  # the observation of the whole iteration's time
# tied fields: fitting the first moves the second by the same factor (unless the second is fitted too)
TIED = {"pcie.h2d_gbps": "pcie.duplex_h2d_gbps", "pcie.d2h_gbps": "pcie.duplex_d2h_gbps"}
# the rate fields whose resource's busy time scales inversely with them (the fit's scaled start)
FIELD_RESOURCE = {"gpu.peak_tflops": "gpu", "cpu.adam_gparams_per_s": "cpu",
                  "cpu.deepspeed_adam_gparams_per_s": "cpu", "pcie.h2d_gbps": "h2d",
                  "pcie.d2h_gbps": "d2h", "ssd.read_gbps": "ssd_read", "ssd.write_gbps": "ssd_write"}
FRACTIONS = {"gpu.gemm_efficiency", "gpu.hbm_efficiency", "gpu.attention_efficiency", "ssd.mixed_efficiency"}
SLOWDOWNS = {"cpu.compute_slowdown_per_io_op", "cpu.copy_slowdown_beside_compute",
             "cpu.ssd_slowdown_beside_compute"}


@dataclass(frozen=True)
class Observation(Run):
    """One op group of the plan (or the whole iteration) and its measured seconds."""

    group: str = ""
    ops: tuple[int, ...] = ()

    def label(self) -> str:
        return self.group


@dataclass(frozen=True)
class PlanRef:
    """What the observations were measured on: the plan's model, schedule and graph."""

    plan: Plan
    iterations: tuple[int, ...]  # the iterations whose op groups are compared
    full: tuple[int, ...]  # the iterations the trace holds entirely (their time per iteration is compared)


def _group_key(kind: str, resource: str, tensor: str) -> str:
    return f"{kind} {resource}" + (f" ({tensor})" if tensor and tensor not in kind else "")


def observations(plan, start_s: np.ndarray, end_s: np.ndarray, source: str) -> tuple[list[Observation],
                                                                                      PlanRef]:
    """The op groups of the iterations the trace holds entirely, each with its measured seconds summed,
    and the measured iteration time (as `tierflow compare` takes it)."""
    tasks = plan.graph.tasks
    ran = ~np.isnan(start_s)
    full = [i for i in range(plan.graph.num_iterations)
            if all(ran[t.id] for t in tasks if t.iteration == i)]
    if not full:
        raise FitError(f"{source}: no iteration of the plan is complete in the trace (pass the trace.json "
                       "that `tierflow run --out` wrote with this plan)")
    its = tuple(full[1:] if len(full) >= 2 else full)
    groups: dict[str, list[int]] = {}
    for t in tasks:
        if t.iteration in its:
            groups.setdefault(_group_key(t.kind, t.resource, t.tensor), []).append(t.id)
    cfg = plan.config
    base = dict(model=plan.model.name, hw=plan.hardware.name, schedule=cfg.family, batch=cfg.batch,
                micro_batch=cfg.micro_batch, seq=cfg.seq, placement="plan", overrides={},
                measure="seconds", source=source)
    out = []
    for row, (name, ids) in enumerate(sorted(groups.items()), start=1):
        measured = float(np.sum(end_s[ids] - start_s[ids]))
        if measured > 0:
            out.append(Observation(**base, measured=measured, row=row, group=name, ops=tuple(ids)))
    ref = PlanRef(plan, its, tuple(full))
    out.append(Observation(**base, measured=iteration_seconds(ref, plan.graph.tasks, end_s),
                           row=len(groups) + 1, group=ITERATION, ops=()))
    return out, ref


def iteration_seconds(ref: PlanRef, tasks, end_s: np.ndarray) -> float:
    """Seconds per iteration: between the last GPU op of the first and the last full iteration (or the
    first's end when there is one)."""
    ends = [max(float(end_s[t.id]) for t in tasks if t.iteration == i and t.resource == "gpu")
            for i in (ref.full[0], ref.full[-1])]
    n = len(ref.full)
    return (ends[1] - ends[0]) / (n - 1) if n >= 2 else ends[1]


def _predict(ref: PlanRef, hw: HardwareProfile) -> dict[str, float] | None:
    """Simulated seconds of each observation on `hw`; None when the plan does not run there."""
    plan = ref.plan
    try:
        graph = build_graph(plan.model, hw, plan.config)
        res = simulate_graph(graph, hw, plan.config.world)
    except (CapacityError, ScheduleError, SimulationError, ValueError):
        return None
    if len(graph.tasks) != len(plan.graph.tasks):
        return None
    return {"dur": res.end_s - res.start_s, ITERATION: iteration_seconds(ref, graph.tasks, res.end_s)}


class _TraceProblem(FitProblem):
    """fit's problem with one plan simulated per point: observation i's value is its group's simulated
    seconds."""

    def __init__(self, obs: list[Observation], ref: PlanRef, base_hw: HardwareProfile,
                 fields: list[FitField]) -> None:
        super().__init__(obs, base_hw, fields)
        self.ref = ref
        self.sims: dict[tuple, dict | None] = {}
        data = base_hw.to_dict()
        fitted = {f.key for f in fields}
        self.tied = {a: (b, _get(data, a), _get(data, b)) for a, b in TIED.items() if a in fitted
                     and b not in fitted}

    def hw(self, i: int, x: np.ndarray) -> HardwareProfile | None:
        key = ("plan", self.xkey(x))
        if key not in self.hw_cache:
            values: dict[str, float] = self.values(x)
            for a, (b, va, vb) in self.tied.items():
                values[b] = vb * values[a] / va
            try:
                self.hw_cache[key] = self.base.with_overrides(values)
            except ProfileError:
                self.hw_cache[key] = None
        return self.hw_cache[key]

    def value(self, i: int, mb: int, x: np.ndarray) -> float | None:
        key = self.xkey(x)
        if key not in self.sims:
            hw = self.hw(i, x)
            self.simulations += hw is not None
            self.sims[key] = None if hw is None else _predict(self.ref, hw)
        sim = self.sims[key]
        if sim is None:
            return None
        ob = self.runs[i]
        return float(sim[ITERATION]) if ob.group == ITERATION else float(np.sum(sim["dur"][list(ob.ops)]))


def _get(data: dict, key: str):
    sec, _, k = key.partition(".")
    return (data.get(sec) or {}).get(k)


def _check_fields(base_hw: HardwareProfile, fields: list[FitField]) -> None:
    """FitError (one line) for a field given twice, not in the profile, not real-valued, or whose bounds make
    the profile invalid (its tied duplex rate moved along)."""
    if not fields:
        raise FitError("no fields to fit: the plan's op kinds exercise no field the base profile sets (name "
                       "them with --field section.key=LOW:HIGH)")
    data = base_hw.to_dict()
    keys = [f.key for f in fields]
    for f in fields:
        sec, _, k = f.key.partition(".")
        if keys.count(f.key) > 1:
            raise FitError(f"--field {f.key}: given twice (fit each field once)")
        if not isinstance(data.get(sec), dict) or k not in data[sec]:
            raise FitError(f"--field {f.key}: not a field of profile {base_hw.name} "
                           "(see docs/hardware-profiles.md)")
        v = data[sec][k]
        if isinstance(v, (bool, int, str)):
            raise FitError(f"--field {f.key}: only real-valued fields can be fitted ({f.key} is "
                           f"{type(v).__name__})")
        b = TIED.get(f.key)
        for bound in (f.lower, f.upper):
            over = {f.key: bound}
            if b and b not in keys:
                over[b] = _get(data, b) * bound / v
            try:
                base_hw.with_overrides(over)
            except ProfileError as e:
                raise FitError(f"--field {f.key}: the bound {bound:.4g} makes {base_hw.name} invalid: {e} "
                               "(narrow the bounds)") from None


def default_fields(plan, hw: HardwareProfile) -> list[FitField]:
    """The fields the plan's op kinds exercise, within [value / 10, value x 10] (see the module docstring)."""
    kinds = {t.kind for t in plan.graph.tasks}
    res = {t.resource for t in plan.graph.tasks}
    keys: list[str] = []
    if kinds & COMPUTE_KINDS:
        keys += ["gpu.peak_tflops", "gpu.gemm_half_gflop", "gpu.attention_efficiency",
                 "gpu.activation_gbps", "gpu.op_overhead_us"]
    if kinds & COMPUTE_KINDS or ADAM_GPU in kinds:
        keys.append("gpu.hbm_efficiency")
    if kinds & CPU_ADAM_KINDS:
        keys.append(adam_rate_key(hw, plan.config.runtime))
    if "h2d" in res:
        keys.append("pcie.h2d_gbps")
    if "d2h" in res:
        keys.append("pcie.d2h_gbps")
    if res & {"h2d", "d2h"}:
        keys.append("pcie.latency_us")
    if "ssd_read" in res:
        keys.append("ssd.read_gbps")
    if "ssd_write" in res:
        keys.append("ssd.write_gbps")
    if res & {"ssd_read", "ssd_write"}:
        keys.append("ssd.latency_us")
    if {"ssd_read", "ssd_write"} <= res:
        keys.append("ssd.mixed_efficiency")
    if hw.gpu.host_cores is not None:
        keys += sorted(SLOWDOWNS)
    data = hw.to_dict()
    out = []
    for key in keys:
        bounds = _default_bounds(key, _get(data, key))
        if bounds is not None:
            lo, hi = (_valid_bound(hw, key, b, _get(data, key)) for b in bounds)
            if lo < hi:
                out.append(FitField(key, lo, hi))
    return out


def _valid_bound(hw: HardwareProfile, key: str, bound: float, v: object) -> float:
    """`bound`, or the value nearest to it towards the profile's own (geometrically) that the profile's
    validation accepts (its sanity ceilings, a tied duplex rate moved along)."""
    data = hw.to_dict()
    start = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else bound
    for _ in range(20):
        over = {key: bound}
        if key in TIED:
            over[TIED[key]] = _get(data, TIED[key]) * bound / start
        try:
            hw.with_overrides(over)
            return bound
        except ProfileError:
            bound = math.sqrt(bound * start)
    return start


def _default_bounds(key: str, v: object) -> tuple[float, float] | None:
    """[v / SPAN, v x SPAN], fractions up to 1 (SSD mixing from 0.5), slowdowns from 1 to 4 v; an unset fixed
    cost within UNSET_FIXED_COSTS; None for another unset field (name it with --field to fit it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        return UNSET_FIXED_COSTS.get(key)
    lo, hi = v / SPAN, v * SPAN
    if key in FRACTIONS:
        lo, hi = (0.5 if key == "ssd.mixed_efficiency" else lo), 1.0
    if key in SLOWDOWNS:
        lo, hi = 1.0, max(v * 4, 2.0)
    return (float(lo), float(hi)) if lo < hi else None


def fit_trace(plan, start_s: np.ndarray, end_s: np.ndarray, base_hw: HardwareProfile,
              fields: Sequence[FitField] | None = None, *, source: str = "trace", method: str = "Powell",
              restarts: int = 0, max_evals: int = 1500, progress: Progress | None = None) -> FitResult:
    """Fit `fields` (default: `default_fields`) of `base_hw` to the op durations measured running `plan`
    (start and end seconds per op id, NaN where not measured: tierflow.planner.io.compare.load_measured reads
    them from a trace file, `source`). The result reads like `fit`'s (no leave-one-out: the groups of one
    trace are not independent runs)."""
    t0 = time.perf_counter()
    obs, ref = observations(plan, start_s, end_s, source)
    fields = list(fields) if fields else default_fields(plan, base_hw)
    _check_fields(base_hw, fields)
    p = _TraceProblem(obs, ref, base_hw, fields)
    data = base_hw.to_dict()
    initial = {f.key: _get(data, f.key) for f in fields}
    x0 = np.clip(np.array([math.log(v) if v else (lo + hi) / 2
                           for v, lo, hi in zip(initial.values(), p.lo, p.hi)]), p.lo, p.hi)
    if p.value(0, 0, x0) is None:
        raise FitError(f"{source}: the plan does not simulate on {base_hw.name} (a base profile whose "
                       "memory holds the plan is needed)")
    scaled = _scaled_start(p, x0)
    if p.objective(scaled, range(len(obs)), {i: 0 for i in range(len(obs))}) < \
            p.objective(x0, range(len(obs)), {i: 0 for i in range(len(obs))}):
        x0 = scaled
    rng = np.random.default_rng(0)
    starts = [x0] + [rng.uniform(p.lo, p.hi) for _ in range(restarts)]
    mbs = {i: 0 for i in range(len(obs))}
    if progress:
        p.on_evaluation = lambda k, rms: progress(0, 2, f"fit: {k} evaluations, rms {rms:.2%}") \
            if k % 10 == 0 else None
    x, _ = p.optimise(list(range(len(obs))), starts, mbs, method, max_evals)
    p.on_evaluation = None
    runs = [RunFit(o, p.value(i, 0, x) or math.nan, obs[i].micro_batch,
                   p.residual(i, p.value(i, 0, x))) for i, o in enumerate(obs)]
    if progress:
        progress(1, 2, "identifiability")
    unidentified, at_bound, sens = identify(p, x, mbs)
    res = np.array([r.residual for r in runs])
    return FitResult(fields=fields, values=p.values(x), initial=initial, runs=runs,
                     rms=float(np.sqrt(np.mean(res ** 2))), max_abs=float(np.max(np.abs(res))), loo_rms=None,
                     loo_max_abs=None, unidentified=unidentified, at_bound=at_bound, sensitivity=sens,
                     evaluations=p.evaluations, simulations=p.simulations, wall_s=time.perf_counter() - t0,
                     base_hw=base_hw.name, base_source=base_hw.source, method=method)


def _scaled_start(p: _TraceProblem, x0: np.ndarray) -> np.ndarray:
    """x0 with each rate field scaled by its resource's predicted / measured busy time at x0 (a rate that
    alone explained the resource's time would move by that much): a start near the optimum when whole
    resources are off by large factors (a profile of another box)."""
    sim = p.sims.get(p.xkey(x0))
    x = x0.copy()
    if sim is None:
        return x
    tasks = p.ref.plan.graph.tasks
    busy: dict[str, list[float]] = {}
    for ob in p.runs:
        if ob.group != ITERATION:
            b = busy.setdefault(tasks[ob.ops[0]].resource, [0.0, 0.0])
            b[0] += ob.measured
            b[1] += float(np.sum(sim["dur"][list(ob.ops)]))
    for j, key in enumerate(p.keys):
        r = FIELD_RESOURCE.get(key)
        if r in busy and busy[r][0] > 0 and busy[r][1] > 0:
            x[j] = np.clip(x0[j] + math.log(busy[r][1] / busy[r][0]), p.lo[j], p.hi[j])
    return x


def with_tied(result: FitResult, base_hw: HardwareProfile) -> FitResult:
    """`result` with the tied duplex rates added as fitted fields (moved by their solo rate's factor, bounds
    likewise), so that the profile written from it is valid and says where each value came from."""
    data = base_hw.to_dict()
    fields, values, initial = list(result.fields), dict(result.values), dict(result.initial)
    for f in result.fields:
        b = TIED.get(f.key)
        if b is None or b in values:
            continue
        va, vb = _get(data, f.key), _get(data, b)
        fields.append(FitField(b, f.lower * vb / va, f.upper * vb / va))
        values[b], initial[b] = vb * values[f.key] / va, vb
    return dataclasses.replace(result, fields=fields, values=values, initial=initial)
