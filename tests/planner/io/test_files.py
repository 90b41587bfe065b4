"""Files: plan files and traces are gzip-compressed when the name ends in .gz and every reader takes both (by
the content, not the name); large plans from the CLI go to NAME.gz; the JSON Schemas in docs/ accept every
bundled profile and a plan written by `tierflow simulate --write-plan`, and refuse broken ones."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml
from support.schemas import hw_validator, plan_validator, schemas

from tierflow import cli
from tierflow.hwprofiles import list_profiles, load_profile
from tierflow.hwprofiles.profile import _RULES
from tierflow.planner.core.jsonio import open_text, read_json, write_json
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.trace import write_chrome_trace
from tierflow.planner.io.compare import compare, load_measured
from tierflow.planner.io.planfile import (
    PlanError,
    load_plan,
    plan_from_graph,
    plan_to_dict,
    simulate_plan,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
GZIP_MAGIC = b"\x1f\x8b"


@cache
def tiny_plan():
    m, hw = get_model("tiny-gpt"), load_profile("rtx3090-desktop")
    cfg = make_schedule("vertical", m, hw, batch=4, micro_batch=1, iterations=2)
    g = build_graph(m, hw, cfg)
    return plan_from_graph(m, hw, cfg, g, predicted=simulate_config(m, hw, cfg, g))


# ---- gzip --------------------------------------------------------------------------------------------------


def test_plan_gzip_round_trip_is_exact(tmp_path):
    plan = tiny_plan()
    plain, packed = tmp_path / "plan.json", tmp_path / "plan.json.gz"
    w_plain, w_packed = write_plan(plan, plain), write_plan(plan, packed)
    assert w_plain.path == plain and not w_plain.compressed and w_plain.file_bytes == plain.stat().st_size
    assert w_packed.path == packed and w_packed.compressed and packed.read_bytes()[:2] == GZIP_MAGIC
    assert w_packed.json_bytes == w_plain.json_bytes == plain.stat().st_size
    # one op per line of repetitive JSON compresses well
    assert packed.stat().st_size < plain.stat().st_size / 4
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()  # the same text inside
    back = load_plan(packed)
    assert plan_to_dict(back) == plan_to_dict(load_plan(plain))
    assert simulate_plan(back).iteration_s == simulate_plan(plan).iteration_s
    # the content decides, not the name: a compressed file under a plain name and vice versa both load
    shutil.copy(packed, tmp_path / "renamed.json")
    shutil.copy(plain, tmp_path / "plain.json.gz")
    assert plan_to_dict(load_plan(tmp_path / "renamed.json")) == plan_to_dict(back)
    assert plan_to_dict(load_plan(tmp_path / "plain.json.gz")) == plan_to_dict(back)


def test_large_plans_go_to_name_gz(tmp_path):
    plan = tiny_plan()
    w = write_plan(plan, tmp_path / "p.json", compress_over_bytes=1000)
    assert w.path == tmp_path / "p.json.gz" and w.requested == tmp_path / "p.json"
    assert not (tmp_path / "p.json").exists() and w.path.read_bytes()[:2] == GZIP_MAGIC
    assert "wrote" in w.note() and "p.json.gz" in w.note() and "gzip" in w.note()
    small = write_plan(plan, tmp_path / "q.json", compress_over_bytes=10**9)
    assert small.path == tmp_path / "q.json" and small.note() is None
    assert (tmp_path / "q.json").read_bytes()[:1] == b"{"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json.gz", "q.json"]  # no temporary files left


def test_cli_compresses_a_large_plan_and_replays_it(tmp_path, monkeypatch, capsys):
    from tierflow.planner.io import planwrite

    monkeypatch.setattr(planwrite, "LARGE_PLAN_BYTES", 1000)
    out = tmp_path / "plan.json"
    argv = ["simulate", "--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--schedule", "vertical",
            "--batch", "4", "--micro-batch", "1", "--write-plan", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if not line.startswith("simulating [")]
    assert len(err) == 1 and f"wrote {out}.gz" in err[0] and f"instead of {out}" in err[0]
    assert f"wrote plan {out}.gz (run it with: tierflow run {out}.gz)" in captured.out
    assert not out.exists()
    assert cli.main(["simulate", "--plan", f"{out}.gz", "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert replay["iteration_s"] == pytest.approx(replay["predicted_in_plan"]["iteration_s"], rel=1e-12)


def test_damaged_gzip_plan_is_one_line_error(tmp_path):
    packed = tmp_path / "plan.json.gz"
    write_plan(tiny_plan(), packed)
    data = packed.read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(data[: len(data) // 2])
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    (tmp_path / "bad.json.gz").write_bytes(bytes(corrupt))
    for name in ("cut.json.gz", "bad.json.gz"):
        with pytest.raises(PlanError) as e:
            load_plan(tmp_path / name)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(tmp_path / name)), msg
    p = subprocess.run([sys.executable, "-m", "tierflow.cli", "simulate", "--plan",
                        str(tmp_path / "cut.json.gz")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert "gzip" in p.stderr


def test_trace_gzip_round_trip_and_compare_reads_both(tmp_path):
    plan = tiny_plan()
    res = simulate_plan(plan)  # a simulation's trace holds every op with its id, like a measured one
    plain, packed = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    write_chrome_trace(res, plain, name="t")
    write_chrome_trace(res, packed, name="t")
    assert packed.read_bytes()[:2] == GZIP_MAGIC and plain.read_bytes()[:1] == b"{"
    assert read_json(packed) == read_json(plain) == json.loads(plain.read_text())
    s1, e1 = load_measured(plain, len(plan.graph.tasks))
    s2, e2 = load_measured(packed, len(plan.graph.tasks))
    assert np.array_equal(s1, s2) and np.array_equal(e1, e2) and not np.isnan(s1).any()
    c = compare(plan, packed)
    assert c.to_dict() == compare(plan, plain).to_dict()
    assert c.measured_iteration_s == pytest.approx(c.predicted_iteration_s, rel=1e-9)  # its own prediction


def test_open_text_modes(tmp_path):
    write_json(tmp_path / "a.json.gz", {"x": [1, 2]})
    with open_text(tmp_path / "a.json.gz") as f:
        assert json.load(f) == {"x": [1, 2]}
    with pytest.raises(FileExistsError):
        open_text(tmp_path / "a.json.gz", "x")
    with pytest.raises(ValueError):
        open_text(tmp_path / "a.json.gz", "a")
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")


# ---- JSON Schemas ------------------------------------------------------------------------------------------


def test_schemas_are_valid_schemas():
    for schema in schemas():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", list_profiles())
def test_every_bundled_profile_validates(name):
    data = yaml.safe_load((ROOT / "hwprofiles" / f"{name}.yaml").read_text())
    hw_validator().validate(data)
    hw_validator().validate(load_profile(name).to_dict())  # and as tierflow writes it


def test_broken_profiles_do_not_validate():
    good = yaml.safe_load((ROOT / "hwprofiles" / "rtx4090-lohan.yaml").read_text())
    v = hw_validator()
    broken = []
    for path, value in [(("gpu", "gemm_efficiency"), 87), (("gpu", "memory_gib"), "24 GB"),
                        (("pcie", "generation"), 4.5), (("ssd", "rw_sharing"), "sometimes"),
                        (("ssd", "mixed_efficiency"), 0.2), (("price", "gpu_usd"), -1),
                        (("gpu", "memroy_gib"), 24)]:
        d = copy.deepcopy(good)
        d[path[0]][path[1]] = value
        broken.append(d)
    d = copy.deepcopy(good)
    del d["cpu"]["memory_gbps"]
    broken.append(d)
    d = copy.deepcopy(good)
    del d["ssd"]["read_gbps"]  # required while ssd.count > 0
    broken.append(d)
    for d in broken:
        assert not v.is_valid(d), d
    d = copy.deepcopy(good)
    d["ssd"] = {"count": 0}  # no SSD tier: the other keys may be left out
    assert v.is_valid(d)


def test_profile_schema_matches_the_loader_rules():
    """The schema names exactly the loader's keys, with its bounds (so the two cannot drift apart)."""
    hw_schema = schemas()[1]
    for section, rules in _RULES.items():
        sec = hw_schema["properties"][section]
        props = sec["properties"]
        when_used = sec.get("then", {}).get("properties", {})  # ssd: the bounds that hold while ssd.count > 0
        assert set(props) == set(rules), section
        for key, rule in rules.items():
            if rule.kind in ("number", "optional_number"):
                low_key = "minimum" if rule.low_inclusive else "exclusiveMinimum"
                low = {**props[key], **when_used.get(key, {})}[low_key]
                assert low == rule.low and props[key]["maximum"] == rule.high, f"{section}.{key}"


def test_plan_from_simulate_write_plan_validates_and_broken_ones_do_not(tmp_path):
    out = tmp_path / "plan.json"
    p = subprocess.run([sys.executable, "-m", "tierflow.cli", "simulate", "--model", "tiny-gpt", "--hw",
                        "rtx3090-desktop", "--schedule", "vertical", "--batch", "4", "--micro-batch", "2",
                        "--placement", '{"master": {"gpu": 0, "cpu": 0, "ssd": 1}}',
                        "--write-plan", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    v = plan_validator()
    v.validate(d)
    assert {"ssd_read", "ssd_write", "gpu", "cpu", "h2d", "d2h"} <= {op["resource"] for op in d["ops"]}
    # the model and decisions sections name exactly what tierflow writes
    plan_schema = schemas()[0]
    assert set(plan_schema["$defs"]["model"]["properties"]) == {f.name for f in dataclasses.fields(ModelSpec)}
    # (gpus and nodes: written for several ranks only)
    assert set(plan_schema["$defs"]["decisions"]["properties"]) == set(d["decisions"]) | {
        "gpus", "nodes", "ds_pipeline_read", "ds_pipeline_write", "ds_sub_group_elems",
        "ds_reduce_bucket_elems"}  # (and DeepSpeed's)

    def broken(edit) -> dict:
        b = copy.deepcopy(d)
        edit(b)
        return b

    cases = {
        "unknown top-level key": lambda b: b.update(extra=1),
        "wrong version": lambda b: b.update(version=99),
        "gpu op without seconds":
            lambda b: next(op for op in b["ops"] if op["resource"] == "gpu").pop("seconds"),
        "link op with seconds":
            lambda b: next(op for op in b["ops"] if op["resource"] == "h2d").update(seconds=1.0),
        "unknown resource": lambda b: b["ops"][0].update(resource="nvlink"),
        "bad mem effect": lambda b: b["ops"][0].update(mem=[["start", "hbm", 1.0]]),
        "negative bytes": lambda b: b["static_bytes"].update(cpu=-1),
        "alpha of 1": lambda b: b["decisions"].update(alpha=1.0),
        "hardware broken": lambda b: b["hardware"]["gpu"].update(gemm_efficiency=87),
        "model key missing": lambda b: b["model"].pop("hidden"),
        "no ops": lambda b: b.update(ops=[]),
    }
    for what, edit in cases.items():
        assert not v.is_valid(broken(edit)), what
