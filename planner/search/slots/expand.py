"""Phases 6 to 10 of the slot model, the expansion of the template to the full iteration: group mapping
(`full_iteration`), copies per block and group (`_copies`), the other iterations' copies and the running sums
(`_unroll`, `_running_sums`), the windows (`_long_windows`, `_local_windows`, `_chain_windows`), identical
ones merged (`_distinct_windows`); and `build_slot_model`, which runs every phase from the schedule to its
SlotModel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.search.slots.gather import ChainAnchor, SlotTemplate, slot_template
from tierflow.planner.search.slots.layout import CHANNELS, TAIL_SLOT, Layout, SlotModel, template_of
from tierflow.planner.search.slots.template import memory_edges, template_graphs

LOCAL_SPAN = 3  # slots of the short windows placed anywhere
_PHASE_CODE = {"F": 0, "B": 1, "H": 2}  # phase of a slot as a number in the vectorised expansion; 3: the tail
_TAIL_PHASE = 3


class FullIteration(NamedTuple):
    """The slots of one iteration of the full model (`full_iteration`)."""

    subslots: int  # slots per weight use
    slots_per_group: int  # Lg = (2 L + 3) uses (F 0..L, H, B L..0) of `subslots` slots each
    full_slots: int  # Ne = G * Lg + 1 (the tail)
    tie: np.ndarray  # (Ne,) the template slot each full-model slot is a copy of
    period: np.ndarray  # (T,) copies of each template slot in one iteration


def _template_group(group: int, G: int) -> int:
    """The template group that group `group` of the full model is a copy of: the first, middle or last."""
    return group if G <= 3 else (0 if group == 0 else (2 if group == G - 1 else 1))


def full_iteration(slots: list[tuple], lay: Layout) -> FullIteration:
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


def _slot_arrays(slots: list[tuple], lay: Layout) -> SlotArrays:
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
              group_copies: np.ndarray, arrays: SlotArrays, full: FullIteration, lay: Layout) -> CopyEnd:
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


def _copies(anchors, arrays: SlotArrays, full: FullIteration, lay: Layout, few: bool = False) -> Copies:
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


def _long_window_ends(slots: list[tuple], full: FullIteration, lay: Layout) -> tuple[np.ndarray, np.ndarray]:
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
                   full: FullIteration, lay: Layout, sums: RunningSums, V1: int) -> WindowRows:
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


def _expand(template: SlotTemplate, lay: Layout) -> SlotModel:
    """Expand the template to the full iteration and build every window's copy counts and work."""
    slots, items, item_work = template.slots, template.items, template.item_work
    T, C, V1 = len(slots), len(CHANNELS), item_work.shape[1]
    full = full_iteration(slots, lay)
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


def build_slot_model(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> SlotModel:
    """The slot model of `cfg` (every decision made: schedule, placement, swap count, alpha, prefetch)."""
    mt, ct, lay = template_of(model, cfg)
    graphs = template_graphs(mt, hw, ct, lay)
    edges = tuple(memory_edges(model, mt, hw, ct))
    sm = _expand(slot_template(graphs, ct, lay, edges), lay)
    # the runtime whose CPU Adam the windows' host-memory terms step at (terms.runtime_box), as the task
    # graph's meta["runtime"] tells the simulator
    sm.meta["runtime"] = cfg.runtime
    return sm
