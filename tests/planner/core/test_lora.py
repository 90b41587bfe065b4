"""LoRA in the planner (planner/core/lora.py): the adapters' parameters against PEFT's, the frozen base's
bytes and FLOPs, the schedules' ops (SSD reads only, one GPU optimizer step per layer), the plan file
(version 2) and the commands' flags."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from tierflow.api import simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.lora import LoraConfig, LoraConfigError, parse_targets
from tierflow.planner.core.memory import adapter_gpu_bytes, placed_bytes
from tierflow.planner.core.models import ModelError, ModelSpec, get_model, model_dict
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import ScheduleError, build_graph, make_schedule
from tierflow.planner.core.workload import layer_cost, model_flops_per_token
from tierflow.planner.io.planfile import PlanError, load_plan, plan_from_graph, write_plan

LORA = LoraConfig(8, alpha=16, dropout=0.0)


def test_config_checks_and_canonical_targets():
    c = LoraConfig(4, targets=("v_proj", "q_proj"))
    assert c.targets == ("q_proj", "v_proj") and c.scaling == 4.0
    assert LoraConfig.from_dict(c.to_dict()) == c
    for bad in (dict(rank=0), dict(rank=4, alpha=0), dict(rank=4, dropout=1.0),
                dict(rank=4, targets=("qkv",)), dict(rank=4, targets=())):
        with pytest.raises(LoraConfigError):
            LoraConfig(**bad)
    assert parse_targets("attention") == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ModelError, match="lora"):
        ModelSpec(**{**model_dict(get_model("tiny-llama")), "lora": {"rank": 4, "bogus": 1}})


def test_adapter_params_equal_peft():
    """The planner's count of the adapters' parameters is PEFT's on the same LLaMA (GQA, gated MLP)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    m = get_model("tiny-llama")
    cfg = transformers.LlamaConfig(hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
                                   num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                                   num_key_value_heads=m.num_kv_heads, vocab_size=m.vocab_size)
    for targets in (LoraConfig(8).targets, ("q_proj", "v_proj"), ("down_proj",)):
        hf = transformers.LlamaForCausalLM(cfg)
        lm = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
        trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
        assert m.with_lora(LoraConfig(8, targets=targets)).adapter_params() == trainable


def test_frozen_flops_and_bytes():
    m = get_model("llama2-7b")
    ml = m.with_lora(LORA)
    full, lora = layer_cost(m, 1, 512), layer_cost(ml, 1, 512)
    base = sum(g.flops for g in full.fwd_gemms)
    adapters = sum(g.flops for g in lora.fwd_gemms) - base
    assert adapters == pytest.approx(2 * 512 * ml.layer_adapter_params())
    # the backward: the base's input gradient only, the adapters' two GEMMs, attention twice
    assert lora.bwd_flops == pytest.approx(base + 2 * adapters + 2 * lora.attn_fwd_flops)
    assert full.bwd_flops == pytest.approx(2 * full.fwd_flops)
    assert (lora.owned_params, lora.grad_params, lora.fetch_params) == (ml.layer_adapter_params(),) * 2 + (
        m.layer_params(),)
    # a third fewer model FLOPs for the base's GEMMs (4 instead of 6 per parameter)
    assert model_flops_per_token(ml, 512) < model_flops_per_token(m, 512) * 0.7
    # placed: the base in 2 bytes where the placement puts it, nothing else; adapters on the GPU
    on_ssd = Placement(weights=Split(gpu=0, cpu=0, ssd=1))
    placed = placed_bytes(ml, on_ssd)
    assert placed["ssd"] == 2 * m.total_params() and placed["cpu"] == 0
    assert placed["gpu"] == adapter_gpu_bytes(ml) == 18 * ml.adapter_params()


def _graph(model, hw, family, placement=None, **kw):
    cfg = make_schedule(family, model, hw, batch=4, micro_batch=1, iterations=2, placement=placement, **kw)
    return cfg, build_graph(model, hw, cfg)


@pytest.mark.parametrize("family", ["horizontal", "fuyou", "vertical", "block"])
def test_schedule_reads_the_ssds_only(family):
    """With the base on the SSDs, a LoRA plan reads it and writes nothing there; its optimizer is one
    adam_gpu per layer and iteration; no gradient leaves the GPU. The same full fine-tuning writes."""
    hw = load_profile("rtx3090-desktop")
    m = get_model("tiny-llama")
    on_ssd = Placement(weights=Split(gpu=0, cpu=0, ssd=1))
    _, g = _graph(m.with_lora(LORA), hw, family, on_ssd)
    kinds = [t.kind for t in g.tasks]
    assert kinds.count("adam_gpu") == 2 * m.num_layers
    assert not {"offload_grads", "adam", "adam_deferred", "write_opt_states", "read_opt_states",
                "write_grads", "update_weights"} & set(kinds)
    assert not [t for t in g.tasks if t.resource == "ssd_write"]
    assert [t for t in g.tasks if t.kind == "read_weights"]
    r = simulate_config(m.with_lora(LORA), hw, _graph(m.with_lora(LORA), hw, family, on_ssd)[0])
    assert r.link_bytes["cpu->ssd"] == 0 and r.link_bytes["ssd->cpu"] > 0
    full_on_ssd = Placement.uniform("ssd")
    if family != "horizontal":
        rf = simulate_config(m, hw, _graph(m, hw, family, replace(full_on_ssd, grads=Split()),
                                           runtime="ideal")[0])
        assert rf.link_bytes["cpu->ssd"] > 0


def test_lora_is_faster_where_compute_binds():
    """Compute-bound (vertical, base in host memory): the backward without weight gradients is shorter."""
    hw = load_profile("rtx4090-lohan")
    m = get_model("llama2-7b")
    times = {}
    for name, mm in (("full", m), ("lora", m.with_lora(LORA))):
        cfg = make_schedule("vertical", mm, hw, batch=8, micro_batch=2, seq=1024, iterations=2,
                            runtime="ideal")
        times[name] = simulate_config(mm, hw, cfg).iteration_s
    # the base's GEMMs 3 passes instead of 4 (forward, recompute, input gradient); the adapters' thin GEMMs
    # move their inputs and outputs through memory (about 10% of a 2048-token forward of LLaMA-2 7B)
    assert times["lora"] < 0.93 * times["full"]


@pytest.mark.parametrize("family", ["horizontal", "fuyou", "vertical"])
def test_several_ranks_all_reduce_the_adapters(family):
    """Data parallel LoRA on 2 ranks: the frozen base all-gathered as full fine-tuning's weights, one
    all_reduce_grads per layer and iteration (a ring: twice (W - 1) / W of the fp32 adapter gradient) before
    that layer's adam_gpu, which steps the whole adapters; nothing reduce-scattered, no SSD write."""
    hw = load_profile("rtx3090-desktop").with_overrides({"topology.gpu_count": 2})
    ml = get_model("tiny-llama").with_lora(LORA)
    cfg, g = _graph(ml, hw, family, Placement(weights=Split(gpu=0, cpu=1, ssd=0)), gpus=2)
    reduces = [t for t in g.tasks if t.kind == "all_reduce_grads"]
    assert sorted((t.iteration, t.block) for t in reduces) == [(i, b) for i in range(2)
                                                                for b in range(1, ml.num_layers + 1)]
    grad_bytes = 4 * ml.layer_adapter_params()
    assert all(t.resource == "net" and t.work == pytest.approx(grad_bytes) for t in reduces)
    adam = {(t.iteration, t.block): t for t in g.tasks if t.kind == "adam_gpu"}
    for t in reduces:
        assert t.id in adam[(t.iteration, t.block)].deps
    assert [t for t in g.tasks if t.kind == "all_gather_weights"]
    assert not [t for t in g.tasks if t.kind == "reduce_scatter_grads" or t.resource == "ssd_write"]
    one = simulate_config(ml, load_profile("rtx3090-desktop"),
                          _graph(ml, load_profile("rtx3090-desktop"), family,
                                 Placement(weights=Split(gpu=0, cpu=1, ssd=0)))[0])
    two = simulate_config(ml, hw, cfg)
    assert two.iteration_s > 0 and one.iteration_s > 0


def test_refusals():
    hw = load_profile("rtx3090-desktop")
    ml = get_model("tiny-llama").with_lora(LORA)
    with pytest.raises(ScheduleError, match="runtime"):
        make_schedule("horizontal", ml, hw, batch=2, micro_batch=1, runtime="deepspeed")
    with pytest.raises(ScheduleError, match="SSD"):
        make_schedule("vertical", ml, hw, batch=2, micro_batch=1, placement=Placement.uniform("ssd"))


def test_plan_file_version_2_round_trip(tmp_path):
    hw = load_profile("rtx3090-desktop")
    ml = get_model("tiny-gpt").with_lora(LoraConfig(4, targets=("q_proj", "v_proj"), dropout=0.1))
    cfg, g = _graph(ml, hw, "vertical")
    path = tmp_path / "lora.json"
    write_plan(plan_from_graph(ml, hw, cfg, g), path)
    d = json.loads(path.read_text())
    assert d["version"] == 2 and d["model"]["lora"] == {"rank": 4, "alpha": 16.0,
                                                        "targets": ["q_proj", "v_proj"], "dropout": 0.1}
    plan = load_plan(path)
    assert plan.model == ml and len(plan.graph.tasks) == len(g.tasks)
    # a full fine-tuning plan has no lora key; a version-1 file still loads, unless it names LoRA
    m = get_model("tiny-gpt")
    cfg, g = _graph(m, hw, "vertical")
    write_plan(plan_from_graph(m, hw, cfg, g), tmp_path / "full.json")
    d1 = json.loads((tmp_path / "full.json").read_text())
    assert "lora" not in d1["model"]
    d1["version"] = 1
    (tmp_path / "v1.json").write_text(json.dumps(d1))
    assert load_plan(tmp_path / "v1.json").model == m
    d["version"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="model.lora"):
        load_plan(tmp_path / "bad.json")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tierflow", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_flags():
    r = _cli("simulate", "--model", "tiny-llama", "--hw", "rtx3090-desktop", "--batch", "4", "--lora", "8",
             "--lora-targets", "attention", "--schedule", "vertical", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["lora"]["rank"] == 8 and out["lora"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert out["trainable_params"] == get_model("tiny-llama").with_lora(
        LoraConfig(8, targets=parse_targets("attention"))).adapter_params()
    r = _cli("simulate", "--model", "tiny-llama", "--hw", "rtx3090-desktop", "--lora-alpha", "8")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--lora" in r.stderr
    r = _cli("simulate", "--model", "tiny-llama", "--hw", "rtx3090-desktop", "--lora", "4", "--lora-targets",
             "qkv")
    assert r.returncode == 2 and "qkv" in r.stderr


def test_run_trains_a_lora_plan(tmp_path):
    """`tierflow run` of a LoRA plan trains its adapters (the executor's side: tests/executor/
    test_lora_executor.py); a --lora flag that differs from the plan is one line."""
    hw = load_profile("rtx3090-desktop")
    ml = get_model("tiny-llama").with_lora(LORA)
    cfg, g = _graph(ml, hw, "vertical")
    write_plan(plan_from_graph(ml, hw, cfg, g), tmp_path / "lora.json")
    (tmp_path / "ssd").mkdir()
    common = (str(tmp_path / "lora.json"), "--steps", "1", "--device", "cpu", "--ssd-dir",
              str(tmp_path / "ssd"))
    r = _cli("run", *common)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = _cli("run", *common, "--lora", str(LORA.rank + 1))
    assert r.returncode == 2 and "differs from plan" in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


def test_lora_tiers_experiment_quick(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "experiments"))
    import lora_tiers

    rows = lora_tiers.run(quick=True, out_dir=tmp_path)
    assert (tmp_path / "lora_tiers.csv").exists()
    lora = [r for r in rows if r["variant"] == "lora r16"]
    assert lora and all(r["ssd_write_gb"] == 0 for r in lora)
    assert "LoRA r16 / full" in lora_tiers.lora_tables(rows)


@pytest.mark.parametrize("name,family,w_ssd,swap", [
    ("gpt3-125m", "horizontal", 1.0, 0), ("gpt3-125m", "fuyou", 0.5, 2), ("llama2-7b", "vertical", 0.5, 0),
    ("llama2-7b", "block", 0.0, 1), ("llama2-7b", "fuyou", 1.0, 2)])
def test_memory_model_holds_lora(name, family, w_ssd, swap):
    """The memory model's estimate of a LoRA schedule suffices (a simulation capped at it runs to the end as
    fast) and is not loose (tests/planner/core/test_memory.py's bounds), the adapters' GPU bytes included."""
    from tierflow.planner.core.memory import MARGIN, schedule_memory

    model = replace(get_model(name), num_layers=3).with_lora(LORA)
    hw = load_profile("rtx4090-lohan")
    placement = Placement(weights=Split(gpu=0, cpu=round(1 - w_ssd, 6), ssd=w_ssd))
    cfg = make_schedule(family, model, hw, batch=4, micro_batch=2, seq=256, placement=placement,
                        swap_layers=swap, iterations=2)
    mem = schedule_memory(model, micro_batch=2, seq=256, num_micro_batches=2, group=cfg.group,
                          alpha=cfg.alpha, optimizer_overlap=cfg.optimizer_overlap,
                          prefetch_depth=cfg.prefetch_depth, act_prefetch=cfg.act_prefetch,
                          runtime=cfg.runtime, hw=hw)
    est, staging = mem.tier_bytes(placement, swap), mem.staging_bytes(placement, swap)
    free = simulate_config(model, hw, cfg)
    g = build_graph(model, hw, cfg)
    g.capacity_bytes = {t: est[t] * (1 + 1e-9) + 1.0 for t in est}
    capped = simulate_config(model, hw, cfg, g)  # raises CapacityError if a tier does not suffice
    assert capped.iteration_s <= free.iteration_s * 1.05
    for tier in est:
        allowance = staging if tier == "cpu" else 0.0
        assert est[tier] <= (1 + MARGIN) * free.peak_bytes[tier] + allowance + 1.0, tier
