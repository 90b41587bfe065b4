"""DeepSpeed's gradient path as its ZeRO-3 code runs it (runtime deepspeed): gradients leave in buckets of
reduce_bucket_size elements, the last at the end of each backward, and the host waits for them before the
next micro-batch's forward; the final gradient is also copied to the optimizer's fp32 one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.memory import schedule_memory
from tierflow.planner.core.models import get_model
from tierflow.planner.core.opkinds import BWD, FWD, OFFLOAD_GRADS, RECOMPUTE
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.runtimes.deepspeed import ds_sub_groups
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config


def _graph(runtime: str, batch: int = 4, **settings):
    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    cfg = make_schedule("horizontal", m, hw, batch=batch, micro_batch=1, seq=32,
                        placement=Placement.uniform("cpu"), runtime=runtime, iterations=1)
    return build_graph(m, hw, replace(cfg, **settings)).tasks


def _ancestors(tasks, tid: int) -> set[int]:
    seen, todo = set(), [tid]
    while todo:
        for d in tasks[todo.pop()].deps:
            if d >= 0 and d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_the_next_forward_waits_for_the_last_backward_s_gradients():
    tasks = _graph("deepspeed")
    for mb in range(1, 4):
        first_fwd = next(t for t in tasks if t.kind == FWD and t.mb == mb and t.block == 0)
        before = _ancestors(tasks, first_fwd.id)
        offloads = [t.id for t in tasks if t.kind == OFFLOAD_GRADS and
                    any(tasks[d].mb == mb - 1 for d in t.deps if d >= 0)]
        assert offloads and set(offloads) <= before
    # the ideal runtime lets the next forward start while the gradients still cross
    ideal = _graph("ideal")
    first_fwd = next(t for t in ideal if t.kind == FWD and t.mb == 1 and t.block == 0)
    assert not any(ideal[d].kind == OFFLOAD_GRADS for d in _ancestors(ideal, first_fwd.id))


def test_a_small_model_s_gradients_leave_in_the_epilogue():
    tasks = _graph("deepspeed")
    for t in tasks:
        if t.kind == OFFLOAD_GRADS:
            # every block's offload waits for the micro-batch's last backward step: the embedding's
            waits = [tasks[d] for d in t.deps if d >= 0]
            assert any(w.kind == BWD and w.block == 0 for w in waits), t.label


def test_a_full_bucket_leaves_during_the_backward():
    layer = get_model("tiny-gpt").layer_params()
    tasks = _graph("deepspeed", ds_reduce_bucket_elems=2 * layer)  # two layers a bucket
    early = [t for t in tasks if t.kind == OFFLOAD_GRADS and t.mb == -1
             and not any(tasks[d].kind == BWD and tasks[d].block == 0 for d in t.deps if d >= 0)]
    assert early  # some buckets close before the backward reaches the embedding


def test_the_boundary_adds_the_fp32_copy():
    d2h = sum(t.work for t in _graph("deepspeed", batch=2) if t.kind == OFFLOAD_GRADS)
    ideal = sum(t.work for t in _graph("ideal", batch=2) if t.kind == OFFLOAD_GRADS)
    fetch = ideal / 2 / 2  # 2 micro-batches x 2 B per parameter
    assert d2h == pytest.approx(ideal + 4 * fetch)


def _ds_nvme(pipeline: dict, sub_group_size: int | None = 1):
    """A ZeRO-Infinity config with the optimizer on NVMe; sub_group_size 1 (default here): one sub-group per
    block, None: DeepSpeed's default."""
    from tierflow.planner.io.deepspeed.config import parse_ds_config

    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    zero = {"stage": 3, "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 12, **pipeline}}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    ds = parse_ds_config(cfg, "ds.json", m)
    return m, hw, ds, ds.schedule(m, hw, seq=32)


@pytest.mark.parametrize("pipeline", [{}, {"pipeline_read": True}, {"pipeline_write": True},
                                      {"pipeline_read": True, "pipeline_write": True}])
def test_the_optimizer_swapper_pipelines_as_configured(pipeline):
    from tierflow.planner.core.opkinds import ADAM, READ_OPT_STATES, WRITE_OPT_STATES

    m, hw, ds, sched = _ds_nvme(pipeline)  # every block its own sub-group
    assert not any("pipeline" in x for x in ds.not_modelled)
    assert (sched.ds_pipeline_read, sched.ds_pipeline_write) == (bool(pipeline.get("pipeline_read")),
                                                                  bool(pipeline.get("pipeline_write")))
    tasks = build_graph(m, hw, sched).tasks
    reads = [t for t in tasks if t.kind == READ_OPT_STATES and t.iteration == 1]
    assert len(reads) >= 3
    adams = [t for t in tasks if t.kind == ADAM and t.iteration == 1]
    writes = [t for t in tasks if t.kind == WRITE_OPT_STATES and t.iteration == 1]
    for i, r in enumerate(reads[1:], start=1):
        waits = {d for d in r.deps if d >= 0}
        kinds = {tasks[d].kind for d in waits}
        # without pipeline_read a sub-group's states are read after the previous sub-group's step; with it
        # after the previous read, and the step two sub-groups back (pipelined_optimizer_swapper.py: the read
        # is issued in the previous sub-group's swap-in, after the swap-out before it)
        assert (adams[i - 1].id in waits) != sched.ds_pipeline_read
        assert (READ_OPT_STATES in kinds) == sched.ds_pipeline_read
        if sched.ds_pipeline_read and i >= 2:
            assert adams[i - 2].id in waits
        # without pipeline_write, after the previous sub-group's states were written back (this iteration);
        # with it, after an older one's: about one write in flight
        assert (writes[i - 1].id in waits) != sched.ds_pipeline_write
        back = 3 if sched.ds_pipeline_read else 2
        if sched.ds_pipeline_write and i >= back:
            assert writes[i - back].id in waits
    assert sched.to_dict().get("ds_pipeline_read", False) == sched.ds_pipeline_read


def test_pipelining_never_slows_the_step():
    from tierflow.planner.core.simulate import simulate_config

    times = []
    for pipeline in ({}, {"pipeline_read": True, "pipeline_write": True}):
        m, hw, _, sched = _ds_nvme(pipeline)
        times.append(simulate_config(m, hw, sched).iteration_s)
    assert times[1] <= times[0] * (1 + 1e-9)


def test_sub_groups_pack_blocks_in_model_order():
    assert ds_sub_groups([5, 5, 5, 5], 10) == [0, 0, 1, 1]
    assert ds_sub_groups([5, 20, 1, 1], 10) == [0, 0, 1, 1]
    assert ds_sub_groups([3, 3, 3], 100) == [0, 0, 0]


def test_one_sub_group_leaves_nothing_to_pipeline():
    from tierflow.planner.core.simulate import simulate_config

    m = get_model("tiny-gpt")
    times = {}
    for name, pipeline in (("serial", {}), ("pipelined", {"pipeline_read": True, "pipeline_write": True})):
        _, hw, ds, sched = _ds_nvme(pipeline, sub_group_size=m.total_params() + 1)
        assert sched.ds_sub_group_elems == m.total_params() + 1
        assert "zero_optimization.sub_group_size" not in " ".join(ds.not_modelled)
        times[name] = simulate_config(m, hw, sched).iteration_s
    assert times["pipelined"] == pytest.approx(times["serial"])


def test_deepspeed_s_own_host_buffers_are_counted():
    from tierflow.planner.core.dsruntime import deepspeed_host_buffers_bytes

    # 16-bit gradient partitions for every parameter; the fp32 gradient (every sub-group's with the states in
    # host memory, the largest sub-group's with them swapped); 4 fp32 sub-group swap buffers; 5 x 1e8 16-bit
    # params
    assert deepspeed_host_buffers_bytes(10**9, 10**8, False, False) == 2e9 + 4e9
    assert deepspeed_host_buffers_bytes(10**9, 10**8, False, True) == 2e9 + 4 * 1e8 + 4 * 4 * 1e8
    assert deepspeed_host_buffers_bytes(10**7, 10**9, True, True) == 2e7 + 4 * 1e7 + 4 * 4 * 1e7 + 5 * 1e8 * 2
    # trained in fp32: the gradient partitions and the parameter swapper's buffers in fp32 too
    assert deepspeed_host_buffers_bytes(10**7, 10**9, True, True, 4) == 4e7 + 4e7 + 4 * 4e7 + 5 * 1e8 * 4
    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    graphs = {}
    for runtime in ("deepspeed", "ideal"):
        cfg = make_schedule("horizontal", m, hw, batch=2, micro_batch=1, seq=32,
                            placement=Placement.uniform("ssd"), runtime=runtime, iterations=1)
        graphs[runtime] = build_graph(m, hw, cfg)
    extra = graphs["deepspeed"].static_bytes["cpu"] - graphs["ideal"].static_bytes["cpu"]
    assert extra == deepspeed_host_buffers_bytes(m.total_params(), 10**9, True, True)


def test_several_ranks_reduce_each_bucket_then_copy_it():
    from tierflow.planner.core.opkinds import REDUCE_SCATTER_GRADS

    m = get_model("tiny-gpt")
    hw = load_profile("rtx4090-lohan-4gpu")
    cfg = make_schedule("horizontal", m, hw, batch=4, micro_batch=1, seq=32,
                        placement=Placement.uniform("cpu"), gpus=2, iterations=1)
    tasks = build_graph(m, hw, cfg).tasks
    offs = [t for t in tasks if t.kind == OFFLOAD_GRADS]
    assert offs
    for o in offs:
        (rs,) = [tasks[d] for d in o.deps]
        assert rs.kind == REDUCE_SCATTER_GRADS and rs.block == o.block
        # the bucket is reduced at the epilogue: after the embedding's backward of the micro-batch
        assert any(tasks[d].kind == BWD and tasks[d].block == 0 for d in rs.deps)


def test_under_deepspeed_the_schedule_s_gradients_take_no_host_memory_of_their_own():
    """DeepSpeed's own buffers (counted as static) hold every gradient on the host: the graph's gradient
    offloads, spills and steps allocate and free none there, as they do under the ideal runtime."""
    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    place = Placement.from_dict({"grads": {"cpu": 0.5, "ssd": 0.5}, "master": {"cpu": 0, "ssd": 1},
                                 "adam_m": {"cpu": 0, "ssd": 1}, "adam_v": {"cpu": 0, "ssd": 1}})
    for runtime, expect in (("deepspeed", False), ("ideal", True)):
        cfg = make_schedule("horizontal", m, hw, batch=2, micro_batch=1, seq=32, placement=place,
                            runtime=runtime, iterations=1)
        grad_tasks = [t for t in build_graph(m, hw, cfg).tasks if t.tensor == "grads"]
        touches_host = any(tier == 1 for t in grad_tasks for tier, _ in t.mem_start + t.mem_end)
        assert touches_host is expect, runtime


def test_the_default_zero_infinity_placement_fits_the_host_it_was_made_for():
    """gpt3-13b on LoHan's box with 128 GiB of host memory: the memory model's host estimate for the default
    placement covers the simulated peak, so the run does not overflow (it did when the estimate counted the
    spilled gradients as gone while the graph held them on the host)."""
    m = get_model("gpt3-13b")
    hw = load_profile("rtx4090-lohan")
    hw = replace(hw, cpu=replace(hw.cpu, memory_gib=128))
    cfg = make_schedule("horizontal", m, hw, batch=64, micro_batch=2, iterations=2)
    res = simulate_config(m, hw, cfg)  # raises CapacityError on an overflow
    mem = schedule_memory(m, micro_batch=2, seq=cfg.seq, num_micro_batches=cfg.num_micro_batches,
                          group=cfg.group, alpha=cfg.alpha, optimizer_overlap=cfg.optimizer_overlap,
                          prefetch_depth=cfg.prefetch_depth, act_prefetch=cfg.act_prefetch,
                          runtime=cfg.runtime)
    est = mem.tier_bytes(cfg.placement, cfg.swap_layers, res.graph.capacity_bytes["cpu"])
    for tier in ("gpu", "cpu"):
        assert res.peak_bytes[tier] <= est[tier] <= res.graph.capacity_bytes[tier], tier


def test_deepspeed_s_host_waits_for_its_oldest_gradient_bucket():
    """With more than max_param_reduce_events (2) buckets in flight, the next backward step waits for the
    oldest bucket's last copy to the host (stage3.py param_reduce_events)."""
    m = replace(get_model("gpt3-13b"), num_layers=6)
    hw = load_profile("rtx4090-lohan")
    cfg = make_schedule("horizontal", m, hw, batch=1, micro_batch=1, seq=128, iterations=1,
                        placement=Placement.uniform("cpu"))
    tasks = build_graph(m, hw, cfg).tasks
    waits = [t for t in tasks if t.kind in (BWD, RECOMPUTE) and t.block < 7
             and any(tasks[d].kind == OFFLOAD_GRADS for d in t.deps)]
    # one block per bucket (a 13B layer is more than half a bucket); block b's gradient flushes block b+1's
    # bucket, the third in flight, so the host waits for block b+2's copy before the next step, block b-1's
    assert [t.block for t in waits] == [3, 2, 1, 0]
    for t in waits:
        (off,) = [tasks[d] for d in t.deps if tasks[d].kind == OFFLOAD_GRADS]
        assert off.block == t.block + 4


def _ds_param_cpu_graph(bucket: int, hw_name: str = "a100-80g-nvme", accumulation: int = 1):
    from tierflow.planner.io.deepspeed.config import parse_ds_config

    m = get_model("gpt3-125m")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
           "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"},
                                 "stage3_prefetch_bucket_size": bucket}}
    ds = parse_ds_config(cfg, "ds.json", m)
    hw = load_profile(hw_name)
    sc = ds.schedule(m, hw, seq=256, iterations=2)
    return ds.prefetch_depth(m), build_graph(m, hw, sc), hw, sc, m


def _forward_fetch_and_compute(g, it: int) -> tuple[dict, dict]:
    from tierflow.planner.core.opkinds import FETCH_WEIGHTS

    fetch, fwd = {}, {}
    for t in g.tasks:
        if t.iteration != it:
            continue
        if t.kind == FETCH_WEIGHTS:
            fetch.setdefault(t.block, t)  # the first fetch of a block in an iteration is its forward's
        elif t.kind == FWD and t.mb == 0:
            fwd.setdefault(t.block, t)
    return fetch, fwd


def test_deepspeed_holds_the_next_module_until_the_prefetched_bucket_has_landed():
    """One GPU, parameters in host memory, a prefetch bucket of d layers: the host synchronizes the
    all-gather stream at every module's wait, so the forward of layer b waits for the fetch of layer
    b + d - 1, issued with the bucket at the previous hook (runtimes.deepspeed._ds_drained_at_next_hook)."""
    layer = get_model("gpt3-125m").layer_params()
    depth, g, *_ = _ds_param_cpu_graph(3 * layer)
    assert depth == 3
    fetch, fwd = _forward_fetch_and_compute(g, 1)
    for b in range(2, 8):
        assert fetch[b + depth - 1].id in fwd[b].deps, b
    # one layer ahead: the fetch the forward needs anyway, no other
    depth1, g1, *_ = _ds_param_cpu_graph(1_000_000)
    assert depth1 == 1
    fetch1, fwd1 = _forward_fetch_and_compute(g1, 1)
    for b in range(2, 8):
        assert not {fetch1[c].id for c in fetch1 if c > b} & set(fwd1[b].deps)


def test_no_drain_on_a_host_device_whose_accelerator_resolves_dependencies_itself():
    depth, _, _, sc, m = _ds_param_cpu_graph(3 * get_model("gpt3-125m").layer_params())
    hw = load_profile("a100-80g-nvme").with_overrides({"gpu.host_cores": 2.0})
    g_host = build_graph(m, hw, sc)
    fetch, fwd = _forward_fetch_and_compute(g_host, 1)
    for b in range(2, 8):
        assert not {fetch[c].id for c in fetch if c > b} & set(fwd[b].deps)
    assert depth >= 3


def test_no_compute_waits_for_a_fetch_across_the_start_of_a_forward():
    """Each forward starts DeepSpeed's trace anew (reset_step waits for what is in flight): the drain holds
    compute only within one micro-batch's forward and backward."""
    from tierflow.planner.core.opkinds import FETCH_WEIGHTS

    _, g, *_ = _ds_param_cpu_graph(3 * get_model("gpt3-125m").layer_params(), accumulation=2)
    starts = [t.id for t in g.tasks if t.kind == FWD and t.block == 0]
    ahead = [(c, d) for c in g.tasks if c.resource == "gpu" for d in c.deps
             if d > c.id and g.tasks[d].kind == FETCH_WEIGHTS]
    assert ahead  # the drain is there
    for c, d in ahead:
        assert not any(c.id < s < d for s in starts), (c.kind, c.block, c.mb)


@pytest.mark.parametrize("runtime, steps_deepspeed", [("deepspeed", True), ("lohan", True), ("ideal", False)])
def test_each_runtime_steps_at_its_optimizer_s_rate(runtime, steps_deepspeed):
    """DeepSpeed's ZeRO-3 and LoHan run DeepSpeedCPUAdam, the ideal runtime its own AdamW: the optimizer's
    busy time is its parameters at that implementation's rate."""
    from tierflow.planner.core.dsruntime import as_runtime_steps

    hw = load_profile("a100-80g-nvme")
    # the host model: on a socket-bound host DeepSpeedCPUAdam's loop (28 B per parameter) outruns tierflow's
    # kernel (30 B), so the two rates differ and each runtime must pick its own
    assert hw.cpu.deepspeed_adam_gparams_per_s == pytest.approx(hw.cpu.adam_gparams_per_s * 30 / 28, rel=1e-2)
    seen = as_runtime_steps(hw, runtime).cpu.adam_gparams_per_s
    assert seen == (hw.cpu.deepspeed_adam_gparams_per_s if steps_deepspeed else hw.cpu.adam_gparams_per_s)
    bare = hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": None})
    assert as_runtime_steps(bare, runtime) is bare  # no rate for DeepSpeedCPUAdam: torch's rule stands


@pytest.mark.parametrize("family, runtime", [("horizontal", "deepspeed"), ("fuyou", "lohan"),
                                             ("horizontal", "ideal"), ("vertical", "ideal")])
def test_build_graph_and_simulate_config_step_each_runtime_at_its_rate(family, runtime):
    """No way to get the rate wrong: a graph built on the bare profile, one built on the box as the runtime
    sees it and simulate_config's own give every adam op the same duration, its parameters at the rate of
    the implementation the runtime runs (a profile whose two rates are far apart, so a graph stepped at the
    other rate would show); simulating that graph on the bare profile gives simulate_config's iteration."""
    from tierflow.planner.core.dsruntime import DEEPSPEED_ADAM_RUNTIMES, as_runtime_steps
    from tierflow.planner.core.opkinds import CPU_ADAM_KINDS
    from tierflow.planner.core.simulator import simulate_graph

    m = get_model("tiny-gpt")
    hw = load_profile("rtx4090-lohan")
    hw = hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": hw.cpu.adam_gparams_per_s / 3})
    cfg = make_schedule(family, m, hw, batch=4, micro_batch=1, seq=32, placement=Placement.uniform("cpu"),
                        runtime=runtime, iterations=2)

    def adam_s(graph) -> list[float]:
        return [t.work for t in graph.tasks if t.kind in CPU_ADAM_KINDS]

    bare, seen = build_graph(m, hw, cfg), build_graph(m, as_runtime_steps(hw, runtime), cfg)
    res = simulate_config(m, hw, cfg)
    assert adam_s(bare) and adam_s(bare) == adam_s(seen) == adam_s(res.graph)
    ds = runtime in DEEPSPEED_ADAM_RUNTIMES
    rate = hw.cpu.deepspeed_adam_gparams_per_s if ds else hw.cpu.adam_gparams_per_s
    stepped = sum(t.work for t in bare.tasks if t.kind in CPU_ADAM_KINDS and t.iteration == 1)
    assert stepped == pytest.approx(m.total_params() / (rate * 1e9), rel=1e-6)
    assert simulate_graph(bare, hw).iteration_s == pytest.approx(res.iteration_s, rel=1e-12)
    assert as_runtime_steps(as_runtime_steps(hw, runtime), runtime) == as_runtime_steps(hw, runtime)


@pytest.mark.parametrize("deepspeed_over_torch", [0.5, None])
def test_the_deepspeed_runtime_s_step_takes_its_time_at_deepspeed_s_adam_rate(deepspeed_over_torch):
    """At half torch's rate (a DeepSpeed step slower than the loop, as polaris' fitted one) the step takes
    longer; at the bundled profile's own rates (the host model's: DeepSpeedCPUAdam's loop moves 28 B per
    parameter against tierflow's 30) shorter, in both cases by the rates' ratio."""
    model, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    if deepspeed_over_torch is not None:
        hw = hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s":
                                hw.cpu.adam_gparams_per_s * deepspeed_over_torch})
    cfg = make_schedule("horizontal", model, hw, batch=4, micro_batch=1, seq=32,
                        placement=Placement.uniform("cpu"), runtime="deepspeed")
    same = hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": hw.cpu.adam_gparams_per_s})
    ds, ref = simulate_config(model, hw, cfg), simulate_config(model, same, cfg)
    # the host's queue also holds DeepSpeed's boundary gradient copy, at the same cost in both
    ratio = hw.cpu.adam_gparams_per_s / hw.cpu.deepspeed_adam_gparams_per_s
    assert ratio != pytest.approx(1, abs=0.05)  # 2 and 28/30 (the bundled rates, to 3 digits: 0.927)
    # the optimizer's share scales by the ratio; the copy's share f (under 20%) does not: the host's busy time
    # is ratio + f x (1 - ratio) of the reference's, between the ratio and 0.8 x ratio + 0.2 (which is not 1)
    lo, hi = sorted((ref.busy["cpu"] * ratio, ref.busy["cpu"] * (0.8 * ratio + 0.2)))
    assert lo <= ds.busy["cpu"] <= hi
    # a slower step lengthens the iteration; a faster one does not, and is mostly off the critical path here:
    # the iteration shortens by under half of what the step saves (1.8 of 6.0 us at the bundled rates)
    if ratio > 1:
        assert ds.iteration_s > ref.iteration_s
    else:
        saved_s = model.total_params() / (hw.cpu.adam_gparams_per_s * 1e9) * (1 - ratio)
        assert 0 <= ref.iteration_s - ds.iteration_s < 0.5 * saved_s


def test_pinned_gradient_buffers_round_to_a_power_of_two_and_peak_at_set_up():
    from tierflow.planner.core.dsruntime import (
        DsKnobs,
        deepspeed_host_buffers_bytes,
        deepspeed_setup_peak_bytes,
        pinned_alloc_bytes,
    )

    assert pinned_alloc_bytes(3e9) == 2.0 ** 32 and pinned_alloc_bytes(2.0 ** 30) == 2.0 ** 30
    pinned, pageable = DsKnobs(pin_memory=True), DsKnobs()
    # 175e9 bf16 gradient partitions: 350 GB pageable, 2^39 B pinned; states and parameters on NVMe
    n = 175 * 10**9
    assert deepspeed_host_buffers_bytes(n, pinned, True, True) - deepspeed_host_buffers_bytes(
        n, pageable, True, True) == pytest.approx(2.0 ** 39 - 2 * n)
    # states in host memory: every sub-group's fp32 gradient pinned on its own (1e9 elements: 4e9 -> 2^32 B)
    assert deepspeed_host_buffers_bytes(3 * 10**9, pinned, False, False) == pytest.approx(
        2.0 ** 33 + 3 * 2.0 ** 32)
    # at set-up the pageable original and its pinned copy live at once, beside the swappers' buffers
    peak = deepspeed_setup_peak_bytes(n, pinned, True, True)
    assert peak == pytest.approx(2 * n + 2.0 ** 39 + 4 * 4 * 10**9 + 5 * 10**8 * 2)
    assert deepspeed_setup_peak_bytes(n, pageable, True, True) == 0.0


def test_a_pinned_deepspeed_run_that_cannot_start_raises_capacity_error():
    from tierflow.planner.core.dsruntime import deepspeed_host_buffers_bytes, deepspeed_setup_peak_bytes
    from tierflow.planner.core.simulator import CapacityError

    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    cfg = make_schedule("horizontal", m, hw, batch=2, micro_batch=1, seq=32,
                        placement=Placement.uniform("ssd"), runtime="deepspeed", iterations=1)
    # sub-groups much smaller than the model: the set-up's pageable gradients outweigh the fp32 sub-group
    # buffer
    pinned = replace(cfg, ds_sub_group_elems=10**5, ds_pin_memory=True)
    n = m.total_params()
    static = deepspeed_host_buffers_bytes(n, pinned.ds_knobs, True, True)
    peak = deepspeed_setup_peak_bytes(n, pinned.ds_knobs, True, True)
    assert build_graph(m, hw, pinned).static_bytes["cpu"] == pytest.approx(static)
    assert peak > static
    # a host between the two: the steady state would fit, the set-up does not
    small = hw.with_overrides({"cpu.memory_gib": (static + peak) / 2 / 2**30, "cpu.reserved_gib": 0})
    with pytest.raises(CapacityError, match="set-up"):
        build_graph(m, small, pinned)
    build_graph(m, small, replace(pinned, ds_pin_memory=False))  # pageable: no set-up peak, fits
    # DeepSpeed's CPU accelerator does not page-lock: no set-up check on a host device
    host = small.with_overrides({"gpu.host_cores": 2})
    build_graph(m, host, pinned)
