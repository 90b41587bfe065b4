"""The pinned transfer area (executor/tiers/arena.py): its size is the plan's peak of transfer buffers,
derived from the plan's memory effects and op bytes; its allocator hands out page-aligned views, coalesces
what comes back, and makes a new owner wait for the stream uses of the previous one."""

from __future__ import annotations

import threading
import time

import networkx as nx
import pytest
import torch
from support.runs import make_plan

from tierflow.executor.binding import Binding
from tierflow.executor.data import TokenData
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend, EmuEvent
from tierflow.executor.engine import Executor, Hyper
from tierflow.executor.tiers.arena import TransferArena, arena_bytes_for, plan_peak_bytes, planned_buffers
from tierflow.executor.tiers.direct_io import ALIGN
from tierflow.executor.tiers.ssd_store import SsdStore
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.core.graph import TIER_INDEX
from tierflow.planner.core.opkinds import ENTRY_TENSORS

CPU = TIER_INDEX["cpu"]
TRANSFER_KINDS = {f"{op}_{t}" for op in ("offload", "write", "read", "fetch") for t in ENTRY_TENSORS}
TRANSFER_KINDS |= {"read_weights", "fetch_weights"}


def queue_order(plan) -> list:
    """Independently of graph.plan_order (networkx): the ops after their dependencies and the ops ahead of
    them in their resource's queue, the smallest (key, id) first among the ready ones."""
    tasks = plan.graph.tasks
    g = nx.DiGraph()
    g.add_nodes_from(t.id for t in tasks)
    g.add_edges_from((d, t.id) for t in tasks for d in t.deps)
    for ids in plan.graph.resource_order().values():
        g.add_edges_from(zip(ids, ids[1:]))
    return [tasks[i] for i in nx.lexicographical_topological_sort(g, key=lambda i: (tasks[i].key, i))]


def effects_peak(plan) -> float:
    """Independently of planned_buffers: the plan's cpu-tier memory effects of the ops that stage transfers,
    plus the bytes of update_weights (its wire lives from the adam step it depends on), replayed in the
    plan's order (queue_order)."""
    tasks = plan.graph.tasks
    wire_from = {t.deps[0]: t.work for t in tasks if t.kind == "update_weights"}
    live = peak = 0.0
    for t in queue_order(plan):
        mine = t.kind in TRANSFER_KINDS
        live += sum(d for i, d in t.mem_start if i == CPU and mine) + wire_from.get(t.id, 0.0)
        peak = max(peak, live)
        live += sum(d for i, d in t.mem_end if i == CPU and mine)
        if t.kind == "update_weights":
            live -= t.work
    return peak


def _state(plan, backend, tmp_path, dtype=torch.bfloat16):
    (tmp_path / "ssd").mkdir(exist_ok=True)
    ssd = SsdStore(tmp_path / "ssd", backend=backend)
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, backend, dtype, ssd)
    return state, ssd


# weights on the CPU cross from the state's own pinned host range: no transfer buffer at all. Weights on the
# SSD use tiny LLaMA: tiny GPT's tied head reads the SSD part of block 0's vector where it overlaps wte, the
# plan a fraction of the head's bytes (the executor's ranges are what it reads; the plan's, an estimate)
CASES = [("tiny-gpt", "horizontal", "weights_cpu", 0), ("tiny-gpt", "vertical", "weights_cpu", 1),
         ("tiny-gpt", "horizontal", "states_ssd", 0), ("tiny-gpt", "vertical", "ckpt_ssd", 0),
         ("tiny-llama", "horizontal", "mix", 2), ("tiny-llama", "vertical", "mix", 2)]


@pytest.mark.parametrize(("model", "family", "placement", "swap"), CASES)
def test_the_area_is_the_peak_of_the_plans_transfer_buffers(model, family, placement, swap, tmp_path):
    plan = make_plan(model, family, placement, swap_layers=swap)
    state, ssd = _state(plan, PlainCpuBackend(), tmp_path)
    binding = Binding(plan, state.layout)
    tasks = plan.graph.tasks
    # byte-exact (page 1, bf16 as the plan counts) the buffers replay the plan's own memory effects; the
    # executor's element ranges differ from the plan's byte fractions by at most an element per buffer
    exact = plan_peak_bytes(tasks, planned_buffers(tasks, binding, state, 2, False, page=1))
    want = effects_peak(plan)
    assert abs(exact - want) <= 2 * 8, (exact, want)
    assert (want > 0) == (placement != "weights_cpu")
    # the area: the same replay with every buffer a whole number of pages, scaled to the compute dtype
    paged = plan_peak_bytes(tasks, planned_buffers(tasks, binding, state, 2, False))
    assert exact <= paged <= exact + ALIGN * len(planned_buffers(tasks, binding, state, 2, False))
    assert plan_peak_bytes(tasks, planned_buffers(tasks, binding, state, 4, False)) >= 2 * exact
    assert paged % ALIGN == 0 and arena_bytes_for(plan, binding, state, False) == paged
    ex = Executor(plan, state, TokenData.load(None, plan.model.vocab_size, seed=0), PlainCpuBackend(),
                  Hyper(), ssd)
    assert ex.arena.size_bytes == paged and ex.backend.arena is ex.arena
    ssd.close()


def test_gradient_wires_are_counted_only_where_copies_are_asynchronous(tmp_path):
    plan = make_plan("tiny-gpt", "vertical", "weights_cpu")
    state, ssd = _state(plan, PlainCpuBackend(), tmp_path)
    binding = Binding(plan, state.layout)
    wires = [b for b in planned_buffers(plan.graph.tasks, binding, state, 2, True) if "wire" in b.what]
    assert wires and not [b for b in planned_buffers(plan.graph.tasks, binding, state, 2, False)
                          if "wire" in b.what]
    offloads = {t.id: t.work for t in plan.graph.tasks if t.kind == "offload_grads"}
    assert {b.take_op for b in wires} == set(offloads)
    ssd.close()


def test_views_are_page_aligned_and_what_comes_back_coalesces():
    arena = TransferArena(PlainCpuBackend(), 4 * ALIGN)
    a = arena.take(10, torch.float32)
    b = arena.take_bytes(ALIGN + 1)
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0 and b.numel() == 2 * ALIGN
    assert arena.used_bytes() == 3 * ALIGN
    del a, b
    assert arena.used_bytes() == 0
    c = arena.take_bytes(4 * ALIGN)  # only possible once both ranges merged back into one
    assert c.numel() == 4 * ALIGN and arena.stats.overflows == 0
    d = arena.take_bytes(1)  # the area is full: served outside it, counted
    assert arena.stats.overflows == 1 and arena.stats.overflow_bytes == ALIGN \
        and not arena.contains(d.data_ptr())


def test_a_range_is_handed_out_again_only_after_the_streams_that_used_it():
    be = AdversarialCpuBackend()
    arena = TransferArena(be, ALIGN)
    be.arena = arena
    a = arena.take_bytes(ALIGN)
    assert arena.contains(a.data_ptr()) and not be._pageable(a)
    ev = EmuEvent(0, enqueued=True)  # a copy that reads `a`, queued on a stream, not done yet
    arena.note_use(a, ev)
    del a
    threading.Timer(0.3, ev.fire).start()
    t0 = time.perf_counter()
    b = arena.take_bytes(ALIGN)  # a host thread: synchronizes on the pending use
    assert time.perf_counter() - t0 >= 0.25 and arena.stats.waits == 1
    assert (b == 0xFF).all()  # the adversary hands it over as garbage (NaN bytes)


def test_an_fp32_plan_counts_its_own_bytes_and_sizes_the_same_area_as_a_bf16_plan(tmp_path):
    """A plan in fp32 (--precision fp32, as a CPU device's plans are) already counts 4 bytes per element: its
    buffers replay its own memory effects unscaled, and an fp32 run of it needs the same area as an fp32 run
    of the same schedule planned in bf16 (2-byte plan bytes, scaled by 2)."""
    from support.runs import BATCH, HW, MICRO, PLACEMENTS, SEQ

    from tierflow.planner.core.models import get_model
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.io.planfile import plan_from_graph

    model = get_model("tiny-gpt").with_precision("fp32")
    cfg = make_schedule("horizontal", model, HW, batch=BATCH, micro_batch=MICRO, seq=SEQ,
                        placement=PLACEMENTS["states_ssd"], iterations=2)
    plan = plan_from_graph(model, HW, cfg, build_graph(model, HW, cfg))
    state, ssd = _state(plan, PlainCpuBackend(), tmp_path, dtype=torch.float32)
    binding = Binding(plan, state.layout)
    tasks = plan.graph.tasks
    exact = plan_peak_bytes(tasks, planned_buffers(tasks, binding, state, 4, False, page=1,
                                                   plan_elem_bytes=4))
    assert exact > 0 and abs(exact - effects_peak(plan)) <= 4 * 8, (exact, effects_peak(plan))
    ssd.close()
    bf16 = make_plan("tiny-gpt", "horizontal", "states_ssd")
    state16, ssd16 = _state(bf16, PlainCpuBackend(), tmp_path, dtype=torch.float32)
    area16 = arena_bytes_for(bf16, Binding(bf16, state16.layout), state16, False)
    assert abs(arena_bytes_for(plan, binding, state, False) - area16) <= 4 * ALIGN
    ssd16.close()


@pytest.mark.parametrize("backend", ["cpu", "cpu-adversarial"])
def test_the_area_holds_what_the_plan_keeps_alive_when_its_queues_number_their_ops_apart(backend):
    """bench_dispatch's checkpoints-in-host plan numbers each queue from 0 (keys), so sorting all ops by key
    put the fetch of the second layer's pack (h2d, key 0) before its offload (d2h, key 1): the area came out
    one pack (36,864 bytes) while the plan keeps both layers' packs on the host until the backward, and every
    round pinned the rest outside it. Replayed in the plan's order the area holds both, and a run takes
    nothing outside it."""
    from tierflow.executor.calibration.dispatch import ITERATIONS, _executor, tiny_plan
    from tierflow.executor.device.factory import make_backend

    be = make_backend(backend)
    plan = tiny_plan("cpu", "checkpoints_host")
    tasks = plan.graph.tasks
    fetch = next(t for t in tasks if t.kind == "fetch_checkpoint" and t.block == 2)
    offload = next(t for t in tasks if t.kind == "offload_checkpoint" and t.block == 2 and t.mb == fetch.mb)
    assert fetch.key < offload.key and offload.id in fetch.deps  # what (key, id) got wrong
    order = plan.graph.plan_order()
    assert order.index(offload.id) < order.index(fetch.id)
    assert [t.id for t in queue_order(plan)] == order
    ex = _executor(plan, be, None)
    packs = [t for t in tasks if t.kind == "offload_checkpoint" and t.iteration == 0 and t.mb == 0]
    assert len(packs) == 2 and ex.arena.size_bytes >= 2 * 32960
    for r in range(2):
        ex.run_round(ITERATIONS, r * ITERATIONS)
    assert ex.arena.stats.takes > 0 and ex.arena.stats.overflows == 0, ex.arena.stats
