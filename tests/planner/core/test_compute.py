"""The per-kernel compute model (planner/core/compute.py, a profile's `compute:` section)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.compute import kernels
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.models import get_model
from tierflow.planner.core.workload import Gemm, layer_cost


@pytest.fixture(scope="module")
def a100():
    return load_profile("a100-80g-nvme")


def test_one_more_tile_than_sms_pays_for_a_partial_wave(a100):
    d = CostModel(a100).delivered
    sms = a100.compute.sm_count
    assert sms == 108
    k = 16384  # deep enough that the tiles, not the bytes, bind
    full = Gemm(256 * 12, 128 * 9, k)  # exactly one wave of 256 x 128 tiles
    over = Gemm(256 * 13, 128 * 9, k)  # one tile more: 2 waves of the large tile, 1.5 of 128 x 128 tiles,
    # 1.25 of 128 x 64, 9/8 of 64 x 64 tiles (936 tiles in 9 waves of 108 eighth-size tiles): the fastest wins
    assert d.gemm_s(over) == pytest.approx(9 / 8 * d.gemm_s(full))
    # a full wave runs at the large-GEMM rate
    large_rate = a100.gpu.peak_tflops * 1e12 * a100.gpu.gemm_efficiency
    assert full.flops / d.gemm_s(full) == pytest.approx(large_rate)


def test_skinny_gemm_is_bound_by_its_bytes(a100):
    cm = CostModel(a100)
    g = Gemm(8, 8192, 8192)  # a matrix-vector-like product: 2 FLOPs per weight byte
    assert cm.gemm_s(g) == pytest.approx(g.bytes / cm.hbm_bps)


def test_without_the_section_the_size_curve_applies(a100):
    bare = dataclasses.replace(a100, compute=None)
    cm = CostModel(bare)
    assert cm.delivered is None
    g = Gemm(4096, 4096, 4096)
    assert cm.gemm_s(g) == pytest.approx(g.flops / (cm.peak_flops * cm.efficiency(g.flops)))


def test_attention_runs_at_the_published_fraction(a100):
    cm = CostModel(a100)
    flops = 1e12
    assert cm.attention_s(flops) == pytest.approx(0.5 * flops / (312e12 * 0.73))
    assert cm.attention_s(flops, backward=True) == pytest.approx(2 * 0.5 * flops / (312e12 * 0.63))


def test_launches_bind_a_block_of_short_kernels(a100):
    model = get_model("gpt3-125m")
    block = layer_cost(model, 1, 64)  # 64 tokens: microsecond kernels
    slow = a100.with_overrides({"compute.kernel_launch_us": 20})
    fast, launched = CostModel(a100), CostModel(slow)
    n = kernels(block, backward=False)
    assert n == 4 + 1 + 7
    assert launched.forward_s(block) == pytest.approx(n * 20e-6)
    assert fast.forward_s(block) < launched.forward_s(block)
    assert launched.backward_s(block) == pytest.approx(kernels(block, backward=True) * 20e-6)
    big = layer_cost(model, 16, 1024)  # long kernels hide the launches
    assert launched.forward_s(big) == pytest.approx(fast.forward_s(big))


def test_override_adds_the_section_to_a_profile_without_one():
    bare = load_profile("rtx4090-lohan")
    bare = dataclasses.replace(bare, compute=None)
    p = bare.with_overrides({"compute.sm_count": 64})
    assert p.compute.sm_count == 64 and p.compute.gemm_tile_m == 256


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 20000), k=st.integers(1, 20000))
def test_never_faster_than_the_large_gemm_rate_or_the_bytes(m, n, k):
    hw = load_profile("h100-80g")
    cm = CostModel(hw)
    g = Gemm(m, n, k)
    t = cm.gemm_s(g)
    assert t >= g.flops / (cm.peak_flops * hw.gpu.gemm_efficiency) * (1 - 1e-9)
    assert t >= g.bytes / cm.hbm_bps * (1 - 1e-9)
    # more rows never take less time (tiles only add)
    assert cm.gemm_s(Gemm(m + 1, n, k)) >= t * (1 - 1e-9)


def test_the_launch_probe_measures_a_positive_bounded_per_op_cost():
    from tierflow.executor.calibration.compute_ops import measure_kernel_launch

    out = measure_kernel_launch("cpu", ops=400, repeats=3)
    lo, hi = out["spread_us"]
    assert 0 < lo <= out["kernel_launch_us"] <= hi < 1000  # torch's CPU dispatch: about a microsecond or more
    with pytest.raises(ValueError):
        measure_kernel_launch("cpu", ops=0)
