"""Optimizer-state formats in the planner: the bytes of each format (optstates), the model field that carries
it (left out of plan files when it is the default), the memory model, the simulated SSD traffic, capacity
and the CLI flag."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from support.helpers import SSD, placement, profile

from tierflow.cli import main
from tierflow.planner.core.graph import Task
from tierflow.planner.core.memory import placed_bytes
from tierflow.planner.core.models import ModelError, get_model, model_dict
from tierflow.planner.core.opkinds import READ_OPT_STATES, WRITE_OPT_STATES
from tierflow.planner.core.optstates import (
    QUANT_BLOCK_ELEMS,
    STATE_FORMATS,
    quantized_bytes,
    state_format,
)
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.workload import precision_of
from tierflow.planner.io.planfile import load_plan, plan_from_graph, plan_to_dict, write_plan
from tierflow.planner.search.capacity import largest


def test_bytes_per_parameter_of_each_format():
    fp32, q, qb = (state_format(n) for n in STATE_FORMATS)
    assert (fp32.master_bytes, fp32.moment_bytes, fp32.state_bytes) == (4, 4, 12)
    assert q.moment_bytes == 1 + 4 / QUANT_BLOCK_ELEMS and q.master_bytes == 4
    assert qb.master_bytes == 2 and qb.moment_bytes == q.moment_bytes
    assert 6 < q.state_bytes < 6.1 and 4 < qb.state_bytes < 4.1
    with pytest.raises(ValueError):
        state_format("4bit")


def test_quantized_bytes_count_a_partial_block():
    assert quantized_bytes(QUANT_BLOCK_ELEMS) == QUANT_BLOCK_ELEMS + 4
    assert quantized_bytes(QUANT_BLOCK_ELEMS + 1) == QUANT_BLOCK_ELEMS + 1 + 8
    assert quantized_bytes(0) == 0


def test_model_field_is_validated_and_left_out_when_default():
    m = get_model("tiny-gpt")
    assert "optimizer_states" not in model_dict(m)
    assert m.with_optimizer_states("fp32") == m
    q = m.with_optimizer_states("8bit")
    assert model_dict(q)["optimizer_states"] == "8bit" and "8bit" in q.describe()
    with pytest.raises(ModelError):
        m.with_optimizer_states("int4")
    with pytest.raises(ModelError, match="16-bit"):
        m.with_precision("fp32").with_optimizer_states("8bit-bf16master")
    assert precision_of(q).adam_state_bytes == state_format("8bit").moment_bytes
    assert precision_of(m) is precision_of(m.with_optimizer_states(None))


@pytest.mark.parametrize("fmt", STATE_FORMATS)
def test_placed_bytes_count_the_format(fmt):
    m = get_model("gpt3-125m").with_optimizer_states(fmt)
    f = state_format(fmt)
    p = placement(weights=SSD, states=SSD)
    got = placed_bytes(m, p)
    assert got["ssd"] == pytest.approx(m.total_params() * (2 + f.state_bytes))
    assert got["cpu"] == 0


def _opt_state_bytes(model, kinds) -> float:
    hw = profile("rtx4090-lohan")
    cfg = make_schedule("vertical", model, hw, batch=4, micro_batch=2, alpha=0.0,
                        placement=placement(states=SSD), runtime="ideal")
    g = build_graph(model, hw, cfg)
    tasks: list[Task] = [t for t in g.tasks if t.kind in kinds and t.iteration == 0]
    return sum(t.work for t in tasks)


def test_simulated_ssd_traffic_of_the_states_shrinks_with_the_format():
    base = get_model("gpt3-125m")
    n = base.total_params()
    for fmt in STATE_FORMATS:
        f = state_format(fmt)
        read = _opt_state_bytes(base.with_optimizer_states(fmt), {READ_OPT_STATES})
        written = _opt_state_bytes(base.with_optimizer_states(fmt), {WRITE_OPT_STATES})
        assert read == pytest.approx(n * f.state_bytes)
        assert written == pytest.approx(n * f.state_bytes)


@pytest.mark.parametrize("fmt", ["fp32", "8bit-bf16master"])
def test_plan_file_records_the_format_only_when_not_fp32(tmp_path, fmt):
    m = get_model("tiny-gpt").with_optimizer_states(fmt)
    hw = profile("rtx3090-desktop")
    cfg = make_schedule("vertical", m, hw, batch=4, micro_batch=2, alpha=0.0)
    plan = plan_from_graph(m, hw, cfg, build_graph(m, hw, cfg))
    d = plan_to_dict(plan)
    assert ("optimizer_states" in d["model"]) == (fmt != "fp32")
    assert ("model.optimizer_states" in d["digest"]["fields"]) == (fmt != "fp32")
    write_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").model == m


def test_capacity_without_ssds_grows_with_smaller_states():
    hw = profile("rtx4090-lohan")
    params = {fmt: largest("gpt", hw, 16, 2048, False, verify=False, optimizer_states=fmt).params
              for fmt in STATE_FORMATS}
    assert params["fp32"] < params["8bit"] < params["8bit-bf16master"]


def test_cli_flag_and_bad_combination(capsys):
    rc = main(["simulate", "--model", "gpt3-125m", "--hw", "rtx3090-desktop", "--schedule", "vertical",
               "--batch", "4", "--micro-batch", "2", "--placement", "ssd", "--json"])
    fp32 = json.loads(capsys.readouterr().out)
    rc = main(["simulate", "--model", "gpt3-125m", "--hw", "rtx3090-desktop", "--schedule", "vertical",
               "--batch", "4", "--micro-batch", "2", "--placement", "ssd", "--json",
               "--optimizer-states", "8bit"])
    assert rc == 0
    q = json.loads(capsys.readouterr().out)
    assert q["link_bytes"]["ssd->cpu"] < fp32["link_bytes"]["ssd->cpu"]
    assert q["peak_bytes"]["ssd"] < fp32["peak_bytes"]["ssd"]
    rc = main(["simulate", "--model", "gpt3-125m", "--precision", "fp32", "--optimizer-states",
               "8bit-bf16master"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "16-bit" in err[0]


def test_compressed_states_count_their_fp32_workspace_where_the_optimizer_runs():
    from tierflow.planner.core.memory import schedule_memory

    kw = dict(micro_batch=1, seq=256, num_micro_batches=2, group=2, alpha=0.0, optimizer_overlap=True,
              prefetch_depth=1)
    m = get_model("gpt3-125m")
    assert schedule_memory(m, **kw).opt_workspace_bytes == 0
    q = schedule_memory(m.with_optimizer_states("8bit"), **kw)
    largest_block = max(m.embedding_params(), m.layer_params())
    assert q.opt_workspace_bytes == 12 * largest_block
    host = q.tier_bytes(placement(states=SSD), 0)
    gpu = Placement.uniform("gpu")
    bare = replace(q, opt_workspace_bytes=0.0)
    assert host["cpu"] - bare.tier_bytes(placement(states=SSD), 0)["cpu"] == q.opt_workspace_bytes
    on_gpu = q.tier_bytes(gpu, 0)["gpu"] - bare.tier_bytes(gpu, 0)["gpu"]
    assert on_gpu == pytest.approx(q.opt_workspace_bytes)


def test_plan_auto_picks_the_fastest_accepted_format(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["plan", "--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--batch", "8", "--time-limit", "5",
               "--optimizer-states", "auto", "--accept-states", "fp32,8bit-bf16master", "-o", str(out),
               "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    times = d["optimizer_states_auto"]
    assert list(times) == ["fp32", "8bit-bf16master"]
    chosen = min(times, key=lambda f: (times[f], list(times).index(f)))
    assert load_plan(out).model.optimizer_states == (None if chosen == "fp32" else chosen)
    assert d["predicted"]["iteration_s"] == times[chosen]
    assert main(["plan", "--model", "tiny-gpt", "--optimizer-states", "auto", "--accept-states", "int4"]) == 2
