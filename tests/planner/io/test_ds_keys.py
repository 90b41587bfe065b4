"""DeepSpeed config keys as DeepSpeed's code runs them (planner/io/deepspeed/keys.py): each modelled key moves
the simulation the way its mechanism says, by the amount its own inputs give; the key table of
docs/deepspeed.md is the code's; every classified key is sorted by the bridge as the table says."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tierflow.cli import main
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.memory import blocks_of
from tierflow.planner.core.models import get_model
from tierflow.planner.core.opkinds import READ_WEIGHTS, WRITE_OPT_STATES
from tierflow.planner.core.runtimes.deepspeed import ds_sub_groups
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.workload import precision_of
from tierflow.planner.io.deepspeed import keys as dskeys
from tierflow.planner.io.deepspeed.config import DsConfigError, largest_param_elems, parse_ds_config

ROOT = Path(__file__).resolve().parents[3]
TINY = get_model("tiny-gpt")
HW = load_profile("rtx4090-lohan")
SEQ = 32


def _nvme(**offload_param) -> dict:
    """ZeRO-Infinity, parameters and optimizer states on NVMe, one sub-group per decoder layer."""
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "sub_group_size": TINY.layer_params(),
                                  "offload_param": {"device": "nvme", "nvme_path": "/n", **offload_param},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}}


def _graph(data: dict):
    ds = parse_ds_config(data, "ds.json", TINY)
    cfg = ds.schedule(TINY, HW, seq=SEQ, iterations=2)
    return ds, cfg, build_graph(ds.trained(TINY), HW, cfg)


def _owned() -> list[int]:
    return [b.owned_params for b in blocks_of(TINY, 1, SEQ)]


# ---- max_in_cpu --------------------------------------------------------------------------------------------


def test_max_in_cpu_keeps_the_leading_whole_sub_groups_in_host_memory():
    owned = _owned()
    groups = ds_sub_groups(owned, TINY.layer_params())
    # room for the sub-groups of the embedding and the first two layers, and half of the next
    k = 3
    room = sum(n for n, g in zip(owned, groups) if g < groups[k]) + owned[k] // 2
    ds, _, g = _graph(_nvme(max_in_cpu=room))
    cached = {b for b, grp in enumerate(groups) if grp < groups[k]}
    assert ds.placement().weights.cpu == pytest.approx(sum(owned[b] for b in cached) / sum(owned))
    read = {t.block for t in g.tasks if t.kind == READ_WEIGHTS}
    assert read == set(range(len(owned))) - cached  # the cached blocks are never read from NVMe
    # their updated weights are not written back to NVMe either: the write-backs of a cached block carry
    # only its optimizer states
    states = {t.block: t.work for t in g.tasks if t.kind == WRITE_OPT_STATES and t.iteration == 0}
    w_bytes = precision_of(ds.trained(TINY)).compute_bytes * TINY.layer_params()
    assert states[k] - states[1] == pytest.approx(w_bytes)


def test_default_max_in_cpu_holds_a_small_model_whole_and_skips_every_nvme_weight_read():
    # tiny-gpt (a few million parameters) fits DeepSpeed's default max_in_cpu of 1e9 with its one sub-group
    data = _nvme()
    data["zero_optimization"]["sub_group_size"] = 1e9
    ds, cfg, g = _graph(data)
    assert ds.placement().weights.cpu == 1.0 and cfg.ds_param_swapper
    assert not [t for t in g.tasks if t.kind == READ_WEIGHTS]
    _, _, none_cached = _graph(_nvme(max_in_cpu=0))
    reads = sum(t.work for t in none_cached.tasks if t.kind == READ_WEIGHTS and t.iteration == 0)
    # the forward and the backward read every weight
    assert reads >= 2 * precision_of(TINY).compute_bytes * TINY.total_params() * 0.99


def test_caching_parameters_in_host_memory_never_slows_the_step():
    t = {}
    for room in (0, 10**9):
        ds = parse_ds_config(_nvme(max_in_cpu=room), "ds.json", TINY)
        t[room] = simulate_config(ds.trained(TINY), HW, ds.schedule(TINY, HW, seq=SEQ)).iteration_s
    assert t[10**9] <= t[0]


# ---- buffers and buckets -----------------------------------------------------------------------------------


def test_the_parameter_swapper_s_buffers_are_counted_in_host_memory():
    a = _graph(_nvme(max_in_cpu=0, buffer_count=5, buffer_size=2e7))[2].static_bytes["cpu"]
    b = _graph(_nvme(max_in_cpu=0, buffer_count=7, buffer_size=3e7))[2].static_bytes["cpu"]
    assert b - a == pytest.approx(precision_of(TINY).compute_bytes * (7 * 3e7 - 5 * 2e7))


def test_the_optimizer_swapper_s_buffers_are_counted_in_host_memory():
    data = _nvme(max_in_cpu=0)
    more = copy.deepcopy(data)
    more["zero_optimization"]["offload_optimizer"]["buffer_count"] = 9
    # fp32 buffers of the largest sub-group, counted at sub_group_size elements (dsruntime)
    largest = min(data["zero_optimization"]["sub_group_size"], TINY.total_params())
    extra = _graph(more)[2].static_bytes["cpu"] - _graph(data)[2].static_bytes["cpu"]
    assert extra == pytest.approx((9 - 4) * 4 * largest)


@pytest.mark.parametrize("contiguous", [True, False])
def test_the_gpu_gradient_bucket_follows_reduce_bucket_size_and_contiguous_gradients(contiguous):
    gpu = {}
    for bucket in (10**6, 3 * 10**6):
        data = _nvme()
        data["zero_optimization"].update(reduce_bucket_size=bucket, contiguous_gradients=contiguous)
        _, cfg, g = _graph(data)
        assert cfg.ds_reduce_bucket_elems == bucket
        gpu[bucket] = g.static_bytes["gpu"]
    bucket_bytes = precision_of(TINY).compute_bytes * 2 * 10**6
    assert gpu[3 * 10**6] - gpu[10**6] == pytest.approx(bucket_bytes if contiguous else 0.0)


def test_configs_deepspeed_stops_on_are_refused_with_one_line():
    gpt = get_model("gpt3-1.3b")
    big = largest_param_elems(gpt)
    assert big == gpt.vocab_size * gpt.hidden  # the embedding
    with pytest.raises(DsConfigError, match=f"buffer_size 100,000,000 .*\\({big:,} elements"):
        parse_ds_config(_nvme(), "ds.json", gpt)
    assert parse_ds_config(_nvme(buffer_size=big), "ds.json", gpt).param_buffer_elems == big
    with pytest.raises(DsConfigError, match="buffer_count 0"):
        parse_ds_config(_nvme(buffer_count=0), "ds.json", TINY)
    few = _nvme()
    few["zero_optimization"]["offload_optimizer"].update(buffer_count=3)
    with pytest.raises(DsConfigError, match="below the 4 swap buffers"):
        parse_ds_config(few, "ds.json", TINY)
    # pipelining over several sub-groups holds the next (read) and the previous (write) sub-group's buffers
    for pipes, need in (({"pipeline_read": True}, 8), ({"pipeline_read": True, "pipeline_write": True}, 12)):
        data = _nvme()
        data["zero_optimization"]["offload_optimizer"].update(pipes, buffer_count=need - 1)
        with pytest.raises(DsConfigError, match=f"below the {need} swap buffers"):
            parse_ds_config(data, "ds.json", TINY)
        data["zero_optimization"]["offload_optimizer"]["buffer_count"] = need
        assert parse_ds_config(data, "ds.json", TINY).opt_buffer_count == need


# ---- the classification and its table ----------------------------------------------------------------------


def _with_key(key: str, value: object) -> dict:
    data = _nvme(buffer_size=1e8)
    node = data
    *path, leaf = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


def test_every_classified_key_is_sorted_by_the_bridge_as_the_table_says():
    for row in dskeys.key_rows():
        value = {"modelled at DeepSpeed's default": "not-the-default"}.get(row.verdict, 1)
        if row.key in dskeys.MODELLED_KEYS:
            value = True if "contiguous" in row.key else 10**8
        if row.key == "gradient_clipping":
            value = 1.0
        ds = parse_ds_config(_with_key(row.key, value), "ds.json", TINY)
        line = ds.warning_line() or ""
        many = ds.warning_line(gpus=4) or ""
        named = row.key in line
        if row.verdict in ("not modelled", "modelled at DeepSpeed's default"):
            assert named, row.key
        else:
            assert not named, row.key
        assert (row.key in many) == (named or row.verdict == "no effect on one GPU"), row.key
        assert row.key not in ds.unknown


def test_the_docs_page_holds_the_generated_key_table():
    page = (ROOT / "docs" / "deepspeed.md").read_text()
    assert dskeys.key_table() in page, ("docs/deepspeed.md's key table is not "
                                        "planner/io/deepspeed/keys.py's: paste the output of "
                                        "dskeys.key_table() over it")


def test_the_warning_line_names_one_gpu_keys_only_for_several_gpus(tmp_path, capsys):
    data = _with_key("zero_optimization.reduce_scatter", True)
    ds = parse_ds_config(data, "ds.json", TINY)
    assert "reduce_scatter" not in (ds.warning_line() or "")
    assert "not modelled on 2 GPUs (no effect on one): zero_optimization.reduce_scatter" in ds.warning_line(2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    assert main(["simulate", "--ds-config", str(path), "--model", "tiny-gpt", "--hw", "rtx4090-lohan",
                 "--no-plan", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ds_config"]["no_effect_on_one_gpu"] == ["zero_optimization.reduce_scatter"]


def test_an_emitted_nvme_config_is_one_deepspeed_runs_and_reads_back_with_the_plan_s_weights():
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import make_schedule
    from tierflow.planner.io.deepspeed.config import ds_config_for_plan

    gpt = get_model("gpt3-1.3b")
    for cpu_share in (0.0, 0.5):
        weights = Split(gpu=0.0, cpu=cpu_share, ssd=1.0 - cpu_share)
        placement = Placement(weights=weights, **{k: Split(gpu=0.0, cpu=0.0, ssd=1.0)
                                                  for k in ("master", "adam_m", "adam_v", "grads")},
                              checkpoints=Split(gpu=1.0, cpu=0.0, ssd=0.0))
        cfg = make_schedule("horizontal", gpt, HW, batch=2, micro_batch=1, placement=placement)
        emitted = ds_config_for_plan(gpt, cfg).config
        assert emitted["zero_optimization"]["offload_param"]["buffer_size"] >= largest_param_elems(gpt)
        back = parse_ds_config(emitted, "emitted.json", gpt)  # not refused
        # DeepSpeed keeps whole leading sub-groups: at most the plan's share, less than one sub-group below it
        owned = [b.owned_params for b in blocks_of(gpt, 1, gpt.seq_len)]
        assert cpu_share - max(owned) / sum(owned) <= back.placement().weights.cpu <= cpu_share
