"""The executor's fixed host cost per op, by the path its handler takes, measured from its own traces on
calibrate's plans of tiny ops (`measure_op_costs`); what the profile's per-op fields charge.

An op's fixed cost is what it took beyond the cost model's time for its work (a compute op's roofline time,
a transfer's bytes / rate), counted from the moment it could start: end - max(its dependencies' ends, its
queue predecessor's end) - work. That span holds its handler's Python and the framework's dispatch, the
engine's loop between two ops, and the wake-up after a dependency run by another worker. The mechanisms
that decide it, each measured on its own plan (a 2 x 64 model, `CAL_MICRO_BATCHES` micro-batches of one
sequence, every tensor on the device but what the plan moves):

    resident   a compute op whose tensors all stay on the device (weights resident, saved tensors left to
               autograd, no dependency on or from another worker): `gpu.op_overhead_us`. Fitted over two
               op sizes (`CAL_SEQS` tokens per micro-batch): fixed = a + c x work with one slope `c` for
               the step (how far the roofline's time of a tiny op is off; reported, not charged, bounded
               as `_fit_keys` says) and an intercept `a` per op (kind, block): the op's fixed cost at zero
               work, so that what scales with the op's size stays in its work. The mean of `a` over the
               plan's ops (every kind in the proportion a step has them: block passes, the head's
               forward-loss-backward, the device optimizer).
    moved      a compute op that exchanges tensors with another worker (its checkpoint offloaded or
               fetched: saved tensors through the pack hooks, the hand-off): the plan with its checkpoints
               in host memory, each such op's fixed cost less the resident plan's for the same (kind, block)
               and size: `gpu.moved_op_overhead_us`, charged on top of op_overhead to the compute ops a plan
               connects to another resource (planner/core/hostcost.py).
    transfer   the same plan's offload and fetch ops: the intercept over the two sizes of their fixed cost
               (`pcie.latency_us`).
    graphs     graph_launch.py: the resident plan run with --cuda-graphs at two segment sizes
               (`gpu.graph_launch_us`, `gpu.graph_op_us`).

The emulation runs without its random delays (an adversary, not a cost). Each plan runs `rounds` rounds of
ITERATIONS steps after one warm-up round; per op (kind, block; every micro-batch alike) the median over its
micro-batches and iterations (the first iteration of each round waits for the round's setup and is left out).

The clock, by device (`op_fixed_cpu_s`, `op_fixed_s`): where the device is the host's CPU (the plain CPU
backend, the emulation of CUDA) every part of an op's cost is host CPU time, so an op's fixed cost is counted
in CPU seconds, not from the trace's wall clock: its handler's CPU time on whichever thread runs it (the time
`executor.ops.run` takes in `time.thread_time`), less its work, plus its share of the round's CPU time outside
the handlers (the engine's loop, events, launches, hand-offs and the stream threads: the process's CPU time of
the round less its handlers', per op); per op key the median over a round's micro-batches and iterations,
and of the rounds the best (as calibrate keeps its best timings: other processes only ever slow one). The
plans' rounds alternate, so that a shared box's load falls on both sizes alike (the slope compares them). On
a box that runs the process alone that is its wall time (one thread holds the interpreter lock at a time); on
a shared box it is what the other processes do not inflate (at load 10-15 on this project's 2 cores the
trace's spans gave 1.5-8x the CPU time: an optimizer op 1-5 ms for 0.6 ms of CPU). On CUDA the span from the
op's events stays: its kernels run on the device, beside the host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from tierflow.executor.device.base import DeviceBackend
from tierflow.planner.core.hostcost import DEVICE_KINDS

CAL_SEQS = (8, 32)  # tokens per micro-batch: the two op sizes the intercept is fitted over
CAL_MICRO_BATCHES = 4
CAL_LAYERS, CAL_HIDDEN = 2, 64
ITERATIONS = 3
COMPUTE = DEVICE_KINDS  # the compute ops gpu.op_overhead_us is charged to
TRANSFERS = ("h2d", "d2h")


def cal_model(seq: int, layers: int = CAL_LAYERS, hidden: int = CAL_HIDDEN, precision: str | None = "fp32"):
    from tierflow.planner.core.models import get_model

    return replace(get_model("tiny-gpt"), name=f"calibrate-{layers}x{hidden}-s{seq}", num_layers=layers,
                   hidden=hidden, num_heads=2, num_kv_heads=2, head_dim=hidden // 2, ffn_hidden=4 * hidden,
                   vocab_size=256, seq_len=seq, max_positions=seq, precision=precision)


def cal_graph(hw, placement: str, seq: int, num_mb: int = CAL_MICRO_BATCHES, layers: int = CAL_LAYERS,
              device_kind: str = "cpu", iterations: int = ITERATIONS):
    """(model, profile, schedule) of a horizontal plan of tiny ops without recompute, the optimizer on the
    device: `placement` on_device (every tensor on the device) or checkpoints_host (the checkpoints in host
    memory); on `hw` with room for it."""
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import make_schedule

    model = cal_model(seq, layers, precision="fp32" if device_kind == "cpu" else None)
    hw = hw.with_overrides({"gpu.memory_gib": max(hw.gpu.memory_gib, 8.0),
                            "cpu.memory_gib": max(hw.cpu.memory_gib, 8.0)})
    on, host = Split(1.0, 0.0, 0.0), Split(0.0, 1.0, 0.0)
    ck = host if placement == "checkpoints_host" else on
    pl = Placement(weights=on, master=on, adam_m=on, adam_v=on, grads=on, checkpoints=ck)
    cfg = make_schedule("horizontal", model, hw, batch=num_mb, micro_batch=1, seq=seq, placement=pl,
                        iterations=iterations, runtime="ideal", recompute=False)
    return model, hw, cfg


def load_cal_plan(model, hw, cfg):
    """The plan file of (model, hw, cfg) as the executor loads it."""
    import tempfile
    from pathlib import Path

    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

    with tempfile.TemporaryDirectory(prefix="tierflow-calibrate-") as tmp:
        path = Path(tmp) / "tiny.json"
        write_plan(plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg)), path)
        return load_plan(path)


def cal_executor(plan, backend: DeviceBackend, cuda_graphs: bool = False):
    """The executor of `plan` on `backend`, its state initialised (seed 0)."""
    from tierflow.executor.data import TokenData
    from tierflow.executor.engine import Executor
    from tierflow.executor.ops.context import Hyper
    from tierflow.executor.tiers.state import TrainState

    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, backend, dtype, None)
    state.init_random(0)
    data = TokenData.load(None, plan.model.vocab_size, seed=0)
    ex = Executor(plan, state, data, backend, Hyper(), None, cuda_graphs=cuda_graphs)
    ex.arena.warn = None  # a tiny plan's transfer area overflows by a few pages: timed, not reported
    return ex


def run_rounds(plan, backend: DeviceBackend, rounds: int, cuda_graphs: bool = False):
    """`rounds` rounds of `plan` (ITERATIONS steps each, after a warm-up round) by the executor on `backend`;
    their RoundResults."""
    ex = cal_executor(plan, backend, cuda_graphs)
    ex.run_round(ITERATIONS, 0)
    return [ex.run_round(ITERATIONS, (r + 1) * ITERATIONS) for r in range(rounds)], ex


@dataclass
class CpuRound:
    """One round's CPU seconds: per op id its handler's (on the thread that ran it), the whole process's."""

    handler_s: dict[int, float]
    process_s: float


def clock_handlers(ex) -> dict[int, float]:
    """Time every op's handler (`ex.ops.run`, the call the engine's workers make) in CPU seconds of the thread
    that runs it: the dict, op id -> seconds of its last call, that the calls fill."""
    out: dict[int, float] = {}
    run = ex.ops.run

    def timed(rs, t) -> None:
        c0 = time.thread_time()
        try:
            run(rs, t)
        finally:
            out[t.id] = time.thread_time() - c0

    ex.ops.run = timed
    return out


class CalRun:
    """One plan's executor, warmed up, whose rounds are timed one at a time (so that several plans can
    alternate round by round: a shared box's load then falls on all of them alike)."""

    def __init__(self, plan, backend: DeviceBackend, cuda_graphs: bool = False, clock: bool = True) -> None:
        """`clock`: the handlers clocked where the device is the host's CPU (`clock_handlers`)."""
        self.plan = plan
        self.ex = cal_executor(plan, backend, cuda_graphs)
        self.handlers = clock_handlers(self.ex) if clock and backend.device.type == "cpu" else None
        self.ex.run_round(ITERATIONS, 0)

    def round_cpu(self, r: int) -> CpuRound:
        """Round r (its steps numbered after the warm-up's) with its CPU seconds (no handlers' unclocked)."""
        if self.handlers is not None:
            self.handlers.clear()
        c0 = time.process_time()
        self.ex.run_round(ITERATIONS, (r + 1) * ITERATIONS)
        return CpuRound(dict(self.handlers or {}), time.process_time() - c0)

    def round_trace(self, r: int):
        return self.ex.run_round(ITERATIONS, (r + 1) * ITERATIONS)


def op_fixed_cpu_s(tasks, rounds: list[CpuRound], rates, cross: set[int]) -> dict[tuple, list[float]]:
    """Per op key (`op_key`) and round: the median over the round's micro-batches and iterations but its
    first of the op's fixed cost in CPU seconds (its handler's CPU time less its work, plus its share of the
    round's CPU time outside the handlers)."""
    out: dict[tuple, list[float]] = {}
    for r in rounds:
        share = max(0.0, r.process_s - sum(r.handler_s.values())) / max(1, len(r.handler_s))
        got: dict[tuple, list[float]] = {}
        for t in tasks:
            if t.iteration >= 1 and t.id in r.handler_s:
                got.setdefault(op_key(t, cross), []).append(r.handler_s[t.id] - work_s(t, rates) + share)
        for key, xs in got.items():
            out.setdefault(key, []).append(statistics.median(xs))
    return out


def work_s(t, rates) -> float:
    return t.work if t.resource in ("gpu", "cpu") else t.work / getattr(rates, t.resource)


def op_fixed_s(tasks, results, rates, cross: set[int]) -> dict[tuple, list[float]]:
    """Per op key (`op_key`): its fixed cost (end - ready - work) in each micro-batch and iteration but the
    first of each round, over `results`."""
    out: dict[tuple, list[float]] = {}
    for res in results:
        start, end = res.start_s, res.end_s
        prev: dict[str, int] = {}
        n = len(start)
        for t in sorted((t for t in tasks if t.id < n), key=lambda t: start[t.id]):
            ready = max([end[d] for d in t.deps] + ([end[prev[t.resource]]] if t.resource in prev else []),
                        default=start[t.id])
            prev[t.resource] = t.id
            if t.iteration >= 1:
                out.setdefault(op_key(t, cross), []).append(end[t.id] - ready - work_s(t, rates))
    return out


def op_key(t, cross: set[int]) -> tuple[str, str, int, bool]:
    """An op's (resource, kind, block, whether it exchanges tensors with another worker): the ops of every
    micro-batch alike."""
    return t.resource, t.kind, t.block, t.id in cross


@dataclass
class _Sized:
    """One plan's measurements at one size: per op key its ops per step, work and median fixed cost
    (seconds)."""

    seq: int
    count: dict[tuple, int] = field(default_factory=dict)
    work_s: dict[tuple, float] = field(default_factory=dict)
    fixed_s: dict[tuple, float] = field(default_factory=dict)
    moved: set[tuple] = field(default_factory=set)  # keys of ops that exchange tensors with another worker


def _measure_plans(hw, plans: list[tuple[str, int]], backend: Callable[[], DeviceBackend],
                   rounds: int) -> dict[tuple[str, int], _Sized]:
    """Per (placement, tokens) of `plans`: calibrate's plan measured (a backend each), their rounds
    alternating; on a CPU device in CPU seconds, each op key's best round (`op_fixed_cpu_s`), else from the
    trace's spans, the median (`op_fixed_s`)."""
    from tierflow.planner.core.costmodel import link_rates

    runs = {}
    for placement, seq in plans:
        be = backend()
        model, hw2, cfg = cal_graph(hw, placement, seq, device_kind=be.device.type)
        runs[placement, seq] = (CalRun(load_cal_plan(model, hw2, cfg), be), link_rates(hw2))
    got: dict[tuple[str, int], list] = {k: [] for k in runs}
    for r in range(rounds):
        for k, (run, _) in runs.items():
            got[k].append(run.round_cpu(r) if run.handlers is not None else run.round_trace(r))
    return {k: _sized(k[1], run, rates, got[k]) for k, (run, rates) in runs.items()}


def _sized(seq: int, run: CalRun, rates, rounds: list) -> _Sized:
    from tierflow.planner.core.hostcost import moved_op_ids

    tasks = run.plan.graph.tasks
    cross = moved_op_ids(tasks)  # the ops gpu.moved_op_overhead_us is charged to
    if run.handlers is not None:  # the host's CPU is the device: CPU seconds, the best round (docstring)
        fixed, pick = op_fixed_cpu_s(tasks, rounds, rates, cross), min
    else:
        fixed, pick = op_fixed_s(tasks, rounds, rates, cross), statistics.median
    out = _Sized(seq)
    for t in tasks:
        key = op_key(t, cross)
        if key not in fixed or t.iteration != 1:
            continue
        out.count[key] = out.count.get(key, 0) + 1
        if key not in out.work_s:
            out.work_s[key] = work_s(t, rates)
            out.fixed_s[key] = pick(fixed[key])
        if key[3]:
            out.moved.add(key)
    return out


def intercept_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + c x over (x, y) points; (a, c). One distinct x: (mean y, 0)."""
    xs = [x for x, _ in points]
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return my, 0.0
    c = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - c * mx, c


SLOPE_RANGE = (-1.0, 0.0)


def _fit_keys(sized: list[_Sized], keep) -> tuple[float | None, float | None, dict]:
    """One slope shared by the kept keys and an intercept per key: fixed = a_key + c x work over the sizes.
    The slope from the step's totals (the kept ops' summed fixed cost against their summed work at each
    size: a key's work differs little between the sizes, the step's spans more and its noise averages out),
    bounded to SLOPE_RANGE: the roofline's time of a tiny op holds the GEMM curve's own fixed cost per GEMM
    (gpu.gemm_half_gflop), which the op's measured dispatch already pays, so the measured fixed cost shrinks
    as the modelled work grows, by at most that work (c >= -1); a real op slower than its roofline beyond
    that is the roofline's error, not a cost per op (c <= 0). Returns the mean intercept over the ops of a
    step (each key as often as a step has it), the slope, per key its intercept (its sizes' mean of
    fixed - c x work)."""
    keys = [k for k in sized[0].fixed_s if keep(k) and all(k in s.fixed_s for s in sized)]
    if not keys:
        return None, None, {}
    n = {k: sized[0].count.get(k, 1) for k in keys}
    totals = [(sum(n[k] * s.work_s[k] for k in keys), sum(n[k] * s.fixed_s[k] for k in keys)) for s in sized]
    _, c = intercept_fit(totals)
    c = min(max(c, SLOPE_RANGE[0]), SLOPE_RANGE[1])
    fits = {k: statistics.fmean(s.fixed_s[k] - c * s.work_s[k] for s in sized) for k in keys}
    return sum(fits[k] * n[k] for k in keys) / sum(n.values()), c, fits


def measure_op_costs(hw, backend: Callable[[], DeviceBackend], rounds: int = 3) -> dict:
    """The fixed costs per op of the module docstring on the backends `backend()` makes (one per run), in
    microseconds: op_overhead_us, moved_op_overhead_us, pcie_latency_us, and what they were fitted on (the
    graphs' figures: graph_launch.py)."""
    got = _measure_plans(hw, [(p, s) for p in ("on_device", "checkpoints_host") for s in CAL_SEQS], backend,
                         rounds)
    res = {s: got["on_device", s] for s in CAL_SEQS}
    ck = {s: got["checkpoints_host", s] for s in CAL_SEQS}
    on_sized = list(res.values())
    a, c, fits = _fit_keys(on_sized, lambda k: k[0] == "gpu" and k[1] in COMPUTE)
    moved = [(ck[s].fixed_s[k] - res[s].fixed_s[(*k[:3], False)], ck[s].count[k]) for s in CAL_SEQS
             for k in ck[s].moved if k[0] == "gpu" and k[1] in COMPUTE and (*k[:3], False) in res[s].fixed_s]
    ck_sized = list(ck.values())
    pcie, pcie_c, _ = _fit_keys(ck_sized, lambda k: k[0] in TRANSFERS)
    out = {"op_overhead_us": None if a is None else max(0.0, a) * 1e6,
           "roofline_slope": c,  # fixed cost per second of modelled work (0: the roofline's time is right)
           "moved_op_overhead_us": (max(0.0, sum(x * n for x, n in moved) / sum(n for _, n in moved)) * 1e6
                                    if moved else None),
           "pcie_latency_us": None if pcie is None else max(0.0, pcie) * 1e6,
           "per_kind_us": _per_kind(fits),
           "fitted_on": f"{CAL_LAYERS} x {CAL_HIDDEN} model, {CAL_MICRO_BATCHES} micro-batches of 1 x "
                        f"{' and '.join(map(str, CAL_SEQS))} tokens, {rounds} rounds of {ITERATIONS} steps"}
    return out


def _per_kind(fits: dict) -> dict[str, float]:
    kinds: dict[str, list[float]] = {}
    for k, a in fits.items():
        kinds.setdefault(k[1], []).append(a)
    return {k: round(statistics.fmean(v) * 1e6, 1) for k, v in kinds.items()}
