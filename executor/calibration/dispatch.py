"""The executor's host cost per op, split into its parts, measured by running the real engine
(executor/engine.py) on a plan of tiny ops, against plain PyTorch stepping the same model.

The plan: a tiny model (`TINY`, 2 layers x 64, vocabulary 256) at micro-batches of 1 x 8 tokens with every
tensor on the device and no recompute (horizontal, the optimizer on the device), so that every op's kernels
take microseconds and what remains is the cost of dispatching them. `TimedExecutor` is the engine with clocks
around its own steps (each clock is a few hundred nanoseconds, counted in the part it wraps):

    handoff   a dependency run by another thread: from that op's `done` being set to the waiting worker
              running again (thread wake-up, the GIL)
    events    the engine's record / wait_event / synchronize_event calls (streams only; a host worker's
              synchronize_event includes the time its stream op still ran)
    launch    backend.launch less the handler when it runs inline (CUDA, the plain CPU): the stream hand-off
    trace     the per-op timing and memory-effect bookkeeping (`apply_mem`)
    handler   the op's handler (ops/table.py), on whichever thread runs it: its torch calls and its Python
    loop      the rest of the worker's time per op (dependency checks, marking the op done, the loop)

and plain PyTorch (executor.models.BlockModel, torch.optim.AdamW, the same micro-batches) gives the step the
same math costs without the executor. `measure_dispatch` returns the mean of each part per op in
microseconds, the executor's and plain PyTorch's step, `executor_op_us`: (executor step - plain step) / ops
per step (in wall and in CPU time), and `engine_op_us`, the parts but the handler: the engine's own cost on
every op, which a profile's `cpu.executor_op_us` charges to every op.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from tierflow.executor.device.base import DeviceBackend
from tierflow.executor.engine import Executor

PARTS = ("handoff", "events", "launch", "trace", "handler", "loop")
SEQ, MICRO_BATCH, NUM_MB, ITERATIONS = 8, 1, 2, 3


def tiny_model(precision: str | None = "fp32"):
    from tierflow.planner.core.models import get_model

    return replace(get_model("tiny-gpt"), name="dispatch-tiny", num_layers=2, hidden=64, num_heads=2,
                   num_kv_heads=2, head_dim=32, ffn_hidden=256, vocab_size=256, seq_len=SEQ,
                   max_positions=SEQ, precision=precision)


class _TimedEvent(threading.Event):
    """An op's `done`, with the time it was set."""

    t_s = 0.0

    def set(self) -> None:
        self.t_s = time.perf_counter()
        super().set()


@dataclass
class DispatchClock:
    """Seconds and counts per part, over every thread of the runs."""

    s: Counter = field(default_factory=Counter)
    n: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def add(self, part: str, dt_s: float) -> None:
        with self.lock:
            self.s[part] += dt_s
            self.n[part] += 1

    def inline_s(self) -> float:
        """Handler seconds run on the calling thread so far."""
        return getattr(self.local, "handler_s", 0.0)

    def reset(self) -> None:
        with self.lock:
            self.s.clear()
            self.n.clear()


class _TimedBackend:
    """The engine's view of its backend with the engine's own event and launch calls clocked; everything
    else (and the ops' own use of the backend) goes straight through."""

    def __init__(self, inner: DeviceBackend, clock: DispatchClock) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _timed(self, part: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._clock.add(part, time.perf_counter() - t0)

    def record(self, stream):
        return self._timed("events", self._inner.record, stream)

    def wait_event(self, stream, event) -> None:
        self._timed("events", self._inner.wait_event, stream, event)

    def synchronize_event(self, event) -> None:
        self._timed("events", self._inner.synchronize_event, event)

    def launch(self, stream, fn, label: str) -> None:
        t0, h0 = time.perf_counter(), self._clock.inline_s()
        self._inner.launch(stream, fn, label)
        self._clock.add("launch", time.perf_counter() - t0 - (self._clock.inline_s() - h0))


class TimedExecutor(Executor):
    """The engine with clocks around its steps (see the module docstring); numerics unchanged."""

    def __init__(self, *args, clock: DispatchClock, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.backend = _TimedBackend(self.backend, clock)
        run = self.ops.run

        def timed_run(rs, t) -> None:
            t0 = time.perf_counter()
            try:
                run(rs, t)
            finally:
                dt = time.perf_counter() - t0
                clock.local.handler_s = clock.inline_s() + dt
                clock.add("handler", dt)

        self.ops.run = timed_run

    def new_round(self, iterations, step0, n):
        rs = super().new_round(iterations, step0, n)
        rs.done = [_TimedEvent() for _ in range(n)]
        return rs

    def wait_op(self, rs, d) -> None:
        ev = rs.done[d]
        if ev.is_set():
            return
        t0 = time.perf_counter()
        super().wait_op(rs, d)
        now = time.perf_counter()
        self.clock.local.blocked_s = getattr(self.clock.local, "blocked_s", 0.0) + (now - t0)
        self.clock.add("handoff", now - max(ev.t_s, t0))

    def apply_mem(self, rs, effects) -> None:
        t0 = time.perf_counter()
        super().apply_mem(rs, effects)
        self.clock.add("trace", time.perf_counter() - t0)

    def worker(self, rs, resource, queue, caller: bool = False) -> None:
        c = self.clock
        c.local.blocked_s = c.local.handler_s = 0.0
        t0 = time.perf_counter()
        super().worker(rs, resource, queue, caller)
        # this worker's time less its waits for other threads' ops
        c.add(f"worker_s:{resource}", time.perf_counter() - t0 - c.local.blocked_s)


def _worker_parts(clock: DispatchClock) -> float:
    return sum(v for k, v in clock.s.items() if k.startswith("worker_s:"))


@dataclass
class DispatchResult:
    backend: str
    ops_per_step: float
    executor_step_s: float
    plain_step_s: float
    parts_us: dict[str, float]  # per op
    # CPU seconds of the whole process per step (every thread): what a loaded machine's other processes do
    # not inflate, unlike the wall time
    executor_cpu_s: float = 0.0
    plain_cpu_s: float = 0.0
    executor_cpu_best_s: float = 0.0  # the best round's (what calibrate keeps: op_costs.py)
    # the median over rounds of (executor - plain) in the same round, per op, wall and CPU: on a box whose
    # speed drifts for seconds at a time (plain PyTorch's own step 5.3-9.7 ms on one quiet core) the
    # difference of two medians carries the drift, a paired difference mostly not
    paired_op_us: float = 0.0
    paired_op_cpu_us: float = 0.0

    @property
    def executor_op_us(self) -> float:
        return max(0.0, (self.executor_step_s - self.plain_step_s) / self.ops_per_step * 1e6)

    @property
    def executor_op_cpu_us(self) -> float:
        return max(0.0, (self.executor_cpu_s - self.plain_cpu_s) / self.ops_per_step * 1e6)

    @property
    def engine_op_us(self) -> float:
        """The engine's own cost per op, the same for every op whatever its handler: its parts but the
        handler (hand-off, events, launch, trace, loop). What cpu.executor_op_us charges to every op; the
        handlers' cost beyond plain PyTorch stays with their ops' fixed costs (gpu.op_overhead_us for a
        compute op)."""
        return sum(v for k, v in self.parts_us.items() if k != "handler")


PLACEMENTS = ("on_device", "checkpoints_host")


def tiny_config(device_kind: str, placement: str = "on_device", hw=None):
    """The tiny model and the schedule of the plan of tiny ops: horizontal, no recompute, every tensor on the
    device (`checkpoints_host`: the checkpoints in host memory, so that offload and fetch ops hand over
    between the gpu, d2h and h2d workers), on `hw` (default a stock profile with room for it); `device_kind`
    cpu: the fp32 a CPU device computes in."""
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import make_schedule

    model = tiny_model("fp32" if device_kind == "cpu" else None)
    hw = (hw or load_profile("rtx3090-desktop")).with_overrides({"gpu.memory_gib": 8, "cpu.memory_gib": 64})
    on, host = Split(1.0, 0.0, 0.0), Split(0.0, 1.0, 0.0)
    ck = host if placement == "checkpoints_host" else on
    pl = Placement(weights=on, master=on, adam_m=on, adam_v=on, grads=on, checkpoints=ck)
    cfg = make_schedule("horizontal", model, hw, batch=MICRO_BATCH * NUM_MB, micro_batch=MICRO_BATCH, seq=SEQ,
                        placement=pl, iterations=ITERATIONS, runtime="ideal", recompute=False)
    return model, hw, cfg


def tiny_plan(device_kind: str, placement: str = "on_device", hw=None):
    """The plan of tiny ops (tiny_config) as the executor loads it."""
    import tempfile
    from pathlib import Path

    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

    model, hw, cfg = tiny_config(device_kind, placement, hw)
    with tempfile.TemporaryDirectory(prefix="tierflow-dispatch-") as tmp:
        path = Path(tmp) / "tiny.json"
        write_plan(plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg)), path)
        return load_plan(path)


def predicted_step_s(device_kind: str, placement: str, hw, graphs: bool = False) -> float:
    """The simulator's step of the plan of tiny ops on profile `hw` (its per-op fields included); `graphs`:
    as `tierflow run --cuda-graphs` runs it (planner/core/capture.py's graphed_graph)."""
    from tierflow.planner.core.capture import graphed_graph
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.core.simulator import simulate_graph

    model, hw, cfg = tiny_config(device_kind, placement, hw)
    graph = build_graph(model, hw, cfg)
    return simulate_graph(graphed_graph(graph, hw) if graphs else graph, hw).iteration_s


def _executor(plan, backend: DeviceBackend, clock: DispatchClock | None) -> Executor:
    from tierflow.executor.data import TokenData
    from tierflow.executor.ops.context import Hyper
    from tierflow.executor.tiers.state import TrainState

    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, backend, dtype, None)
    state.init_random(0)
    data = TokenData.load(None, plan.model.vocab_size, seed=0)
    if clock is None:
        ex = Executor(plan, state, data, backend, Hyper(), None)
    else:
        ex = TimedExecutor(plan, state, data, backend, Hyper(), None, clock=clock)
    # a tiny plan's transfer area overflows by a few pages (its buffers outlive the plan's order by a little):
    # what it pins beyond is timed with the rest, not reported to whoever runs the measurement
    ex.arena.warn = None
    return ex


class PlainSteps:
    """Plain PyTorch on the same model, micro-batches and optimizer hyper-parameters."""

    def __init__(self, plan, device: torch.device) -> None:
        from tierflow.executor.models import BlockModel
        from tierflow.executor.ops.context import Hyper

        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(0)
        self.model = BlockModel(plan.model, dtype=dtype, device=device)
        h = Hyper()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                     weight_decay=h.weight_decay)
        g = torch.Generator().manual_seed(0)
        n = MICRO_BATCH * NUM_MB
        self.x = torch.randint(0, plan.model.vocab_size, (n, SEQ), generator=g).to(device)
        self.y = torch.randint(0, plan.model.vocab_size, (n, SEQ), generator=g).to(device)

    def step_s(self, steps: int) -> float:
        from tierflow.executor.models import loss as lm_loss

        t0 = time.perf_counter()
        for _ in range(steps):
            for i in range(NUM_MB):
                sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                (lm_loss(self.model(self.x[sl]), self.y[sl]) / NUM_MB).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / steps


def measure_dispatch(make_backend, rounds: int = 5, placement: str = "on_device",
                     setup=None) -> DispatchResult:
    """The executor's cost per op on the backend `make_backend()` makes (one for each executor: a backend
    holds its executor's transfer area; see the module docstring): `rounds` rounds of the tiny plan
    (ITERATIONS steps each) after one warm-up round, alternating with as many steps of plain PyTorch, the
    median round of each; the executor's step is timed without the clocks, the parts by a second executor
    with them (`TimedExecutor`) in the same rounds. `setup(executor)`, if given, is called on both executors
    before they run (a benchmark's variant)."""
    backend = make_backend()
    plan = tiny_plan(backend.device.type, placement)
    clock = DispatchClock()
    ex, timed = _executor(plan, backend, None), _executor(plan, make_backend(), clock)
    for e in (ex, timed):
        if setup is not None:
            setup(e)
        e.run_round(ITERATIONS, 0)
    plain = PlainSteps(plan, backend.device)
    plain.step_s(1)
    clock.reset()
    ex_s, plain_s, ex_cpu_s, plain_cpu_s = [], [], [], []
    for r in range(rounds):
        step0 = (r + 1) * ITERATIONS
        c0 = time.process_time()
        ex_s.append(ex.run_round(ITERATIONS, step0).wall_s / ITERATIONS)
        c1 = time.process_time()
        timed.run_round(ITERATIONS, step0)
        c2 = time.process_time()
        plain_s.append(plain.step_s(ITERATIONS))
        ex_cpu_s.append((c1 - c0) / ITERATIONS)
        plain_cpu_s.append((time.process_time() - c2) / ITERATIONS)
    n_ops = len([t for t in plan.graph.tasks if t.iteration < ITERATIONS]) * rounds
    parts = {p: clock.s[p] / n_ops * 1e6 for p in PARTS if p != "loop"}
    inline = clock.s["handler"] if not backend.streams_async else 0.0
    own = clock.s["events"] + clock.s["launch"] + clock.s["trace"] + inline
    parts["loop"] = max(0.0, (_worker_parts(clock) - own) / n_ops * 1e6)
    ops = n_ops / rounds / ITERATIONS
    return DispatchResult(backend.name, ops, statistics.median(ex_s),
                          statistics.median(plain_s), parts, statistics.median(ex_cpu_s),
                          statistics.median(plain_cpu_s), min(ex_cpu_s),
                          paired_op_us(ex_s, plain_s, ops), paired_op_us(ex_cpu_s, plain_cpu_s, ops))


def paired_op_us(ours_s: list[float], plain_s: list[float], ops_per_step: float) -> float:
    """The median over rounds of (ours - plain) per step, in microseconds per op (may be negative: the
    estimate, not a cost)."""
    return statistics.median(o - p for o, p in zip(ours_s, plain_s)) / ops_per_step * 1e6
