"""Several GPUs and boxes (issue 19): the schedule builder's collectives and sharded bytes, plan-file fields and
their validation, `--gpus / --nodes` on the command line, and one rank (W = 1) exactly as before."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from helpers import CPU, SSD, placement, profile

from tierflow.planner.core.graph import HOST_LINKS, LINK_NAMES, NET, RESOURCES
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import (
    FAMILIES,
    ScheduleConfig,
    ScheduleError,
    build_graph,
    make_schedule,
)
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.workload import COMPUTE_BYTES, GRAD_WIRE_BYTES
from tierflow.planner.core.world import rank_capacity_bytes, shard_elems, shard_range
from tierflow.planner.io.cli import main
from tierflow.planner.io.planfile import (
    PlanError,
    load_plan,
    plan_from_dict,
    plan_from_graph,
    plan_to_dict,
    simulate_plan,
    write_plan,
)

TINY = get_model("tiny-gpt")


def box(gpus: int = 4, **more):
    return profile().with_overrides({"topology.gpu_count": gpus, **more})


def sched(family: str, gpus: int = 1, nodes: int = 1, hw=None, batch: int = 8, micro_batch: int = 2, **kw):
    hw = hw or box(max(gpus, 1), **({"network.gbps": 12.5} if nodes > 1 else {}))
    return hw, make_schedule(family, TINY, hw, batch=batch, micro_batch=micro_batch, gpus=gpus, nodes=nodes,
                             iterations=2, **kw)


def test_shards_cover_the_vector_once():
    for n in (1, 7, 8, 1000, 1001):
        for w in (1, 2, 3, 8):
            ranges = [shard_range(n, w, r) for r in range(w)]
            covered = [i for a, b in ranges for i in range(a, b)]
            assert covered == list(range(n))
            assert shard_elems(n, w) == max(b - a for a, b in ranges) == ranges[0][1] - ranges[0][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_has_no_collectives_and_writes_no_world(family):
    hw, cfg = sched(family, gpus=1)
    g = build_graph(TINY, hw, cfg)
    assert not [t for t in g.tasks if t.resource == NET]
    assert "gpus" not in cfg.to_dict() and "nodes" not in cfg.to_dict()
    assert g.resources() == tuple(r for r in RESOURCES if r != NET)
    res = simulate_config(TINY, hw, cfg, g)
    assert set(res.busy) == set(RESOURCES) - {NET}
    assert set(res.link_bytes) == {LINK_NAMES[k] for k in HOST_LINKS}
    d = res.to_dict()
    assert "world" not in d and "tokens_per_s_per_gpu" not in d
    # a topology in the profile does not change a one-GPU run: same graph, same time, same digest
    plain = profile()
    cfg1 = make_schedule(family, TINY, plain, batch=8, micro_batch=2, iterations=2)
    assert cfg1 == cfg
    g1 = build_graph(TINY, plain, cfg1)
    assert [(t.kind, t.resource, t.work, t.deps, t.key) for t in g1.tasks] == \
           [(t.kind, t.resource, t.work, t.deps, t.key) for t in g.tasks]
    assert simulate_config(TINY, plain, cfg1, g1).iteration_s == res.iteration_s
    fields = plan_to_dict(plan_from_graph(TINY, plain, cfg1, g1))["digest"]["fields"]
    assert not [k for k in fields if k.startswith(("decisions.gpus", "decisions.nodes", "hardware.topology",
                                                      "hardware.network"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_gather_weights_and_reduce_scatter_grads(family):
    W = 2
    p = placement(weights=SSD, states=CPU, grads=CPU, checkpoints=CPU)
    hw, cfg = sched(family, gpus=W, placement=p)
    # one rank with the micro-batches of one of the two: the same steps, whole blocks
    one = make_schedule(family, TINY, box(4), batch=4, micro_batch=2, iterations=2, placement=p)
    g1 = build_graph(TINY, box(4), one)
    g = build_graph(TINY, hw, cfg)
    assert cfg.num_micro_batches == 8 // (2 * W)
    tasks = g.tasks
    by_kind = Counter(t.kind for t in tasks)
    fetches = [t for t in tasks if t.kind == "fetch_weights"]
    gathers = [t for t in tasks if t.kind == "all_gather_weights"]
    assert len(gathers) == len(fetches) > 0
    blocks = {t.block: t.work for t in g1.tasks if t.kind == "fetch_weights"}  # full block bytes
    for f, a in zip(fetches, gathers):
        assert a.resource == NET and a.tensor == "weights" and a.deps == [f.id]
        assert (a.block, a.mb, a.iteration) == (f.block, f.mb, f.iteration)
        full = blocks[f.block]
        assert f.work == COMPUTE_BYTES * math.ceil(full / COMPUTE_BYTES / W)
        assert a.work == pytest.approx((W - 1) / W * full)
        # the full block's buffer is taken at the fetch
        assert [(tier, b) for tier, b in f.mem_start if tier == 0] == [(0, full)]
        users = [t for t in tasks if f.id in t.deps and t.resource == "gpu"]
        assert not users, "compute waits for the all-gather, not the fetch"
    assert all(any(a.id in t.deps for t in tasks if t.resource == "gpu") for a in gathers)
    # every gradient offload moves this rank's shard, after a reduce-scatter of the whole block's gradient
    offs = [t for t in tasks if t.kind == "offload_grads"]
    assert len(offs) == by_kind["reduce_scatter_grads"] == sum(1 for t in g1.tasks if t.kind == "offload_grads")
    full_grads = {t.block: t.work for t in g1.tasks if t.kind == "offload_grads"}
    for o in offs:
        (rs,) = [tasks[d] for d in o.deps]
        assert rs.kind == "reduce_scatter_grads" and rs.resource == NET and rs.block == o.block
        full = full_grads[o.block]
        assert rs.work == pytest.approx((W - 1) / W * full)
        assert o.work == GRAD_WIRE_BYTES * math.ceil(full / GRAD_WIRE_BYTES / W)
        assert tasks[rs.deps[0]].resource == "gpu"
    # Adam on the shard: half the CPU seconds of one rank... on half the CPU (the box's cores are shared by 2)
    adam1 = sum(t.work for t in g1.tasks if t.resource == "cpu")
    adam2 = sum(t.work for t in tasks if t.resource == "cpu")
    assert adam2 == pytest.approx(adam1, rel=0.01)
    # host memory and SSD capacity per rank: the box's halved; the GPU's whole
    cap = hw.tier_capacity_bytes
    assert g.capacity_bytes == {"gpu": cap["gpu"], "cpu": cap["cpu"] / W, "ssd": cap["ssd"] / W}
    res = simulate_config(TINY, hw, cfg, g)
    assert res.busy[NET] > 0 and res.link_bytes["gpu<->gpu"] > 0
    assert res.to_dict()["world"] == {"gpus": 2, "nodes": 1, "ranks": 2}
    assert res.tokens_per_iteration == 8 * cfg.seq  # the global batch


def test_gpu_optimizer_reduce_scatters_before_adam():
    p = Placement.uniform("gpu")
    hw, cfg = sched("vertical", gpus=2, placement=p)
    g = build_graph(TINY, hw, cfg)
    adams = [t for t in g.tasks if t.kind == "adam_gpu"]
    assert adams
    for a in adams:
        assert any(g.tasks[d].kind == "reduce_scatter_grads" for d in a.deps)
    # resident weights: no fetch, but every use still gathers the other ranks' shards
    assert not [t for t in g.tasks if t.kind == "fetch_weights"]
    assert [t for t in g.tasks if t.kind == "all_gather_weights"]
    simulate_config(TINY, hw, cfg, g)


def test_world_errors_are_one_line():
    with pytest.raises(ScheduleError, match=r"not divisible by 2 ranks x micro-batch 2 = 4"):
        sched("fuyou", gpus=2, batch=6)
    with pytest.raises(ScheduleError, match=r"has 1 \(use --gpus <= 1.*topology.gpu_count=2"):
        make_schedule("fuyou", TINY, profile(), batch=8, micro_batch=2, gpus=2)
    with pytest.raises(ScheduleError, match="no network"):
        make_schedule("fuyou", TINY, box(2), batch=8, micro_batch=2, gpus=2, nodes=2)
    with pytest.raises(ScheduleError, match="positive integer"):
        make_schedule("fuyou", TINY, box(2), batch=8, micro_batch=2, gpus=0)


def test_two_boxes_use_the_network():
    hw, cfg = sched("vertical", gpus=2, nodes=2, hw=box(2, **{"network.gbps": 12.5}))
    res = simulate_config(TINY, hw, cfg)
    assert res.world == {"gpus": 2, "nodes": 2, "ranks": 4}
    assert res.busy[NET] > 0
    # with a far slower network the collectives take longer
    slow = box(2, **{"network.gbps": 0.01})
    assert simulate_config(TINY, slow, cfg).busy[NET] * simulate_config(TINY, slow, cfg).iteration_s > \
        res.busy[NET] * res.iteration_s


# ---- plan files -------------------------------------------------------------------------------------------


def two_rank_plan_dict():
    hw, cfg = sched("fuyou", gpus=2)
    return plan_to_dict(plan_from_graph(TINY, hw, cfg, build_graph(TINY, hw, cfg)))


def test_plan_round_trip_carries_the_world(tmp_path):
    hw, cfg = sched("vertical", gpus=2)
    g = build_graph(TINY, hw, cfg)
    res = simulate_config(TINY, hw, cfg, g)
    path = tmp_path / "p.json"
    write_plan(plan_from_graph(TINY, hw, cfg, g, predicted=res), path)
    d = json.loads(path.read_text())
    assert (d["decisions"]["gpus"], d["decisions"]["nodes"]) == (2, 1)
    assert d["hardware"]["topology"]["gpu_count"] == 2
    assert NET in {o["resource"] for o in d["ops"]}
    assert all("bytes" in o for o in d["ops"] if o["resource"] == NET)
    plan = load_plan(path)
    assert (plan.config.gpus, plan.config.nodes) == (2, 1)
    assert simulate_plan(plan).iteration_s == res.iteration_s


def test_old_plan_without_world_loads_as_one_rank():
    hw, cfg = sched("fuyou", gpus=1)
    d = plan_to_dict(plan_from_graph(TINY, hw, cfg, build_graph(TINY, hw, cfg)))
    assert "gpus" not in d["decisions"]
    plan = plan_from_dict(d)
    assert (plan.config.gpus, plan.config.nodes, plan.config.ranks) == (1, 1, 1)
    assert ScheduleConfig.from_dict(d["decisions"]).ranks == 1


@pytest.mark.parametrize("edit, where", [
    (lambda d: d["decisions"].update(gpus=8), "decisions.gpus: 8 GPUs per box, but the hardware section has 2"),
    (lambda d: d["decisions"].update(gpus=0), "decisions.gpus: must be >= 1"),
    (lambda d: d["decisions"].update(gpus=1.5), "decisions.gpus: expected int"),
    (lambda d: d["decisions"].update(nodes=2), "decisions.nodes: 2 boxes, but the hardware section has no network"),
    (lambda d: d["decisions"].update(batch=6), "decisions.batch: batch 6 is not divisible by 2 ranks"),
    (lambda d: d["decisions"].update(gpus=1, batch=4), "a collective (resource net) in a plan of one rank"),
])
def test_plan_world_validation(edit, where):
    d = two_rank_plan_dict()
    edit(d)
    with pytest.raises(PlanError) as e:
        plan_from_dict(d, "p.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("p.json: ")
    assert where in msg


# ---- command line -----------------------------------------------------------------------------------------


def test_cli_simulate_gpus_writes_a_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["simulate", "--model", "tiny-gpt", "--set", "topology.gpu_count=2", "--gpus", "2", "--schedule",
               "fuyou", "--batch", "8", "--micro-batch", "2", "--json", "--write-plan", str(out)])
    assert rc == 0
    j = json.loads(capsys.readouterr().out)
    assert j["world"] == {"gpus": 2, "nodes": 1, "ranks": 2}
    assert j["tokens_per_s_per_gpu"] == pytest.approx(j["tokens_per_s"] / 2)
    assert j["hw_tflops_per_gpu"] == pytest.approx(j["hw_tflops"] / 2)
    plan = load_plan(out)
    assert plan.config.gpus == 2
    assert any(t.kind == "all_gather_weights" for t in plan.graph.tasks)


def test_cli_json_of_one_gpu_reports_the_world(capsys):
    rc = main(["simulate", "--model", "tiny-gpt", "--schedule", "vertical", "--batch", "8", "--micro-batch", "2",
               "--json"])
    assert rc == 0
    j = json.loads(capsys.readouterr().out)
    assert j["world"] == {"gpus": 1, "nodes": 1, "ranks": 1}
    assert j["tokens_per_s_per_gpu"] == j["tokens_per_s"]
    assert "net" not in j["busy"]


def test_cli_too_many_gpus_is_one_line(capsys):
    rc = main(["simulate", "--model", "tiny-gpt", "--gpus", "2", "--schedule", "fuyou", "--batch", "8",
               "--micro-batch", "2"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--set topology.gpu_count=2" in err


def test_rank_capacity():
    hw = box(4)
    assert rank_capacity_bytes(hw, 1) == hw.tier_capacity_bytes
    assert rank_capacity_bytes(hw, 4)["cpu"] == hw.tier_capacity_bytes["cpu"] / 4


def test_two_rank_plan_validates_against_the_schema(tmp_path):
    from test_files import plan_validator

    d = two_rank_plan_dict()
    v = plan_validator()
    assert v.is_valid(d), next(iter(v.iter_errors(d))).message
    bad = json.loads(json.dumps(d))
    bad["decisions"]["gpus"] = 0
    assert not v.is_valid(bad)


# ---- profiles ---------------------------------------------------------------------------------------------


def test_bundled_multi_gpu_boxes():
    from tierflow.hwprofiles import load_profile

    lohan4 = load_profile("rtx4090-lohan-4gpu")
    one = load_profile("rtx4090-lohan")
    assert (lohan4.gpu_count, lohan4.topology.p2p, lohan4.network) == (4, "host", None)
    # the same host as the one-GPU box: only the GPUs (and their price) differ
    for section in ("gpu", "pcie", "cpu", "ssd"):
        assert getattr(lohan4, section) == getattr(one, section), section
    assert one.topology is None and one.gpu_count == 1 and "topology" not in one.to_dict()
    dgx = load_profile("dgx-a100-8gpu")
    assert (dgx.gpu_count, dgx.topology.p2p, dgx.topology.p2p_gbps) == (8, "nvlink", 300)
    assert dgx.network.gbps == 200
    assert dgx.summary().startswith("8x A100")


@pytest.mark.parametrize("key, value, fragment", [
    ("topology.gpus_per_switch", 8, "must be <= topology.gpu_count (4)"),
    ("topology.p2p", "infiniband", "must be one of 'nvlink', 'pcie', 'host'"),
    ("topology.gpu_count", 0, "must be >= 1"),
    ("topology.p2p_gbps", 0, "must be > 0"),
    ("network.gbps", -1, "must be > 0"),
])
def test_bad_topology_is_one_line(key, value, fragment):
    from tierflow.hwprofiles import ProfileError, load_profile

    with pytest.raises(ProfileError) as e:
        load_profile("rtx4090-lohan-4gpu").with_overrides({key: value})
    assert "\n" not in str(e.value) and key in str(e.value) and fragment in str(e.value)


def test_topology_section_needs_every_key(tmp_path):
    import yaml

    from tierflow.hwprofiles import ProfileError, load_profile

    d = load_profile("rtx4090-lohan-4gpu").to_dict()
    del d["topology"]["p2p"]
    path = tmp_path / "box.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ProfileError, match=r"topology.p2p: missing key"):
        load_profile(str(path))
