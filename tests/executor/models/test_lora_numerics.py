"""LoRA numerics: tierflow's LoRA training equals plain PyTorch + PEFT on the same llama model
(transformers' LlamaForCausalLM with the same base weights and the same initial adapters), the same data and
seed, over 20 steps on the CPU in fp32: the losses and the trained adapters within float tolerance."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install peft)")

from tierflow.executor.data import TokenData  # noqa: E402
from tierflow.executor.lora import LoraState, lora_state_dict  # noqa: E402
from tierflow.executor.models import build_blocks, export_hf  # noqa: E402
from tierflow.executor.models import loss as lm_loss  # noqa: E402
from tierflow.executor.run import OptimizerOptions, OutputOptions, RunConfig, run_plan  # noqa: E402
from tierflow.hwprofiles import load_profile  # noqa: E402
from tierflow.planner.core.lora import LoraConfig  # noqa: E402
from tierflow.planner.core.models import get_model  # noqa: E402
from tierflow.planner.core.placement import Placement, Split  # noqa: E402
from tierflow.planner.core.schedules import build_graph, make_schedule  # noqa: E402
from tierflow.planner.io.planfile import plan_from_graph  # noqa: E402

STEPS, BATCH, MICRO, SEQ, SEED = 20, 4, 2, 32, 0
LR, WD, BETAS, EPS = 2e-3, 0.1, (0.9, 0.95), 1e-8
LORA = LoraConfig(rank=4, alpha=8.0)  # every projection, no dropout (PEFT's mask could not be matched)


def tierflow_run(tmp_path, spec):
    """The executor: base weights split over GPU / host / SSD tiers, two micro-batches, the vertical
    schedule."""
    hw = load_profile("rtx3090-desktop")
    placement = Placement(weights=Split(0.3, 0.3, 0.4), checkpoints=Split(1.0, 0.0, 0.0))
    cfg = make_schedule("vertical", spec, hw, batch=BATCH, micro_batch=MICRO, seq=SEQ, placement=placement,
                        iterations=2)
    plan = plan_from_graph(spec, hw, cfg, build_graph(spec, hw, cfg))
    (tmp_path / "ssd").mkdir()
    config = RunConfig(steps=STEPS, device="cpu", ssd_dir=str(tmp_path / "ssd"),
                       optimizer=OptimizerOptions(lr=LR, weight_decay=WD, betas=BETAS, eps=EPS),
                       output=OutputOptions(quiet=True, collect_final=True))
    return run_plan(plan, config)


def peft_run(tmp_path, spec):
    """transformers' LlamaForCausalLM with the base weights tierflow initialises under SEED, PEFT's LoRA on
    the same projections with tierflow's initial adapters, torch.optim.AdamW on the adapters."""
    base = spec.with_lora(None)
    torch.manual_seed(SEED)
    blocks = build_blocks(base)
    export_hf(base, [dict(b.state_dict()) for b in blocks], tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    cfg = peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0,
                          target_modules=list(LORA.targets))
    model = peft.get_peft_model(hf, cfg)
    init = LoraState(spec, torch.device("cpu"))
    init.init_random(SEED)
    adapters = lora_state_dict(init)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in adapters.items():
            named[peft_name(key)].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == spec.adapter_params()
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    data = TokenData.load(None, spec.vocab_size, seed=SEED)
    losses = []
    M = BATCH // MICRO
    model.train()
    for s in range(STEPS):
        x, y = data.batch(s, BATCH, SEQ)
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            logits = model(input_ids=x[m * MICRO:(m + 1) * MICRO]).logits
            loss = lm_loss(logits, y[m * MICRO:(m + 1) * MICRO])
            (loss / M).backward()
            total += loss.item() / M
        opt.step()
        losses.append(total)
    return losses, {key: named[peft_name(key)].detach() for key in adapters}


def peft_name(key: str) -> str:
    """PEFT's parameter name of a canonical adapter name (blocks.{i}.{target}.lora_A) on LlamaForCausalLM."""
    _, i, target, ab = key.split(".")
    module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{i}.{module}.{target}.{ab}.default.weight"


def test_lora_training_equals_peft_over_20_steps(tmp_path):
    spec = get_model("tiny-llama").with_lora(LORA)
    res = tierflow_run(tmp_path, spec)
    want_losses, want = peft_run(tmp_path, spec)
    assert len(res.losses) == STEPS
    for got, ref in zip(res.losses, want_losses, strict=True):
        assert abs(got - ref) <= 1e-6 * abs(ref), (res.losses, want_losses)
    got = res.final_lora
    assert set(got) == set(want)
    for key in want:
        err = float((got[key] - want[key]).norm() / want[key].norm())
        assert err < 1e-4, (key, err)
    # the comparison covers trained adapters: B started at zero, A moved from its initial draw
    init = LoraState(spec, torch.device("cpu"))
    init.init_random(SEED)
    start = lora_state_dict(init)
    assert all(want[k].abs().max() > 1e-3 for k in want if k.endswith("lora_B"))
    moved = [float((want[k] - start[k]).norm() / start[k].norm()) for k in want if k.endswith("lora_A")]
    assert min(moved) > 1e-3
