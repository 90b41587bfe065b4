"""Discrete-event simulation of a task graph on a hardware profile.

Each resource runs its tasks one at a time in the schedule's order. A task starts when (1) it is at the head of
its resource's queue, (2) all its dependencies have finished and (3) the bytes it allocates at its start fit on
every tier. Transfers on the two directions of a shared link (H2D/D2H over PCIe, reads/writes of the SSD array)
slow each other down while both run, as the profile says: the simulator tracks the bytes each transfer still has
to move and re-rates it whenever the opposite direction starts or stops (a fluid model). Host memory is shared the
same way: every transfer's bytes and CPU Adam's (costmodel.CPU_ADAM_DRAM_BYTES_PER_PARAM) cross DRAM, and while
together they would ask for more than the box sustains, every one of them slows in proportion. On a host device
(the CPU as the device) the compute, CPU Adam and the copies share the host's cores the same way, except where the
profile has measured how compute and the host's I/O threads slow each other (costmodel.Rates.io_contention): then
compute runs (1 + extra x k) times slower beside k copies or SSD ops, and each of them its measured factor slower.

If the run can no longer progress because a task's allocation never fits, the schedule is refused with a
CapacityError naming the tier, the simulated time and the bytes over.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from tierflow.errors import DoesNotFit, TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.graph import HOST_LINKS, LINK_NAMES, NET, RESOURCES, TIERS, TaskGraph, gc_paused
from tierflow.planner.core.world import SINGLE, World

_EPS_BYTES = 1.0


class SimulationError(TierflowError, RuntimeError):
    """A schedule the simulator cannot play."""


class CapacityError(DoesNotFit, SimulationError):
    def __init__(self, tier: str, time_s: float, over_bytes: float, what: str):
        self.tier, self.time_s, self.over_bytes = tier, time_s, over_bytes
        super().__init__(f"{tier} memory exceeded by {over_bytes / 1e9:.2f} GB at t={time_s:.3f} s ({what})")


@dataclass
class SimResult:
    graph: TaskGraph
    start_s: np.ndarray
    end_s: np.ndarray
    iteration_ends_s: list[float]
    iteration_s: float
    window_s: tuple[float, float]
    busy: dict[str, float]
    link_bytes: dict[str, float]
    peak_bytes: dict[str, float]
    memory_trace: list[tuple[float, float, float, float]]  # (time, gpu, cpu, ssd) bytes
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
            **({"measured_device_memory": dict(self.meta["device_memory"])} if self.meta.get("device_memory") else {}),
        }


def simulate_graph(graph: TaskGraph, hw: HardwareProfile, world: World | None = None) -> SimResult:
    """Play `graph` on `hw`; returns times of every task and the steady-state metrics (see _summarize). With
    several ranks (`world`, else the graph's meta["world"]) the graph is one rank's, on its share of the box
    (tierflow.planner.core.world)."""
    if world is None and "world" in graph.meta:
        world = World(graph.meta["world"]["gpus"], graph.meta["world"]["nodes"])
    with gc_paused():
        return _simulate(graph, hw, world or SINGLE)


def _simulate(graph: TaskGraph, hw: HardwareProfile, world: World) -> SimResult:
    rates = link_rates(hw, world)
    tasks = graph.tasks
    n = len(tasks)
    R = len(RESOURCES)
    ridx = {r: i for i, r in enumerate(RESOURCES)}
    order = graph.resource_order()
    queues = [order[r] for r in RESOURCES]
    res_of = [ridx[t.resource] for t in tasks]
    work = [t.work for t in tasks]
    ndeps = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        for d in set(t.deps):
            succ[d].append(t.id)
            ndeps[t.id] += 1
    mstart = [t.mem_start for t in tasks]
    mend = [t.mem_end for t in tasks]
    is_link = [r in LINK_NAMES for r in RESOURCES]
    # fluid resources progress at a rate that depends on what else runs: the links (bytes), the CPU and, on a host
    # device, the GPU (seconds of work at solo speed); each shared host pool (memory bandwidth, cores) has a
    # capacity and, per resource, what one unit of its work per second uses of it
    pools = [(cap_s, [use.get(r, 0.0) for r in RESOURCES]) for _, cap_s, use in rates.pools()]
    fluid = [is_link[r] or RESOURCES[r] == "cpu" or any(use[r] > 0 for _, use in pools) for r in range(R)]
    fluids = [r for r in range(R) if fluid[r]]
    contention = rates.io_contention
    gpu_r = ridx["gpu"]
    beside = [rates.beside_compute(res) for res in RESOURCES]
    partner = [-1] * R
    solo = [1.0] * R
    duplex = [1.0] * R
    for a, b, sa, sb, da, db in (
        ("h2d", "d2h", rates.h2d, rates.d2h, rates.h2d_duplex, rates.d2h_duplex),
        ("ssd_read", "ssd_write", rates.ssd_read, rates.ssd_write, rates.ssd_read_mixed, rates.ssd_write_mixed),
    ):
        ia, ib = ridx[a], ridx[b]
        partner[ia], partner[ib] = ib, ia
        solo[ia], solo[ib], duplex[ia], duplex[ib] = sa, sb, da, db
    solo[ridx[NET]] = duplex[ridx[NET]] = rates.net
    if rates.net <= 0 and any(t.resource == NET for t in tasks):
        raise SimulationError("the graph has collectives (net ops) but the world has one rank: simulate it "
                              "with the plan's gpus and nodes")

    cap = [graph.capacity_bytes[t] for t in TIERS]
    mem = [graph.static_bytes[t] for t in TIERS]
    for i, tier in enumerate(TIERS):
        if mem[i] > cap[i] + _EPS_BYTES:
            raise CapacityError(tier, 0.0, mem[i] - cap[i], "resident tensors alone do not fit")
    peak = list(mem)
    trace: list[tuple[float, float, float, float]] = [(0.0, mem[0], mem[1], mem[2])]

    start = [math.nan] * n
    end = [math.nan] * n
    ptr = [0] * R
    running = [-1] * R
    remaining = [0.0] * R
    rate = [0.0] * R
    since = [0.0] * R
    version = [0] * R
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, resource, version)
    # each op's fixed software cost on its resource (pcie.latency_us, ssd.latency_us) runs before its work flows
    latency = [rates.latency_s(res) for res in RESOURCES]
    flowing = [True] * R  # False while the op running on a resource is still in its fixed cost
    seq = 0
    now = 0.0
    mem_blocked: set[int] = set()

    def base_rate(r: int) -> float:
        p = partner[r]
        return duplex[r] if p >= 0 and running[p] >= 0 and flowing[p] else solo[r]

    def rerate_fluids() -> None:
        """Bring every running fluid resource's progress up to now and reschedule its finish at the rate it gets
        now: its solo or duplex rate, all scaled down together while their DRAM traffic exceeds the box's."""
        nonlocal seq
        active = [r for r in fluids if running[r] >= 0 and flowing[r]]
        base = {r: base_rate(r) for r in active}
        scale = dict.fromkeys(active, 1.0)
        for cap_s, use in pools:
            demand = sum(base[r] * use[r] for r in active)
            if demand > cap_s:
                for r in active:
                    if use[r] > 0:
                        scale[r] = min(scale[r], cap_s / demand)
        if contention and gpu_r in scale:  # measured interference of compute and the host's I/O threads
            io = [r for r in active if RESOURCES[r] in HOST_LINKS]  # host threads (the collectives: not measured)
            if io:
                scale[gpu_r] = min(scale[gpu_r], 1.0 / (1.0 + rates.compute_io_extra * len(io)))
                for r in io:
                    scale[r] = min(scale[r], 1.0 / beside[r])
        for r in active:
            new = base[r] * scale[r]
            if new == rate[r]:
                continue
            remaining[r] -= rate[r] * (now - since[r])
            since[r] = now
            rate[r] = new
            version[r] += 1
            left = max(remaining[r], 0.0)
            fin = now + (left / new if new > 0 else math.inf)
            seq += 1
            heapq.heappush(heap, (fin, seq, r, version[r]))

    def try_start(r: int) -> None:
        nonlocal seq
        if running[r] >= 0 or ptr[r] >= len(queues[r]):
            return
        tid = queues[r][ptr[r]]
        if ndeps[tid]:
            return
        ms = mstart[tid]
        if ms:
            need = [0.0, 0.0, 0.0]
            for tier, delta in ms:
                need[tier] += delta
            for i in range(3):
                if need[i] > 0 and mem[i] + need[i] > cap[i] + _EPS_BYTES:
                    mem_blocked.add(r)
                    return
            for i in range(3):
                if need[i]:
                    mem[i] += need[i]
                    if mem[i] > peak[i]:
                        peak[i] = mem[i]
            trace.append((now, mem[0], mem[1], mem[2]))
        mem_blocked.discard(r)
        ptr[r] += 1
        running[r] = tid
        start[tid] = now
        version[r] += 1
        if latency[r] > 0:  # the op's fixed software cost first, outside the shared link and pools
            flowing[r] = False
            seq += 1
            heapq.heappush(heap, (now + latency[r], seq, r, version[r]))
        else:
            begin_work(r, tid)

    def begin_work(r: int, tid: int) -> None:
        """The op's work starts: a fluid resource's flows at the rate it gets now, another's takes its time."""
        nonlocal seq
        flowing[r] = True
        if fluid[r]:
            remaining[r] = work[tid]
            since[r] = now
            rate[r] = -1.0  # no rate yet: rerate_fluids schedules its finish
            rerate_fluids()
        else:
            version[r] += 1
            seq += 1
            heapq.heappush(heap, (now + work[tid], seq, r, version[r]))

    for r in range(R):
        try_start(r)
    done = 0
    while heap:
        t_ev, _, r, ver = heapq.heappop(heap)
        if ver != version[r] or running[r] < 0:
            continue
        now = t_ev
        tid = running[r]
        if not flowing[r]:  # its fixed cost is paid: now its work
            begin_work(r, tid)
            continue
        running[r] = -1
        end[tid] = now
        done += 1
        freed = False
        me = mend[tid]
        if me:
            for tier, delta in me:
                mem[tier] += delta
                if delta < 0:
                    freed = True
                elif mem[tier] > peak[tier]:
                    peak[tier] = mem[tier]
            trace.append((now, mem[0], mem[1], mem[2]))
        if fluid[r]:
            rate[r] = 0.0
            rerate_fluids()
        wake = {r}
        for s in succ[tid]:
            ndeps[s] -= 1
            if not ndeps[s]:
                wake.add(res_of[s])
        if freed and mem_blocked:
            wake |= mem_blocked
        for w in wake:
            try_start(w)

    if done < n:
        _raise_stuck(graph, queues, ptr, ndeps, mem, cap, now, mem_blocked, RESOURCES)

    return summarize(graph, np.asarray(start), np.asarray(end), peak, trace)


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
                            f"{t.label} on {t.resource} needs {need / 1e9:.2f} GB more{tail}")
    heads = []
    for r, q in enumerate(queues):
        if ptr[r] < len(q):
            t = graph.tasks[q[ptr[r]]]
            heads.append(f"{resources[r]}: {t.label} waits for {ndeps[t.id]} deps")
    raise SimulationError("schedule deadlocks: " + "; ".join(heads))


def summarize(graph: TaskGraph, start: np.ndarray, end: np.ndarray, peak: list[float], trace) -> SimResult:
    """Steady-state metrics of a played graph: from the simulator's times, or from an executor's measured ones."""
    tasks = graph.tasks
    N = graph.num_iterations
    gpu_mask = np.array([t.resource == "gpu" for t in tasks])
    its = np.array([t.iteration for t in tasks])
    ends = [float(end[gpu_mask & (its == i)].max()) for i in range(N)]
    res = np.array([t.resource for t in tasks])
    if N >= 2:
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
    else:
        w0, iteration_s = 0.0, float(np.nanmax(end))
    w1 = w0 + iteration_s
    busy = {}
    for r in graph.resources():
        m = res == r
        s = np.clip(start[m], w0, w1)
        e = np.clip(end[m], w0, w1)
        busy[r] = float((e - s).sum() / iteration_s) if iteration_s > 0 else 0.0
    return SimResult(
        graph=graph, start_s=start, end_s=end, iteration_ends_s=ends, iteration_s=iteration_s, window_s=(w0, w1),
        busy=busy, link_bytes=graph.bytes_per_link(iteration=max(N - 2, 0)),
        peak_bytes={t: peak[i] for i, t in enumerate(TIERS)}, memory_trace=trace,
    )
