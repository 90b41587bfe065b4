"""The executor's LoRA: LoRA adapters trained on a frozen base over the tiers, for every model family.

Each family's LoRA run (its base split over GPU, host memory and the SSD tier) equals an independent plain
PyTorch reference: the same blocks with each adapted weight replaced by W + (alpha / rank) * B A on its rows
of the (possibly fused) projection, autograd on A and B only, torch.optim.AdamW. The base is never written:
the SSD tier is not written after set-up, the base weights come out as they went in, and the only optimizer
ops are the decoder layers' adam_gpu steps of their adapters."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call

from tierflow.executor.data import TokenData
from tierflow.executor.engine import Executor
from tierflow.executor.lora import (
    AdapterLayout,
    LoraError,
    LoraState,
    load_lora_state_dict,
    lora_state_dict,
)
from tierflow.executor.models import BlockModel, build_blocks, check_supported, export_hf
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.ops.optimizer import OptimizerOps
from tierflow.executor.options import CheckpointOptions, LoraOptions, ModelDataOptions
from tierflow.executor.run import OptimizerOptions, OutputOptions, RunConfig, RunError, run_plan
from tierflow.executor.tiers.state import StateError
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.lora import LoraConfig
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import plan_from_graph, write_plan

HW = load_profile("rtx3090-desktop")
STEPS, BATCH, MICRO, SEQ = 3, 4, 2, 32
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.95)
GPT = get_model("tiny-gpt")
LLAMA = get_model("tiny-llama")
FAMILIES = {
    "gpt": GPT,
    "llama": LLAMA,
    "opt": dataclasses.replace(GPT, name="tiny-opt", family="opt", activation="relu", position_offset=2),
    "gpt_neox": dataclasses.replace(GPT, name="tiny-neox", family="gpt_neox", max_positions=0,
                                    tied_embeddings=False, parallel_residual=True, rotary_fraction=0.25),
    "phi3": dataclasses.replace(LLAMA, name="tiny-phi3", family="phi3", rotary_fraction=0.5),
}
# the base split over every tier; checkpoints in host memory (LoRA writes nothing to the SSDs)
TIERED = Placement(weights=Split(0.3, 0.3, 0.4), checkpoints=Split(1.0, 0.0, 0.0))


def make_plan(spec, family="vertical", placement=TIERED, swap_layers=0):
    cfg = make_schedule(family, spec, HW, batch=BATCH, micro_batch=MICRO, seq=SEQ, placement=placement,
                        iterations=2, swap_layers=swap_layers)
    return plan_from_graph(spec, HW, cfg, build_graph(spec, HW, cfg))


def run(spec, tmp_path, steps=STEPS, device="cpu", **kw):
    (tmp_path / "ssd").mkdir(parents=True, exist_ok=True)
    config = RunConfig(steps=steps, device=device, ssd_dir=str(tmp_path / "ssd"),
                       optimizer=OptimizerOptions(lr=LR, weight_decay=WD, betas=BETAS),
                       output=OutputOptions(quiet=True, collect_final=True))
    return run_plan(make_plan(spec, **kw), config)


def _rows(spec, slot) -> torch.Tensor:
    """The output rows of the (fused) projection an adapter adds to, written out independently of
    executor/lora.py's hooks: a slice, or NeoX's part j of every head's (q, k, v) rows."""
    if slot.part is None:
        return torch.arange(slot.out_features)
    if slot.part[0] == "slice":
        return torch.arange(slot.part[1], slot.part[1] + slot.out_features)
    _, j, parts = slot.part
    hd = spec.head_dim
    return torch.cat([torch.arange(h * parts * hd + j * hd, h * parts * hd + (j + 1) * hd)
                      for h in range(spec.num_heads)])


def reference(spec, steps=STEPS, seed=0):
    """Plain PyTorch: the base blocks under `seed`, each adapted weight W replaced by W + s * B A on its rows,
    gradients of A and B only, torch.optim.AdamW (every adapter matrix decayed)."""
    base = spec.with_lora(None)
    torch.manual_seed(seed)
    model = BlockModel(base, build_blocks(base))
    for p in model.parameters():
        p.requires_grad_(False)
    init = LoraState(spec, torch.device("cpu"))
    init.init_random(seed)
    adapters = {k: v.clone().requires_grad_() for k, v in lora_state_dict(init).items()}
    layout = AdapterLayout(spec)
    scaling = spec.lora.scaling
    opt = torch.optim.AdamW(list(adapters.values()), lr=LR, weight_decay=WD, betas=BETAS)
    data = TokenData.load(None, spec.vocab_size, seed=seed)
    params = dict(model.named_parameters())
    losses = []
    M = BATCH // MICRO
    for s in range(steps):
        x, y = data.batch(s, BATCH, SEQ)
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            weights = dict(params)
            for i in range(spec.num_layers):
                for slot in layout.slots:
                    name = f"blocks.{i + 1}.{slot.module}.weight"
                    a = adapters[f"blocks.{i}.{slot.target}.lora_A"]
                    b = adapters[f"blocks.{i}.{slot.target}.lora_B"]
                    weights[name] = weights[name].index_add(0, _rows(spec, slot), (b @ a) * scaling)
            logits = functional_call(model, weights, (x[m * MICRO:(m + 1) * MICRO],))
            loss = lm_loss(logits, y[m * MICRO:(m + 1) * MICRO])
            (loss / M).backward()
            total += loss.item() / M
        opt.step()
        losses.append(total)
    return losses, {k: v.detach() for k, v in adapters.items()}, [
        torch.cat([p.reshape(-1) for p in blk.parameters()]) for blk in model.blocks]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_trains_every_family_over_the_tiers(family, tmp_path, monkeypatch):
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    if family in ("llama", "phi3"):
        targets = (*targets, "gate_proj")
    spec = FAMILIES[family].with_lora(LoraConfig(rank=4, alpha=8.0, targets=targets))
    written, optimizer_blocks = [], []
    run_round = Executor.run_round

    def watched(self, iterations, step0, on_step=None):
        before = self.ssd.bytes_written
        try:
            return run_round(self, iterations, step0, on_step)
        finally:
            written.append(self.ssd.bytes_written - before)

    def no_host_adam(self, rs, t):
        raise AssertionError(f"a host optimizer op ran on block {t.block}")

    adam_gpu = OptimizerOps.adam_gpu

    def seen_adam_gpu(self, rs, t):
        optimizer_blocks.append(t.block)
        return adam_gpu(self, rs, t)

    monkeypatch.setattr(Executor, "run_round", watched)
    monkeypatch.setattr(OptimizerOps, "adam", no_host_adam)
    monkeypatch.setattr(OptimizerOps, "adam_gpu", seen_adam_gpu)
    res = run(spec, tmp_path)
    want_losses, want, base = reference(spec)
    for got, ref in zip(res.losses, want_losses, strict=True):
        assert abs(got - ref) <= 2e-6 * abs(ref), (res.losses, want_losses)
    for key, value in want.items():
        err = float((res.final_lora[key] - value).norm() / value.norm())
        assert err < 1e-4, (key, err)
    # the base: read from the SSD tier, never written back, unchanged
    assert written and sum(written) == 0
    assert res.ssd_bytes_read > 0
    for got, ref in zip(res.final_master, base, strict=True):
        assert torch.equal(got, ref)
    # the optimizer: each decoder layer's adapters, once a step; nothing for the embedding or the head
    layers = list(range(1, spec.num_layers + 1))
    assert sorted(set(optimizer_blocks)) == layers and len(optimizer_blocks) == STEPS * len(layers)
    # no master copy or moments of the base exist
    assert set(res.state.vec) == {"weights"}
    assert all(g is None for g in res.state.grads)


def test_lora_on_the_emulated_cuda_device_equals_the_reference(tmp_path):
    """Streams, events and late copies (the adversarial CUDA emulation, executor/device/emulated.py): the
    adapters' gradients cross from the compute stream to their adam_gpu and the base's fetches land late,
    and the training is still the reference's."""
    spec = FAMILIES["phi3"].with_lora(LoraConfig(rank=4, alpha=8.0, dropout=0.1))
    res = run(spec, tmp_path, device="cpu-adversarial")
    plain = run(spec, tmp_path / "plain")
    for got, want in zip(res.losses, plain.losses, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    for key, value in plain.final_lora.items():
        assert float((res.final_lora[key] - value).norm() / value.norm()) < 1e-5


@pytest.mark.parametrize("schedule,swap", [("horizontal", 0), ("vertical", 2)])
def test_lora_with_dropout_and_swapped_activations(schedule, swap, tmp_path):
    """Dropout on the adapters' input: a recomputed layer drops what its forward dropped (the masks are keyed
    by step, layer and micro-batch), so the horizontal (recompute) and the vertical schedule with swapped
    activations train the same adapters."""
    spec = LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0, dropout=0.25))
    res = run(spec, tmp_path, family=schedule, swap_layers=swap)
    ref = run(spec, tmp_path / "plain", family="vertical",
              placement=Placement(weights=Split(1.0, 0.0, 0.0), checkpoints=Split(1.0, 0.0, 0.0)))
    for got, want in zip(res.losses, ref.losses, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want)
    for key, value in ref.final_lora.items():
        assert float((res.final_lora[key] - value).norm() / value.norm()) < 1e-5
    # and dropout changes the training (it is applied)
    nodrop = run(LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0)), tmp_path / "nodrop")
    assert nodrop.losses[-1] != res.losses[-1]


def test_canonical_names_round_trip_and_bad_keys_are_one_line():
    spec = GPT.with_lora(LoraConfig(rank=2, targets=("q_proj", "v_proj", "down_proj")))
    state = LoraState(spec, torch.device("cpu"))
    state.init_random(3)
    sd = lora_state_dict(state)
    assert sorted(sd)[:2] == ["blocks.0.down_proj.lora_A", "blocks.0.down_proj.lora_B"]
    assert sd["blocks.0.q_proj.lora_A"].shape == (2, GPT.hidden)
    assert sd["blocks.0.down_proj.lora_A"].shape == (2, GPT.ffn_hidden)
    assert sd["blocks.1.v_proj.lora_B"].shape == (GPT.kv_dim, 2)
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in sd.values())
    assert all(not torch.any(v) for k, v in sd.items() if k.endswith("lora_B"))  # PEFT: B starts at zero
    other = LoraState(spec, torch.device("cpu"))
    load_lora_state_dict(other, {k: v * 2 for k, v in sd.items()})
    assert all(torch.equal(v, sd[k] * 2) for k, v in lora_state_dict(other).items())
    bad = dict(sd)
    bad["blocks.0.q_proj.lora_A"] = torch.zeros(3, GPT.hidden)
    with pytest.raises(LoraError, match=r"^adapter tensor 'blocks.0.q_proj.lora_A' has shape \[3, "):
        load_lora_state_dict(other, bad)
    with pytest.raises(LoraError, match="'blocks.0.k_proj.lora_A' is not one of"):
        load_lora_state_dict(other, {**sd, "blocks.0.k_proj.lora_A": torch.zeros(2, GPT.hidden)})
    missing = dict(sd)
    del missing["blocks.1.down_proj.lora_B"]
    with pytest.raises(LoraError, match="'blocks.1.down_proj.lora_B' is missing"):
        load_lora_state_dict(other, missing)


def test_a_target_the_family_lacks_is_refused_in_one_line():
    spec = GPT.with_lora(LoraConfig(rank=2, targets=("gate_proj", "q_proj")))
    with pytest.raises(NotImplementedError, match="lora target 'gate_proj': a gpt layer has no such") as e:
        check_supported(spec)
    assert "\n" not in str(e.value)
    check_supported(GPT.with_lora(LoraConfig(rank=2)))  # every target: all the layer has


# -- checkpoints and resume ----------------------------------------------------------------------------------


def _config(tmp_path, steps, ck, seed=0, allow=False, lora=None):
    (tmp_path / "ssd").mkdir(parents=True, exist_ok=True)
    return RunConfig(steps=steps, device="cpu", ssd_dir=str(tmp_path / "ssd"),
                     model_data=ModelDataOptions(seed=seed),
                     optimizer=OptimizerOptions(lr=LR, weight_decay=WD, betas=BETAS),
                     checkpoint=CheckpointOptions(directory=str(ck), every=1, allow_changed_hyper=allow),
                     output=OutputOptions(quiet=True, collect_final=True), lora=lora)


def test_a_checkpoint_holds_the_adapters_names_the_base_and_resumes_bit_for_bit(tmp_path):
    spec = LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0, dropout=0.1))
    plan = make_plan(spec)
    straight = run_plan(plan, _config(tmp_path / "a", 5, tmp_path / "a" / "ck"))
    ck = tmp_path / "b" / "ck"
    first = run_plan(plan, _config(tmp_path / "b", 2, ck))
    assert first.losses == straight.losses[:2]
    latest = ck / (ck / "latest").read_text().strip()
    manifest = json.loads((latest / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["adapters.safetensors"]  # the adapters only: no base block files
    assert manifest["lora"] == spec.lora.to_dict()
    assert manifest["base"] == {"model": spec.name, "digest": first.state.base_digest()}
    tensors = load_file(latest / "adapters.safetensors")
    assert set(tensors) == {p + k for p in ("", "adam_m.", "adam_v.") for k in first.final_lora}
    resumed = run_plan(plan, _config(tmp_path / "b", 5, ck))
    assert resumed.first_step == 2
    assert resumed.losses == straight.losses[2:]  # bit for bit
    for key, value in straight.final_lora.items():
        assert torch.equal(resumed.final_lora[key], value)
        assert torch.equal(resumed.final_lora_adam_m[key], straight.final_lora_adam_m[key])


def test_resuming_onto_another_base_or_without_lora_is_refused_in_one_line(tmp_path):
    spec = LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0))
    ck = tmp_path / "ck"
    run_plan(make_plan(spec), _config(tmp_path, 1, ck))
    with pytest.raises(StateError, match="its adapters were trained on another base") as e:
        run_plan(make_plan(spec), _config(tmp_path, 2, ck, seed=1, allow=True))  # another random base
    assert "\n" not in str(e.value)
    with pytest.raises(StateError) as e:  # the same model, full fine-tuning
        run_plan(make_plan(LLAMA, placement=Placement(checkpoints=Split(1.0, 0.0, 0.0))),
                 _config(tmp_path, 2, ck))
    assert "\n" not in str(e.value) and "another" in str(e.value)


def test_run_lora_flags_must_match_the_plan(tmp_path):
    spec = LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0))
    ok = run_plan(make_plan(spec), _config(tmp_path / "ok", 1, tmp_path / "ok" / "ck",
                                           lora=LoraOptions(rank=4, alpha=8.0)))
    assert ok.losses
    with pytest.raises(RunError, match=r"^--lora-alpha: 16.0 differs from plan .*'s 8.0 \(drop the flag"):
        run_plan(make_plan(spec), _config(tmp_path, 1, tmp_path / "ck", lora=LoraOptions(rank=4)))
    with pytest.raises(RunError, match=r"^--lora 4: plan .* trains every weight; make a LoRA plan"):
        run_plan(make_plan(LLAMA, placement=Placement(checkpoints=Split(1.0, 0.0, 0.0))),
                 _config(tmp_path, 1, tmp_path / "ck2", lora=LoraOptions(rank=4)))


def test_cli_run_refuses_lora_flags_another_plan_does_not_have(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(make_plan(GPT, placement=Placement(checkpoints=Split(1.0, 0.0, 0.0))), path)
    (tmp_path / "ssd").mkdir()
    cmd = [sys.executable, "-m", "tierflow.cli", "run", str(path), "--device", "cpu", "--ssd-dir",
           str(tmp_path / "ssd"), "--steps", "1", "--lora", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--lora 8:" in lines[0] and "trains every weight" in lines[0]


@pytest.mark.parametrize("family", ["gpt_neox", "phi3"])
def test_export_hf_of_a_lora_run_writes_the_merged_model(family, tmp_path):
    """--export-hf of a LoRA run: the base with W + s B A merged, which transformers loads and which computes
    the trained model's logits (its fused projections' rows included)."""
    transformers = pytest.importorskip("transformers")
    spec = FAMILIES[family].with_lora(LoraConfig(rank=4, alpha=8.0))
    (tmp_path / "ssd").mkdir()
    out = tmp_path / "hf"
    config = RunConfig(steps=2, device="cpu", ssd_dir=str(tmp_path / "ssd"),
                       optimizer=OptimizerOptions(lr=LR, weight_decay=WD, betas=BETAS),
                       output=OutputOptions(quiet=True, collect_final=True, export_hf=str(out)))
    res = run_plan(make_plan(spec), config)
    base = spec.with_lora(None)
    torch.manual_seed(0)
    model = BlockModel(base, build_blocks(base)).eval()
    weights = dict(model.named_parameters())
    for i in range(spec.num_layers):
        for slot in AdapterLayout(spec).slots:
            a = res.final_lora[f"blocks.{i}.{slot.target}.lora_A"]
            b = res.final_lora[f"blocks.{i}.{slot.target}.lora_B"]
            assert b.abs().max() > 0
            name = f"blocks.{i + 1}.{slot.module}.weight"
            weights[name] = weights[name].index_add(0, _rows(spec, slot), (b @ a) * spec.lora.scaling)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = TokenData.load(None, spec.vocab_size, seed=7).batch(0, 2, SEQ)[0]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, functional_call(model, weights, (x,)), atol=1e-4,
                                   rtol=0)


# -- PEFT: the run's --export-peft and --init-peft (executor/lora_peft.py) ----------------------------------


def _peft_param(key: str) -> str:
    """PEFT's parameter name of a canonical adapter name (blocks.{i}.{target}.lora_A) on LlamaForCausalLM."""
    _, i, target, ab = key.split(".")
    module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{i}.{module}.{target}.{ab}.default.weight"


def test_a_run_exports_its_adapters_for_peft_and_another_starts_from_them(tmp_path):
    """run --export-peft writes the trained adapters, which PEFT loads onto the --init base exactly as they
    were trained; a run with --init-peft starts from them: its first loss is the PEFT model's on that
    batch."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install peft)")
    spec = LLAMA.with_lora(LoraConfig(rank=4, alpha=8.0))
    base = spec.with_lora(None)
    torch.manual_seed(3)
    export_hf(base, [dict(b.state_dict()) for b in build_blocks(base)], tmp_path / "base")
    (tmp_path / "ssd").mkdir()
    adapter = tmp_path / "adapter"

    def config(steps, init_peft=None, export_peft=None):
        md = ModelDataOptions(init=str(tmp_path / "base"), init_peft=init_peft, seed=0)
        out = OutputOptions(quiet=True, collect_final=True, export_peft=export_peft)
        return RunConfig(steps=steps, device="cpu", ssd_dir=str(tmp_path / "ssd"), model_data=md, output=out,
                         optimizer=OptimizerOptions(lr=LR, weight_decay=WD, betas=BETAS))

    trained = run_plan(make_plan(spec), config(2, export_peft=str(adapter)))
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    named = dict(model.named_parameters())
    for key, value in trained.final_lora.items():
        assert torch.equal(named[_peft_param(key)].detach(), value), key
    assert max(v.abs().max() for k, v in trained.final_lora.items() if k.endswith("lora_B")) > 0
    x, y = TokenData.load(None, spec.vocab_size, seed=0).batch(0, BATCH, SEQ)
    with torch.no_grad():
        want = sum(lm_loss(model(input_ids=x[m:m + MICRO]).logits, y[m:m + MICRO]).item()
                   for m in range(0, BATCH, MICRO)) / (BATCH // MICRO)
    again = run_plan(make_plan(spec), config(1, init_peft=str(adapter)))
    assert again.losses[0] == pytest.approx(want, rel=1e-5)
    assert abs(trained.losses[0] - want) > 1e-3  # the fresh adapters' (B = 0) first loss is another
