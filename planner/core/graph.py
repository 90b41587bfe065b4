"""The task graph: every compute, transfer and optimizer step of a training run, with its resource, amount of
work, memory effects and data dependencies. Schedules build it (tierflow.planner.core.schedules); the
simulator plays it.

Tasks are stored as a flat list for speed; `TaskGraph.to_networkx()` gives the same graph as a
`networkx.DiGraph` (one node per task id, attributes = the task's fields, edges = dependencies).
"""

from __future__ import annotations

import gc
import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierflow.errors import TierflowError

if TYPE_CHECKING:  # networkx is imported only by to_networkx(): ~0.2 s of every command's start-up
    import networkx as nx

# "net": the collectives of several data-parallel ranks (all-gather of weights, reduce-scatter of gradients);
# a W = 1 graph has no op on it (tierflow.planner.core.world)
RESOURCES = ("gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu", "net")
NET = "net"
HOST_LINKS = ("h2d", "d2h", "ssd_read", "ssd_write")
LINKS = (*HOST_LINKS, NET)  # resources whose work is bytes
TIERS = ("gpu", "cpu", "ssd")  # the memory tiers, fastest first (the one definition: placement imports it)
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}
# which physical link a transfer resource is, for bytes-per-link reporting
LINK_NAMES = {
    "h2d": "cpu->gpu", "d2h": "gpu->cpu", "ssd_read": "ssd->cpu", "ssd_write": "cpu->ssd", NET: "gpu<->gpu",
}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building and playing a graph make ~10^6 small objects and no
    cycles, so collections only cost time. On leaving, the objects made meanwhile are moved to the collector's
    permanent generation (gc.freeze) instead of being scanned when it resumes: one scan of a 175B graph's
    tasks cost ~60 ms at every build and simulation, and again at every full collection while the graph lives.
    Frozen objects are still freed by reference counting when the graph is dropped; only cyclic garbage made
    inside the pause would never be collected, and the builder and simulator make none."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


class CycleError(TierflowError, ValueError):
    """`topological_order` met a cycle. `order` is the topological order of the nodes it could sort (every
    node not on or after a cycle), `left` the nodes it could not, and `cycle` one cycle among them as node
    ids, each a predecessor of the next and the last a predecessor of the first (see `find_cycle`)."""

    def __init__(self, message: str, order: list[int], left: set[int], cycle: list[int]) -> None:
        super().__init__(message)
        self.order, self.left, self.cycle = order, left, cycle


def topological_order(num_nodes: int, preds: Sequence[Sequence[int]],
                      tie_break: Sequence[float] | None = None, *,
                      cycle_message: str = "dependency cycle") -> list[int]:
    """Nodes 0..num_nodes-1 in an order where every node comes after all of its predecessors (Kahn's
    algorithm).

    `preds[i]` lists the predecessors of node i (a repeated predecessor counts once). Which ready node (all of
    its predecessors placed) goes next:

    - `tie_break=None`: first ready, first out. The nodes with no predecessors come first in id order; a node
      becomes ready when its last predecessor is placed and queues behind the nodes already ready, in id order
      among those the same predecessor releases;
    - `tie_break=key` (one number per node): the ready node with the smallest (key[i], i); e.g. key = each
      node's position in a queue keeps that queue's order wherever the edges allow it.

    A cycle raises `CycleError` (a ValueError; `cycle_message` is its text) that carries the partial order,
    the unsorted nodes and one cycle among them."""
    n = num_nodes
    if len(preds) != n:
        raise ValueError(f"preds has {len(preds)} lists for {n} nodes")
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i in range(n):
        ps = preds[i]
        if not ps:
            continue
        if len(ps) > 1:
            ps = set(ps)
        if min(ps) < 0 or max(ps) >= n:
            raise ValueError(f"node {i} has a predecessor outside 0..{n - 1}: {sorted(ps)}")
        for p in ps:
            succ[p].append(i)
        indeg[i] = len(ps)
    out: list[int] = []
    if tie_break is None:
        ready = deque(i for i in range(n) if not indeg[i])
        while ready:
            i = ready.popleft()
            out.append(i)
            for s in succ[i]:
                indeg[s] -= 1
                if not indeg[s]:
                    ready.append(s)
    else:
        if len(tie_break) != n:
            raise ValueError(f"tie_break has {len(tie_break)} keys for {n} nodes")
        heap = [(tie_break[i], i) for i in range(n) if not indeg[i]]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            out.append(i)
            for s in succ[i]:
                indeg[s] -= 1
                if not indeg[s]:
                    heapq.heappush(heap, (tie_break[s], s))
    if len(out) < n:
        left = {i for i in range(n) if indeg[i]}
        raise CycleError(cycle_message, out, left, find_cycle(preds, left))
    return out


def find_cycle(preds: Sequence[Sequence[int]], left: set[int]) -> list[int]:
    """A cycle among the nodes `left`, each of which has a predecessor in `left` (as the nodes Kahn's
    algorithm leaves unsorted do), as node ids with each a predecessor of the next: from the smallest node of
    `left`, walk to the first of its predecessors (in `preds` order) that is in `left` until a node
    repeats."""
    seen: dict[int, int] = {}
    path: list[int] = []
    node = min(left)
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(p for p in preds[node] if p in left)
    cycle = path[seen[node]:]
    cycle.reverse()  # dependency first
    return cycle


@dataclass(slots=True)
class Task:
    id: int
    kind: str  # one of the op vocabulary, tierflow.planner.core.opkinds.OP_KINDS
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


def plan_order(tasks: Sequence[Task]) -> list[int]:
    """Task ids (tasks[i].id == i) in one order of the whole plan: after their dependencies and after the ops
    ahead of them in their resource's queue (by key, then id), the smallest (key, id) first among the ready
    ones. A key orders its own resource's queue only (most schedules number each queue from 0), so sorting
    every op by key is no order of the plan: an h2d fetch keyed 0 would come before the d2h offload keyed 1
    that it copies back. This is the order a run's memory is replayed in (the executor's transfer area) and
    the one a worker running several resources' queues follows."""
    preds = [list(t.deps) for t in tasks]
    last: dict[str, int] = {}
    rank = [0] * len(tasks)
    for r, t in enumerate(sorted(tasks, key=lambda t: (t.key, t.id))):
        rank[t.id] = r
        if t.resource in last:
            preds[t.id].append(last[t.resource])
        last[t.resource] = t.id
    return topological_order(len(tasks), preds, rank, cycle_message="the plan's queues and dependencies "
                             "form a cycle")


@dataclass
class TaskGraph:
    tasks: list[Task]
    static_bytes: dict[str, float]  # bytes resident on each tier for the whole run
    capacity_bytes: dict[str, float]  # usable bytes of each tier
    num_iterations: int
    num_blocks: int
    meta: dict = field(default_factory=dict)

    def has_net(self) -> bool:
        """Whether the graph has collectives (several ranks); cached in meta["net"] once known."""
        if "net" not in self.meta:
            self.meta["net"] = any(t.resource == NET for t in self.tasks) if self.tasks else False
        return bool(self.meta["net"])

    def resources(self) -> tuple[str, ...]:
        """The resources to report for this graph: every one, less `net` when it has no op on it (one rank),
        so that one-GPU outputs stay as they were before several GPUs existed."""
        return RESOURCES if self.has_net() else tuple(r for r in RESOURCES if r != NET)

    def resource_order(self) -> dict[str, list[int]]:
        """Task ids of each resource in the order the schedule runs them (by key, then creation)."""
        order: dict[str, list[int]] = {r: [] for r in RESOURCES}
        for t in sorted(self.tasks, key=lambda t: (t.key, t.id)):
            order[t.resource].append(t.id)
        return order

    def plan_order(self) -> list[int]:
        """The plan's ops in one order (`plan_order`)."""
        return plan_order(self.tasks)

    def topological_order(self, tie_break: Sequence[float] | None = None) -> list[int]:
        """Task ids with every task after its dependencies (`topological_order` over the tasks' deps, first
        ready first out unless a `tie_break` key per task is given); a dependency cycle raises
        `CycleError`."""
        return topological_order(len(self.tasks), [t.deps for t in self.tasks], tie_break,
                                 cycle_message="the task graph has a dependency cycle")

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
        out = {LINK_NAMES[link]: 0.0 for link in (LINKS if self.has_net() else HOST_LINKS)}
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
        tasks = self.tasks
        if deps:
            deps = [d for d in deps if d is not None and d >= 0]
            # A task never sits in its queue ahead of its own dependencies: with every key >= its
            # dependencies' keys, the order (key, id) is a topological order, so no schedule built here can
            # deadlock on its own.
            for d in deps:
                k = tasks[d].key
                if k > key:
                    key = k
        else:
            deps = []
        t = Task(len(tasks), kind, resource, float(work), tensor, block, mb, iteration, deps, key, [], [])
        tasks.append(t)
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
