"""Discrete-event simulation of a task graph on a hardware profile.

Each resource runs its tasks one at a time in the schedule's order. A task starts when (1) it is at the head
of its resource's queue, (2) all its dependencies have finished and (3) the bytes it allocates at its start
fit on every tier. Transfers on the two directions of a shared link (H2D/D2H over PCIe, reads/writes of the
SSD array) slow each other down while both run, as the profile says: the simulator tracks the bytes each
transfer still has to move and re-rates it whenever the opposite direction starts or stops (a fluid model).
Host memory is shared the same way: every transfer's bytes and CPU Adam's
(costmodel.CPU_ADAM_DRAM_BYTES_PER_PARAM) cross DRAM, and while together they would ask for more than the box
sustains, every one of them slows in proportion. On a host device (the CPU as the device) the compute, CPU
Adam and the copies share the host's cores the same way, except where the profile has measured how compute and
the host's I/O threads slow each other (costmodel.Rates.io_contention): then compute runs (1 + extra x k)
times slower beside k copies or SSD ops, and each of them its measured factor slower.

If the run can no longer progress because a task's allocation never fits, the schedule is refused with a
CapacityError naming the tier, the simulated time and the bytes over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from tierflow.errors import DoesNotFit, TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.costmodel import Rates, link_rates
from tierflow.planner.core.dsruntime import as_runtime_steps
from tierflow.planner.core.graph import HOST_LINKS, LINK_NAMES, NET, RESOURCES, TIERS, TaskGraph, gc_paused
from tierflow.planner.core.opkinds import CPU_ADAM_KINDS
from tierflow.planner.core.simkernel import kernel_for
from tierflow.planner.core.world import SINGLE, World

_EPS_BYTES = 1.0


class SimulationError(TierflowError, RuntimeError):
    """A schedule the simulator cannot play."""


def bytes_text(n: float) -> str:
    """Bytes with a unit that shows them (decimal units, 3 significant digits): 512 B, 3.1 MB, 24.6 GB, so
    that a small amount never reads 0.0 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:,.{2 if abs(v) < 10 else 1 if abs(v) < 100 else 0}f} {unit}"
    return f"{n:.0f} B"


class CapacityError(DoesNotFit, SimulationError):
    """A tier's memory overflows: the tier, the simulated time and the bytes over."""

    def __init__(self, tier: str, time_s: float, over_bytes: float, what: str):
        self.tier, self.time_s, self.over_bytes = tier, time_s, over_bytes
        super().__init__(f"{tier} memory exceeded by {bytes_text(over_bytes)} at t={time_s:.3f} s ({what})")


@dataclass
class SimResult:
    """The times of every task of a played graph and the steady-state metrics of its iteration
    (`summarize`)."""

    graph: TaskGraph
    start_s: np.ndarray
    end_s: np.ndarray
    iteration_ends_s: list[float]
    iteration_s: float
    window_s: tuple[float, float]
    busy: dict[str, float]
    link_bytes: dict[str, float]
    peak_bytes: dict[str, float]
    # (time, gpu, cpu, ssd) bytes: a list of tuples, or an array of such rows from the compiled loop
    memory_trace: list[tuple[float, float, float, float]] | np.ndarray
    tokens_per_iteration: int = 0
    model_flops_per_iteration: float = 0.0
    hw_flops_per_iteration: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole world (every rank)."""
        return self.tokens_per_iteration / self.iteration_s

    @property
    def world(self) -> dict:
        """{gpus, nodes, ranks} of the run (one rank unless the graph says otherwise)."""
        return dict(self.graph.meta.get("world") or {"gpus": 1, "nodes": 1, "ranks": 1})

    @property
    def ranks(self) -> int:
        return int(self.world["ranks"])

    def per_gpu(self) -> dict:
        """Throughput per GPU (rank): the world's divided by the ranks."""
        r = self.ranks
        return {"tokens_per_s_per_gpu": self.tokens_per_s / r, "model_tflops_per_gpu": self.model_tflops / r,
                "hw_tflops_per_gpu": self.hw_tflops / r}

    @property
    def model_tflops(self) -> float:
        return self.model_flops_per_iteration / self.iteration_s / 1e12

    @property
    def hw_tflops(self) -> float:
        return self.hw_flops_per_iteration / self.iteration_s / 1e12

    def timeline(self):
        """Every task as a row: id, kind, resource, tensor, block, mb, iteration, work, start_s, end_s."""
        import pandas as pd

        t = self.graph.tasks
        return pd.DataFrame({
            "id": [x.id for x in t], "kind": [x.kind for x in t], "resource": [x.resource for x in t],
            "tensor": [x.tensor for x in t], "block": [x.block for x in t], "mb": [x.mb for x in t],
            "iteration": [x.iteration for x in t], "work": [x.work for x in t],
            "start_s": self.start_s, "end_s": self.end_s,
        })

    def summary_only(self) -> SimResult:
        """This result without its task graph's tasks and per-task times (cheap to send between processes):
        every metric and peak stays; timeline() needs the full result."""
        g = self.graph
        shell = TaskGraph([], g.static_bytes, g.capacity_bytes, g.num_iterations, g.num_blocks,
                          meta={**g.meta, "tasks": len(g.tasks), "net": g.has_net()})
        return replace(self, graph=shell, start_s=np.empty(0), end_s=np.empty(0), memory_trace=[])

    def to_dict(self) -> dict:
        return {
            "iteration_s": self.iteration_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops": self.model_tflops,
            "hw_tflops": self.hw_tflops,
            "busy": dict(self.busy),
            "link_bytes": dict(self.link_bytes),
            "peak_bytes": dict(self.peak_bytes),
            "capacity_bytes": dict(self.graph.capacity_bytes),
            "tasks": self.graph.meta.get("tasks", len(self.graph.tasks)),
            "iterations_simulated": self.graph.num_iterations,
            # several ranks: the world and per-GPU throughput (left out for one, whose output stays as it was)
            **({"world": self.world, **self.per_gpu()} if self.ranks > 1 else {}),
            # an executor's measurement: the device allocator's peaks (bytes), where the device measures them
            **({"measured_device_memory": dict(self.meta["device_memory"])}
               if self.meta.get("device_memory") else {}),
            # and the device it was measured on (tierflow compare: is it the plan's box?)
            **({"measured_on": dict(self.meta["measured_on"])} if self.meta.get("measured_on") else {}),
            # an executor's measurement: the optimizer-state format it ran (a trace is fitted to its own)
            **({"optimizer_states": self.meta["optimizer_states"]}
               if self.meta.get("optimizer_states") else {}),
            # LoRA: the adapters and how many parameters train
            **({"lora": self.meta["lora"], "trainable_params": self.meta["trainable_params"]}
               if self.meta.get("lora") else {}),
        }


def simulate_graph(graph: TaskGraph, hw: HardwareProfile, world: World | None = None) -> SimResult:
    """Play `graph` on `hw`; returns times of every task and the steady-state metrics (see _summarize). With
    several ranks (`world`, else the graph's meta["world"]) the graph is one rank's, on its share of the box
    (tierflow.planner.core.world). The host's CPU Adam runs at the rate of the graph's runtime
    (meta["runtime"], which build_graph and simulate_config record: dsruntime.as_runtime_steps), as the
    graph's adam ops were timed."""
    hw = as_runtime_steps(hw, graph.meta.get("runtime"))
    if world is None and "world" in graph.meta:
        world = World(graph.meta["world"]["gpus"], graph.meta["world"]["nodes"])
    # the compiled loop (where numba is installed and the graph is large enough, else None: the pure-Python
    # loop, the same results) is loaded outside the collector's pause: compiling makes cyclic garbage
    k = kernel_for(len(graph.tasks))
    with gc_paused():
        return _simulate(graph, hw, world or SINGLE, k)


def _simulate(graph: TaskGraph, hw: HardwareProfile, world: World, k=None) -> SimResult:
    """Play the graph: set up its queues, rates and memory, run the event loop (the compiled kernel `k`, else
    the pure-Python loop), build the result."""
    rates = link_rates(hw, world)
    if k is not None:
        return _simulate_arrays(graph, rates, k)
    run = _Run(graph, rates)
    run.play()
    if run.done < len(graph.tasks):
        _raise_stuck(graph, run.queues, run.ptr, run.ndeps, run.mem, run.cap, run.now, run.mem_blocked,
                     RESOURCES)
    return summarize(graph, np.asarray(run.start), np.asarray(run.end), run.peak, run.trace)


def _graph_arrays(graph: TaskGraph) -> dict[str, np.ndarray]:
    """The graph as arrays for the kernel: each resource's queue in (key, id) order, each task's distinct
    dependencies' count and its successors in id order, its resource and work, the bytes it allocates at its
    start (summed per tier in their order, as _start_needs) and its deltas at its end, as compressed rows."""
    tasks = graph.tasks
    n, R = len(tasks), len(RESOURCES)
    ridx = {r: i for i, r in enumerate(RESOURCES)}
    res_of = np.fromiter(map(ridx.__getitem__, map(attrgetter("resource"), tasks)), np.int64, n)
    keys = np.fromiter(map(attrgetter("key"), tasks), np.float64, n)
    order = np.lexsort((np.arange(n), keys))
    qidx = order[np.argsort(res_of[order], kind="stable")]
    ids = np.arange(n, dtype=np.int64)
    deps = list(map(attrgetter("deps"), tasks))
    lens = np.fromiter(map(len, deps), np.int64, n)
    flat = np.fromiter(chain.from_iterable(deps), np.int64, int(lens.sum()))
    pairs = np.sort(flat * n + np.repeat(ids, lens))  # by dependency, then task
    if len(pairs) > 1:  # a dependency repeated in a task's list counts once
        pairs = pairs[np.concatenate(([True], pairs[1:] != pairs[:-1]))]
    succ_of, succ = pairs // n, pairs % n
    # the start's deltas summed per (task, tier) in their order (np.add.at adds one after the other, from 0.0)
    ms = list(map(attrgetter("mem_start"), tasks))
    mlen = np.fromiter(map(len, ms), np.int64, n)
    mflat = np.fromiter(chain.from_iterable(chain.from_iterable(ms)), np.float64, 2 * int(mlen.sum()))
    need = np.zeros(3 * n)
    np.add.at(need, np.repeat(ids, mlen) * 3 + mflat[0::2].astype(np.int64), mflat[1::2])
    where = np.flatnonzero(need)
    me = list(map(attrgetter("mem_end"), tasks))
    elen = np.fromiter(map(len, me), np.int64, n)
    eflat = np.fromiter(chain.from_iterable(chain.from_iterable(me)), np.float64, 2 * int(elen.sum()))
    return {
        "qptr": _row_starts(np.bincount(res_of, minlength=R)), "qidx": qidx,
        "ndeps": np.bincount(succ, minlength=n).astype(np.int64),
        "sptr": _row_starts(np.bincount(succ_of, minlength=n)), "sidx": succ,
        "res_of": res_of, "work": np.fromiter(map(attrgetter("work"), tasks), np.float64, n),
        "nptr": _row_starts(np.bincount(where // 3, minlength=n)), "ntier": where % 3, "nval": need[where],
        "eptr": _row_starts(elen), "etier": eflat[0::2].astype(np.int64), "evals": eflat[1::2].copy(),
    }


def _row_starts(counts: np.ndarray) -> np.ndarray:
    """Where each compressed row starts, and the end of the last."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _simulate_arrays(graph: TaskGraph, rates: Rates, k) -> SimResult:
    """Play the graph with the kernel `k` (tierflow.planner.core.simkernel): the same play as _Run.play."""
    tasks = graph.tasks
    n, R = len(tasks), len(RESOURCES)
    ridx = {r: i for i, r in enumerate(RESOURCES)}
    a = _graph_arrays(graph)
    pools, fluid, _ = _fluid_tables(rates)
    partner, solo, duplex = _link_tables(rates, ridx)
    if rates.net <= 0 and bool((a["res_of"] == ridx[NET]).any()):
        raise SimulationError("the graph has collectives (net ops) but the world has one rank: simulate "
                              "it with the plan's gpus and nodes")
    host_opt = (np.fromiter((t.kind in CPU_ADAM_KINDS for t in tasks), np.bool_, n)
                if rates.gpu_beside_host_optimizer > 1 else np.zeros(1, np.bool_))
    cap, mem0 = _resident_memory(graph)
    mem = np.array(mem0, np.float64)
    peak = mem.copy()
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    trace = np.empty((2 * n + 1, 4))
    trace[0] = (0.0, mem0[0], mem0[1], mem0[2])
    ptr = np.zeros(R, np.int64)
    mem_blocked = np.zeros(R, np.bool_)
    pool_use = np.array([use for _, use in pools], np.float64).reshape(len(pools), R)
    now, done, ntrace = k(
        a["qptr"], a["qidx"], a["ndeps"], a["sptr"], a["sidx"], a["res_of"], a["work"], a["nptr"], a["ntier"],
        a["nval"], a["eptr"], a["etier"], a["evals"], host_opt, np.array(fluid, np.bool_),
        np.array(partner, np.int64), np.array(solo, np.float64), np.array(duplex, np.float64),
        np.array([rates.latency_s(r) for r in RESOURCES], np.float64),
        np.array([rates.beside_compute(r) for r in RESOURCES], np.float64),
        np.array([r in HOST_LINKS for r in RESOURCES], np.bool_),
        np.array([c for c, _ in pools], np.float64), pool_use, float(rates.gpu_beside_host_optimizer),
        bool(rates.io_contention), float(rates.compute_io_extra), ridx["gpu"], ridx["cpu"], mem,
        np.array([c + _EPS_BYTES for c in cap], np.float64), peak, start, end, trace, ptr, mem_blocked)
    if done < n:
        qptr, qidx = a["qptr"], a["qidx"]
        queues = [qidx[qptr[r]:qptr[r + 1]].tolist() for r in range(R)]
        _raise_stuck(graph, queues, ptr.tolist(), a["ndeps"].tolist(), mem.tolist(), cap, float(now),
                     {r for r in range(R) if mem_blocked[r]}, RESOURCES)
    # the memory trace stays an array of (time, gpu, cpu, ssd) rows: a list of tuples costs ~0.4 us a row
    return summarize(graph, start, end, peak.tolist(), trace[:ntrace], res=np.array(RESOURCES)[a["res_of"]],
                     its=np.fromiter(map(attrgetter("iteration"), tasks), np.int64, n))


class _LinkTables(NamedTuple):
    """The two directions of each shared link, by resource index (`_link_tables`)."""

    partner: list[int]  # the other direction of the resource's link (-1: none)
    solo: list[float]  # its rate alone (bytes/s; 1.0 for a resource that is not a link)
    duplex: list[float]  # its rate while the other direction runs


def _link_tables(rates: Rates, ridx: dict[str, int]) -> _LinkTables:
    """Solo and duplex rates of the PCIe link and the SSD array, each direction against the other, and the
    collectives' rate (no partner)."""
    R = len(RESOURCES)
    partner = [-1] * R
    solo = [1.0] * R
    duplex = [1.0] * R
    for a, b, sa, sb, da, db in (
        ("h2d", "d2h", rates.h2d, rates.d2h, rates.h2d_duplex, rates.d2h_duplex),
        ("ssd_read", "ssd_write", rates.ssd_read, rates.ssd_write, rates.ssd_read_mixed,
         rates.ssd_write_mixed),
    ):
        ia, ib = ridx[a], ridx[b]
        partner[ia], partner[ib] = ib, ia
        solo[ia], solo[ib], duplex[ia], duplex[ib] = sa, sb, da, db
    solo[ridx[NET]] = duplex[ridx[NET]] = rates.net
    return _LinkTables(partner, solo, duplex)


def _dependencies(tasks) -> tuple[list[int], list[list[int]]]:
    """How many distinct tasks each task waits for, and the tasks waiting for each (in id order)."""
    n = len(tasks)
    ndeps = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        deps = t.deps
        if not deps:
            continue
        if len(deps) > 1:
            deps = set(deps)
        tid = t.id
        for d in deps:
            succ[d].append(tid)
        ndeps[tid] = len(deps)
    return ndeps, succ


def _start_needs(tasks) -> list[tuple[tuple[int, float], ...] | None]:
    """Per task, what it allocates at its start as (tier index, net bytes) for each tier it changes, its
    deltas summed per tier in their order (None: nothing)."""
    out: list[tuple[tuple[int, float], ...] | None] = [None] * len(tasks)
    for t in tasks:
        ms = t.mem_start
        if not ms:
            continue
        need = [0.0, 0.0, 0.0]
        for tier, delta in ms:
            need[tier] += delta
        out[t.id] = tuple((i, need[i]) for i in range(3) if need[i])
    return out


def _resident_memory(graph: TaskGraph) -> tuple[list[float], list[float]]:
    """Each tier's capacity and the bytes its resident tensors take (raises CapacityError where they alone do
    not fit)."""
    cap = [graph.capacity_bytes[t] for t in TIERS]
    mem = [graph.static_bytes[t] for t in TIERS]
    for i, tier in enumerate(TIERS):
        if mem[i] > cap[i] + _EPS_BYTES:
            raise CapacityError(tier, 0.0, mem[i] - cap[i],
                                f"what stays resident on it for the whole run ({bytes_text(mem[i])}: placed "
                                f"tensors and runtime buffers) alone does not fit its {bytes_text(cap[i])}; "
                                f"fix: place fewer tensors on the {tier}, or a {tier} with more memory")
    return cap, mem


def _fluid_tables(rates: Rates) -> tuple[list[tuple[float, list[float]]], list[bool], list[int]]:
    """Fluid resources progress at a rate that depends on what else runs: the links (bytes), the CPU and, on a
    host device, the GPU (seconds of work at solo speed); each shared host pool (memory bandwidth, cores) has
    a capacity and, per resource, what one unit of its work per second uses of it. Returns the pools, whether
    each resource is fluid and the fluid ones."""
    R = len(RESOURCES)
    is_link = [r in LINK_NAMES for r in RESOURCES]
    pools = [(cap_s, [use.get(r, 0.0) for r in RESOURCES]) for _, cap_s, use in rates.pools()]
    fluid = [is_link[r] or RESOURCES[r] == "cpu" or any(use[r] > 0 for _, use in pools) for r in range(R)]
    if rates.gpu_beside_host_optimizer > 1:  # the GPU's rate then depends on the host optimizer's ops
        fluid[RESOURCES.index("gpu")] = True
    return pools, fluid, [r for r in range(R) if fluid[r]]


class _Run:
    """One play of a task graph: the resources' queues and rates, the memory on each tier and the pending
    events. Resources are indexed as RESOURCES, tiers as TIERS, tasks by id.

    A resource runs one op at a time, so it has at most one pending event (its op's fixed cost paid, or its
    work done): the events are one (time, sequence number) slot per resource, and the next is the smallest of
    them (ties in time by the order they were scheduled), found among the resources' slots instead of in a
    heap of one object per event. A fluid resource's rate is recomputed when what runs beside it changes; its
    finish is rescheduled only when its rate changes."""

    __slots__ = ("graph", "rates", "queues", "res_of", "work", "ndeps", "succ", "need", "mend", "pools",
                 "fluid", "fluids", "contention", "gpu_r", "cpu_r", "beside", "partner", "solo", "duplex",
                 "cap", "mem", "peak", "trace", "start", "end", "ptr", "latency", "now", "mem_blocked",
                 "done", "host_optimizer")

    def __init__(self, graph: TaskGraph, rates: Rates):
        tasks = graph.tasks
        n, R = len(tasks), len(RESOURCES)
        ridx = {r: i for i, r in enumerate(RESOURCES)}
        order = graph.resource_order()
        self.graph, self.rates = graph, rates
        self.queues = [order[r] for r in RESOURCES]
        self.res_of = [ridx[t.resource] for t in tasks]
        self.work = [t.work for t in tasks]
        self.ndeps, self.succ = _dependencies(tasks)
        self.need = _start_needs(tasks)
        self.mend = [t.mem_end for t in tasks]
        self.pools, self.fluid, self.fluids = _fluid_tables(rates)
        self.contention = rates.io_contention
        self.gpu_r, self.cpu_r = ridx["gpu"], ridx["cpu"]
        self.beside = [rates.beside_compute(res) for res in RESOURCES]
        self.partner, self.solo, self.duplex = _link_tables(rates, ridx)
        if rates.net <= 0 and any(t.resource == NET for t in tasks):
            raise SimulationError("the graph has collectives (net ops) but the world has one rank: simulate "
                                  "it with the plan's gpus and nodes")
        # whether each task is a host optimizer op (it slows the GPU where the profile says so)
        self.host_optimizer = ([t.kind in CPU_ADAM_KINDS for t in tasks]
                               if rates.gpu_beside_host_optimizer > 1 else None)
        self.cap, self.mem = _resident_memory(graph)
        self.peak = list(self.mem)
        self.trace: list[tuple[float, float, float, float]] = [(0.0, self.mem[0], self.mem[1], self.mem[2])]
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        self.ptr = [0] * R  # the next task of each resource's queue
        # each op's fixed software cost on its resource (pcie.latency_us, ssd.latency_us) runs before its work
        # flows
        self.latency = [rates.latency_s(res) for res in RESOURCES]
        self.now = 0.0
        self.mem_blocked: set[int] = set()
        self.done = 0

    def _scales(self):
        """A function (active fluid resources, their base rates by resource) -> the factor each runs at: every
        user of an oversubscribed host pool slowed in proportion, and with measured interference compute and
        the host's I/O threads slowed by each other; None where nothing ever scales a rate."""
        pools, gpu_r, cpu_r = self.pools, self.gpu_r, self.cpu_r
        slow_gpu = self.rates.gpu_beside_host_optimizer
        host_optimizer = self.host_optimizer
        contention, extra, beside = self.contention, self.rates.compute_io_extra, self.beside
        is_host_link = [r in HOST_LINKS for r in RESOURCES]
        if not pools and slow_gpu <= 1 and not contention:
            return None

        def scales(active: list[int], base: list[float], running: list[int], flowing: list[bool]) -> list:
            scale = [1.0] * len(base)
            for cap_s, use in pools:
                demand = sum(base[r] * use[r] for r in active)
                if demand > cap_s:
                    f = cap_s / demand
                    for r in active:
                        if use[r] > 0 and f < scale[r]:
                            scale[r] = f
            gpu_active = running[gpu_r] >= 0 and flowing[gpu_r] and gpu_r in active
            if gpu_active and slow_gpu > 1:
                t = running[cpu_r]
                if t >= 0 and flowing[cpu_r] and host_optimizer[t]:
                    f = 1.0 / slow_gpu
                    if f < scale[gpu_r]:
                        scale[gpu_r] = f
            if contention and gpu_active:  # measured interference of compute and the host's I/O threads
                # host threads (the collectives: not measured)
                io = [r for r in active if is_host_link[r]]
                if io:
                    f = 1.0 / (1.0 + extra * len(io))
                    if f < scale[gpu_r]:
                        scale[gpu_r] = f
                    for r in io:
                        f = 1.0 / beside[r]
                        if f < scale[r]:
                            scale[r] = f
            return scale

        return scales

    # --- the event loop ---------------------------------------------------------------------------------

    def play(self) -> None:
        """Start what can start, then take the events in time order: an op's fixed cost paid (its work
        begins) or its work done (it finishes: its memory freed or kept, the fluid resources re-rated, and its
        resource, the resources of the tasks it released and, when it freed memory, those waiting for memory
        try to start), until none is left."""
        R = len(RESOURCES)
        inf = math.inf
        queues, ptr, ndeps, succ, res_of, work = (self.queues, self.ptr, self.ndeps, self.succ, self.res_of,
                                                  self.work)
        qlen = [len(q) for q in queues]
        need_of, mend_of, start, end = self.need, self.mend, self.start, self.end
        mem, cap, peak, trace = self.mem, self.cap, self.peak, self.trace
        cap_eps = [c + _EPS_BYTES for c in cap]
        mem_blocked = self.mem_blocked
        fluid, fluids, latency = self.fluid, self.fluids, self.latency
        partner, solo, duplex = self.partner, self.solo, self.duplex
        scales = self._scales()
        running = [-1] * R  # the task each resource runs (-1: none)
        flowing = [True] * R  # False while the op running on a resource is still in its fixed cost
        remaining = [0.0] * R  # a fluid resource's work left at `since`
        rate = [0.0] * R
        since = [0.0] * R
        ev_t = [inf] * R  # each resource's pending event: its time, its sequence number, whether there is one
        ev_seq = [0] * R
        pending = [False] * R
        base = [0.0] * R
        seq = 0
        now = 0.0

        def rerate() -> None:
            """Bring every running fluid resource's progress up to now and reschedule its finish where its
            rate changed: its solo or duplex rate, scaled down where it shares an oversubscribed pool."""
            nonlocal seq
            active = [r for r in fluids if running[r] >= 0 and flowing[r]]
            for r in active:
                p = partner[r]
                base[r] = duplex[r] if p >= 0 and running[p] >= 0 and flowing[p] else solo[r]
            scale = scales(active, base, running, flowing) if scales is not None else None
            for r in active:
                new = base[r] * scale[r] if scale is not None else base[r] * 1.0
                old = rate[r]
                if new == old:
                    continue
                rem = remaining[r] - old * (now - since[r])
                remaining[r] = rem
                since[r] = now
                rate[r] = new
                if 0.0 > rem:
                    rem = 0.0
                seq += 1
                ev_t[r] = now + (rem / new if new > 0 else inf)
                ev_seq[r] = seq
                pending[r] = True

        def begin(r: int, tid: int) -> None:
            """The op's work starts: a fluid resource's flows at the rate it gets now, another's takes its
            time."""
            nonlocal seq
            flowing[r] = True
            if fluid[r]:
                remaining[r] = work[tid]
                since[r] = now
                rate[r] = -1.0  # no rate yet: rerate schedules its finish
                rerate()
            else:
                seq += 1
                ev_t[r] = now + work[tid]
                ev_seq[r] = seq
                pending[r] = True

        def try_start(r: int) -> None:
            """Start the task at the head of r's queue if r is idle, its dependencies are done and the bytes
            it allocates fit on every tier (else r waits for memory, in mem_blocked): its fixed cost first
            where r has one, else its work."""
            nonlocal seq
            if running[r] >= 0 or ptr[r] >= qlen[r]:
                return
            tid = queues[r][ptr[r]]
            if ndeps[tid]:
                return
            need = need_of[tid]
            if need is not None:
                for i, x in need:
                    if x > 0 and mem[i] + x > cap_eps[i]:
                        mem_blocked.add(r)
                        return
                for i, x in need:
                    m = mem[i] + x
                    mem[i] = m
                    if m > peak[i]:
                        peak[i] = m
                trace.append((now, mem[0], mem[1], mem[2]))
            mem_blocked.discard(r)
            ptr[r] += 1
            running[r] = tid
            start[tid] = now
            lat = latency[r]
            if lat > 0:  # the op's fixed software cost first, outside the shared link and pools
                flowing[r] = False
                seq += 1
                ev_t[r] = now + lat
                ev_seq[r] = seq
                pending[r] = True
            else:
                begin(r, tid)

        for r in range(R):
            try_start(r)
        done = 0
        while True:
            t_ev = min(ev_t)
            if t_ev == inf:
                if True not in pending:
                    break
                r = min((ev_seq[i], i) for i in range(R) if pending[i])[1]
            else:
                r = ev_t.index(t_ev)
                if ev_t.count(t_ev) > 1:
                    r = min((ev_seq[i], i) for i in range(R) if ev_t[i] == t_ev)[1]
            ev_t[r] = inf
            pending[r] = False
            tid = running[r]
            if tid < 0:
                continue
            now = t_ev
            if not flowing[r]:  # its fixed cost is paid: now its work
                begin(r, tid)
                continue
            # its work is done
            running[r] = -1
            end[tid] = now
            done += 1
            freed = False
            me = mend_of[tid]
            if me:
                for i, x in me:
                    m = mem[i] + x
                    mem[i] = m
                    if x < 0:
                        freed = True
                    elif m > peak[i]:
                        peak[i] = m
                trace.append((now, mem[0], mem[1], mem[2]))
            if fluid[r]:
                rate[r] = 0.0
                rerate()
            wake = {r}
            for s in succ[tid]:
                k = ndeps[s] - 1
                ndeps[s] = k
                if not k:
                    wake.add(res_of[s])
            if freed and mem_blocked:
                wake |= mem_blocked
            for w in wake:
                try_start(w)
        self.now, self.done = now, done


def _raise_stuck(graph, queues, ptr, ndeps, mem, cap, now, mem_blocked, resources) -> None:
    blocked = []  # (tier index, task, bytes needed)
    for r in sorted(mem_blocked):
        t = graph.tasks[queues[r][ptr[r]]]
        need = [0.0, 0.0, 0.0]
        for tier, delta in t.mem_start:
            need[tier] += delta
        blocked += [(i, t, need[i]) for i in range(3) if need[i] > 0 and mem[i] + need[i] > cap[i]]
    if blocked:
        # the slowest tier is the root cause: a full CPU or SSD stalls the offloads that would free the GPU
        i, t, need = max(blocked, key=lambda x: x[0])
        others = sorted({TIERS[j] for j, _, _ in blocked if j != i})
        tail = f"; {', '.join(others)} waiting on it" if others else ""
        raise CapacityError(TIERS[i], now, mem[i] + need - cap[i],
                            f"{t.label} on {t.resource} needs {bytes_text(need)} more{tail}; fix: a smaller "
                            f"micro-batch or seq, or fewer tensors placed on the {TIERS[i]}")
    heads = []
    for r, q in enumerate(queues):
        if ptr[r] < len(q):
            t = graph.tasks[q[ptr[r]]]
            heads.append(f"{resources[r]}: {t.label} waits for {ndeps[t.id]} deps")
    raise SimulationError("schedule deadlocks: " + "; ".join(heads))


def summarize(graph: TaskGraph, start: np.ndarray, end: np.ndarray, peak: list[float], trace,
              res: np.ndarray | None = None, its: np.ndarray | None = None) -> SimResult:
    """Steady-state metrics of a played graph: from the simulator's times, or from an executor's measured
    ones. `res`, `its`: each task's resource name and iteration, where the caller has them as arrays."""
    tasks = graph.tasks
    N = graph.num_iterations
    if res is None:
        res = np.array([t.resource for t in tasks])
    if its is None:
        its = np.array([t.iteration for t in tasks])
    gpu_mask = res == "gpu"
    ends = [float(end[gpu_mask & (its == i)].max()) for i in range(N)]
    w0, iteration_s = _steady_window(N, end, ends, res, its)
    w1 = w0 + iteration_s
    return SimResult(
        graph=graph, start_s=start, end_s=end, iteration_ends_s=ends, iteration_s=iteration_s,
        window_s=(w0, w1),
        busy=_busy_shares(graph, start, end, res, w0, w1, iteration_s),
        link_bytes=graph.bytes_per_link(iteration=max(N - 2, 0)),
        peak_bytes={t: peak[i] for i, t in enumerate(TIERS)}, memory_trace=trace,
    )


def _steady_window(N: int, end: np.ndarray, ends: list[float], res: np.ndarray,
                   its: np.ndarray) -> tuple[float, float]:
    """The start of the iteration reported and its period (N iterations played; `ends`: when each iteration's
    GPU work ends; `res`, `its`: each task's resource and iteration)."""
    if N < 2:
        return 0.0, float(np.nanmax(end))
    # Report an iteration with one before and one after it (the last one has no successor whose prefetches
    # compete with it). Its period: a pipeline runs at the pace of its slowest stage, and a short run has not
    # always settled, so it is the largest gap, over every resource (and each shared link as a whole) and
    # every pair of consecutive iterations, between finishing one iteration's work and the next's.
    w0 = ends[-3] if N >= 3 else ends[-2]
    iteration_s = 0.0
    for group in [(r,) for r in RESOURCES] + [("h2d", "d2h"), ("ssd_read", "ssd_write")]:
        m = np.isin(res, group)
        done = [end[m & (its == i)] for i in range(N)]
        for i in range(1, N):
            if len(done[i - 1]) and len(done[i]):
                iteration_s = max(iteration_s, float(done[i].max() - done[i - 1].max()))
    return w0, iteration_s


def _busy_shares(graph: TaskGraph, start: np.ndarray, end: np.ndarray, res: np.ndarray, w0: float, w1: float,
                 iteration_s: float) -> dict[str, float]:
    """The share of the window [w0, w1] each resource of the graph is busy."""
    busy = {}
    for r in graph.resources():
        m = res == r
        s = np.clip(start[m], w0, w1)
        e = np.clip(end[m], w0, w1)
        busy[r] = float((e - s).sum() / iteration_s) if iteration_s > 0 else 0.0
    return busy
