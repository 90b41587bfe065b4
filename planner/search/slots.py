"""The slot model: the planner's prediction of one steady-state iteration of a fully decided plan.

The roofline and phase bounds of tierflow.planner.search.loads are exact about *how much* each resource works but not about
*when*: a transfer that must be done before a given layer computes cannot hide behind another phase's compute, a tensor
parked on the CPU cannot be fetched back before it has been offloaded, and each queue runs its tasks in the
schedule's order. The slot model keeps that timing at the granularity of the GPU's weight uses (one block's
compute steps in one phase, a "slot"): the iteration is the sequence of slots the GPU runs, and every other task
is given the slot in which it can start at the earliest (its release: after the GPU step it depends on, after the
tasks ahead of it in its queue and the tasks it depends on) and the slot by whose end it must be done (its
deadline: before the GPU step that needs it, before the tasks queued behind it). Then, for every window of
consecutive slots, each resource must do the work released and due within the window in the time the window
lasts (for the PCIe link as a whole and for a shared SSD array, both directions together, at the duplex rates):

    sum_{s in window} D_s >= work_r(window) / rate_r        D_s >= GPU work of slot s

and the predicted iteration time is the least sum of the slot durations D_s that satisfies them all, a linear
program (`solve_slots`: GLOP, by constraint generation). A window constraint is the physical statement that one resource
cannot do more than its rate allows in that time; nothing else enters.

Serial chains (a task waits for the task ahead of it in its queue and for its dependencies on other resources, e.g.
read optimizer states -> deferred Adam -> fetch weights -> the layer's first step) give windows of their own: from
the slot the chain's first task is released in (after the GPU steps of that slot up to the one releasing it) to the
step it feeds (with the steps of that slot from it on), the window lasts at least the chain. A transfer on a chain
runs at its solo rate where the other direction of its link is idle and at the duplex rate beside it; the other
direction runs the work released in the window spread over it (`chain_needs`).

The constraints are derived from the builder's own task graph of a *template*: the model with a few layers
(every run of identical layers - recomputed, then swapped - keeps `2 E + 1` of them, E = how far ahead the
schedule fetches), at most three groups of micro-batches, three iterations. The middle layer of each run stands
for all the layers the template leaves out, the middle group for all the middle groups: the template is expanded
back to the full iteration (a slot per block, phase and group of the real model, all the copies of a middle
layer or group sharing one duration variable), each template task repeated once per layer or group it stands for
at the slots that copy occupies. Windows end at the slots of layers and groups that are not repeated (so a
window holds every copy of a repeated layer or none), and windows of up to LOCAL_SPAN consecutive slots
anywhere (one copy each). Tasks of the template are matched to the full model's exactly: the template is built
by the same builder with the same rules, so a run's middle layer has the same tasks as every layer of that run.

The code follows these steps in named phases (each a function taking and returning NamedTuples): the template
(`template_of`, `_template_graphs`), its slots (`_slot_grid`), the order its tasks wait in (`_task_order`),
each task's release and deadline slot (`_release_slots`, `_deadline_slots`, `_task_windows`), the serial
chains (`_step_shares`, `_chain_heads`, `_chains_into_steps`, `_chains_into_tasks`), all gathered by
`_template_items` and `_slot_template`; then the expansion (`_expand`): group mapping (`_full_iteration`),
copies per block and group (`_copies`), the windows (`_long_windows`, `_local_windows`, `_chain_windows`),
identical ones merged (`_distinct_windows`); and the LP (`window_needs`, `solve_slots`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import groupby
from typing import NamedTuple

import numpy as np

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clock import Clock
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.graph import RESOURCES, CycleError, topological_order
from tierflow.planner.core.memory import static_bytes
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.schedules import ScheduleConfig, build_graph, step_sequence
from tierflow.planner.search.loads import duplex_coefficient

SLOT_RESOURCES = ("h2d", "d2h", "ssd_read", "ssd_write", "cpu")
CHANNELS = SLOT_RESOURCES + ("chain",)  # work channels of a window; "chain": seconds of one serial chain
LOCAL_SPAN = 3  # slots of the short windows placed anywhere
TAIL_SLOT = ("tail",)  # the template's last slot: the optimizer after the last backward step (not overlapped)
_NO_DEADLINE = 10**9
_PHASE_CODE = {"F": 0, "B": 1, "H": 2}  # phase of a slot as a number in the vectorised expansion; 3: the tail
_TAIL_PHASE = 3

# Notation (as in the module docstring): L layers and G groups of micro-batches of the full model, Lt and Gt
# of the template; T template slots (the tail last); S GPU steps per template iteration; Ne slots of one
# full-model iteration. "Unrolled" slots count over the template's three iterations (iteration * T + slot)
# or three full-model iterations (iteration * Ne + slot); the middle one is the iteration predicted. V1: the
# length of a task's work vector (1); C: len(CHANNELS).


@dataclass(frozen=True)
class _Layout:
    """Where each template block and group stands in the full model."""

    L: int  # layers of the full model
    G: int  # groups of micro-batches per iteration (full model)
    Lt: int  # layers of the template
    Gt: int  # groups of the template
    mid_count: dict  # template middle layer block -> how many layers of the full model it stands for
    run_of: tuple  # template block -> run index (0 recomputed, 1 swapped, -1 embedding/head)
    rep_step: int = -1  # position in a use of the template step standing for several steps (-1: none)
    rep_count: int = 1  # how many steps of the full model it stands for

    def expanded_layer(self, b: int) -> int:
        """Full-model block index of template block b (its first copy for a middle layer)."""
        out = b
        for m, c in self.mid_count.items():
            if m < b:
                out += c - 1
        return out if b <= self.Lt else self.L + 1


class Template(NamedTuple):
    """The template of a schedule (`template_of`)."""

    model: ModelSpec  # the model with a few layers per run of identical layers
    cfg: ScheduleConfig  # the schedule on it: at most three groups, three iterations
    layout: _Layout  # where its blocks and groups stand in the full model


def template_span(cfg: ScheduleConfig) -> int:
    """Layers of a run the template keeps (2 E + 1, E: how many weight uses ahead the schedule fetches)."""
    E = max(cfg.prefetch_depth + 1, -(-(cfg.act_prefetch + 1) // cfg.group))
    return 2 * E + 1


def template_of(model: ModelSpec, cfg: ScheduleConfig) -> Template:
    """The template of `cfg`: a few layers per run of identical layers, at most three groups, three iterations."""
    L = model.num_layers
    swapped = cfg.swap_layers if cfg.recompute else L
    group_size = cfg.group  # micro-batches per group
    G = cfg.num_micro_batches // group_size
    span = template_span(cfg)
    E = span // 2
    runs = [L - swapped, swapped]  # layers of the recomputed run, of the swapped run
    kept = [min(c, span) for c in runs]  # layers of each run the template keeps
    mid_count, run_of = {}, [-1]
    start = 1
    for r, (layers, kept_layers) in enumerate(zip(runs, kept)):
        if layers > span:
            mid_count[start + E] = layers - 2 * E
        run_of += [r] * kept_layers
        start += kept_layers
    Lt = sum(kept)
    run_of.append(-1)
    Gt = min(G, 3)
    # micro-batches per group: the first steps of a use take what the previous use fetched for them, the last
    # one hands its output to the next use; a step at position rep = 2 a + 2 (a = act_prefetch) and beyond is
    # released and due inside its own use, so one such step stands for all the middle ones
    rep = 2 * cfg.act_prefetch + 2
    group_size_t = min(group_size, rep + 2)
    mt = replace(model, num_layers=Lt)
    ct = replace(cfg, batch=cfg.micro_batch * group_size_t * Gt, group=group_size_t,
                 swap_layers=kept[1] if cfg.recompute else 0, iterations=3)
    return Template(mt, ct, _Layout(L=L, G=G, Lt=Lt, Gt=Gt, mid_count=mid_count, run_of=tuple(run_of),
                                    rep_step=rep if group_size > group_size_t else -1,
                                    rep_count=group_size - group_size_t + 1))


@dataclass
class SlotModel:
    """The window constraints of one schedule, in the template's slots (see the module docstring). The work
    arrays end in an axis of length 1 (seconds of work on gpu/cpu/chains, bytes on the links)."""

    slots: list[tuple]  # template slot -> SlotKey (group, phase, block, sub) or TAIL_SLOT
    gpu: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    period: np.ndarray  # (T,) copies of each template slot in one iteration of the full model
    counts: np.ndarray  # (W, T) copies of each template slot inside window w
    work: np.ndarray  # (W, C, 1) work of each channel (CHANNELS) released and due in window w
    released: np.ndarray  # (W, C, 1) work of each channel released in window w, due whenever
    total: np.ndarray  # (C, 1) work of each channel in one iteration
    links: np.ndarray  # (W, C) bytes a serial chain's transfers move on each link channel (other windows: 0)
    meta: dict


class LinkPair(NamedTuple):
    """One direction of a shared link (PCIe, or an SSD array) against the other direction."""

    channel: str  # this direction (a name in CHANNELS)
    other: str  # the other direction
    solo_bytes_per_s: float  # this direction's rate alone
    shared_bytes_per_s: float  # this direction's rate while the other runs
    other_shared_bytes_per_s: float  # the other's rate while this one runs
    other_solo_bytes_per_s: float  # the other's rate alone


class EagerTerm(NamedTuple):
    """A window's need for one direction of a shared link with the other running eagerly beside it
    (`eager_terms`): due_bytes * (s_per_byte + extra_s_per_byte), or, when the other direction stops first,
    due_bytes * s_per_byte + other_released_bytes * other_extra_s_per_byte; the smaller of the two."""

    channel: int  # index in CHANNELS of the direction whose due work the window must finish
    other: int  # index in CHANNELS of the other direction, running its released work beside it
    s_per_byte: float  # 1 / solo rate
    extra_s_per_byte: float  # k / shared rate of this direction
    other_extra_s_per_byte: float  # k / shared rate of the other direction


def eager_terms(hw: HardwareProfile) -> list[EagerTerm]:
    """The shared links, each direction A against the other B: (channel A, channel B, 1/solo_A, k, ...) such
    that finishing A's due work while B's released work runs eagerly beside it takes
        A/solo_A + k * min(A/shared_A, B/shared_B),   k = 1 - shared_A/solo_A
    (both directions at their shared rates while both run, A alone after: the fluid sharing the simulator
    plays). Returns (a, b, 1/solo_a, k/shared_a, k/shared_b) per ordered pair with k > 0."""
    idx = {k: i for i, k in enumerate(CHANNELS)}
    out = []
    for pair in _link_pairs(hw):
        solo, shared = pair.solo_bytes_per_s, pair.shared_bytes_per_s
        other_shared = pair.other_shared_bytes_per_s
        if solo <= 0 or shared <= 0 or other_shared <= 0:
            continue
        slowdown = 1.0 - shared / solo
        if slowdown > 1e-12:
            out.append(EagerTerm(idx[pair.channel], idx[pair.other], 1.0 / solo, slowdown / shared,
                                 slowdown / other_shared))
    return out


def _link_pairs(hw: HardwareProfile) -> list[LinkPair]:
    """Each direction A of a shared link against the other, B: (A, B, solo_A, shared_A, shared_B, solo_B)."""
    r = link_rates(hw)
    pairs = [LinkPair("h2d", "d2h", r.h2d, r.h2d_duplex, r.d2h_duplex, r.d2h),
             LinkPair("d2h", "h2d", r.d2h, r.d2h_duplex, r.h2d_duplex, r.h2d)]
    if hw.ssd.count > 0:
        pairs += [LinkPair("ssd_read", "ssd_write", r.ssd_read, r.ssd_read_mixed, r.ssd_write_mixed,
                           r.ssd_write),
                  LinkPair("ssd_write", "ssd_read", r.ssd_write, r.ssd_write_mixed, r.ssd_read_mixed,
                           r.ssd_read)]
    return pairs


class _ChainLinkTerm(NamedTuple):
    """A shared link direction A on the serial chains, against the other direction B (`chain_needs`)."""

    chain_solo_s: np.ndarray  # (W,) seconds of A's transfers on each window's chain, at A's solo rate
    other_released_s: np.ndarray  # (W,) seconds of B's work released in each window, at B's solo rate
    slowdown: float  # k = 1 - shared_A / solo_A


def chain_needs(sm: SlotModel, hw: HardwareProfile, rounds: int = 40) -> np.ndarray:
    """Seconds each serial chain's window needs: the chain at the links' solo rates, each transfer on it slowed
    where the other direction of its link runs beside it. That direction runs the work released in the window
    (eagerly, at its solo rate: B seconds) spread over the window's length X, so it runs beside the transfer a
    fraction f = min(1, B / X) of the transfer's time, and the transfer of A solo seconds takes A / (1 - k f),
    k = 1 - shared_A / solo_A. X is the least length that holds the chain so stretched (found by bisection: the
    stretched chain shrinks as X grows). Windows that are not chains: 0."""
    chain_s = sm.work[:, CHANNELS.index("chain"), 0]
    terms: list[_ChainLinkTerm] = []
    for pair in _link_pairs(hw):
        solo, shared, other_solo = pair.solo_bytes_per_s, pair.shared_bytes_per_s, pair.other_solo_bytes_per_s
        if solo <= 0 or shared <= 0 or other_solo <= 0 or shared >= solo:
            continue
        ia, ib = CHANNELS.index(pair.channel), CHANNELS.index(pair.other)
        terms.append(_ChainLinkTerm(sm.links[:, ia] / solo, sm.released[:, ib, 0] / other_solo,
                                    1.0 - shared / solo))

    pools = _chain_pool_terms(sm, hw)

    def stretched(window_s: np.ndarray) -> np.ndarray:
        out = chain_s.copy()
        for term in terms:
            beside = np.minimum(1.0, term.other_released_s / np.maximum(window_s, 1e-12))
            out += term.chain_solo_s * (1.0 / (1.0 - term.slowdown * beside) - 1.0)
        for pool in pools:  # host pools: the chain's transfers and Adam slow while the window oversubscribes one
            background = pool.background_use(window_s)
            for chain_solo_s, demand in pool.items:
                scale = np.minimum(1.0, pool.capacity / (demand + background))
                out += chain_solo_s * (1.0 / scale - 1.0)
        return out

    lo, hi = chain_s.copy(), stretched(chain_s)  # stretched(lo) <= hi: the answer lies in [lo, hi]
    for _ in range(rounds):
        mid = (lo + hi) / 2
        ok = stretched(mid) <= mid
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return np.where(chain_s > 0, hi, 0.0)


class _ChainPool(NamedTuple):
    """One shared host pool on the serial chains (`chain_needs`)."""

    items: list[tuple[np.ndarray, float]]  # per channel: (W,) chain seconds at solo speed, its use of the pool
    background: list[tuple[np.ndarray, float, float]]  # per channel: (W,) released work beside the chain, its
    #   solo rate (work/s: no channel moves faster than that) and its use of the pool per unit of work
    capacity: float

    def background_use(self, window_s: np.ndarray) -> np.ndarray:
        """What the work released beside the chain uses of the pool per second, spread over the window, each
        channel at most at its solo rate."""
        out = np.zeros_like(window_s)
        for released, rate, unit in self.background:
            out += np.minimum(released / np.maximum(window_s, 1e-12), rate) * unit
        return out


def _chain_pool_terms(sm: SlotModel, hw: HardwareProfile) -> list[_ChainPool]:
    """Each chain's transfers and CPU Adam steps against the rest of its window's released work on each shared
    host pool (host memory; on a host device, its cores), spread evenly over the window: while together they ask
    for more than the pool holds, the chain's items run at capacity / (their demand + the background) of their
    solo speed, as the simulator slows every user of a pool in proportion."""
    r = link_rates(hw)
    solo = {"h2d": r.h2d, "d2h": r.d2h, "ssd_read": r.ssd_read, "ssd_write": r.ssd_write, "cpu": 1.0}
    out = []
    for _, cap_s, use in r.pools():
        items, background = [], []
        for ch, unit in use.items():
            if ch not in solo or solo[ch] <= 0:
                continue
            i = CHANNELS.index(ch)
            background.append((np.maximum(sm.released[:, i, 0] - sm.links[:, i], 0.0), solo[ch], unit))
            if sm.links[:, i].any():
                items.append((sm.links[:, i] / solo[ch], solo[ch] * unit))
        out.append(_ChainPool(items, background, cap_s))
    return out


class WindowTerms(NamedTuple):
    """The linear terms of a window's need (`window_terms`)."""

    per_channel: np.ndarray  # (K, C) seconds per unit of each channel's work (bytes on links, seconds else)
    names: list[str]  # (K,) the resource each term stands for


def window_terms(hw: HardwareProfile) -> WindowTerms:
    """Seconds a window needs per unit of each channel's work, one row per resource (each link alone, the PCIe
    link both ways, each SSD direction and a shared array, the CPU, a serial chain), and their names."""
    r = link_rates(hw)
    idx = {k: i for i, k in enumerate(CHANNELS)}
    rows, names = [], []

    def row(label: str, **per: float) -> None:
        v = np.zeros(len(CHANNELS))
        for k, s in per.items():
            v[idx[k]] = s
        rows.append(v)
        names.append(label)

    row("cpu", cpu=1.0)
    row("chain", chain=1.0)
    row("h2d", h2d=1.0 / r.h2d)
    row("d2h", d2h=1.0 / r.d2h)
    def duplex_rows(label: str, a: str, b: str, a_rate: float, b_rate: float, a_mixed: float,
                    b_mixed: float) -> None:
        """Both directions of one link: a/A + b/B + c min(a/Am, b/Bm) (loads.duplex_time_s), a max of two
        linear terms when c < 0."""
        c = duplex_coefficient(a_rate, b_rate, a_mixed, b_mixed)
        if c < 0:
            row(label, **{a: 1.0 / a_rate + c / a_mixed, b: 1.0 / b_rate})
            row(label, **{a: 1.0 / a_rate, b: 1.0 / b_rate + c / b_mixed})
        else:
            row(label, **{a: 1.0 / a_rate, b: 1.0 / b_rate})

    duplex_rows("pcie", "h2d", "d2h", r.h2d, r.d2h, r.h2d_duplex, r.d2h_duplex)
    if hw.ssd.count > 0:
        row("ssd_read", ssd_read=1.0 / r.ssd_read)
        row("ssd_write", ssd_write=1.0 / r.ssd_write)
        duplex_rows("ssd", "ssd_read", "ssd_write", r.ssd_read, r.ssd_write, r.ssd_read_mixed, r.ssd_write_mixed)
    for name, cap_s, use in r.pools():  # host memory and, on a host device, its cores (loads.pool_times_s); the
        # GPU's own share of the cores is left out: its seconds are the slot durations, not a channel's work
        row(name, **{k: u / cap_s for k, u in use.items() if k in idx})
    return WindowTerms(np.array(rows), names)


def _subslots(cfg: ScheduleConfig) -> int:
    """Slots per weight use: its first act_prefetch steps one by one (the activations they need were fetched
    during the previous use, queued with that use's weight fetch), the rest of the use as one slot."""
    return min(cfg.group, cfg.act_prefetch + 1)


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
    """A task that had to wait for another to free memory (`_memory_edges`)."""

    freeing: TaskSignature  # the task whose end freed the memory
    waiting: TaskSignature  # the task that started then


def _memory_edges(model: ModelSpec, mt: ModelSpec, hw: HardwareProfile,
                  ct: ScheduleConfig) -> list[MemoryEdge]:
    """Which task waits for which to free memory: the template (at ct's placement) replayed by the simulator
    with each tier's capacity less the full model's resident tensors beyond the template's, so its buffers
    compete for the same headroom as the full model's. Returns (freeing task, waiting task) signatures."""
    from tierflow.planner.core.simulator import SimulationError, simulate_graph

    g = build_graph(mt, hw, ct)
    full = static_bytes(model, ct.placement, ct.runtime)
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


def _topological(n: int, preds: list[list[int]], prev_in_queue: list[int], queue_order: list[int]) -> list[int]:
    """A topological order of the tasks over dependencies, queue order and memory edges (the graph's one
    topological sort, ties broken by queue order); where an edge closed a cycle, the queue order is kept."""
    rank = [0] * n
    for r, i in enumerate(queue_order):
        rank[i] = r
    all_preds = [preds[i] + [prev_in_queue[i]] if prev_in_queue[i] >= 0 else preds[i] for i in range(n)]
    try:
        return topological_order(n, all_preds, tie_break=rank)
    except CycleError as e:  # a memory edge against the queue order closed a cycle: keep the queue order there
        left = set(e.left)
        return e.order + [i for i in queue_order if i in left]


# --- the template: its slots, and the release and deadline slot of each of its tasks ----------------------


def _step_scale(g, cfg_t: ScheduleConfig, lay: _Layout) -> np.ndarray:
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
    use), or the `sub`-th part of them (`_subslots`)."""

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
    """The template's slots and the slot of each GPU step of an iteration (`_slot_grid`)."""

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


def _slot_grid(g, cfg_t: ScheduleConfig) -> SlotGrid:
    """Phase 1, the slots of the template: one per group, phase and block, its first steps one by one
    (`_subslots`), in the order the GPU runs them, and the tail after them."""
    S = g.meta["steps_per_iteration"]
    steps = step_sequence(g.num_blocks, cfg_t.num_micro_batches, cfg_t.group)
    group_size = cfg_t.group
    nsub = _subslots(cfg_t)
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
    """Which template task waits for which (`_task_order`)."""

    preds: list[list[int]]  # task -> the tasks it depends on (dependencies, then memory edges)
    prev_in_queue: list[int]  # task -> the task ahead of it in its queue (-1: none; GPU steps: -1)
    succs: list[list[int]]  # task -> the tasks waiting for it (the inverse of preds and prev_in_queue)
    order: list[int]  # a topological order of the tasks over all of these

    def waits_for(self, i: int) -> list[int]:
        """The tasks task i waits for: its predecessors, then the task ahead of it in its queue."""
        prev = self.prev_in_queue[i]
        return self.preds[i] + ([prev] if prev >= 0 else [])


def _task_order(tasks, mem_edges: tuple) -> TaskOrder:
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
    order = _topological(n, preds, prev_in_queue, queue_order)
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for d in preds[i]:
            succs[d].append(i)
        if prev_in_queue[i] >= 0:
            succs[prev_in_queue[i]].append(i)
    return TaskOrder(preds, prev_in_queue, succs, order)


def _release_slots(tasks, order: TaskOrder, step_slot: list) -> list[int]:
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


def _deadline_slots(tasks, order: TaskOrder, step_slot: list) -> list[int]:
    """Phase 3b: the deadline slot of every non-GPU task (unrolled; _NO_DEADLINE when nothing waits for it),
    the earliest over what waits for it: a GPU step's slot (the one before if the step opens its slot),
    another task's deadline."""
    deadline = [_NO_DEADLINE] * len(tasks)
    for i in reversed(order.order):
        if tasks[i].resource == "gpu":
            continue
        earliest = _NO_DEADLINE
        for s in order.succs[i]:
            if tasks[s].resource == "gpu":
                slot, is_first, _ = step_slot[s]
                earliest = min(earliest, slot - 1 if is_first else slot)
            else:
                earliest = min(earliest, deadline[s])
        deadline[i] = earliest
    return deadline


def _gpu_seconds(tasks, step_slot: list, scale: np.ndarray, T: int) -> np.ndarray:
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


def _task_windows(tasks, grid: SlotGrid, release: list[int], deadline: list[int], group_size: int,
                  Gt: int) -> list[TaskWindow]:
    """Phase 3d: every non-GPU task of the middle iteration with its release and deadline slot (no deadline:
    two iterations after its release), its resource and its anchor (block, home group)."""
    T = len(grid.slots)
    out = []
    for i, t in enumerate(tasks):
        if t.iteration != 1 or t.resource == "gpu":
            continue
        rel, dl = release[i], deadline[i]
        if dl >= _NO_DEADLINE:
            dl = rel + 2 * T
        dl = max(rel, dl)
        home_group = grid.home_group(grid.next_at(t.key), t.mb // group_size if t.mb >= 0 else Gt - 1)
        out.append(TaskWindow(i, rel, dl, SLOT_RESOURCES.index(t.resource), t.block, home_group))
    return out


# --- the template's serial chains --------------------------------------------------------------------------


class GpuSteps(NamedTuple):
    """Where each GPU task of the template runs (`_gpu_steps`; None for the other tasks)."""

    step: list  # task -> (iteration, step index) of its GPU step (Clock.nearest_step)
    slot: list  # task -> StepSlot of that step


def _gpu_steps(tasks, grid: SlotGrid) -> GpuSteps:
    """The step and the slot of every GPU task."""
    step = [grid.clock.nearest_step(t.key) if t.resource == "gpu" else None for t in tasks]
    return GpuSteps(step, [grid.at_step(*s) if s is not None else None for s in step])


class StepShares(NamedTuple):
    """GPU seconds of a slot around each of its steps (`_step_shares`), keyed by (iteration, step index)."""

    before_s: dict[tuple[int, int], float]  # the slot's steps up to and including this one
    after_s: dict[tuple[int, int], float]  # this step and the slot's steps after it


def _step_shares(tasks, scale: np.ndarray, gpu_steps: GpuSteps, grid: SlotGrid) -> StepShares:
    """Phase 4a: a slot holds several GPU steps, run one at a time: a chain released by a step inside its
    first slot starts only after the steps of that slot up to it (`before_s`), and a chain into a step must
    end before the steps of its slot from that one on (`after_s`)."""
    step_s: dict[tuple[int, int], float] = {}  # GPU seconds of each step (all its GPU tasks, scaled)
    for i, t in enumerate(tasks):
        if t.resource == "gpu":
            step = gpu_steps.step[i]
            step_s[step] = step_s.get(step, 0.0) + t.work * scale[i]
    before_s: dict[tuple[int, int], float] = {}
    after_s: dict[tuple[int, int], float] = {}
    for _, run in groupby(sorted(step_s), key=lambda step: grid.at_step(*step).slot):
        run = list(run)  # the steps of one slot, in order
        acc, total = 0.0, sum(step_s[x] for x in run)
        for x in run:
            after_s[x] = total - acc
            acc += step_s[x]
            before_s[x] = acc
    return StepShares(before_s, after_s)


def _chain_vectors(tasks, affine_s: np.ndarray) -> np.ndarray:
    """Phase 4b: each task's share of a chain's vector (n, V1 + C): its affine seconds at the links' solo
    rates (the V1 columns of `affine_s`), then the bytes it moves on each link channel (a transfer on a chain
    runs slower while the other direction of its link runs: `chain_needs`)."""
    V1 = affine_s.shape[1]
    vectors = np.zeros((len(tasks), V1 + len(CHANNELS)))
    vectors[:, :V1] = affine_s
    for i, t in enumerate(tasks):
        if t.resource in SLOT_RESOURCES:  # bytes on a link, seconds of CPU Adam (both share host memory)
            vectors[i, V1 + CHANNELS.index(t.resource)] = t.work
    return vectors


class ChainHeads(NamedTuple):
    """The longest serial chains ending at one task, one per slot their first task is released in (keys: those
    unrolled template slots)."""

    seconds: dict[int, float]  # its length at the reference placement (solo link rates)
    vector: dict[int, np.ndarray]  # (V1 + C,) its chain vector (`_chain_vectors`)
    resources: dict[int, int]  # the resources on it, a bit mask over RESOURCES


_NO_HEADS = ChainHeads({}, {}, {})  # of a GPU step (never changed)


def _chain_heads(tasks, order: TaskOrder, release: list[int], gpu_steps: GpuSteps, shares: StepShares,
                 vectors: np.ndarray, ref_s: np.ndarray, reach: int) -> list[ChainHeads]:
    """Phase 4c: a task cannot start before the tasks it depends on (on other resources) and the task ahead of
    it in its queue are done. For each task, the longest chain ending at it among the chains whose first task
    is released at slot a, one per a for the last `reach` slots before its release (ties: the first found).
    A chain released by a GPU step starts after the steps of that slot up to the step (`before_s`)."""
    bit = {r: 1 << j for j, r in enumerate(RESOURCES)}
    heads = [_NO_HEADS] * len(tasks)
    for i in order.order:
        t = tasks[i]
        if t.resource == "gpu":
            continue
        rel = release[i]
        offset_s = max([shares.before_s[gpu_steps.step[p]] for p in order.preds[i]
                        if tasks[p].resource == "gpu" and gpu_steps.slot[p].slot == rel] + [0.0])
        own_s = float(ref_s[i])
        longest_s = {rel: own_s + offset_s}  # first slot -> seconds of the longest chain
        extends: dict[int, ChainHeads] = {}  # first slot -> whose chain it extends (none: task t alone)
        for p in order.waits_for(i):
            if tasks[p].resource == "gpu":
                continue
            for first, head_s in heads[p].seconds.items():
                if first >= rel - reach and (first not in longest_s or head_s + own_s > longest_s[first]):
                    longest_s[first] = head_s + own_s
                    extends[first] = heads[p]
        vec, mask = vectors[i], bit[t.resource]
        vector, resources = {}, {}
        for first in longest_s:
            if first in extends:
                vector[first] = extends[first].vector[first] + vec
                resources[first] = extends[first].resources[first] | mask
            else:  # t alone, after the steps of its slot before it
                vector[first] = vec.copy()
                vector[first][0] += offset_s
                resources[first] = mask
        heads[i] = ChainHeads(longest_s, vector, resources)
    return heads


class Chain(NamedTuple):
    """A serial chain: a window of its own that must last at least the chain."""

    release_slot: int  # unrolled template slot its first task is released in
    deadline_slot: int  # unrolled template slot by whose end it must be done
    block: int  # template block it is anchored at (the block of its last task)
    home_group: int  # template group it is anchored at
    vector: np.ndarray  # (V1 + C,) chain vector (`_chain_vectors`)


def _chains_into_steps(tasks, grid: SlotGrid, order: TaskOrder, gpu_steps: GpuSteps, shares: StepShares,
                       heads: list[ChainHeads], width: int, Gt: int) -> list[Chain]:
    """Phase 4d: a GPU step of the middle iteration waits for its inputs (and for memory) and then computes:
    the longest chain into it from each first slot, plus its own work and that of its slot's steps after it,
    must fit between the chain's first slot and the end of the step's slot (`width`: length of a vector)."""
    chains = []
    for i, t in enumerate(tasks):
        if t.resource != "gpu" or t.iteration != 1:
            continue
        slot = gpu_steps.slot[i].slot
        own = np.zeros(width)
        own[0] = shares.after_s[gpu_steps.step[i]]
        home_group = grid.home_group(slot, Gt - 1)
        longest_s: dict[int, float] = {}  # first slot -> seconds of the longest chain into the step
        via: dict[int, ChainHeads] = {}  # first slot -> the input it ends at
        for p in order.preds[i]:
            if tasks[p].resource == "gpu":
                continue
            for first, head_s in heads[p].seconds.items():
                if first not in longest_s or head_s > longest_s[first]:
                    longest_s[first] = head_s
                    via[first] = heads[p]
        for first in longest_s:
            chains.append(Chain(first, max(first, slot), t.block, home_group, via[first].vector[first] + own))
    return chains


def _chains_into_tasks(tasks, order: TaskOrder, deadline: list[int], heads: list[ChainHeads],
                       windows: list[TaskWindow]) -> list[Chain]:
    """Phase 4e: the chains through more than one resource (a single queue's window holds the others) that
    end at a task feeding a GPU step (such a chain holds every chain into that task), by its deadline."""
    chains = []
    for w in windows:
        i, ends = w.task, heads[w.task]
        if deadline[i] >= _NO_DEADLINE or not any(tasks[q].resource == "gpu" for q in order.succs[i]):
            continue
        for first, mask in ends.resources.items():
            if mask & (mask - 1):
                chains.append(Chain(first, max(first, deadline[i]), w.block, w.home_group,
                                    ends.vector[first]))
    return chains


class TemplateItems(NamedTuple):
    """The template's slots and what happens in them (`_template_items`)."""

    slots: list[tuple]  # template slot -> SlotKey; the last one is TAIL_SLOT
    gpu_s: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    items: list[TaskWindow]  # the non-GPU tasks of the middle iteration
    chains: list[Chain]  # the serial chains of the middle iteration


def _template_items(g, cfg_t: ScheduleConfig, lay: _Layout, affine_s: np.ndarray, ref_s: np.ndarray,
                    scale: np.ndarray, mem_edges: tuple = ()) -> TemplateItems:
    """Template slots and, for every non-GPU task of the middle iteration, its release and deadline slot
    (unrolled over the three iterations: iteration * T + slot), its anchor (block, home group) and resource;
    and the serial chains. Takes the template's graph g, each task's affine seconds (n, V1) and seconds at the
    reference placement (n,), how many full-model tasks each stands for (n,), and the memory edges (pairs of
    task ids: freeing, waiting)."""
    tasks = g.tasks
    grid = _slot_grid(g, cfg_t)
    order = _task_order(tasks, mem_edges)
    gpu_steps = _gpu_steps(tasks, grid)
    release = _release_slots(tasks, order, gpu_steps.slot)
    deadline = _deadline_slots(tasks, order, gpu_steps.slot)
    items = _task_windows(tasks, grid, release, deadline, cfg_t.group, lay.Gt)
    shares = _step_shares(tasks, scale, gpu_steps, grid)
    vectors = _chain_vectors(tasks, affine_s)
    heads = _chain_heads(tasks, order, release, gpu_steps, shares, vectors, ref_s,
                         reach=4 * _subslots(cfg_t) + 2)
    chains = (_chains_into_steps(tasks, grid, order, gpu_steps, shares, heads, vectors.shape[1], lay.Gt)
              + _chains_into_tasks(tasks, order, deadline, heads, items))
    gpu_s = _gpu_seconds(tasks, gpu_steps.slot, scale, len(grid.slots))
    return TemplateItems(grid.slots, gpu_s, items, chains)


def build_slot_model(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SlotModel:
    """The slot model of `cfg` (every decision made: schedule, placement, swap count, alpha, prefetch)."""
    mt, ct, lay = template_of(model, cfg)
    graphs = _template_graphs(mt, hw, ct, lay)
    edges = tuple(_memory_edges(model, mt, hw, ct))
    return _expand(_slot_template(graphs, ct, lay, edges), lay)


class TemplateGraph(NamedTuple):
    """The template's task graph and what each of its tasks weighs (`_template_graphs`)."""

    graph: object  # the builder's task graph of the template
    work: np.ndarray  # (n, 1) each task's work: bytes on the links and SSDs, seconds on the GPU and CPU
    seconds_per_work: np.ndarray  # (n,) seconds per unit of that work at its resource's solo rate
    copies: np.ndarray  # (n,) how many tasks of the full model each task stands for (`_step_scale`)
    index_of: dict  # TaskSignature -> task id


def _template_graphs(mt: ModelSpec, hw: HardwareProfile, ct: ScheduleConfig, lay: _Layout) -> TemplateGraph:
    """The template's task graph, every task's work, and how many tasks of the full model each task stands
    for."""
    g = build_graph(mt, hw, ct)
    work = np.array([[t.work] for t in g.tasks]).reshape(len(g.tasks), 1)
    r = link_rates(hw)
    sec = {"h2d": 1 / r.h2d, "d2h": 1 / r.d2h, "ssd_read": 1 / r.ssd_read if r.ssd_read else 0.0,
           "ssd_write": 1 / r.ssd_write if r.ssd_write else 0.0, "cpu": 1.0, "gpu": 1.0}
    seconds_per_work = np.array([sec[t.resource] for t in g.tasks])
    return TemplateGraph(g, work, seconds_per_work, _step_scale(g, ct, lay),
                         {sg: i for i, sg in enumerate(_signatures(g))})


class ChainAnchor(NamedTuple):
    """Where a serial chain stands (its window and anchor): a Chain without its vector."""

    release_slot: int  # unrolled template slot its first task is released in
    deadline_slot: int  # unrolled template slot by whose end it must be done
    block: int  # template block it is anchored at
    home_group: int  # template group it is anchored at


class SlotTemplate(NamedTuple):
    """What the expansion takes from the template (`_slot_template`)."""

    slots: list[tuple]  # template slot -> SlotKey; the last one is TAIL_SLOT
    gpu_s: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    items: list[TaskWindow]  # the non-GPU tasks of the middle iteration
    item_work: np.ndarray  # (N, V1) work of each item (bytes or seconds), times the tasks it stands for
    chains: list[ChainAnchor]  # the distinct serial chains
    chain_work: np.ndarray  # (K, V1 + C) their chain vectors (`_chain_vectors`)


def _slot_template(graphs: TemplateGraph, ct: ScheduleConfig, lay: _Layout,
                   mem_edges: tuple = ()) -> SlotTemplate:
    """Phase 5: the template's items and chains, with the memory edges (MemoryEdge signatures) mapped to the
    template's tasks, the items' work scaled to the tasks they stand for, identical chains merged."""
    where = graphs.index_of
    edges = tuple((where[a], where[b]) for a, b in mem_edges if a in where and b in where)
    per_s = graphs.seconds_per_work
    template = _template_items(graphs.graph, ct, lay, graphs.work * per_s[:, None],
                               np.array([t.work for t in graphs.graph.tasks]) * per_s, graphs.copies, edges)
    scaled_work = graphs.work * graphs.copies[:, None]
    distinct: dict = {}  # identical chains (same window, same anchor, same length) are one
    for chain in template.chains:
        distinct.setdefault((*chain[:4], tuple(np.round(chain.vector, 9))), chain.vector)
    chain_work = np.array(list(distinct.values())).reshape(len(distinct), -1)
    item_work = scaled_work[[it.task for it in template.items]].reshape(len(template.items), -1)
    return SlotTemplate(template.slots, template.gpu_s, template.items, item_work,
                        [ChainAnchor(*k[:4]) for k in distinct], chain_work)


# --- the expansion to the full iteration ------------------------------------------------------------------


class FullIteration(NamedTuple):
    """The slots of one iteration of the full model (`_full_iteration`)."""

    subslots: int  # slots per weight use
    slots_per_group: int  # Lg = (2 L + 3) uses (F 0..L, H, B L..0) of `subslots` slots each
    full_slots: int  # Ne = G * Lg + 1 (the tail)
    tie: np.ndarray  # (Ne,) the template slot each full-model slot is a copy of
    period: np.ndarray  # (T,) copies of each template slot in one iteration


def _template_group(group: int, G: int) -> int:
    """The template group that group `group` of the full model is a copy of: the first, middle or last."""
    return group if G <= 3 else (0 if group == 0 else (2 if group == G - 1 else 1))


def _full_iteration(slots: list[tuple], lay: _Layout) -> FullIteration:
    """Phase 6, group mapping: the template slot ("tie") of every slot of one full-model iteration, its
    groups mapped to the template's first, middle and last group, its layers to the template block standing
    for them."""
    T = len(slots)
    L, G, Lt = lay.L, lay.G, lay.Lt
    nsub = 1 + max((s.sub for s in slots[:-1]), default=0)  # the tail is the last slot
    Lg = (2 * L + 3) * nsub
    Ne = G * Lg + 1
    template_block = []  # template block of each full-model block
    for b in range(Lt + 2):
        template_block += [b] * lay.mid_count.get(b, 1)
    slot_index = {s: i for i, s in enumerate(slots)}  # looked up by plain (group, phase, block, sub) tuples
    tie = np.empty(Ne, dtype=np.int64)
    for group in range(G):
        tg, off = _template_group(group, G), group * Lg
        for sub in range(nsub):
            for layer in range(L + 1):
                block = template_block[layer]
                tie[off + layer * nsub + sub] = slot_index[(tg, "F", block, sub)]
                tie[off + (2 * L + 2 - layer) * nsub + sub] = slot_index[(tg, "B", block, sub)]
            tie[off + (L + 1) * nsub + sub] = slot_index[(tg, "H", Lt + 1, sub)]
    tie[Ne - 1] = T - 1
    return FullIteration(nsub, Lg, Ne, tie, np.bincount(tie, minlength=T).astype(float))


class SlotArrays(NamedTuple):
    """The template's slots and blocks as arrays, for the vectorised expansion (`_slot_arrays`)."""

    group: np.ndarray  # (T,) template group of each slot (tail: 0)
    phase: np.ndarray  # (T,) 0 forward, 1 backward, 2 head, 3 tail (_PHASE_CODE)
    block: np.ndarray  # (T,) template block (tail: 0)
    sub: np.ndarray  # (T,) part of its use (tail: 0)
    first_copy: np.ndarray  # (Lt + 2,) full-model block of each template block (of its first copy)
    copies: np.ndarray  # (Lt + 2,) full-model blocks each template block stands for
    repeated: np.ndarray  # (Lt + 2,) the block is a run's middle layer, standing for several
    run: np.ndarray  # (Lt + 2,) run of each block (0 recomputed, 1 swapped, -1 embedding/head)


def _slot_arrays(slots: list[tuple], lay: _Layout) -> SlotArrays:
    """The template's slot keys (SlotKey, the tail last) and layout as arrays indexed by slot and block."""
    keys = slots[:-1]  # the tail is the last slot
    blocks = range(lay.Lt + 2)
    return SlotArrays(group=np.array([s.group for s in keys] + [0]),
                      phase=np.array([_PHASE_CODE[s.phase] for s in keys] + [_TAIL_PHASE]),
                      block=np.array([s.block for s in keys] + [0]),
                      sub=np.array([s.sub for s in keys] + [0]),
                      first_copy=np.array([lay.expanded_layer(b) for b in blocks]),
                      copies=np.array([lay.mid_count.get(b, 1) for b in blocks]),
                      repeated=np.array([b in lay.mid_count for b in blocks]),
                      run=np.array(lay.run_of))


class CopyEnd(NamedTuple):
    """One end (release or deadline) of every copy of some template tasks (`_copy_end`), in unrolled
    full-model slots relative to the middle iteration: copy (j, h) of a task (the j-th layer and h-th group it
    stands for) has it at base + j * layer_step + h * group_step."""

    base: np.ndarray  # (N,) the first copy's slot
    layer_step: np.ndarray  # (N,) slots from one layer's copy to the next (0: it stays where it is)
    group_step: np.ndarray  # (N,) slots from one group's copy to the next


def _copy_end(position: np.ndarray, block: np.ndarray, group: np.ndarray, home: np.ndarray,
              group_copies: np.ndarray, arrays: SlotArrays, full: FullIteration, lay: _Layout) -> CopyEnd:
    """Phase 7a: where the unrolled template slot `position` of tasks anchored at template `block` and `group`
    (home: the full-model group of the first copy) lies for each copy. A slot of the task's own repeated run
    moves with the task's layer; another repeated block's slot is its first copy before the task, else its
    last."""
    T = len(arrays.group)
    L, G = lay.L, lay.G
    nsub, Lg, Ne = full.subslots, full.slots_per_group, full.full_slots
    iteration, tslot = np.divmod(position, T)
    iteration = iteration - 1  # relative to the middle iteration
    slot_group, phase = arrays.group[tslot], arrays.phase[tslot]
    slot_block, sub = arrays.block[tslot], arrays.sub[tslot]
    full_group = np.clip(home + (slot_group - group), 0, G - 1)
    in_run = arrays.repeated[block] & (arrays.run[slot_block] == arrays.run[block]) & (phase <= 1)
    nearest_copy = np.where(block < slot_block, 0, arrays.copies[slot_block] - 1)
    fixed = np.where(arrays.repeated[slot_block], arrays.first_copy[slot_block] + nearest_copy,
                     arrays.first_copy[slot_block])
    layer = np.where(in_run, arrays.first_copy[block] + (slot_block - block), fixed)
    use = np.where(phase == 0, layer, np.where(phase == 1, 2 * L + 2 - layer, L + 1))
    base = np.where(phase == _TAIL_PHASE, iteration * Ne + Ne - 1,
                    iteration * Ne + full_group * Lg + use * nsub + sub)
    layer_step = np.where(in_run, nsub * np.where(phase == 0, 1, -1), 0)
    group_step = np.where((group_copies > 1) & (phase < _TAIL_PHASE), Lg, 0)
    return CopyEnd(base, layer_step, group_step)


class CopyIndex(NamedTuple):
    """The copies of some template tasks, one entry each (`_copy_indices`)."""

    item: np.ndarray  # the template task (or chain) it is a copy of
    layer: np.ndarray  # which of the layers that task stands for
    group: np.ndarray  # which of the groups


def _copy_indices(layer_copies: np.ndarray, group_copies: np.ndarray, few: bool) -> CopyIndex:
    """Phase 7b: every (layer, group) copy of each task (`few`: only copies 0..4, the middle one and the last
    five of a layer or group repeated more than 12 times, the others being the same)."""
    if few:
        n_layer = np.where(layer_copies <= 12, layer_copies, 11)
        n_group = np.where(group_copies <= 12, group_copies, 11)
    else:
        n_layer, n_group = layer_copies, group_copies
    per = n_layer * n_group
    item = np.repeat(np.arange(len(layer_copies)), per)
    k = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    j_layer, j_group = k // n_group[item], k % n_group[item]
    if few:
        def unpick(j, n):
            return np.where(n <= 12, j, np.where(j < 5, j, np.where(j == 5, n // 2, n - 11 + j)))
        j_layer, j_group = unpick(j_layer, layer_copies[item]), unpick(j_group, group_copies[item])
    return CopyIndex(item, j_layer, j_group)


class Copies(NamedTuple):
    """Every copy of some template tasks in the full model (`_copies`), in unrolled full-model slots relative
    to the middle iteration."""

    release: np.ndarray  # slot it is released in
    deadline: np.ndarray  # slot by whose end it is due (at least its release)
    item: np.ndarray  # the template task (or chain) it is a copy of


def _copies(anchors, arrays: SlotArrays, full: FullIteration, lay: _Layout, few: bool = False) -> Copies:
    """Phase 7, copies per block and group: the release and deadline of every copy of the template tasks with
    the given (release slots, deadline slots, blocks, home groups), and the task of each copy."""
    release, deadline, block, group = (np.asarray(v, dtype=np.int64) for v in anchors)
    G = lay.G
    group_copies = np.where((G > 3) & (group == 1), G - 2, 1)
    home = group if G <= 3 else np.where(group == 0, 0, np.where(group == 1, 1, G - 1))
    rel = _copy_end(release, block, group, home, group_copies, arrays, full, lay)
    due = _copy_end(deadline, block, group, home, group_copies, arrays, full, lay)
    idx = _copy_indices(arrays.copies[block], group_copies, few)
    item = idx.item
    rel_at = rel.base[item] + idx.layer * rel.layer_step[item] + idx.group * rel.group_step[item]
    due_at = due.base[item] + idx.layer * due.layer_step[item] + idx.group * due.group_step[item]
    return Copies(rel_at, np.maximum(due_at, rel_at), item)


class Unrolled(NamedTuple):
    """The copies over three full-model iterations (`_unroll`), in unrolled slots: iteration * Ne + slot."""

    release: np.ndarray
    deadline: np.ndarray
    item: np.ndarray  # the template task it is a copy of (a row of the item work)
    channel: np.ndarray  # its channel, an index in CHANNELS


def _unroll(copies: Copies, channel_of_item: np.ndarray, Ne: int) -> Unrolled:
    """Phase 8a: the other iterations' copies (the steady state is periodic): the middle iteration's copies
    shifted by one and two iterations, those released inside the three."""
    release = np.concatenate([copies.release + k * Ne for k in range(3)])
    deadline = np.concatenate([copies.deadline + k * Ne for k in range(3)])
    item = np.concatenate([copies.item] * 3)
    keep = (release >= 0) & (release < 3 * Ne)
    release, deadline, item = release[keep], deadline[keep], item[keep]
    return Unrolled(release, deadline, item, channel_of_item[item])


class RunningSums(NamedTuple):
    """Running sums over the unrolled full-model slots (`_running_sums`); row s: slots [0, s)."""

    slot_copies: np.ndarray  # (3 Ne + 1, T) copies of each template slot
    released: np.ndarray  # (3 Ne + 1, C, V1) work of each channel released


def _running_sums(unrolled: Unrolled, item_work: np.ndarray, full: FullIteration, T: int) -> RunningSums:
    """Phase 8b: the running sums a window's copy counts and released work are differences of."""
    Ne = full.full_slots
    slot_copies = np.zeros((3 * Ne + 1, T))
    slot_copies[1:] = np.cumsum(np.eye(T)[np.concatenate([full.tie] * 3)], axis=0)
    released = np.zeros((3 * Ne + 1, len(CHANNELS), item_work.shape[1]))
    inside = unrolled.release < 3 * Ne
    np.add.at(released, (unrolled.release[inside] + 1, unrolled.channel[inside]),
              item_work[unrolled.item[inside]])
    return RunningSums(slot_copies, np.cumsum(released, axis=0))


class WindowRows(NamedTuple):
    """Windows, a row each: the SlotModel's arrays before identical windows are merged."""

    work: np.ndarray  # (W, C, V1) work of each channel released and due inside the window
    counts: np.ndarray  # (W, T) copies of each template slot inside it
    released: np.ndarray  # (W, C, V1) work of each channel released inside it, due whenever
    links: np.ndarray  # (W, C) bytes a serial chain's transfers move on each channel (other windows: 0)


def _between(sums: RunningSums, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Copy counts and released work of the windows from slots `first` to `last` (unrolled, inclusive)."""
    counts = sums.slot_copies[last + 1] - sums.slot_copies[first]
    return counts, sums.released[last + 1] - sums.released[first]


def _long_window_ends(slots: list[tuple], full: FullIteration, lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """Phase 9a: the slots of one iteration long windows start and end at: slots of the first, last and the
    first and last repeated group, at layers that are not repeated or at the first or last copy of a repeated
    layer; a long window starts where a weight use starts and ends where one ends (shorter ones are local
    windows); and the tail. Returns (starts, ends)."""
    Ne, Lg, nsub = full.full_slots, full.slots_per_group, full.subslots
    L, G, mid = lay.L, lay.G, lay.mid_count
    slot = np.arange(Ne)
    group_of = np.minimum(slot // Lg, G - 1)
    use_of = (slot % Lg) // nsub
    layer_of = np.where(use_of <= L + 1, use_of, 2 * L + 2 - use_of)
    edge_copy = np.zeros(Ne, dtype=bool)
    for m, c in mid.items():
        first = lay.expanded_layer(m)
        edge_copy |= (layer_of == first) | (layer_of == first + c - 1)
    layer_rep = np.array([s != TAIL_SLOT and s.block in mid for s in slots])
    sub_of = slot % nsub
    at = (~layer_rep[full.tie] | edge_copy) & np.isin(group_of, [0, 1, G - 2, G - 1])
    starts = np.union1d(np.nonzero(at & (sub_of == 0))[0], [Ne - 1])
    ends = np.union1d(np.nonzero(at & (sub_of == nsub - 1))[0], [Ne - 1])
    return starts, ends


def _long_windows(unrolled: Unrolled, item_work: np.ndarray, sums: RunningSums, starts: np.ndarray,
                  ends: np.ndarray, Ne: int) -> WindowRows:
    """Phase 9b: the windows from each start to each end less than two iterations later, with the work
    released and due inside each: a copy counts in every window from its last start at or before its release
    to an end at or after its first end at or after its deadline (a 2-D running sum)."""
    C, V1 = len(CHANNELS), item_work.shape[1]
    start_at = np.concatenate([starts + k * Ne for k in range(3)])
    end_at = np.concatenate([ends + k * Ne for k in range(3)])
    last_start = np.searchsorted(start_at, unrolled.release, side="right") - 1  # last start <= release
    first_end = np.searchsorted(end_at, unrolled.deadline, side="left")  # first end >= deadline
    ok = (last_start >= 0) & (first_end < len(end_at))
    inside = np.zeros((len(start_at), len(end_at), C, V1))
    np.add.at(inside, (last_start[ok], first_end[ok], unrolled.channel[ok]), item_work[unrolled.item[ok]])
    inside = inside[::-1].cumsum(axis=0)[::-1].cumsum(axis=1)  # [i, q]: last start >= i and first end <= q
    wi, wq = [], []
    for i in range(len(starts)):
        q = np.nonzero((end_at >= start_at[i]) & (end_at < start_at[i] + 2 * Ne))[0]
        wi.append(np.full(q.size, i))
        wq.append(q)
    wi, wq = np.concatenate(wi), np.concatenate(wq)
    counts, released = _between(sums, start_at[wi], end_at[wq])
    return WindowRows(inside[wi, wq], counts, released, np.zeros((len(wi), C)))


def _local_windows(unrolled: Unrolled, item_work: np.ndarray, sums: RunningSums, Ne: int) -> list[WindowRows]:
    """Phase 9c: the short windows, of 1 to LOCAL_SPAN consecutive slots starting at every slot of the
    iteration, with the work of the copies released and due inside each (a difference array over the
    start)."""
    C, V1 = len(CHANNELS), item_work.shape[1]
    span = unrolled.deadline - unrolled.release
    first = np.arange(Ne)
    out = []
    for width in range(1, LOCAL_SPAN + 1):
        fits = span < width
        lo = np.maximum(unrolled.deadline[fits] - width + 1, 0)  # the first start of a window holding it
        hi = np.minimum(unrolled.release[fits], Ne - 1)  # the last one
        good = lo <= hi
        channel = unrolled.channel[fits][good]
        work = item_work[unrolled.item[fits][good]]
        acc = np.zeros((Ne + 1, C, V1))
        np.add.at(acc, (lo[good], channel), work)
        np.add.at(acc, (hi[good] + 1, channel), -work)
        counts, released = _between(sums, first, first + width - 1)
        out.append(WindowRows(np.cumsum(acc, axis=0)[:Ne], counts, released, np.zeros((Ne, C))))
    return out


def _chain_windows(anchors: list[ChainAnchor], chain_work: np.ndarray, arrays: SlotArrays,
                   full: FullIteration, lay: _Layout, sums: RunningSums, V1: int) -> WindowRows:
    """Phase 9d: serial chains, one window per copy of each chain (`few` copies of a repeated one) from its
    first slot to its deadline, needing the chain's seconds; its released work is what the other queues take
    up in the window, against which the chain's transfers (its link bytes) run."""
    Ne, C = full.full_slots, len(CHANNELS)
    copies = _copies(tuple(zip(*anchors)), arrays, full, lay, few=True)
    shift = np.where(copies.release < 0, Ne, 0)
    first, last = copies.release + shift, copies.deadline + shift
    good = last < 3 * Ne
    chain = copies.item[good]
    work = np.zeros((int(good.sum()), C, V1))
    work[:, CHANNELS.index("chain"), :] = chain_work[chain, :V1]
    counts, released = _between(sums, first[good], last[good])
    return WindowRows(work, counts, released, chain_work[chain, V1:])


def _distinct_windows(rows: WindowRows, T: int) -> np.ndarray:
    """Phase 10: identical windows (the copies of a repeated slot, the chains of a repeated layer) are one
    constraint, windows without work none. Returns the indices of the rows to keep."""
    flat = np.concatenate([rows.work.reshape(len(rows.work), -1), rows.links], axis=1)
    nonzero = np.abs(flat).sum(axis=1) > 0
    rng = np.random.default_rng(0)  # a fixed random projection of each window's data: equal rows, equal keys
    sig = rows.counts @ rng.random(T) + np.round(flat, 3) @ rng.random(flat.shape[1])
    _, first = np.unique(np.round(sig[nonzero], 6), return_index=True)
    return np.nonzero(nonzero)[0][first]


def _expand(template: SlotTemplate, lay: _Layout) -> SlotModel:
    """Expand the template to the full iteration and build every window's copy counts and work."""
    slots, items, item_work = template.slots, template.items, template.item_work
    T, C, V1 = len(slots), len(CHANNELS), item_work.shape[1]
    full = _full_iteration(slots, lay)
    arrays = _slot_arrays(slots, lay)
    if items:
        copies = _copies(([it.release_slot for it in items], [it.deadline_slot for it in items],
                          [it.block for it in items], [it.home_group for it in items]), arrays, full, lay)
    else:
        none = np.zeros(0, np.int64)
        copies = Copies(none, none, none)
    channel_of_item = np.array([it.channel for it in items], dtype=np.int64)
    total = np.zeros((C, V1))
    np.add.at(total, channel_of_item[copies.item], item_work[copies.item])
    Ne = full.full_slots
    unrolled = _unroll(copies, channel_of_item, Ne)
    sums = _running_sums(unrolled, item_work, full, T)
    starts, ends = _long_window_ends(slots, full, lay)
    rows = [_long_windows(unrolled, item_work, sums, starts, ends, Ne)]
    rows += _local_windows(unrolled, item_work, sums, Ne)
    if len(template.chains):
        rows.append(_chain_windows(template.chains, template.chain_work, arrays, full, lay, sums, V1))
    windows = WindowRows(*(np.concatenate(column) for column in zip(*rows)))
    keep = _distinct_windows(windows, T)
    return SlotModel(slots=slots, gpu=template.gpu_s, period=full.period, counts=windows.counts[keep],
                     work=windows.work[keep], released=windows.released[keep], total=total,
                     links=windows.links[keep],
                     meta={"template_layers": lay.Lt, "template_groups": lay.Gt, "full_slots": Ne,
                           "subslots": full.subslots, "windows": len(keep)})


# --- the LP -----------------------------------------------------------------------------------------------


class SlotModelError(TierflowError, RuntimeError):
    """The slot model's LP could not be solved."""


@dataclass
class SolverReport:
    status: str
    objective_s: float
    best_bound_s: float
    gap: float
    wall_s: float
    solver: str = "CP-SAT"
    constraints: int = 0  # the rows the solver needed (slot model: windows added by constraint generation)

    def to_dict(self) -> dict:
        return {"solver": self.solver, "status": self.status, "objective": self.objective_s,
                "best_bound": self.best_bound_s, "gap": self.gap, "wall_s": self.wall_s,
                "constraints": self.constraints}


class WindowNeeds(NamedTuple):
    """What the LP must satisfy (`window_needs`)."""

    need_s: np.ndarray  # (W,) seconds each window needs
    throughput_s: float  # the least iteration any resource's whole load allows


def window_needs(sm: SlotModel, hw: HardwareProfile) -> WindowNeeds:
    """Seconds each window needs (the largest of its terms: each resource alone, both PCIe directions, a
    shared SSD array, a serial chain, a shared link's direction against the other running eagerly beside it),
    and the least iteration any resource's whole load allows."""
    per_channel, _ = window_terms(hw)
    linear_s = np.einsum("wcv,kc->wkv", sm.work, per_channel)[:, :, 0]  # (W, K): seconds needed by each term
    # a shared link's direction A against B running eagerly beside it: the smaller of two linear branches
    eager = eager_terms(hw)
    eager_s = np.zeros((len(sm.work), len(eager), 2))
    for p, term in enumerate(eager):
        due = sm.work[:, term.channel, 0]
        eager_s[:, p, 0] = due * (term.s_per_byte + term.extra_s_per_byte)
        eager_s[:, p, 1] = due * term.s_per_byte + sm.released[:, term.other, 0] * term.other_extra_s_per_byte
    need_s = np.concatenate([linear_s, eager_s.min(axis=2)], axis=1).max(axis=1)
    need_s = np.maximum(need_s, chain_needs(sm, hw))
    need_s = np.maximum(need_s, dram_needs(sm, hw))
    return WindowNeeds(need_s, float((per_channel @ sm.total[:, 0]).max()))


def dram_needs(sm: SlotModel, hw: HardwareProfile, rounds: int = 40) -> np.ndarray:
    """Seconds each window needs for one channel's due work (a link's bytes, CPU Adam's seconds) while the other
    channels run their released work eagerly beside it and together oversubscribe a shared host pool (host
    memory; on a host device, its cores): the channel runs at capacity / (its demand + the others') of its solo
    speed, as the simulator slows every user of a pool in proportion. The others' demand over a window of X
    seconds is each one's released work / X, at most its solo rate; X is the least length that holds the slowed
    work (bisection: the slowdown shrinks as X grows). 0 without a shared pool."""
    r = link_rates(hw)
    W = len(sm.work)
    out = np.zeros(W)
    solo = {"h2d": r.h2d, "d2h": r.d2h, "ssd_read": r.ssd_read, "ssd_write": r.ssd_write, "cpu": 1.0}
    for _, cap_s, use in r.pools():
        chans = [c for c in use if c in solo and solo[c] > 0]
        for a in chans:
            alone_s = sm.work[:, CHANNELS.index(a), 0] / solo[a]
            if not alone_s.any():
                continue
            others = [(sm.released[:, CHANNELS.index(c), 0], solo[c], use[c]) for c in chans if c != a]

            def slowed(window_s: np.ndarray, alone_s=alone_s, others=others, a=a, cap_s=cap_s, use=use):
                demand = np.full(W, solo[a] * use[a])
                for released, rate, u in others:
                    demand += np.minimum(released / np.maximum(window_s, 1e-12), rate) * u
                return alone_s * np.maximum(1.0, demand / cap_s)

            lo, hi = alone_s.copy(), slowed(alone_s)  # slowed(lo) <= hi: the answer lies in [lo, hi]
            for _ in range(rounds):
                mid = (lo + hi) / 2
                ok = slowed(mid) <= mid
                hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
            out = np.maximum(out, np.where(alone_s > 0, hi, 0.0))
    return out


def solve_slots(sm: SlotModel, hw: HardwareProfile, *, tol: float = 1e-9, max_rounds: int = 200) -> SolverReport:
    """The least iteration time of the slot model: the linear program

        min  period . D   s.t.  counts_w . D >= need_w (every window w),  D >= gpu,  period . D >= throughput

    over the slot durations D, solved with GLOP (OR-Tools' simplex) by constraint generation: start from the
    throughput row, add the windows the current solution violates (the 256 worst per round), re-solve warm,
    until no window is violated by more than `tol` (relative). Every window is checked at the end, so the
    objective satisfies the whole model; status OPTIMAL means the LP optimum was reached, FEASIBLE that the
    round limit stopped it first (the objective is then a lower bound of the model's optimum)."""
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    need_s, throughput_s = window_needs(sm, hw)
    T = len(sm.gpu)
    lp = pywraplp.Solver.CreateSolver("GLOP")
    lp.SuppressOutput()
    # dual simplex: rows added to an optimal basis leave it dual feasible, so each round re-solves from it (the
    # primal default also stalled, ABNORMAL, on 256 micro-batches with 17,000 copies of a slot in one window)
    lp.SetSolverSpecificParametersAsString("use_dual_simplex: true")
    D = [lp.NumVar(float(sm.gpu[t]), lp.infinity(), f"D{t}") for t in range(T)]
    iteration_s = lp.Sum([float(sm.period[t]) * D[t] for t in range(T)])
    lp.Add(iteration_s >= throughput_s)
    lp.Minimize(iteration_s)
    rows: set[int] = set()
    durations_s = sm.gpu.astype(float).copy()
    status = "FEASIBLE"
    for _ in range(max_rounds):
        violation_s = need_s - sm.counts @ durations_s
        worst = [int(w) for w in np.argsort(-violation_s)[:256]
                 if violation_s[w] > tol * max(1.0, need_s[w]) and int(w) not in rows]
        if not worst:
            status = "OPTIMAL"
            break
        for w in worst:
            copies = sm.counts[w]
            lp.Add(lp.Sum([float(copies[t]) * D[t] for t in np.nonzero(copies)[0]]) >= float(need_s[w]))
            rows.add(w)
        if lp.Solve() != pywraplp.Solver.OPTIMAL:
            raise SlotModelError("the slot model's LP did not solve (numerical trouble)")
        durations_s = np.array([v.solution_value() for v in D])
    obj = max(float(sm.period @ durations_s), throughput_s)
    return SolverReport(status, obj, obj if status == "OPTIMAL" else 0.0, 0.0 if status == "OPTIMAL" else 1.0,
                        time.perf_counter() - t0, solver="GLOP LP", constraints=len(rows) + 1)


def predict_config(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SolverReport:
    """The slot model's prediction of one steady-state iteration of `cfg`, whose decisions are all made. One rank
    only: a plan of several ranks (collectives on `net`, the box's shares) raises SlotModelError, and the search
    then verifies it in the simulator without the slot model's pruning."""
    if cfg.ranks > 1:
        raise SlotModelError("the slot model covers one rank; several ranks are verified by simulation only")
    return solve_slots(build_slot_model(model, hw, cfg), hw)
