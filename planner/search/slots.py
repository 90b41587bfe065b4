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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clock import Clock
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.core.memory import placed_bytes
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.schedules import ScheduleConfig, build_graph, step_sequence

SLOT_RESOURCES = ("h2d", "d2h", "ssd_read", "ssd_write", "cpu")
CHANNELS = SLOT_RESOURCES + ("chain",)  # work channels of a window; "chain": seconds of one serial chain
LOCAL_SPAN = 3  # slots of the short windows placed anywhere
_NO_DEADLINE = 10**9


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


def template_span(cfg: ScheduleConfig) -> int:
    """Layers of a run the template keeps (2 E + 1, E: how many weight uses ahead the schedule fetches)."""
    E = max(cfg.prefetch_depth + 1, -(-(cfg.act_prefetch + 1) // cfg.group))
    return 2 * E + 1


def template_of(model: ModelSpec, cfg: ScheduleConfig) -> tuple[ModelSpec, ScheduleConfig, _Layout]:
    """The template of `cfg`: a few layers per run of identical layers, at most three groups, three iterations."""
    L = model.num_layers
    n = cfg.swap_layers if cfg.recompute else L
    k = cfg.group
    G = cfg.num_micro_batches // k
    R = template_span(cfg)
    E = R // 2
    runs = [L - n, n]
    explicit = [min(c, R) for c in runs]
    mid_count, run_of = {}, [-1]
    start = 1
    for r, (c, ct) in enumerate(zip(runs, explicit)):
        if c > R:
            mid_count[start + E] = c - 2 * E
        run_of += [r] * ct
        start += ct
    Lt = sum(explicit)
    run_of.append(-1)
    Gt = min(G, 3)
    # micro-batches per group: the first steps of a use take what the previous use fetched for them, the last
    # one hands its output to the next use; a step at position rep = 2 a + 2 (a = act_prefetch) and beyond is
    # released and due inside its own use, so one such step stands for all the middle ones
    rep = 2 * cfg.act_prefetch + 2
    kt = min(k, rep + 2)
    mt = replace(model, num_layers=Lt)
    ct = replace(cfg, batch=cfg.micro_batch * kt * Gt, group=kt,
                 swap_layers=explicit[1] if cfg.recompute else 0, iterations=3)
    return mt, ct, _Layout(L=L, G=G, Lt=Lt, Gt=Gt, mid_count=mid_count, run_of=tuple(run_of),
                           rep_step=rep if k > kt else -1, rep_count=k - kt + 1)


@dataclass
class SlotModel:
    """The window constraints of one schedule, in the template's slots (see the module docstring). The work
    arrays end in an axis of length 1 (seconds of work on gpu/cpu/chains, bytes on the links)."""

    slots: list[tuple]  # template slot -> (group, phase, block) or ("tail",)
    gpu: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    period: np.ndarray  # (T,) copies of each template slot in one iteration of the full model
    counts: np.ndarray  # (W, T) copies of each template slot inside window w
    work: np.ndarray  # (W, C, 1) work of each channel (CHANNELS) released and due in window w
    released: np.ndarray  # (W, C, 1) work of each channel released in window w, due whenever
    total: np.ndarray  # (C, 1) work of each channel in one iteration
    links: np.ndarray  # (W, C) bytes a serial chain's transfers move on each link channel (other windows: 0)
    meta: dict


def eager_terms(hw: HardwareProfile) -> list[tuple[int, int, float, float, float]]:
    """The shared links, each direction A against the other B: (channel A, channel B, 1/solo_A, k, ...) such
    that finishing A's due work while B's released work runs eagerly beside it takes
        A/solo_A + k * min(A/shared_A, B/shared_B),   k = 1 - shared_A/solo_A
    (both directions at their shared rates while both run, A alone after: the fluid sharing the simulator
    plays). Returns (a, b, 1/solo_a, k/shared_a, k/shared_b) per ordered pair with k > 0."""
    idx = {k: i for i, k in enumerate(CHANNELS)}
    out = []
    for a, b, solo, sa, sb, _solo_b in _link_pairs(hw):
        if solo <= 0 or sa <= 0 or sb <= 0:
            continue
        k = 1.0 - sa / solo
        if k > 1e-12:
            out.append((idx[a], idx[b], 1.0 / solo, k / sa, k / sb))
    return out


def _link_pairs(hw: HardwareProfile) -> list[tuple[str, str, float, float, float, float]]:
    """Each direction A of a shared link against the other, B: (A, B, solo_A, shared_A, shared_B, solo_B)."""
    r = CostModel(hw).rates
    pairs = [("h2d", "d2h", r.h2d, r.h2d_duplex, r.d2h_duplex, r.d2h),
             ("d2h", "h2d", r.d2h, r.d2h_duplex, r.h2d_duplex, r.h2d)]
    if hw.ssd.count > 0:
        pairs += [("ssd_read", "ssd_write", r.ssd_read, r.ssd_read_mixed, r.ssd_write_mixed, r.ssd_write),
                  ("ssd_write", "ssd_read", r.ssd_write, r.ssd_write_mixed, r.ssd_read_mixed, r.ssd_read)]
    return pairs


def chain_needs(sm: SlotModel, hw: HardwareProfile, rounds: int = 40) -> np.ndarray:
    """Seconds each serial chain's window needs: the chain at the links' solo rates, each transfer on it slowed
    where the other direction of its link runs beside it. That direction runs the work released in the window
    (eagerly, at its solo rate: B seconds) spread over the window's length X, so it runs beside the transfer a
    fraction f = min(1, B / X) of the transfer's time, and the transfer of A solo seconds takes A / (1 - k f),
    k = 1 - shared_A / solo_A. X is the least length that holds the chain so stretched (found by bisection: the
    stretched chain shrinks as X grows). Windows that are not chains: 0."""
    chain = sm.work[:, CHANNELS.index("chain"), 0]
    terms = []  # (A solo seconds on the chain, B seconds released in the window, k)
    for a, b, solo, shared, _sb, solo_b in _link_pairs(hw):
        if solo <= 0 or shared <= 0 or solo_b <= 0 or shared >= solo:
            continue
        ia, ib = CHANNELS.index(a), CHANNELS.index(b)
        terms.append((sm.links[:, ia] / solo, sm.released[:, ib, 0] / solo_b, 1.0 - shared / solo))

    def stretched(x: np.ndarray) -> np.ndarray:
        out = chain.copy()
        for t_a, t_b, k in terms:
            f = np.minimum(1.0, t_b / np.maximum(x, 1e-12))
            out += t_a * (1.0 / (1.0 - k * f) - 1.0)
        return out

    lo, hi = chain.copy(), stretched(chain)  # stretched(lo) <= hi: the answer lies in [lo, hi]
    for _ in range(rounds):
        mid = (lo + hi) / 2
        ok = stretched(mid) <= mid
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return np.where(chain > 0, hi, 0.0)


def window_terms(hw: HardwareProfile) -> tuple[np.ndarray, list[str]]:
    r = CostModel(hw).rates
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
    c = 1.0 - r.h2d_duplex / r.h2d - r.d2h_duplex / r.d2h
    if c < 0:  # pcie_time_s: h/H + d/D + c min(h/Hd, d/Dd), a max of two linear terms
        row("pcie", h2d=1.0 / r.h2d + c / r.h2d_duplex, d2h=1.0 / r.d2h)
        row("pcie", h2d=1.0 / r.h2d, d2h=1.0 / r.d2h + c / r.d2h_duplex)
    else:
        row("pcie", h2d=1.0 / r.h2d, d2h=1.0 / r.d2h)
    if hw.ssd.count > 0:
        row("ssd_read", ssd_read=1.0 / r.ssd_read)
        row("ssd_write", ssd_write=1.0 / r.ssd_write)
        if hw.ssd.rw_sharing == "shared":
            row("ssd", ssd_read=1.0 / r.ssd_read, ssd_write=1.0 / r.ssd_write)
    return np.array(rows), names


def _subslots(cfg: ScheduleConfig) -> int:
    """Slots per weight use: its first act_prefetch steps one by one (the activations they need were fetched
    during the previous use, queued with that use's weight fetch), the rest of the use as one slot."""
    return min(cfg.group, cfg.act_prefetch + 1)


def _signatures(g) -> list[tuple]:
    """A name for every task that does not depend on which other tasks the placement creates."""
    seen: dict[tuple, int] = {}
    out = []
    for t in g.tasks:
        k = (t.kind, t.resource, t.block, t.mb, t.iteration, t.tensor)
        seen[k] = seen.get(k, -1) + 1
        out.append(k + (seen[k],))
    return out


def _memory_edges(model: ModelSpec, mt: ModelSpec, hw: HardwareProfile, ct: ScheduleConfig) -> list[tuple]:
    """Which task waits for which to free memory: the template (at ct's placement) replayed by the simulator
    with each tier's capacity less the full model's resident tensors beyond the template's, so its buffers
    compete for the same headroom as the full model's. Returns (freeing task, waiting task) signatures."""
    from tierflow.planner.core.simulator import SimulationError, simulate_graph

    g = build_graph(mt, hw, ct)
    full = placed_bytes(model, ct.placement)
    g.capacity_bytes = {t: c - (full[t] - g.static_bytes[t]) for t, c in g.capacity_bytes.items()}
    g.static_bytes = dict(g.static_bytes)
    try:
        res = simulate_graph(g, hw)
    except SimulationError:
        return []
    tasks = g.tasks
    st, en = res.start_s, res.end_s
    prev: dict[int, int] = {}
    for ids in g.resource_order().values():
        for a, b in zip(ids, ids[1:]):
            prev[b] = a
    frees: dict[float, list[int]] = {}
    for t in tasks:
        if any(d < 0 for _, d in t.mem_end):
            frees.setdefault(float(en[t.id]), []).append(t.id)
    sig = _signatures(g)
    out = []
    for t in tasks:
        ready = max([en[d] for d in t.deps if d >= 0] + ([en[prev[t.id]]] if t.id in prev else []) + [0.0])
        if st[t.id] > ready + 1e-9 * max(1.0, ready) and t.mem_start:
            for j in frees.get(float(st[t.id]), []):
                out.append((sig[j], sig[t.id]))
    return out


def _topological(n: int, preds: list[list[int]], prev_in_queue: list[int], queue_order: list[int]) -> list[int]:
    """A topological order of the tasks over dependencies, queue order and memory edges (Kahn's algorithm,
    ties broken by queue order); an edge that would close a cycle is dropped."""
    rank = {i: r for r, i in enumerate(queue_order)}
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i in range(n):
        ps = set(preds[i])
        if prev_in_queue[i] >= 0:
            ps.add(prev_in_queue[i])
        for p in ps:
            succ[p].append(i)
            indeg[i] += 1
    import heapq

    heap = [(rank[i], i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i = heapq.heappop(heap)
        out.append(i)
        for s_ in succ[i]:
            indeg[s_] -= 1
            if indeg[s_] == 0:
                heapq.heappush(heap, (rank[s_], s_))
    if len(out) < n:  # a memory edge against the queue order closed a cycle: keep the queue order there
        seen = set(out)
        out += [i for i in queue_order if i not in seen]
    return out


def _step_scale(g, cfg_t: ScheduleConfig, lay: _Layout) -> np.ndarray:
    """How many tasks of the full model each template task stands for: the steps at position lay.rep_step of a
    use stand for lay.rep_count steps, with every per-micro-batch transfer that serves them (found through the
    dependencies: the GPU step a transfer feeds, else the one it drains)."""
    tasks = g.tasks
    out = np.ones(len(tasks))
    if lay.rep_step < 0:
        return out
    S = g.meta["steps_per_iteration"]
    steps = step_sequence(g.num_blocks, cfg_t.num_micro_batches, cfg_t.group)
    pos, p = [], 0
    for i, st in enumerate(steps):
        p = p + 1 if i and steps[i - 1].block == st.block and steps[i - 1].phase == st.phase else 0
        pos.append(p)
    clock = Clock(S)

    def is_rep(t) -> bool:
        i = clock.nearest_step(t.key)[1]
        return not clock.is_tail(i) and pos[i] == lay.rep_step

    succs: list[list[int]] = [[] for _ in tasks]
    for t in tasks:
        for d in t.deps:
            if d >= 0:
                succs[d].append(t.id)
    for t in tasks:
        if t.mb < 0:
            continue
        if t.resource == "gpu":
            out[t.id] = lay.rep_count if is_rep(t) else 1.0
            continue
        step = None
        frontier = [t.id]
        for _ in range(4):  # the consumer first
            nxt = []
            for j in frontier:
                for s_ in succs[j]:
                    ts = tasks[s_]
                    if ts.mb == t.mb and ts.resource == "gpu":
                        step = ts
                        break
                    if ts.mb == t.mb:
                        nxt.append(s_)
                if step is not None:
                    break
            if step is not None or not nxt:
                break
            frontier = nxt
        if step is None:
            for d in t.deps:
                if d >= 0 and tasks[d].resource == "gpu" and tasks[d].mb == t.mb:
                    step = tasks[d]
                    break
        if step is not None and is_rep(step):
            out[t.id] = lay.rep_count
    return out


def _template_items(g, cfg_t: ScheduleConfig, lay: _Layout, tcoef: np.ndarray, tref: np.ndarray,
                    scale: np.ndarray, mem_edges: tuple = ()):
    """Template slots and, for every non-GPU task of the middle iteration, its release and deadline slot
    (unrolled over the three iterations: iteration * T + slot), its anchor (block, home group) and resource."""
    S = g.meta["steps_per_iteration"]
    steps = step_sequence(g.num_blocks, cfg_t.num_micro_batches, cfg_t.group)
    k = cfg_t.group
    nsub = _subslots(cfg_t)
    slot_of_step, slots, index = [], [], {}
    pos = 0
    for i, st in enumerate(steps):
        pos = pos + 1 if i and steps[i - 1].block == st.block and steps[i - 1].phase == st.phase else 0
        key = (st.mb // k, st.phase, st.block, min(pos, nsub - 1))
        if key not in index:
            index[key] = len(slots)
            slots.append(key)
        slot_of_step.append(index[key])
    T = len(slots) + 1  # + the tail (the optimizer after the last backward step, when not overlapped)
    slots.append(("tail",))
    first = [i == 0 or slot_of_step[i - 1] != slot_of_step[i] for i in range(S)]
    last = [i == S - 1 or slot_of_step[i + 1] != slot_of_step[i] for i in range(S)]
    clock = Clock(S)

    def step_slot(t) -> tuple[int, bool, bool]:
        return slot_of_key(t.key)

    def slot_of_key(key: float) -> tuple[int, bool, bool]:
        it, i = clock.nearest_step(key)
        if clock.is_tail(i):
            return it * T + T - 1, True, True
        return it * T + slot_of_step[i], first[i], last[i]

    def key_slot(t) -> int:
        it, i = clock.next_step(t.key)
        return it * T + (T - 1 if clock.is_tail(i) else slot_of_step[i])

    tasks = g.tasks
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
    rel = [0] * n
    gslot = [0] * n
    for i in order:
        t = tasks[i]
        if t.resource == "gpu":
            gslot[i] = step_slot(t)[0]
            continue
        r = 0
        for d in preds[i] + ([prev_in_queue[i]] if prev_in_queue[i] >= 0 else []):
            if tasks[d].resource == "gpu":
                s, _, is_last = step_slot(tasks[d])
                r = max(r, s + 1 if is_last else s)
            else:
                r = max(r, rel[d])
        rel[i] = r
    succs: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for d in preds[i]:
            succs[d].append(i)
        if prev_in_queue[i] >= 0:
            succs[prev_in_queue[i]].append(i)
    dl = [_NO_DEADLINE] * n
    for i in reversed(order):
        t = tasks[i]
        if t.resource == "gpu":
            continue
        v = _NO_DEADLINE
        for s in succs[i]:
            if tasks[s].resource == "gpu":
                sl, is_first, _ = step_slot(tasks[s])
                v = min(v, sl - 1 if is_first else sl)
            else:
                v = min(v, dl[s])
        dl[i] = v
    # serial chains: a task cannot start before the tasks it depends on (on other resources) and the task ahead
    # of it in its queue are done. For each task, the longest chain ending at it among the chains whose first
    # task is released at slot a (one per a, for the last `reach` slots): window [a, deadline] must last as long.
    reach = 4 * _subslots(cfg_t) + 2
    # a slot holds several GPU steps: a chain released by a step inside its first slot starts only after the
    # steps of that slot up to it (`before`), and a chain into a step must end before the steps of its slot from
    # that one on (`after`), the GPU running one step at a time
    step_work: dict[int, float] = {}
    for i, t in enumerate(tasks):
        if t.resource == "gpu":
            step_work[round(t.key)] = step_work.get(round(t.key), 0.0) + t.work * scale[i]
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    keys = sorted(step_work)
    slot_key = {key: slot_of_key(key)[0] for key in keys}
    run: list[int] = []
    for key in keys + [None]:
        if run and (key is None or slot_key[key] != slot_key[run[0]]):
            acc, tot = 0.0, sum(step_work[x] for x in run)
            for x in run:
                after[x] = tot - acc
                acc += step_work[x]
                before[x] = acc
            run = []
        if key is not None:
            run.append(key)
    # a chain's vector: its affine seconds (at the links' solo rates), then the bytes it moves on each channel
    # (a transfer on a chain runs slower while the other direction of its link runs: window_needs)
    V1 = tcoef.shape[1]
    ext = np.zeros((n, V1 + len(CHANNELS)))
    ext[:, :V1] = tcoef
    for i, t in enumerate(tasks):
        if t.resource in SLOT_RESOURCES and t.resource != "cpu":
            ext[i, V1 + CHANNELS.index(t.resource)] = t.work
    # head[i][a] = (seconds at the reference placement, chain vector, resources on the chain as a bit mask)
    head: list[dict] = [{} for _ in range(n)]
    bit = {r: 1 << j for j, r in enumerate(RESOURCES)}
    for i in order:
        t = tasks[i]
        if t.resource == "gpu":
            continue
        off = max([before[round(tasks[p].key)] for p in preds[i]
                   if tasks[p].resource == "gpu" and step_slot(tasks[p])[0] == rel[i]] + [0.0])
        vec = ext[i]
        d = float(tref[i])
        start = vec.copy()
        start[0] += off
        best = {rel[i]: (d + off, start, bit[t.resource])}
        for p in preds[i] + ([prev_in_queue[i]] if prev_in_queue[i] >= 0 else []):
            if tasks[p].resource == "gpu":
                continue
            for a, (lp, lv, lm) in head[p].items():
                if a >= rel[i] - reach and (a not in best or lp + d > best[a][0]):
                    best[a] = (lp + d, lv + vec, lm | bit[t.resource])
        head[i] = best
    chains = []  # (first slot, deadline slot, block, home group, affine seconds)
    # a GPU step waits for its inputs (and for memory) and then computes: the chain into it plus its own work
    # must fit between the chain's first slot and the end of the step's slot
    for i, t in enumerate(tasks):
        if t.resource != "gpu" or t.iteration != 1:
            continue
        sl = step_slot(t)[0]
        own = np.zeros(ext.shape[1])
        own[0] = after[round(t.key)]
        home = sl % T
        grp = slots[home][0] if home < T - 1 else lay.Gt - 1
        best: dict[int, tuple[float, np.ndarray, int]] = {}
        for p in preds[i]:
            if tasks[p].resource == "gpu":
                continue
            for a, (lp, lv, _m) in head[p].items():
                if a not in best or lp > best[a][0]:
                    best[a] = (lp, lv, 0)
        for a, (_, lv, _m) in best.items():
            chains.append((a, max(a, sl), t.block, grp, lv + own))
    gpu = np.zeros(T)
    items = []  # (task id, rel, dl, resource index, block, home group)
    for i, t in enumerate(tasks):
        if t.iteration != 1:
            continue
        if t.resource == "gpu":
            gpu[gslot[i] - T] += t.work * scale[i]
            continue
        a, b = rel[i], dl[i]
        if b >= _NO_DEADLINE:
            b = a + 2 * T
        b = max(a, b)
        home = key_slot(t) % T
        grp = slots[home][0] if home < T - 1 else (t.mb // k if t.mb >= 0 else lay.Gt - 1)
        items.append((i, a, b, SLOT_RESOURCES.index(t.resource), t.block, grp))
        if dl[i] >= _NO_DEADLINE or not any(tasks[q].resource == "gpu" for q in succs[i]):
            continue  # a chain that ends at a task feeding a GPU step holds every chain into that task
        for a0, (_, vec, mask) in head[i].items():
            if mask & (mask - 1):  # more than one resource: a chain no single queue's window holds
                chains.append((a0, max(a0, dl[i]), t.block, grp, vec))
    return slots, gpu, items, chains


def build_slot_model(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SlotModel:
    """The slot model of `cfg` (every decision made: schedule, placement, swap count, alpha, prefetch)."""
    mt, ct, lay = template_of(model, cfg)
    graphs = _template_graphs(mt, hw, ct, lay)
    edges = tuple(_memory_edges(model, mt, hw, ct))
    slots, gpu, items, item_coef, chains, chain_coef = _slot_template(graphs, ct, lay, edges)
    return _expand(slots, gpu, items, item_coef, lay, chains, chain_coef)


def _template_graphs(mt: ModelSpec, hw: HardwareProfile, ct: ScheduleConfig, lay: _Layout):
    """The template's task graph, every task's work, and how many tasks of the full model each task stands
    for."""
    g = build_graph(mt, hw, ct)
    coef = np.array([[t.work] for t in g.tasks]).reshape(len(g.tasks), 1)
    r = CostModel(hw).rates
    sec = {"h2d": 1 / r.h2d, "d2h": 1 / r.d2h, "ssd_read": 1 / r.ssd_read if r.ssd_read else 0.0,
           "ssd_write": 1 / r.ssd_write if r.ssd_write else 0.0, "cpu": 1.0, "gpu": 1.0}
    tsec = np.array([sec[t.resource] for t in g.tasks])
    return g, coef, tsec, _step_scale(g, ct, lay), {sg: i for i, sg in enumerate(_signatures(g))}


def _slot_template(graphs, ct: ScheduleConfig, lay: _Layout, mem_edges: tuple = ()):
    g, coef, tsec, scale, where = graphs
    edges = tuple((where[a], where[b]) for a, b in mem_edges if a in where and b in where)
    slots, gpu, items, chains = _template_items(g, ct, lay, coef * tsec[:, None],
                                                np.array([t.work for t in g.tasks]) * tsec, scale, edges)
    coef = coef * scale[:, None]
    uniq: dict = {}  # identical chains (same window, same anchor, same length) are one
    for a, b, blk, grp, cv in chains:
        uniq.setdefault((a, b, blk, grp, tuple(np.round(cv, 9))), cv)
    chain_coef = np.array(list(uniq.values())).reshape(len(uniq), -1)
    item_coef = coef[[it[0] for it in items]].reshape(len(items), -1)
    return slots, gpu, items, item_coef, [k[:4] for k in uniq], chain_coef


def _expand(slots, gpu_t, items, coef, lay: _Layout, chains=(), chain_coef=None) -> SlotModel:
    """Expand the template to the full iteration and build every window's copy counts and work."""
    T = len(slots)
    L, G, Lt, Gt = lay.L, lay.G, lay.Lt, lay.Gt
    nsub = 1 + max((s[3] for s in slots if len(s) == 4), default=0)
    Lg = (2 * L + 3) * nsub  # slots per group in the full model: F(0..L), H, B(L..0), nsub per use
    Ne = G * Lg + 1  # + tail
    mid = lay.mid_count
    V1 = coef.shape[1]
    C = len(CHANNELS)
    tb = []  # template block of each full-model block
    for b in range(Lt + 2):
        tb += [b] * (mid.get(b, 1))
    slot_index = {s: i for i, s in enumerate(slots)}

    def tgroup(ge: int) -> int:
        return ge if G <= 3 else (0 if ge == 0 else (2 if ge == G - 1 else 1))

    # the tie (template slot) of every full-model slot of one iteration
    tie = np.empty(Ne, dtype=np.int64)
    for ge in range(G):
        gt, off = tgroup(ge), ge * Lg
        for sub in range(nsub):
            for ell in range(L + 1):
                tie[off + ell * nsub + sub] = slot_index[(gt, "F", tb[ell], sub)]
                tie[off + (2 * L + 2 - ell) * nsub + sub] = slot_index[(gt, "B", tb[ell], sub)]
            tie[off + (L + 1) * nsub + sub] = slot_index[(gt, "H", Lt + 1, sub)]
    tie[Ne - 1] = T - 1
    period = np.bincount(tie, minlength=T).astype(float)

    # slot attributes (tail: phase 3) and block attributes as arrays, for vectorised expansion
    s_g = np.array([sl[0] if len(sl) == 4 else 0 for sl in slots])
    s_ph = np.array([{"F": 0, "B": 1, "H": 2}[sl[1]] if len(sl) == 4 else 3 for sl in slots])
    s_b = np.array([sl[2] if len(sl) == 4 else 0 for sl in slots])
    s_sub = np.array([sl[3] if len(sl) == 4 else 0 for sl in slots])
    nb = Lt + 2
    E_of = np.array([lay.expanded_layer(b) for b in range(nb)])
    cnt = np.array([mid.get(b, 1) for b in range(nb)])
    is_mid = np.array([b in mid for b in range(nb)])
    run = np.array(lay.run_of)

    def copies(a, b, blk, grp, few: bool = False):
        """Full-model slots (relative to the middle iteration) of the release a and deadline b of every copy of
        the template tasks (arrays: release, deadline, block, home group), and the task of each copy (`few`:
        only the copies near the ends of a repeated run and one in the middle, the others being the same)."""
        a, b, blk, grp = (np.asarray(v, dtype=np.int64) for v in (a, b, blk, grp))
        cl = cnt[blk]
        cg = np.where((G > 3) & (grp == 1), G - 2, 1)
        home = grp if G <= 3 else np.where(grp == 0, 0, np.where(grp == 1, 1, G - 1))
        parts = []
        for p in (a, b):
            it, sidx = np.divmod(p, T)
            it = it - 1
            gt, ph, bt, sub = s_g[sidx], s_ph[sidx], s_b[sidx], s_sub[sidx]
            ge = np.clip(home + (gt - grp), 0, G - 1)
            same = is_mid[blk] & (run[bt] == run[blk]) & (ph <= 1)
            ell0 = np.where(same, E_of[blk] + (bt - blk),
                            np.where(is_mid[bt], E_of[bt] + np.where(blk < bt, 0, cnt[bt] - 1), E_of[bt]))
            use = np.where(ph == 0, ell0, np.where(ph == 1, 2 * L + 2 - ell0, L + 1))
            base = np.where(ph == 3, it * Ne + Ne - 1, it * Ne + ge * Lg + use * nsub + sub)
            step = np.where(same, nsub * np.where(ph == 0, 1, -1), 0)
            gstep = np.where((cg > 1) & (ph < 3), Lg, 0)
            parts.append((base, step, gstep))
        if few:  # copy indices 0..4, the middle one, and the last five
            nl = np.where(cl <= 12, cl, 11)
            ng = np.where(cg <= 12, cg, 11)
        else:
            nl, ng = cl, cg
        per = nl * ng
        src_ = np.repeat(np.arange(len(a)), per)
        k = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
        jl, jg = k // ng[src_], k % ng[src_]
        if few:
            def unpick(j, n):
                return np.where(n <= 12, j, np.where(j < 5, j, np.where(j == 5, n // 2, n - 11 + j)))
            jl, jg = unpick(jl, cl[src_]), unpick(jg, cg[src_])
        (ra, rl, rg), (da, dl_, dg) = parts
        rr = ra[src_] + jl * rl[src_] + jg * rg[src_]
        dd = da[src_] + jl * dl_[src_] + jg * dg[src_]
        return rr, np.maximum(dd, rr), src_

    if items:
        rel_pos, dl_pos, src = copies([it[1] for it in items], [it[2] for it in items], [it[4] for it in items],
                                      [it[5] for it in items])
    else:
        rel_pos = dl_pos = src = np.zeros(0, np.int64)
    chan_of_item = np.array([it[3] for it in items], dtype=np.int64)
    total = np.zeros((C, V1))
    np.add.at(total, chan_of_item[src], coef[src])

    # the other iterations' copies (the steady state is periodic): shifted by one and two iterations
    rel3 = np.concatenate([rel_pos + k * Ne for k in range(3)])
    dl3 = np.concatenate([dl_pos + k * Ne for k in range(3)])
    src3 = np.concatenate([src] * 3)
    keep = (rel3 >= 0) & (rel3 < 3 * Ne)
    rel3, dl3, src3 = rel3[keep], dl3[keep], src3[keep]
    chan = chan_of_item[src3]
    onehot_cum = np.zeros((3 * Ne + 1, T))
    onehot_cum[1:] = np.cumsum(np.eye(T)[np.concatenate([tie] * 3)], axis=0)

    # long windows: both ends at slots of the first, last and the first and last repeated group, at layers that
    # are not repeated or at the first or last copy of a repeated layer
    grp_of = np.minimum(np.arange(Ne) // Lg, G - 1)
    use_of = (np.arange(Ne) % Lg) // nsub
    ell_of = np.where(use_of <= L + 1, use_of, 2 * L + 2 - use_of)
    edge_copy = np.zeros(Ne, dtype=bool)
    for m, c in mid.items():
        e0 = lay.expanded_layer(m)
        edge_copy |= (ell_of == e0) | (ell_of == e0 + c - 1)
    layer_rep = np.array([len(s) == 4 and s[2] in mid for s in slots])
    sub_of = np.arange(Ne) % nsub
    at = (~layer_rep[tie] | edge_copy) & np.isin(grp_of, [0, 1, G - 2, G - 1])
    # a long window starts where a weight use starts and ends where one ends (shorter ones are local windows)
    starts1 = np.union1d(np.nonzero(at & (sub_of == 0))[0], [Ne - 1])
    ends1 = np.union1d(np.nonzero(at & (sub_of == nsub - 1))[0], [Ne - 1])
    sreps = np.concatenate([starts1 + k * Ne for k in range(3)])
    ereps = np.concatenate([ends1 + k * Ne for k in range(3)])
    br = np.searchsorted(sreps, rel3, side="right") - 1  # last start <= release
    bd = np.searchsorted(ereps, dl3, side="left")  # first end >= deadline
    ok = (br >= 0) & (bd < len(ereps))
    H = np.zeros((len(sreps), len(ereps), C, V1))
    np.add.at(H, (br[ok], bd[ok], chan[ok]), coef[src3[ok]])
    H = H[::-1].cumsum(axis=0)[::-1].cumsum(axis=1)  # H[i, q]: tasks with br >= i and bd <= q
    wi, wq = [], []
    for i in range(len(starts1)):
        q = np.nonzero((ereps >= sreps[i]) & (ereps < sreps[i] + 2 * Ne))[0]
        wi.append(np.full(q.size, i))
        wq.append(q)
    wi, wq = np.concatenate(wi), np.concatenate(wq)
    reps_s, reps_e = sreps[wi], ereps[wq]
    # work released in a window (whatever its deadline): the queues run eagerly, so it competes with the
    # other direction of its link for the window's time
    relcum = np.zeros((3 * Ne + 1, C, V1))
    inside = rel3 < 3 * Ne
    np.add.at(relcum, (rel3[inside] + 1, chan[inside]), coef[src3[inside]])
    relcum = np.cumsum(relcum, axis=0)
    blocks_w = [H[wi, wq]]
    blocks_c = [onehot_cum[reps_e + 1] - onehot_cum[reps_s]]
    blocks_r = [relcum[reps_e + 1] - relcum[reps_s]]

    # short windows: up to LOCAL_SPAN consecutive slots, starting anywhere in the iteration
    span = dl3 - rel3
    for s_ in range(1, LOCAL_SPAN + 1):
        m = span < s_
        lo = np.maximum(dl3[m] - s_ + 1, 0)
        hi = np.minimum(rel3[m], Ne - 1)
        good = lo <= hi
        acc = np.zeros((Ne + 1, C, V1))
        np.add.at(acc, (lo[good], chan[m][good]), coef[src3[m][good]])
        np.add.at(acc, (hi[good] + 1, chan[m][good]), -coef[src3[m][good]])
        blocks_w.append(np.cumsum(acc, axis=0)[:Ne])
        blocks_c.append(onehot_cum[np.arange(Ne) + s_] - onehot_cum[np.arange(Ne)])
        blocks_r.append(relcum[np.arange(Ne) + s_] - relcum[np.arange(Ne)])

    # serial chains: one window per copy of each chain
    cw, cc, cl = [], [], []
    if len(chains):
        rr, dd, csrc = copies(*zip(*chains), few=True)
        sh = np.where(rr < 0, Ne, 0)
        rr, dd = rr + sh, dd + sh
        good = dd < 3 * Ne
        w = np.zeros((int(good.sum()), C, V1))
        w[:, C - 1, :] = chain_coef[csrc[good], :V1]
        cw.append(w)
        cc.append(onehot_cum[dd[good] + 1] - onehot_cum[rr[good]])
        cl.append(chain_coef[csrc[good], V1:])
        # the work the other queues take up in the chain's window, against which its transfers run
        blocks_r.append(relcum[dd[good] + 1] - relcum[rr[good]])
    n_other = sum(len(b) for b in blocks_w)
    blocks_w += cw
    blocks_c += cc
    work = np.concatenate(blocks_w)
    counts = np.concatenate(blocks_c)
    released = np.concatenate(blocks_r)
    links = np.concatenate([np.zeros((n_other, C))] + cl)
    # identical windows (the copies of a repeated slot, the chains of a repeated layer) are one constraint
    flat = np.concatenate([work.reshape(len(work), -1), links], axis=1)
    nonzero = np.abs(flat).sum(axis=1) > 0
    rng = np.random.default_rng(0)  # a fixed random projection of each window's data: equal rows, equal keys
    sig = counts @ rng.random(T) + np.round(flat, 3) @ rng.random(flat.shape[1])
    _, uniq = np.unique(np.round(sig[nonzero], 6), return_index=True)
    idx = np.nonzero(nonzero)[0][uniq]
    return SlotModel(slots=slots, gpu=gpu_t, period=period, counts=counts[idx], work=work[idx],
                     released=released[idx], total=total, links=links[idx], meta={"template_layers": Lt, "template_groups": Gt, "full_slots": Ne,
                                        "subslots": nsub, "windows": len(idx)})


class SlotModelError(RuntimeError):
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


def window_needs(sm: SlotModel, hw: HardwareProfile) -> tuple[np.ndarray, float]:
    """Seconds each window needs (the largest of its terms: each resource alone, both PCIe directions, a
    shared SSD array, a serial chain, a shared link's direction against the other running eagerly beside it),
    and the least iteration any resource's whole load allows."""
    terms, _ = window_terms(hw)
    lin = np.einsum("wcv,kc->wkv", sm.work, terms)[:, :, 0]  # (W, K): seconds needed by each term
    # a shared link's direction A against B running eagerly beside it: the smaller of two linear branches
    eager = eager_terms(hw)
    eag = np.zeros((len(sm.work), len(eager), 2))
    for p, (a, b, inv_solo, ka, kb) in enumerate(eager):
        eag[:, p, 0] = sm.work[:, a, 0] * (inv_solo + ka)
        eag[:, p, 1] = sm.work[:, a, 0] * inv_solo + sm.released[:, b, 0] * kb
    need = np.concatenate([lin, eag.min(axis=2)], axis=1).max(axis=1)
    need = np.maximum(need, chain_needs(sm, hw))
    return need, float((terms @ sm.total[:, 0]).max())


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
    need, thr = window_needs(sm, hw)
    T = len(sm.gpu)
    lp = pywraplp.Solver.CreateSolver("GLOP")
    lp.SuppressOutput()
    # dual simplex: rows added to an optimal basis leave it dual feasible, so each round re-solves from it (the
    # primal default also stalled, ABNORMAL, on 256 micro-batches with 17,000 copies of a slot in one window)
    lp.SetSolverSpecificParametersAsString("use_dual_simplex: true")
    D = [lp.NumVar(float(sm.gpu[t]), lp.infinity(), f"D{t}") for t in range(T)]
    period = lp.Sum([float(sm.period[t]) * D[t] for t in range(T)])
    lp.Add(period >= thr)
    lp.Minimize(period)
    rows: set[int] = set()
    d = sm.gpu.astype(float).copy()
    status = "FEASIBLE"
    for _ in range(max_rounds):
        viol = need - sm.counts @ d
        new = [int(w) for w in np.argsort(-viol)[:256] if viol[w] > tol * max(1.0, need[w]) and int(w) not in rows]
        if not new:
            status = "OPTIMAL"
            break
        for w in new:
            c = sm.counts[w]
            lp.Add(lp.Sum([float(c[t]) * D[t] for t in np.nonzero(c)[0]]) >= float(need[w]))
            rows.add(w)
        if lp.Solve() != pywraplp.Solver.OPTIMAL:
            raise SlotModelError("the slot model's LP did not solve (numerical trouble)")
        d = np.array([v.solution_value() for v in D])
    obj = max(float(sm.period @ d), thr)
    return SolverReport(status, obj, obj if status == "OPTIMAL" else 0.0, 0.0 if status == "OPTIMAL" else 1.0,
                        time.perf_counter() - t0, solver="GLOP LP", constraints=len(rows) + 1)


def predict_config(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SolverReport:
    """The slot model's prediction of one steady-state iteration of `cfg`, whose decisions are all made."""
    return solve_slots(build_slot_model(model, hw, cfg), hw)
