"""Phase 5 of the slot model: the template's items (its non-GPU tasks with their release and deadline slots)
and serial chains gathered from phases 1 to 4 (`_template_items`); the memory edges mapped to the template's
tasks, the items' work scaled to the full-model tasks they stand for and identical chains merged
(`slot_template`): what the expansion takes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.search.slots.chains import (
    Chain,
    chain_heads,
    chain_vectors,
    chains_into_steps,
    chains_into_tasks,
    gpu_steps_of,
    step_shares,
)
from tierflow.planner.search.slots.layout import CHANNELS, Layout, subslots_per_use
from tierflow.planner.search.slots.template import (
    TaskWindow,
    TemplateGraph,
    deadline_slots,
    gpu_seconds,
    release_slots,
    slot_grid,
    task_order,
    task_windows,
)


class TemplateItems(NamedTuple):
    """The template's slots and what happens in them (`_template_items`)."""

    slots: list[tuple]  # template slot -> SlotKey; the last one is TAIL_SLOT
    gpu_s: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    items: list[TaskWindow]  # the non-GPU tasks of the middle iteration
    chains: list[Chain]  # the serial chains of the middle iteration


def _template_items(g, cfg_t: ScheduleConfig, lay: Layout, affine_s: np.ndarray, ref_s: np.ndarray,
                    scale: np.ndarray, mem_edges: tuple = ()) -> TemplateItems:
    """Template slots and, for every non-GPU task of the middle iteration, its release and deadline slot
    (unrolled over the three iterations: iteration * T + slot), its anchor (block, home group) and resource;
    and the serial chains. Takes the template's graph g, each task's affine seconds (n, V1) and seconds at the
    reference placement (n,), how many full-model tasks each stands for (n,), and the memory edges (pairs of
    task ids: freeing, waiting)."""
    tasks = g.tasks
    grid = slot_grid(g, cfg_t)
    order = task_order(tasks, mem_edges)
    gpu_steps = gpu_steps_of(tasks, grid)
    release = release_slots(tasks, order, gpu_steps.slot)
    deadline = deadline_slots(tasks, order, gpu_steps.slot)
    items = task_windows(tasks, grid, release, deadline, cfg_t.group, lay.Gt)
    shares = step_shares(tasks, scale, gpu_steps, grid)
    vectors = chain_vectors(tasks, affine_s)
    heads = chain_heads(tasks, order, release, gpu_steps, shares, vectors, ref_s,
                         reach=4 * subslots_per_use(cfg_t) + 2)
    chains = (chains_into_steps(tasks, grid, order, gpu_steps, shares, heads, vectors.shape[1], lay.Gt)
              + chains_into_tasks(tasks, order, deadline, heads, items))
    gpu_s = gpu_seconds(tasks, gpu_steps.slot, scale, len(grid.slots))
    return TemplateItems(grid.slots, gpu_s, items, chains)


class ChainAnchor(NamedTuple):
    """Where a serial chain stands (its window and anchor): a Chain without its vector."""

    release_slot: int  # unrolled template slot its first task is released in
    deadline_slot: int  # unrolled template slot by whose end it must be done
    block: int  # template block it is anchored at
    home_group: int  # template group it is anchored at


class SlotTemplate(NamedTuple):
    """What the expansion takes from the template (`slot_template`)."""

    slots: list[tuple]  # template slot -> SlotKey; the last one is TAIL_SLOT
    gpu_s: np.ndarray  # (T,) GPU seconds of one copy of each template slot
    items: list[TaskWindow]  # the non-GPU tasks of the middle iteration
    item_work: np.ndarray  # (N, V1) work of each item (bytes or seconds), times the tasks it stands for
    chains: list[ChainAnchor]  # the distinct serial chains
    chain_work: np.ndarray  # (K, V1 + C) their chain vectors (`chain_vectors`)


def slot_template(graphs: TemplateGraph, ct: ScheduleConfig, lay: Layout,
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
    # the widths given, not -1: a template may have no chains (a plan with no transfer on a serial chain)
    V1 = scaled_work.shape[1]
    chain_work = np.array(list(distinct.values())).reshape(len(distinct), V1 + len(CHANNELS))
    item_work = scaled_work[[it.task for it in template.items]].reshape(len(template.items), V1)
    return SlotTemplate(template.slots, template.gpu_s, template.items, item_work,
                        [ChainAnchor(*k[:4]) for k in distinct], chain_work)
