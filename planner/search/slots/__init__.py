"""The slot model: the planner's prediction of one steady-state iteration of a fully decided plan.

The roofline and phase bounds of tierflow.planner.search.loads are exact about *how much* each resource works
but not about *when*: a transfer that must be done before a given layer computes cannot hide behind another
phase's compute, a tensor parked on the CPU cannot be fetched back before it has been offloaded, and each
queue runs its tasks in the schedule's order. The slot model keeps that timing at the granularity of the GPU's
weight uses (one block's compute steps in one phase, a "slot"): the iteration is the sequence of slots the GPU
runs, and every other task is given the slot in which it can start at the earliest (its release: after the GPU
step it depends on, after the tasks ahead of it in its queue and the tasks it depends on) and the slot by
whose end it must be done (its deadline: before the GPU step that needs it, before the tasks queued behind
it). Then, for every window of consecutive slots, each resource must do the work released and due within the
window in the time the window lasts (for the PCIe link as a whole and for a shared SSD array, both directions
together, at the duplex rates):

    sum_{s in window} D_s >= work_r(window) / rate_r        D_s >= GPU work of slot s

and the predicted iteration time is the least sum of the slot durations D_s that satisfies them all, a linear
program (`solve_slots`: GLOP, by constraint generation). A window constraint is the physical statement that
one resource cannot do more than its rate allows in that time; nothing else enters.

Serial chains (a task waits for the task ahead of it in its queue and for its dependencies on other resources,
e.g. read optimizer states -> deferred Adam -> fetch weights -> the layer's first step) give windows of their
own: from the slot the chain's first task is released in (after the GPU steps of that slot up to the one
releasing it) to the step it feeds (with the steps of that slot from it on), the window lasts at least the
chain. A transfer on a chain runs at its solo rate where the other direction of its link is idle and at the
duplex rate beside it; the other direction runs the work released in the window spread over it
(`chain_needs`).

The constraints are derived from the builder's own task graph of a *template*: the model with a few layers
(every run of identical layers - recomputed, then swapped - keeps `2 E + 1` of them, E = how far ahead the
schedule fetches), at most three groups of micro-batches, three iterations. The middle layer of each run
stands for all the layers the template leaves out, the middle group for all the middle groups: the template is
expanded back to the full iteration (a slot per block, phase and group of the real model, all the copies of a
middle layer or group sharing one duration variable), each template task repeated once per layer or group it
stands for at the slots that copy occupies. Windows end at the slots of layers and groups that are not
repeated (so a window holds every copy of a repeated layer or none), and windows of up to LOCAL_SPAN
consecutive slots anywhere (one copy each). Tasks of the template are matched to the full model's exactly: the
template is built by the same builder with the same rules, so a run's middle layer has the same tasks as every
layer of that run.

The code follows these steps in named phases (each a function taking and returning NamedTuples), one module
per stage, each importing only the ones before it: `layout` (the setup: channels, `template_of`, SlotModel);
`terms` (the rate terms of a window's need: `window_terms`, `eager_terms`, `chain_needs`, `dram_needs`);
`template` (the template's graph `template_graphs`, its slots `slot_grid`, the order its tasks wait in
`task_order`, each task's release and deadline slot `release_slots`, `deadline_slots`, `task_windows`);
`chains` (the serial chains: `step_shares`, `chain_heads`, `chains_into_steps`, `chains_into_tasks`);
`gather` (all of it gathered by `_template_items` and `slot_template`); `expand` (the expansion `_expand`:
group mapping `full_iteration`, copies per block and group `_copies`, the windows `_long_windows`,
`_local_windows`, `_chain_windows`, identical ones merged `_distinct_windows`; and `build_slot_model`); and
`lp` (`window_needs`, `solve_slots`, `predict_config`). This package re-exports the names its users import.
"""

from tierflow.planner.search.slots.expand import LOCAL_SPAN, build_slot_model, full_iteration
from tierflow.planner.search.slots.gather import slot_template
from tierflow.planner.search.slots.layout import (
    CHANNELS,
    SLOT_RESOURCES,
    TAIL_SLOT,
    SlotModel,
    Template,
    template_of,
    template_span,
)
from tierflow.planner.search.slots.lp import (
    SlotModelError,
    SolverReport,
    WindowNeeds,
    predict_config,
    solve_slots,
    window_needs,
)
from tierflow.planner.search.slots.template import (
    SlotKey,
    memory_edges,
    template_graphs,
    topological_by_queue,
)
from tierflow.planner.search.slots.terms import (
    EagerTerm,
    LinkPair,
    WindowTerms,
    chain_needs,
    dram_needs,
    eager_terms,
    window_terms,
)

__all__ = ["CHANNELS", "LOCAL_SPAN", "SLOT_RESOURCES", "TAIL_SLOT", "EagerTerm", "LinkPair", "SlotKey",
           "SlotModel", "SlotModelError", "SolverReport", "Template", "WindowNeeds", "WindowTerms",
           "build_slot_model", "chain_needs", "dram_needs", "eager_terms", "predict_config", "solve_slots",
           "template_of", "template_span", "window_needs", "window_terms",
           # the stages' parts that tests check one by one
           "full_iteration", "memory_edges", "slot_template", "template_graphs", "topological_by_queue"]
