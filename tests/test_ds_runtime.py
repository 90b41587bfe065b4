"""DeepSpeed's gradient path as its ZeRO-3 code runs it (runtime deepspeed): gradients leave in buckets of
reduce_bucket_size elements, the last at the end of each backward, and the host waits for them before the
next micro-batch's forward; the final gradient is also copied to the optimizer's fp32 one."""

from __future__ import annotations

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core import schedules
from tierflow.planner.core.models import get_model
from tierflow.planner.core.opkinds import BWD, FWD, OFFLOAD_GRADS
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import build_graph, make_schedule


def _graph(runtime: str, batch: int = 4):
    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    cfg = make_schedule("horizontal", m, hw, batch=batch, micro_batch=1, seq=32,
                        placement=Placement.uniform("cpu"), runtime=runtime, iterations=1)
    return build_graph(m, hw, cfg).tasks


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


def test_a_full_bucket_leaves_during_the_backward(monkeypatch):
    layer = get_model("tiny-gpt").layer_params()
    monkeypatch.setattr(schedules, "DS_REDUCE_BUCKET_ELEMS", 2 * layer)  # two layers a bucket
    tasks = _graph("deepspeed")
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
    from tierflow.planner.io.dsconfig import parse_ds_config

    m, hw = get_model("tiny-gpt"), load_profile("rtx4090-lohan")
    zero = {"stage": 3, "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", **pipeline}}
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
    for r in reads[1:]:
        waits = {tasks[d].kind for d in r.deps if d >= 0
                 and (tasks[d].kind != WRITE_OPT_STATES or tasks[d].iteration == r.iteration)}
        # without pipeline_read a sub-group's states are read after the previous sub-group's step
        assert (ADAM in waits) != sched.ds_pipeline_read
        assert (READ_OPT_STATES in waits) == sched.ds_pipeline_read
        # without pipeline_write, after the previous sub-group's states were written back (this iteration)
        assert (WRITE_OPT_STATES in waits) != sched.ds_pipeline_write
    assert sched.to_dict().get("ds_pipeline_read", False) == sched.ds_pipeline_read


def test_pipelining_never_slows_the_step():
    from tierflow.planner.core.simulate import simulate_config

    times = []
    for pipeline in ({}, {"pipeline_read": True, "pipeline_write": True}):
        m, hw, _, sched = _ds_nvme(pipeline)
        times.append(simulate_config(m, hw, sched).iteration_s)
    assert times[1] <= times[0] * (1 + 1e-9)


def test_sub_groups_pack_blocks_in_model_order():
    assert schedules.ds_sub_groups([5, 5, 5, 5], 10) == [0, 0, 1, 1]
    assert schedules.ds_sub_groups([5, 20, 1, 1], 10) == [0, 0, 1, 1]
    assert schedules.ds_sub_groups([3, 3, 3], 100) == [0, 0, 0]


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

    # 16-bit gradient partitions for every parameter; 4 fp32 sub-group swap buffers; 5 x 1e8 16-bit params
    assert deepspeed_host_buffers_bytes(10**9, 10**8, False, False) == 2e9
    assert deepspeed_host_buffers_bytes(10**9, 10**8, False, True) == 2e9 + 4 * 4 * 1e8
    assert deepspeed_host_buffers_bytes(10**7, 10**9, True, True) == 2e7 + 4 * 4 * 1e7 + 5 * 1e8 * 2
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
