"""Tests for tierflow.planner.io.planfile: plan files round-trip exactly (same tasks, same queues, same
simulated time), every invalid plan is refused with a one-line PlanError naming the file, the key or op and
the problem, writes are atomic, and the example in docs/plan-format.md is a valid plan."""

from __future__ import annotations

import copy
import json
import os
import re
from functools import cache
from pathlib import Path

import networkx as nx
import pytest

from tierflow.api import simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.families import FAMILIES
from tierflow.planner.core.graph import LINKS, RESOURCES
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import (
    PLAN_FORMAT,
    PLAN_VERSION,
    PlanError,
    load_plan,
    plan_from_graph,
    plan_to_dict,
    simulate_plan,
    validate_plan_dict,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[3]
SRC = "plan.json"
SSD = Split(0.0, 0.0, 1.0)
HALF = Split(0.0, 0.5, 0.5)
# spills to the SSD so that every resource (gpu, cpu, h2d, d2h, ssd_read, ssd_write) has ops
MIXED = Placement(weights=HALF, master=SSD, adam_m=SSD, adam_v=SSD, grads=HALF, checkpoints=HALF)


@cache
def tiny(family: str = "vertical", mixed: bool = True, iterations: int = 2):
    m, hw = get_model("tiny-gpt"), load_profile("rtx3090-desktop")
    cfg = make_schedule(family, m, hw, batch=4, micro_batch=1, placement=MIXED if mixed else None,
                        iterations=iterations)
    return m, hw, cfg, build_graph(m, hw, cfg)


@cache
def _valid_text() -> str:
    m, hw, cfg, g = tiny()
    return json.dumps(plan_to_dict(plan_from_graph(m, hw, cfg, g, predicted=simulate_config(m, hw, cfg, g))))


def valid() -> dict:
    """A fresh valid plan dict (tiny-gpt, vertical, 2 iterations, SSD spills) to corrupt."""
    return json.loads(_valid_text())


def task_fields(graph) -> list[tuple]:
    return [(t.id, t.kind, t.resource, t.work, t.tensor, t.block, t.mb, t.iteration, list(t.deps),
             list(t.mem_start), list(t.mem_end)) for t in graph.tasks]


def refused(d: dict, *patterns: str) -> str:
    """`d` is refused with a one-line message naming the source and matching every pattern."""
    with pytest.raises(PlanError) as e:
        validate_plan_dict(d, SRC)
    return check_message(str(e.value), SRC, *patterns)


def check_message(msg: str, source: str, *patterns: str) -> str:
    assert "\n" not in msg, msg
    assert msg.startswith(f"{source}: "), msg
    assert len(msg) <= 200 + max(0, len(source) - 20), (len(msg), msg)
    assert re.search(r"\(.+\)$", msg), f"no fix in parentheses: {msg}"
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in {msg!r}"
    return msg


def op(d: dict, tid: int) -> dict:
    return next(o for o in d["ops"] if o["id"] == tid)


def ops_on(d: dict, resource: str) -> list[dict]:
    return sorted((o for o in d["ops"] if o["resource"] == resource), key=lambda o: o["order"])


# ---- round trip --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mixed", [True, False])
def test_round_trip_rebuilds_the_same_graph_and_time(tmp_path, family, mixed):
    m, hw, cfg, g = tiny(family, mixed)
    res = simulate_config(m, hw, cfg, g)
    plan = plan_from_graph(m, hw, cfg, g, predicted=res,
                           solver={"status": "OPTIMAL", "objective": 1.5, "best_bound": 1.5, "gap": 0.0,
                                   "wall_s": 0.25})
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    back = load_plan(path)
    assert isinstance(back, Plan)
    assert back.source == str(path)
    assert (back.model, back.hardware, back.config) == (m, hw, cfg)
    assert task_fields(back.graph) == task_fields(g)
    assert back.graph.resource_order() == g.resource_order()
    assert back.graph.static_bytes == g.static_bytes
    assert back.graph.capacity_bytes == g.capacity_bytes
    assert (back.graph.num_iterations, back.graph.num_blocks) == (g.num_iterations, g.num_blocks)
    assert back.predicted == json.loads(json.dumps(res.to_dict()))
    assert back.solver["status"] == "OPTIMAL"
    again = simulate_plan(back)
    assert again.iteration_s == pytest.approx(res.iteration_s, rel=1e-12)
    assert list(again.end_s) == pytest.approx(list(res.end_s), rel=1e-12)
    assert again.tokens_per_s == pytest.approx(res.tokens_per_s, rel=1e-12)
    assert again.model_tflops == pytest.approx(res.model_tflops, rel=1e-12)
    # writing the loaded plan again gives the same document (apart from nothing: it is deterministic)
    write_plan(back, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(path.read_text())


def test_plan_dict_layout():
    d = valid()
    assert (d["format"], d["version"]) == (PLAN_FORMAT, PLAN_VERSION)
    assert d["created_by"].startswith("tierflow")
    assert d["num_blocks"] == get_model("tiny-gpt").num_layers + 2
    m, hw, cfg, g = tiny()
    order = g.resource_order()
    assert {o["resource"] for o in d["ops"]} == set(RESOURCES) - {"net"}  # one rank: no collectives
    for o in d["ops"]:
        assert ("bytes" in o) == (o["resource"] in LINKS)
        assert ("seconds" in o) == (o["resource"] not in LINKS)
        assert order[o["resource"]][o["order"]] == o["id"]
        for when, tier, nbytes in o["mem"]:
            assert when in ("start", "end") and tier in ("gpu", "cpu", "ssd") and isinstance(nbytes, float)


def test_plan_file_is_strict_json_one_op_per_line(tmp_path):
    m, hw, cfg, g = tiny()
    write_plan(plan_from_graph(m, hw, cfg, g), tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith('{"id": ')) == len(g.tasks)


def test_non_finite_predictions_become_null(tmp_path):
    m, hw, cfg, g = tiny()
    write_plan(plan_from_graph(m, hw, cfg, g, solver={"status": "FEASIBLE", "best_bound": float("inf")}),
               tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").solver == {"status": "FEASIBLE", "best_bound": None}


# ---- atomic writes -----------------------------------------------------------------------------------------


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path):
    m, hw, cfg, g = tiny()
    path = tmp_path / "plan.json"
    path.write_text("old")
    write_plan(plan_from_graph(m, hw, cfg, g), path)
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
    assert load_plan(path).graph.resource_order() == g.resource_order()


def test_failed_write_keeps_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    m, hw, cfg, g = tiny()
    path = tmp_path / "plan.json"
    path.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_plan(plan_from_graph(m, hw, cfg, g), path)
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]
    assert path.read_text() == "old"


def test_an_invalid_plan_is_never_written(tmp_path):
    m, hw, cfg, g = tiny()
    bad = copy.deepcopy(g)
    bad.tasks[3].deps.append(len(bad.tasks) + 7)
    path = tmp_path / "plan.json"
    with pytest.raises(PlanError, match="does not exist"):
        write_plan(plan_from_graph(m, hw, cfg, bad), path)
    assert os.listdir(tmp_path) == []


# ---- validation: the file and the top level ----------------------------------------------------------------


def test_not_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"format": "tierflow-plan",\n "version": 1,,}')
    with pytest.raises(PlanError) as e:
        load_plan(path)
    check_message(str(e.value), str(path), "line 2", "not JSON")


def test_nan_is_not_strict_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(_valid_text().replace('"seconds": ', '"seconds": NaN, "x": ', 1))
    with pytest.raises(PlanError) as e:
        load_plan(path)
    check_message(str(e.value), str(path), "NaN")


def test_missing_file(tmp_path):
    with pytest.raises(PlanError) as e:
        load_plan(tmp_path / "nope.json")
    check_message(str(e.value), str(tmp_path / "nope.json"), "not found")


def test_top_level_not_an_object():
    with pytest.raises(PlanError) as e:
        validate_plan_dict([1, 2], SRC)  # type: ignore[arg-type]
    check_message(str(e.value), SRC, "expected a JSON object")


def test_wrong_format():
    d = valid()
    d["format"] = "tierflow-profile"
    refused(d, "format: ", "'tierflow-plan'", "not a tierflow plan")
    del d["format"]
    refused(d, "format: missing key")


def test_missing_version():
    d = valid()
    del d["version"]
    refused(d, "version: missing key", "versions 1")


@pytest.mark.parametrize("version", [3, 0, "1", True, None])
def test_unsupported_version(version):
    d = valid()
    d["version"] = version
    msg = refused(d, "version: unsupported version", "reads versions 1, 2")
    assert ("upgrade tierflow" in msg) == (version == 3)


@pytest.mark.parametrize("key", ["model", "hardware", "decisions", "static_bytes", "capacity_bytes",
                                 "num_iterations", "num_blocks", "ops"])
def test_missing_top_level_key(key):
    d = valid()
    del d[key]
    refused(d, f"{SRC}: {key}: missing key")


def test_optional_keys_may_be_left_out():
    d = valid()
    for key in ("created_by", "predicted", "solver"):
        d.pop(key, None)
    validate_plan_dict(d, SRC)


def test_unknown_top_level_key():
    d = valid()
    d["opps"] = []
    refused(d, r"\(top level\): unknown key 'opps'", "did you mean 'ops'")


def test_bad_sections():
    d = valid()
    d["predicted"] = [1]
    refused(d, "predicted: expected an object or null")
    d = valid()
    d["static_bytes"]["gpu"] = -1.0
    refused(d, r"static_bytes\.gpu: expected a non-negative number")
    d = valid()
    del d["capacity_bytes"]["ssd"]
    refused(d, r"capacity_bytes\.ssd: missing key")
    d = valid()
    d["num_iterations"] = 3
    refused(d, "num_iterations: 3 but decisions.iterations is 2")
    d = valid()
    d["num_blocks"] = 5
    refused(d, "num_blocks: 5 but the model has 4 layers")


# ---- validation: model, hardware, decisions ----------------------------------------------------------------


def test_model_that_does_not_rebuild():
    d = valid()
    d["model"]["hidden"] = -128
    refused(d, "model: ", "hidden", "positive integer", "fix the model section")
    d = valid()
    d["model"]["num_kv_heads"] = 3
    refused(d, "model: ", "num_kv_heads", "does not divide")
    d = valid()
    d["model"]["hiden"] = 128
    refused(d, "model: unknown key 'hiden'", "did you mean 'hidden'")
    d = valid()
    del d["model"]["vocab_size"]
    refused(d, r"model\.vocab_size: missing key")
    d = valid()
    d["model"]["qkv_bias"] = "yes"
    refused(d, r"model\.qkv_bias: expected bool")


def test_hardware_that_does_not_rebuild():
    d = valid()
    d["hardware"]["gpu"]["memory_gib"] = -1
    refused(d, r"hardware\.gpu\.memory_gib: must be > 0")
    d = valid()
    d["hardware"]["ssd"]["rw_sharing"] = "sometimes"
    refused(d, r"hardware\.ssd\.rw_sharing: must be one of")
    d = valid()
    d["hardware"] = "rtx3090-desktop"
    refused(d, "hardware: expected an object")


def test_decisions_that_do_not_rebuild():
    d = valid()
    d["decisions"]["placement"]["weights"] = {"gpu": 0.5, "cpu": 0.7, "ssd": 0.0}
    refused(d, r"decisions\.placement: ", "must sum to 1", "fix the placement")
    d = valid()
    d["decisions"]["placement"]["master"] = {"gpu": 1.0, "cpu": 0.0, "ssd": 0.0}
    refused(d, r"decisions\.placement: ", "same GPU fraction")
    d = valid()
    d["decisions"]["placement"]["optimizer"] = {"gpu": 0.0, "cpu": 1.0, "ssd": 0.0}
    refused(d, r"decisions\.placement: unknown tensor class 'optimizer'")
    d = valid()
    d["decisions"]["placement"]["grads"] = {"gpu": 0.0, "cpu": 1.0, "nvme": 0.0}
    refused(d, r"decisions\.placement\.grads: expected an object of gpu/cpu/ssd fractions")
    d = valid()
    del d["decisions"]["placement"]
    refused(d, r"decisions\.placement: missing key")
    d = valid()
    d["decisions"]["micro_batch"] = 3
    refused(d, r"decisions\.batch: batch 4 is not divisible by micro_batch 3")
    d = valid()
    d["decisions"]["family"] = "diagonal"
    refused(d, r"decisions\.family: unknown schedule family 'diagonal'")
    d = valid()
    d["decisions"]["alpha"] = 1.5
    refused(d, r"decisions\.alpha: must be within \[0, 1\)")
    d = valid()
    d["decisions"]["batch"] = "4"
    refused(d, r"decisions\.batch: expected int, got string")
    d["decisions"]["batch"] = {"n": 4}  # JSON names a mapping an object (hwprofiles.type_name says mapping)
    refused(d, r"decisions\.batch: expected int, got object")
    d["decisions"]["batch"] = None
    refused(d, r"decisions\.batch: expected int, got null")
    d = valid()
    d["decisions"]["grup"] = 2
    refused(d, "decisions: unknown key 'grup'", "did you mean 'group'")


# ---- validation: ops ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["kind", "resource", "tensor", "block", "mb", "iteration", "deps", "order",
                                   "mem"])
def test_op_missing_field(field):
    d = valid()
    del op(d, 7)[field]
    refused(d, f"op 7: missing field '{field}'")


def test_op_missing_work():
    d = valid()
    gpu = ops_on(d, "gpu")[0]
    del gpu["seconds"]
    refused(d, f"op {gpu['id']}: missing field 'seconds'")
    d = valid()
    link = ops_on(d, "h2d")[0]
    del link["bytes"]
    refused(d, f"op {link['id']}: missing field 'bytes'")
    d = valid()
    link = ops_on(d, "ssd_read")[0]
    link["seconds"] = link.pop("bytes")
    refused(d, f"op {link['id']}: a ssd_read op carries 'seconds'", "link ops bytes")


def test_op_missing_id():
    d = valid()
    del d["ops"][4]["id"]
    refused(d, r"ops\[4\]: missing field 'id'")


def test_unknown_op_key():
    d = valid()
    op(d, 2)["dependencies"] = []
    refused(d, "op 2: unknown key 'dependencies'")


def test_unknown_resource():
    d = valid()
    op(d, 5)["resource"] = "tpu"
    refused(d, "op 5: unknown resource 'tpu'", "gpu, h2d, d2h, ssd_read, ssd_write, cpu")


def test_unknown_tier_in_mem():
    d = valid()
    o = next(o for o in d["ops"] if o["mem"])
    o["mem"][0][1] = "nvme"
    refused(d, f"op {o['id']}: unknown tier 'nvme' in mem", "gpu, cpu, ssd")
    o["mem"][0] = ["middle", "gpu", 1.0]
    refused(d, f"op {o['id']}: mem effect at 'middle'")
    o["mem"][0] = ["start", "gpu"]
    refused(d, f"op {o['id']}: mem effect .* is not \\[when, tier, bytes\\]")


def test_negative_seconds_and_bytes():
    d = valid()
    gpu = ops_on(d, "gpu")[2]
    gpu["seconds"] = -1e-3
    refused(d, f"op {gpu['id']}: seconds must be a non-negative number, got -0.001")
    d = valid()
    link = ops_on(d, "d2h")[1]
    link["bytes"] = -4096.0
    refused(d, f"op {link['id']}: bytes must be a non-negative number, got -4096.0")


def test_dangling_dependency():
    d = valid()
    n = len(d["ops"])
    op(d, 9)["deps"].append(n + 100)
    refused(d, f"op 9: dangling dependency: op {n + 100} does not exist", f"0..{n - 1}")
    op(d, 9)["deps"][-1] = -1
    refused(d, "op 9: dangling dependency: op -1 does not exist")


def test_duplicate_ids():
    d = valid()
    d["ops"][11]["id"] = d["ops"][10]["id"]
    refused(d, f"op {d['ops'][10]['id']}: duplicate id")


def test_ids_out_of_range():
    d = valid()
    n = len(d["ops"])
    d["ops"][-1]["id"] = n + 3
    refused(d, rf"ops\[{n - 1}\]: id {n + 3} out of range", f"0..{n - 1}")


def test_dependency_cycle():
    d = valid()
    child = next(o for o in d["ops"] if o["deps"])
    parent = child["deps"][0]
    op(d, parent)["deps"].append(child["id"])  # parent <-> child
    msg = refused(d, "dependency cycle", "remove a dependency")
    named = int(re.search(r": op (\d+): ", msg).group(1))
    assert named in (parent, child["id"])


def test_long_dependency_cycle_names_an_op_on_it():
    d = valid()
    g = nx.DiGraph()
    g.add_edges_from((dep, o["id"]) for o in d["ops"] for dep in o["deps"])
    path = max((nx.shortest_path(g, 0, t) for t in nx.descendants(g, 0)), key=len)
    assert len(path) >= 5
    op(d, path[0])["deps"].append(path[-1])  # close the longest chain from op 0 into a cycle
    msg = refused(d, "dependency cycle")
    named = int(re.search(r": op (\d+): ", msg).group(1))
    assert named in path


def test_self_dependency_is_a_cycle():
    d = valid()
    op(d, 6)["deps"].append(6)
    refused(d, "op 6: dependency cycle 6 -> 6")


def test_same_order_twice_on_one_resource():
    d = valid()
    a, b = ops_on(d, "h2d")[3:5]
    b["order"] = a["order"]
    refused(d, f"same order {a['order']} on h2d as op", f"op ({a['id']}|{b['id']})")


def test_order_with_a_gap():
    d = valid()
    last = ops_on(d, "cpu")[-1]
    last["order"] += 5
    refused(d, f"op {last['id']}: order {last['order']} on cpu but position {last['order'] - 5} is empty")


def test_order_before_a_same_resource_dependency():
    d = valid()
    t = next(o for o in ops_on(d, "gpu") if any(op(d, dep)["resource"] == "gpu" for dep in o["deps"]))
    dep = next(op(d, x) for x in t["deps"] if op(d, x)["resource"] == "gpu")
    t["order"], dep["order"] = dep["order"], t["order"]
    refused(d, f"op {t['id']}: order {t['order']} on gpu is before its dependency op {dep['id']}",
            "queue every op after")


def test_orders_that_deadlock_across_resources():
    """h2d op `a` made to wait for an op `x` on another resource that itself waits for an h2d op queued after
    `a`: no dependency cycle, no same-resource inversion, yet the resources would wait on each other
    forever."""
    d = valid()
    g = nx.DiGraph()
    g.add_edges_from((dep, o["id"]) for o in d["ops"] for dep in o["deps"])
    h2d = ops_on(d, "h2d")
    found = None
    for i, a in enumerate(h2d):
        later = h2d[i + 1]
        below_a = nx.descendants(g, a["id"]) | {a["id"]}
        for x in sorted(nx.descendants(g, later["id"]) - below_a):
            if op(d, x)["resource"] != "h2d":
                found = a, x
                break
        if found:
            break
    assert found, "the tiny plan has such a pair"
    a, x = found
    a["deps"].append(x)
    refused(d, "the resource orders deadlock", "reorder the queues")


def test_iteration_and_block_out_of_range():
    d = valid()
    op(d, 3)["iteration"] = 2
    refused(d, "op 3: iteration 2 out of range", r"0\.\.1")
    d = valid()
    op(d, 3)["block"] = 6
    refused(d, "op 3: block 6 out of range", r"0\.\.5")
    d = valid()
    op(d, 3)["mb"] = -2
    refused(d, "op 3: mb -2 is not a micro-batch index")
    op(d, 3)["mb"] = 4
    refused(d, "op 3: mb 4 is not a micro-batch index", r"0\.\.3")


def test_bool_is_not_an_int():
    d = valid()
    op(d, 1)["order"] = True
    refused(d, "op 1: order True is not a queue position")


def test_messages_stay_short_for_long_paths(tmp_path):
    d = valid()
    d["model"]["name"] = "x" * 500
    d["model"]["num_kv_heads"] = 3
    with pytest.raises(PlanError) as e:
        validate_plan_dict(d, SRC)
    assert len(str(e.value)) <= 200


# ---- simulate_plan and the docs example --------------------------------------------------------------------


def test_simulate_plan_fills_tokens_and_flops():
    m, hw, cfg, g = tiny("horizontal")
    res = simulate_plan(plan_from_graph(m, hw, cfg, g))
    ref = simulate_config(m, hw, cfg, g)
    assert res.tokens_per_iteration == cfg.batch * cfg.seq
    assert res.hw_flops_per_iteration == ref.hw_flops_per_iteration > 0
    assert res.meta["schedule"] == cfg.to_dict()


def test_docs_example_is_a_valid_plan():
    text = (ROOT / "docs" / "plan-format.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    example = next(json.loads(b) for b in blocks if '"format": "tierflow-plan"' in b)
    validate_plan_dict(example, "docs/plan-format.md")
    assert example["decisions"]["family"] == "vertical"
    assert len(example["ops"]) == 6


# ---- the straight pass over the ops and the careful one agree ----------------------------------------------


def test_straight_and_careful_op_passes_give_the_same_tasks():
    """Validation parses the ops in one straight pass (plain JSON types only) and falls back to the careful
    field-by-field pass for anything else: both give the same tasks, and a value of another type that the
    careful pass accepts (an int subclass) is still accepted, through the fallback."""
    from tierflow.planner.io.planvalidate import _checked_ops, _OpBounds, _plain_ops

    d = valid()
    m, hw, cfg, g = tiny()
    bounds = _OpBounds(len(d["ops"]), d["num_iterations"], d["num_blocks"], cfg.num_micro_batches)
    straight, careful = _plain_ops(d["ops"], bounds), _checked_ops(SRC, d["ops"], bounds)
    assert straight is not None
    assert straight[1] == careful[1]
    assert task_fields(type(g)(straight[0], {}, {}, 1, 1)) == task_fields(type(g)(careful[0], {}, {}, 1, 1))
    assert [t.key for t in straight[0]] == [t.key for t in careful[0]]

    class Index(int):
        pass

    op(d, 3)["mb"] = Index(op(d, 3)["mb"])
    assert _plain_ops(d["ops"], bounds) is None
    validate_plan_dict(d, SRC)  # the careful pass accepts it
    op(d, 3)["deps"].append(True)  # a boolean is no op id: refused by the careful pass, with its message
    refused(d, "op 3", "dangling dependency")
