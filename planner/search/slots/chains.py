"""Phase 4 of the slot model, the template's serial chains: the GPU seconds of a slot around each of its steps
(`step_shares`), each task's share of a chain (`chain_vectors`), the longest chains ending at each task
(`chain_heads`), and the chains into the GPU steps and into the tasks that feed them (`chains_into_steps`,
`chains_into_tasks`)."""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

import numpy as np

from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.search.slots.layout import CHANNELS, NO_DEADLINE, SLOT_RESOURCES
from tierflow.planner.search.slots.template import SlotGrid, TaskOrder, TaskWindow


class GpuSteps(NamedTuple):
    """Where each GPU task of the template runs (`gpu_steps_of`; None for the other tasks)."""

    step: list  # task -> (iteration, step index) of its GPU step (Clock.nearest_step)
    slot: list  # task -> StepSlot of that step


def gpu_steps_of(tasks, grid: SlotGrid) -> GpuSteps:
    """The step and the slot of every GPU task."""
    step = [grid.clock.nearest_step(t.key) if t.resource == "gpu" else None for t in tasks]
    return GpuSteps(step, [grid.at_step(*s) if s is not None else None for s in step])


class StepShares(NamedTuple):
    """GPU seconds of a slot around each of its steps (`step_shares`), keyed by (iteration, step index)."""

    before_s: dict[tuple[int, int], float]  # the slot's steps up to and including this one
    after_s: dict[tuple[int, int], float]  # this step and the slot's steps after it


def step_shares(tasks, scale: np.ndarray, gpu_steps: GpuSteps, grid: SlotGrid) -> StepShares:
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


def chain_vectors(tasks, affine_s: np.ndarray) -> np.ndarray:
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
    vector: dict[int, np.ndarray]  # (V1 + C,) its chain vector (`chain_vectors`)
    resources: dict[int, int]  # the resources on it, a bit mask over RESOURCES


_NO_HEADS = ChainHeads({}, {}, {})  # of a GPU step (never changed)


def chain_heads(tasks, order: TaskOrder, release: list[int], gpu_steps: GpuSteps, shares: StepShares,
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
    vector: np.ndarray  # (V1 + C,) chain vector (`chain_vectors`)


def chains_into_steps(tasks, grid: SlotGrid, order: TaskOrder, gpu_steps: GpuSteps, shares: StepShares,
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


def chains_into_tasks(tasks, order: TaskOrder, deadline: list[int], heads: list[ChainHeads],
                       windows: list[TaskWindow]) -> list[Chain]:
    """Phase 4e: the chains through more than one resource (a single queue's window holds the others) that
    end at a task feeding a GPU step (such a chain holds every chain into that task), by its deadline."""
    chains = []
    for w in windows:
        i, ends = w.task, heads[w.task]
        if deadline[i] >= NO_DEADLINE or not any(tasks[q].resource == "gpu" for q in order.succs[i]):
            continue
        for first, mask in ends.resources.items():
            if mask & (mask - 1):
                chains.append(Chain(first, max(first, deadline[i]), w.block, w.home_group,
                                    ends.vector[first]))
    return chains
