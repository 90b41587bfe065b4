"""Model families are plug-ins: a family registered from outside the package (here, from inside this test) on
the planner's side (tierflow.planner.core.models) and the executor's (tierflow.executor.models) is planned,
simulated and trained through `tierflow plan`, `tierflow simulate` and `tierflow run` like a built-in one,
and is gone again once unregistered.

The toy family is LLaMA-shaped (RMSNorm, rotary grouped-query attention) with another MLP: a plain,
ungated squared-ReLU MLP (Primer's), two matrices instead of SwiGLU's three."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierflow.cli import main
from tierflow.executor.data import TokenData
from tierflow.executor.models import (
    BlockFamily,
    BlockModel,
    LlamaBlock,
    build_blocks,
    check_supported,
    loss,
    param_count,
    register_block_family,
    unregister_block_family,
)
from tierflow.planner.core.models import (
    Family,
    ModelError,
    build_spec,
    family_names,
    get_family,
    get_model,
    list_models,
    register_family,
    register_model,
    unregister_family,
    unregister_model,
)

FAMILY, MODEL = "toy_sqrelu", "tiny-toy-sqrelu"
LAYER_DEFAULTS = {"max_positions": 0, "norm": "rmsnorm", "activation": "relu", "qkv_bias": False,
                  "out_bias": False, "mlp_bias": False, "tied_embeddings": False}


class SquaredReluMLP(nn.Module):
    def __init__(self, spec, device=None, dtype=None) -> None:
        super().__init__()
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class ToyBlock(LlamaBlock):
    def make_mlp(self, spec, *, device, dtype) -> nn.Module:
        return SquaredReluMLP(spec, device=device, dtype=dtype)


def make_layer(spec, *, norm_eps, rope_theta, device) -> ToyBlock:
    return ToyBlock(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)


def refuse(spec) -> str:
    return "" if (spec.norm, spec.activation) == ("rmsnorm", "relu") else "toy blocks are RMSNorm + ReLU"


@pytest.fixture
def toy():
    """The toy family on both sides and one named model of it; all unregistered afterwards."""
    register_family(Family(FAMILY, LAYER_DEFAULTS))
    register_block_family(BlockFamily(FAMILY, make_layer, refuse))
    try:
        spec = register_model(build_spec(MODEL, FAMILY, hidden=64, heads=4, num_layers=2, num_kv_heads=2,
                                         ffn_hidden=192, vocab_size=256, seq_len=32))
        try:
            yield spec
        finally:
            unregister_model(MODEL)
    finally:
        unregister_block_family(FAMILY)
        unregister_family(FAMILY)


def test_the_toy_family_is_built_with_its_own_mlp(toy):
    assert get_model(MODEL) is toy and FAMILY in family_names() and MODEL in list_models()
    check_supported(toy)
    blocks = build_blocks(toy)
    assert [type(b) for b in blocks[1:-1]] == [ToyBlock, ToyBlock]
    assert isinstance(blocks[1].mlp, SquaredReluMLP)
    # the planner's exact counts (2 MLP matrices: an ungated activation) are the built blocks' counts
    assert [param_count(b) for b in blocks] == [
        toy.embedding_params(), toy.layer_params(), toy.layer_params(),
        toy.final_norm_params() + toy.head_params()]
    assert toy.mlp_matmul_params() == 2 * 64 * 192


def test_plan_simulate_and_run_the_toy_family(toy, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    common = ["--model", MODEL, "--hw", "rtx3090-desktop", "--batch", "4"]
    assert main(["-q", "simulate", *common, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["params"] == toy.total_params()
    assert main(["-q", "plan", *common, "-o", str(plan), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert json.loads(plan.read_text())["model"]["family"] == FAMILY
    assert main(["-q", "run", str(plan), "--device", "cpu", "--steps", "2", "--seed", "0",
                 "--out", str(tmp_path / "run"), "--json"]) == 0
    losses = [s["loss"] for s in json.loads(capsys.readouterr().out)["steps"]]
    # the first step's loss is the toy model's, initialised under the seed, on the first batch (plain PyTorch)
    torch.manual_seed(0)
    ref = BlockModel(toy, build_blocks(toy))
    x, y = TokenData.load(None, toy.vocab_size, seed=0).batch(0, 4, planned["decisions"]["seq"])
    micro = planned["decisions"]["micro_batch"]
    with torch.no_grad():
        parts = [loss(ref(x[i:i + micro]), y[i:i + micro]).item() for i in range(0, 4, micro)]
    want = sum(parts) / len(parts)
    assert len(losses) == 2 and abs(losses[0] - want) <= 1e-5 * want
    assert losses[1] != losses[0]  # a step was taken


def test_unregistered_the_family_is_gone():
    register_family(Family(FAMILY, LAYER_DEFAULTS))
    register_block_family(BlockFamily(FAMILY, make_layer, refuse))
    spec = build_spec(MODEL, FAMILY, hidden=64, heads=4, num_layers=1, ffn_hidden=128, vocab_size=256,
                      seq_len=32)
    assert get_family(FAMILY).layer_defaults["activation"] == "relu"
    unregister_block_family(FAMILY)
    unregister_family(FAMILY)
    assert FAMILY not in family_names()
    with pytest.raises(NotImplementedError, match="unknown family"):
        check_supported(spec)
    with pytest.raises(ModelError, match=f"family: '{FAMILY}' is not one of gpt, llama"):
        dataclasses.replace(spec, num_layers=2)  # a spec of the family no longer validates
