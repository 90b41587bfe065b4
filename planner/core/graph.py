"""The task graph: every compute, transfer and optimizer step of a training run, with its resource, amount of
work, memory effects and data dependencies. Schedules build it (tierflow.planner.core.schedules); the simulator plays it.

Tasks are stored as a flat list for speed; `TaskGraph.to_networkx()` gives the same graph as a
`networkx.DiGraph` (one node per task id, attributes = the task's fields, edges = dependencies).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # networkx is imported only by to_networkx(): ~0.2 s of every command's start-up
    import networkx as nx

RESOURCES = ("gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu")
LINKS = ("h2d", "d2h", "ssd_read", "ssd_write")
TIERS = ("gpu", "cpu", "ssd")
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
# which physical link a transfer resource is, for bytes-per-link reporting
LINK_NAMES = {"h2d": "cpu->gpu", "d2h": "gpu->cpu", "ssd_read": "ssd->cpu", "ssd_write": "cpu->ssd"}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building and playing a graph make ~10^6 small objects and no cycles,
    so collections only cost time. On leaving, the objects made meanwhile are moved to the collector's permanent
    generation (gc.freeze) instead of being scanned when it resumes: one scan of a 175B graph's tasks cost ~60 ms
    at every build and simulation, and again at every full collection while the graph lives. Frozen objects are
    still freed by reference counting when the graph is dropped; only cyclic garbage made inside the pause would
    never be collected, and the builder and simulator make none."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


@dataclass(slots=True)
class Task:
    id: int
    kind: str  # fwd, recompute, bwd, head, opt_gpu | fetch_w, fetch_act, offload_act, offload_grad, ... | adam
    resource: str  # one of RESOURCES
    work: float  # seconds on gpu/cpu; bytes on links
    tensor: str  # tensor class touched: weights, checkpoint, act, act_grad, grads, opt_states, ...
    block: int  # 0 = embedding, 1..L = decoder layers, L+1 = head
    mb: int  # micro-batch index, -1 for per-block tasks
    iteration: int
    deps: list[int]
    key: float  # position in its resource's order (the schedule's decision)
    mem_start: list[tuple[int, float]] = field(default_factory=list)  # (tier index, +/- bytes) at start
    mem_end: list[tuple[int, float]] = field(default_factory=list)  # at end

    @property
    def label(self) -> str:
        mb = f" mb{self.mb}" if self.mb >= 0 else ""
        return f"{self.kind} b{self.block}{mb} it{self.iteration}"


@dataclass
class TaskGraph:
    tasks: list[Task]
    static_bytes: dict[str, float]  # bytes resident on each tier for the whole run
    capacity_bytes: dict[str, float]  # usable bytes of each tier
    num_iterations: int
    num_blocks: int
    meta: dict = field(default_factory=dict)

    def resource_order(self) -> dict[str, list[int]]:
        """Task ids of each resource in the order the schedule runs them (by key, then creation)."""
        order: dict[str, list[int]] = {r: [] for r in RESOURCES}
        for t in sorted(self.tasks, key=lambda t: (t.key, t.id)):
            order[t.resource].append(t.id)
        return order

    def to_networkx(self) -> nx.DiGraph:
        import networkx as nx

        g = nx.DiGraph()
        for t in self.tasks:
            g.add_node(
                t.id, kind=t.kind, resource=t.resource, work=t.work, tensor=t.tensor, block=t.block, mb=t.mb,
                iteration=t.iteration, key=t.key, mem_start=list(t.mem_start), mem_end=list(t.mem_end),
            )
        g.add_edges_from((d, t.id) for t in self.tasks for d in t.deps)
        return g

    def bytes_per_link(self, iteration: int | None = None) -> dict[str, float]:
        out = {LINK_NAMES[link]: 0.0 for link in LINKS}
        for t in self.tasks:
            if t.resource in LINK_NAMES and (iteration is None or t.iteration == iteration):
                out[LINK_NAMES[t.resource]] += t.work
        return out


class GraphBuilder:
    """Appends tasks; the schedule gives each a key that fixes its place in its resource's order."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(
        self, kind: str, resource: str, work: float, *, tensor: str, block: int, mb: int, iteration: int,
        key: float, deps: list[int] | tuple[int, ...] = (),
    ) -> Task:
        deps = [d for d in deps if d is not None and d >= 0]
        # A task never sits in its queue ahead of its own dependencies: with every key >= its dependencies'
        # keys, the order (key, id) is a topological order, so no schedule built here can deadlock on its own.
        for d in deps:
            if self.tasks[d].key > key:
                key = self.tasks[d].key
        t = Task(len(self.tasks), kind, resource, float(work), tensor, block, mb, iteration, deps, key)
        self.tasks.append(t)
        return t

    @staticmethod
    def alloc(task: Task, tier: str, nbytes: float) -> None:
        """Allocations happen when a task starts (so the simulator checks them against capacity)."""
        if nbytes > 0:
            task.mem_start.append((TIER_INDEX[tier], float(nbytes)))

    @staticmethod
    def free(task: Task, tier: str, nbytes: float, at_start: bool = False) -> None:
        if nbytes > 0:
            (task.mem_start if at_start else task.mem_end).append((TIER_INDEX[tier], -float(nbytes)))
