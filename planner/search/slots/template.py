"""Phases 1 to 3 of the slot model, the template: its task graph and what each task weighs
(`template_graphs`, `_step_scale`), the tasks that wait for memory another frees (`memory_edges`), its slots
(`slot_grid`), the order its tasks wait in (`task_order`), and each task's release and deadline slot
(`release_slots`, `deadline_slots`, `task_windows`)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clock import Clock
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.graph import CycleError, topological_order
from tierflow.planner.core.memory import static_bytes
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.schedules import build_graph, step_sequence
from tierflow.planner.core.simulator import SimulationError, simulate_graph
from tierflow.planner.search.slots.layout import (
    NO_DEADLINE,
    SLOT_RESOURCES,
    TAIL_SLOT,
    Layout,
    subslots_per_use,
)

# A task's signature: a name for it that does not depend on which other tasks the placement creates, the
# plain tuple (kind, resource, block, mb, iteration, tensor, n), n: how many tasks with the same fields come
# before it (a tuple: built for every task of two graphs per slot model).
TaskSignature = tuple


def _signatures(g) -> list[TaskSignature]:
    """The signature of every task of graph g, in task order."""
    seen: dict[tuple, int] = {}
    out = []
    for t in g.tasks:
        k = (t.kind, t.resource, t.block, t.mb, t.iteration, t.tensor)
        seen[k] = seen.get(k, -1) + 1
        out.append(k + (seen[k],))
    return out


class MemoryEdge(NamedTuple):
    """A task that had to wait for another to free memory (`memory_edges`)."""

    freeing: TaskSignature  # the task whose end freed the memory
    waiting: TaskSignature  # the task that started then


def memory_edges(model: ModelSpec, mt: ModelSpec, hw: HardwareProfile,
                  ct: ScheduleConfig) -> list[MemoryEdge]:
    """Which task waits for which to free memory: the template (at ct's placement) replayed by the simulator
    with each tier's capacity less the full model's resident tensors beyond the template's, so its buffers
    compete for the same headroom as the full model's. Returns (freeing task, waiting task) signatures."""
    g = build_graph(mt, hw, ct)
    full = static_bytes(model, ct.placement, ct.runtime, ct.world.ranks, ct.ds_knobs)
    g.capacity_bytes = {t: c - (full[t] - g.static_bytes[t]) for t, c in g.capacity_bytes.items()}
    g.static_bytes = dict(g.static_bytes)
    try:
        res = simulate_graph(g, hw)
    except SimulationError:
        return []
    tasks = g.tasks
    start_s, end_s = res.start_s, res.end_s
    prev: dict[int, int] = {}
    for ids in g.resource_order().values():
        for a, b in zip(ids, ids[1:]):
            prev[b] = a
    frees: dict[float, list[int]] = {}  # end time -> tasks freeing memory then
    for t in tasks:
        if any(d < 0 for _, d in t.mem_end):
            frees.setdefault(float(end_s[t.id]), []).append(t.id)
    sig = _signatures(g)
    out = []
    for t in tasks:
        ready = max([end_s[d] for d in t.deps if d >= 0] + ([end_s[prev[t.id]]] if t.id in prev else [])
                    + [0.0])
        if start_s[t.id] > ready + 1e-9 * max(1.0, ready) and t.mem_start:
            for j in frees.get(float(start_s[t.id]), []):
                out.append(MemoryEdge(sig[j], sig[t.id]))
    return out


def topological_by_queue(n: int, preds: list[list[int]], prev_in_queue: list[int],
                 queue_order: list[int]) -> list[int]:
    """A topological order of the tasks over dependencies, queue order and memory edges (the graph's one
    topological sort, ties broken by queue order); where an edge closed a cycle, the queue order is kept."""
    rank = [0] * n
    for r, i in enumerate(queue_order):
        rank[i] = r
    all_preds = [preds[i] + [prev_in_queue[i]] if prev_in_queue[i] >= 0 else preds[i] for i in range(n)]
    try:
        return topological_order(n, all_preds, tie_break=rank)
    except CycleError as e:
        # a memory edge against the queue order closed a cycle: keep the queue order there
        left = set(e.left)
        return e.order + [i for i in queue_order if i in left]


def _step_scale(g, cfg_t: ScheduleConfig, lay: Layout) -> np.ndarray:
    """How many tasks of the full model each template task stands for: the steps at position lay.rep_step of a
    use stand for lay.rep_count steps, with every per-micro-batch transfer that serves them (found through the
    dependencies: the GPU step a transfer feeds, else the one it drains). Returns (tasks,) copies."""
    tasks = g.tasks
    copies = np.ones(len(tasks))
    if lay.rep_step < 0:
        return copies
    position = _use_positions(step_sequence(g.num_blocks, cfg_t.num_micro_batches, cfg_t.group))
    clock = Clock(g.meta["steps_per_iteration"])

    def is_rep(t) -> bool:
        i = clock.nearest_step(t.key)[1]
        return not clock.is_tail(i) and position[i] == lay.rep_step

    succs: list[list[int]] = [[] for _ in tasks]
    for t in tasks:
        for d in t.deps:
            if d >= 0:
                succs[d].append(t.id)
    for t in tasks:
        if t.mb < 0:
            continue
        if t.resource == "gpu":
            copies[t.id] = lay.rep_count if is_rep(t) else 1.0
            continue
        step = _served_step(t, tasks, succs)
        if step is not None and is_rep(step):
            copies[t.id] = lay.rep_count
    return copies


def _use_positions(steps) -> list[int]:
    """The position of each GPU step in its weight use (the run of steps of one block and phase)."""
    out, pos = [], 0
    for i, st in enumerate(steps):
        pos = pos + 1 if i and steps[i - 1].block == st.block and steps[i - 1].phase == st.phase else 0
        out.append(pos)
    return out


def _served_step(t, tasks, succs: list[list[int]]):
    """The GPU step of t's micro-batch that task t serves: the one it feeds (within 4 dependency hops through
    tasks of the same micro-batch), else the one it drains (a direct dependency); None if neither."""
    frontier = [t.id]
    for _ in range(4):  # the consumer first
        nxt = []
        for j in frontier:
            for k in succs[j]:
                succ = tasks[k]
                if succ.mb == t.mb and succ.resource == "gpu":
                    return succ
                if succ.mb == t.mb:
                    nxt.append(k)
        if not nxt:
            break
        frontier = nxt
    for d in t.deps:
        if d >= 0 and tasks[d].resource == "gpu" and tasks[d].mb == t.mb:
            return tasks[d]
    return None


class SlotKey(NamedTuple):
    """A slot of the template: the steps of one group of micro-batches in one phase of one block (a weight
    use), or the `sub`-th part of them (`subslots_per_use`)."""

    group: int  # group of micro-batches (template)
    phase: str  # "F" forward, "B" backward, "H" the head between them
    block: int  # template block (0 the embedding, 1..Lt the layers, Lt + 1 the head)
    sub: int  # part of the use: its first act_prefetch steps one by one, then the rest of the use


class StepSlot(NamedTuple):
    """The slot of a GPU step (or of the step a task's key belongs to)."""

    slot: int  # unrolled template slot: iteration * T + slot
    is_first: bool  # the step is the first of its slot
    is_last: bool  # the step is the last of its slot


class SlotGrid(NamedTuple):
    """The template's slots and the slot of each GPU step of an iteration (`slot_grid`)."""

    slots: list[tuple]  # template slot -> SlotKey; the last one is TAIL_SLOT
    slot_of_step: list[int]  # step index (0..S-1) -> template slot
    first_in_slot: list[bool]  # step index -> the first step of its slot
    last_in_slot: list[bool]  # step index -> the last step of its slot
    clock: Clock  # reads the task keys of the template's graph

    def at_step(self, iteration: int, index: int) -> StepSlot:
        """The unrolled slot of GPU step `index` of `iteration` (an index past the steps: the tail)."""
        T = len(self.slots)
        if self.clock.is_tail(index):
            return StepSlot(iteration * T + T - 1, True, True)
        return StepSlot(iteration * T + self.slot_of_step[index], self.first_in_slot[index],
                        self.last_in_slot[index])

    def next_at(self, key: float) -> int:
        """The unrolled slot of the first GPU step at or after `key` (Clock.next_step)."""
        T = len(self.slots)
        it, i = self.clock.next_step(key)
        return it * T + (T - 1 if self.clock.is_tail(i) else self.slot_of_step[i])

    def home_group(self, slot: int, tail_group: int) -> int:
        """The template group of unrolled slot `slot`; `tail_group` for the tail."""
        T = len(self.slots)
        home = slot % T
        return self.slots[home].group if home < T - 1 else tail_group


def slot_grid(g, cfg_t: ScheduleConfig) -> SlotGrid:
    """Phase 1, the slots of the template: one per group, phase and block, its first steps one by one
    (`subslots_per_use`), in the order the GPU runs them, and the tail after them."""
    S = g.meta["steps_per_iteration"]
    steps = step_sequence(g.num_blocks, cfg_t.num_micro_batches, cfg_t.group)
    group_size = cfg_t.group
    nsub = subslots_per_use(cfg_t)
    slot_of_step, slots, index = [], [], {}
    for st, pos in zip(steps, _use_positions(steps)):
        key = SlotKey(st.mb // group_size, st.phase, st.block, min(pos, nsub - 1))
        if key not in index:
            index[key] = len(slots)
            slots.append(key)
        slot_of_step.append(index[key])
    slots.append(TAIL_SLOT)
    first = [i == 0 or slot_of_step[i - 1] != slot_of_step[i] for i in range(S)]
    last = [i == S - 1 or slot_of_step[i + 1] != slot_of_step[i] for i in range(S)]
    return SlotGrid(slots, slot_of_step, first, last, Clock(S))


class TaskOrder(NamedTuple):
    """Which template task waits for which (`task_order`)."""

    preds: list[list[int]]  # task -> the tasks it depends on (dependencies, then memory edges)
    prev_in_queue: list[int]  # task -> the task ahead of it in its queue (-1: none; GPU steps: -1)
    succs: list[list[int]]  # task -> the tasks waiting for it (the inverse of preds and prev_in_queue)
    order: list[int]  # a topological order of the tasks over all of these

    def waits_for(self, i: int) -> list[int]:
        """The tasks task i waits for: its predecessors, then the task ahead of it in its queue."""
        prev = self.prev_in_queue[i]
        return self.preds[i] + ([prev] if prev >= 0 else [])


def task_order(tasks, mem_edges: tuple) -> TaskOrder:
    """Phase 2: dependencies and memory edges (pairs of task ids: freeing, waiting), the queue order (key, id)
    of each non-GPU resource, their successors and a topological order over all of them."""
    n = len(tasks)
    queue_order = sorted(range(n), key=lambda i: (tasks[i].key, i))
    preds: list[list[int]] = [[d for d in set(t.deps) if d >= 0] for t in tasks]
    for j, i in mem_edges:  # i could not start before j freed the memory it needed
        if j not in preds[i]:
            preds[i].append(j)
    prev_in_queue = [-1] * n
    last_on: dict[str, int] = {}
    for i in queue_order:
        r = tasks[i].resource
        if r != "gpu":
            prev_in_queue[i] = last_on.get(r, -1)
            last_on[r] = i
    order = topological_by_queue(n, preds, prev_in_queue, queue_order)
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for d in preds[i]:
            succs[d].append(i)
        if prev_in_queue[i] >= 0:
            succs[prev_in_queue[i]].append(i)
    return TaskOrder(preds, prev_in_queue, succs, order)


def release_slots(tasks, order: TaskOrder, step_slot: list) -> list[int]:
    """Phase 3a: the release slot of every non-GPU task (unrolled; GPU steps: 0), the latest over what it
    waits for: a GPU step's slot (the next one if the step closes its slot), another task's release.
    `step_slot`: task -> StepSlot of a GPU step."""
    release = [0] * len(tasks)
    for i in order.order:
        if tasks[i].resource == "gpu":
            continue
        latest = 0
        for d in order.waits_for(i):
            if tasks[d].resource == "gpu":
                slot, _, is_last = step_slot[d]
                latest = max(latest, slot + 1 if is_last else slot)
            else:
                latest = max(latest, release[d])
        release[i] = latest
    return release


def deadline_slots(tasks, order: TaskOrder, step_slot: list) -> list[int]:
    """Phase 3b: the deadline slot of every non-GPU task (unrolled; NO_DEADLINE when nothing waits for it),
    the earliest over what waits for it: a GPU step's slot (the one before if the step opens its slot),
    another task's deadline."""
    deadline = [NO_DEADLINE] * len(tasks)
    for i in reversed(order.order):
        if tasks[i].resource == "gpu":
            continue
        earliest = NO_DEADLINE
        for s in order.succs[i]:
            if tasks[s].resource == "gpu":
                slot, is_first, _ = step_slot[s]
                earliest = min(earliest, slot - 1 if is_first else slot)
            else:
                earliest = min(earliest, deadline[s])
        deadline[i] = earliest
    return deadline


def gpu_seconds(tasks, step_slot: list, scale: np.ndarray, T: int) -> np.ndarray:
    """Phase 3c: GPU seconds of one copy of each template slot (the middle iteration's steps, scaled)."""
    gpu_s = np.zeros(T)
    for i, t in enumerate(tasks):
        if t.iteration == 1 and t.resource == "gpu":
            gpu_s[step_slot[i].slot - T] += t.work * scale[i]
    return gpu_s


class TaskWindow(NamedTuple):
    """A non-GPU task of the template's middle iteration: the slots it may run in and where it stands."""

    task: int  # task id in the template's graph
    release_slot: int  # unrolled template slot it can start in at the earliest
    deadline_slot: int  # unrolled template slot by whose end it must be done
    channel: int  # its resource, an index in SLOT_RESOURCES (and CHANNELS)
    block: int  # template block it belongs to
    home_group: int  # template group whose slots it is queued in


def task_windows(tasks, grid: SlotGrid, release: list[int], deadline: list[int], group_size: int,
                  Gt: int) -> list[TaskWindow]:
    """Phase 3d: every non-GPU task of the middle iteration with its release and deadline slot (no deadline:
    two iterations after its release), its resource and its anchor (block, home group)."""
    T = len(grid.slots)
    out = []
    for i, t in enumerate(tasks):
        if t.iteration != 1 or t.resource == "gpu":
            continue
        rel, dl = release[i], deadline[i]
        if dl >= NO_DEADLINE:
            dl = rel + 2 * T
        dl = max(rel, dl)
        home_group = grid.home_group(grid.next_at(t.key), t.mb // group_size if t.mb >= 0 else Gt - 1)
        out.append(TaskWindow(i, rel, dl, SLOT_RESOURCES.index(t.resource), t.block, home_group))
    return out


class TemplateGraph(NamedTuple):
    """The template's task graph and what each of its tasks weighs (`template_graphs`)."""

    graph: object  # the builder's task graph of the template
    work: np.ndarray  # (n, 1) each task's work: bytes on the links and SSDs, seconds on the GPU and CPU
    seconds_per_work: np.ndarray  # (n,) seconds per unit of that work at its resource's solo rate
    copies: np.ndarray  # (n,) how many tasks of the full model each task stands for (`_step_scale`)
    index_of: dict  # TaskSignature -> task id


def _template_buckets(mt: ModelSpec, ct: ScheduleConfig, lay: Layout) -> ScheduleConfig:
    """Runtime deepspeed sends gradients to the host in buckets of reduce_bucket_size elements, so where a
    bucket leaves depends on how many layers the model has: the template's few layers would all fall into
    the backward's last bucket (every copy waiting for the epilogue) where the full model's leave spread over
    the backward. Its bucket is scaled by the template's share of the full model's parameters, so that both
    send about as many buckets, at the same fraction of the backward."""
    if ct.runtime != "deepspeed":
        return ct
    share = mt.total_params() / replace(mt, num_layers=lay.L).total_params()
    return replace(ct, ds_reduce_bucket_elems=max(1, round(ct.ds_reduce_bucket_elems * share)))


def template_graphs(mt: ModelSpec, hw: HardwareProfile, ct: ScheduleConfig, lay: Layout) -> TemplateGraph:
    """The template's task graph, every task's work, and how many tasks of the full model each task stands
    for."""
    g = build_graph(mt, hw, _template_buckets(mt, ct, lay))
    work = np.array([[t.work] for t in g.tasks]).reshape(len(g.tasks), 1)
    r = link_rates(hw)
    sec = {"h2d": 1 / r.h2d, "d2h": 1 / r.d2h, "ssd_read": 1 / r.ssd_read if r.ssd_read else 0.0,
           "ssd_write": 1 / r.ssd_write if r.ssd_write else 0.0, "cpu": 1.0, "gpu": 1.0}
    seconds_per_work = np.array([sec[t.resource] for t in g.tasks])
    return TemplateGraph(g, work, seconds_per_work, _step_scale(g, ct, lay),
                         {sg: i for i, sg in enumerate(_signatures(g))})
