"""The slot model's setup: its work channels, the template of a schedule (`template_of`: a few layers per run
of identical layers, at most three groups of micro-batches, three iterations), where the template's blocks and
groups stand in the full model (`Layout`), the slots per weight use (`subslots_per_use`), and the SlotModel
the phases build (see the package docstring, tierflow.planner.search.slots, for the whole model)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec

SLOT_RESOURCES = ("h2d", "d2h", "ssd_read", "ssd_write", "cpu")
CHANNELS = SLOT_RESOURCES + ("chain",)  # work channels of a window; "chain": seconds of one serial chain
TAIL_SLOT = ("tail",)  # the template's last slot: the optimizer after the last backward step (not overlapped)
NO_DEADLINE = 10**9  # the deadline slot of a task nothing waits for

# Notation (as in the package docstring): L layers and G groups of micro-batches of the full model, Lt and Gt
# of the template; T template slots (the tail last); S GPU steps per template iteration; Ne slots of one
# full-model iteration. "Unrolled" slots count over the template's three iterations (iteration * T + slot)
# or three full-model iterations (iteration * Ne + slot); the middle one is the iteration predicted. V1: the
# length of a task's work vector (1); C: len(CHANNELS).


@dataclass(frozen=True)
class Layout:
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
    layout: Layout  # where its blocks and groups stand in the full model


def template_span(cfg: ScheduleConfig) -> int:
    """Layers of a run the template keeps (2 E + 1, E: how many weight uses ahead the schedule fetches)."""
    E = max(cfg.prefetch_depth + 1, -(-(cfg.act_prefetch + 1) // cfg.group))
    return 2 * E + 1


def template_of(model: ModelSpec, cfg: ScheduleConfig) -> Template:
    """The template of `cfg`: a few layers per run of identical layers, at most three groups, three
    iterations."""
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
    return Template(mt, ct, Layout(L=L, G=G, Lt=Lt, Gt=Gt, mid_count=mid_count, run_of=tuple(run_of),
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


def subslots_per_use(cfg: ScheduleConfig) -> int:
    """Slots per weight use: its first act_prefetch steps one by one (the activations they need were fetched
    during the previous use, queued with that use's weight fetch), the rest of the use as one slot."""
    return min(cfg.group, cfg.act_prefetch + 1)
