"""Workload arithmetic and the roofline cost model."""

from __future__ import annotations

import math

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.costmodel import CAUSAL_ATTENTION_WORK, CPU_ADAM_DRAM_BYTES_PER_PARAM, CostModel
from tierflow.planner.core.models import get_model
from tierflow.planner.core.workload import (
    Gemm,
    head_cost,
    layer_cost,
    model_flops_per_token,
    recompute_flops_per_token,
)


@pytest.mark.parametrize("name", ["gpt3-175b", "gpt3-13b", "llama2-70b", "tiny-llama"])
def test_layer_forward_flops_are_2_tokens_params_plus_attention(name):
    m = get_model(name)
    b, s = 2, m.seq_len
    c = layer_cost(m, b, s)
    gemm_flops = sum(g.flops for g in c.fwd_gemms)
    assert gemm_flops == 2 * b * s * m.layer_matmul_params()
    assert c.attn_fwd_flops == 4 * b * s * s * m.q_dim
    assert c.bwd_flops == 2 * c.fwd_flops


def test_model_flops_per_token_is_6p_plus_attention():
    m = get_model("gpt3-175b")
    f = model_flops_per_token(m, 2048)
    # 6 * P is the famous approximation; the exact count excludes norms/biases/positions and adds attention
    assert f == pytest.approx(6 * m.total_params() + 12 * 96 * 12288 * 2048, rel=0.01)
    assert recompute_flops_per_token(m, 2048) == pytest.approx(f / 3, rel=0.01)


def test_checkpoint_is_the_bf16_layer_input():
    m = get_model("gpt3-13b")
    assert layer_cost(m, 4, 1024).checkpoint_bytes == 2 * 4 * 1024 * 5120
    assert layer_cost(m, 4, 1024).full_activation_bytes > 10 * layer_cost(m, 4, 1024).checkpoint_bytes


def test_tied_head_fetches_the_embedding_matrix():
    gpt, llama = get_model("gpt3-1.3b"), get_model("llama2-7b")
    assert head_cost(gpt, 1, 128).fetch_params == gpt.final_norm_params() + gpt.vocab_size * gpt.hidden
    assert head_cost(gpt, 1, 128).owned_params == gpt.final_norm_params()
    assert head_cost(llama, 1, 128).owned_params == llama.final_norm_params() + llama.head_params()


def test_small_gemms_run_below_peak_and_large_ones_approach_it():
    cm = CostModel(load_profile("h100-80g"))
    small, big = Gemm(64, 64, 64), Gemm(16384, 16384, 16384)
    eff = lambda g: g.flops / cm.gemm_s(g) / cm.peak_flops  # noqa: E731
    assert eff(small) < 0.05
    assert eff(big) == pytest.approx(cm.gemm_eff, rel=0.01)
    assert eff(small) < eff(Gemm(1024, 1024, 1024)) < eff(big)


def test_skinny_gemm_is_bound_by_hbm():
    cm = CostModel(load_profile("rtx4090-lohan"))
    g = Gemm(1, 12288, 12288)  # a matrix-vector product: 2 FLOPs per 2-byte weight
    assert cm.gemm_s(g) == pytest.approx(g.bytes / cm.hbm_bps)


def test_attention_counts_half_the_work_when_causal():
    cm = CostModel(load_profile("rtx4090-lohan"))
    f = 1e12
    work = f * CAUSAL_ATTENTION_WORK
    assert cm.attention_s(f) == pytest.approx(work / (cm.peak_flops * cm.efficiency(work)))


def test_links_and_cpu_adam_use_profile_rates():
    hw = load_profile("rtx4090-lohan")
    cm = CostModel(hw)
    assert cm.transfer_s("h2d", 25e9) == pytest.approx(25e9 / (hw.pcie.h2d_gbps * 1e9))
    assert cm.transfer_s("ssd_read", 60e9) == pytest.approx(60e9 / (hw.ssd.total_read_gbps * 1e9))
    assert cm.rates.ssd_read_mixed == pytest.approx(cm.rates.ssd_read * hw.ssd.mixed_efficiency)  # fitted
    shared = CostModel(hw.with_overrides({"ssd.mixed_efficiency": None, "ssd.rw_sharing": "shared"})).rates
    assert shared.ssd_read_mixed == pytest.approx(shared.ssd_read / 2)  # from rw_sharing when not set
    assert cm.rates.dram_bps == pytest.approx(hw.cpu.memory_gbps * hw.cpu.memory_efficiency * 1e9)
    assert cm.rates.adam_dram_bps == pytest.approx(hw.cpu.adam_gparams_per_s * 1e9
                                                   * CPU_ADAM_DRAM_BYTES_PER_PARAM)
    assert cm.cpu_adam_s(hw.cpu.adam_gparams_per_s * 1e9) == pytest.approx(1.0)
    no_ssd = CostModel(hw.with_overrides({"ssd.count": 0}))
    assert math.isinf(no_ssd.transfer_s("ssd_write", 1.0))


def test_a_model_without_lm_head_has_no_logits():
    """LoHan's benchmark model (loss on the hidden states): no logits GEMM, no vocab-sized working memory, the
    token embedding kept; the executor refuses to train it with one line."""
    from dataclasses import replace

    from tierflow.planner.core.workload import head_cost, loss_working_bytes, model_flops_per_token

    full = get_model("gpt3-1.3b")
    headless = replace(full, name="gpt3-1.3b-headless", lm_head=False)
    h_full, h_less = head_cost(full, 4, 1024), head_cost(headless, 4, 1024)
    assert h_less.fwd_flops == 0 and h_full.fwd_flops > 0
    # no loss chunk, no weight gradient of the tied head
    assert loss_working_bytes(headless, 4, 1024) == 0
    # the tied weight's gradient and one chunk of logits more
    chunk = loss_working_bytes(full, 4, 1024) - 2 * 4 * 1024 * full.embed_dim
    more = h_full.bwd_working_bytes - h_less.bwd_working_bytes
    assert more >= 2 * full.vocab_size * full.embed_dim + 0.99 * chunk
    assert headless.total_params() == full.total_params()  # tied: the embedding stays, no lm_head weights
    assert model_flops_per_token(full, 1024) - model_flops_per_token(headless, 1024) == \
        6.0 * full.vocab_size * full.embed_dim
    torch_models = pytest.importorskip("tierflow.executor.models")
    with pytest.raises(NotImplementedError, match="without an lm_head"):
        torch_models.check_supported(headless)


def test_measured_attention_and_activation_rates_slow_exactly_their_part_of_a_layer():
    """gpu.attention_efficiency scales attention's time, gpu.activation_gbps the activation function's bytes;
    absent, a profile's times are unchanged."""
    from tierflow.planner.core.models import get_model
    from tierflow.planner.core.workload import layer_cost

    hw = load_profile("rtx3090-desktop")
    block = layer_cost(get_model("gpt3-125m"), 2, 1024)
    base = CostModel(hw)
    slow = CostModel(hw.with_overrides({"gpu.attention_efficiency": 0.25, "gpu.activation_gbps": 100.0}))
    attn = base.attention_s(block.attn_fwd_flops)
    act_base = block.fwd_activation_bytes / base.hbm_bps
    act_slow = block.fwd_activation_bytes / 100e9
    assert block.fwd_activation_bytes > 0
    assert slow.forward_s(block) == pytest.approx(base.forward_s(block) + 3 * attn + act_slow - act_base,
                                                  rel=1e-12)
    assert slow.backward_s(block) == pytest.approx(base.backward_s(block)
                                                   + 2 * (3 * attn + act_slow - act_base), rel=1e-12)
