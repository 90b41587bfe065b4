"""The given A100 sweep's mechanisms: DeepSpeed's blocking dtype-changing copies,
DeepSpeedCPUAdam's own rate under the DeepSpeed bridge, Megatron's unfused layer ops; and
experiments/dos_polaris.py's quick run."""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.compute import unfused_extra_bytes
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.models import get_model
from tierflow.planner.core.opkinds import BWD, CPU_ADAM_KINDS, OFFLOAD_GRADS, RECOMPUTE
from tierflow.planner.core.workload import layer_cost
from tierflow.planner.io.deepspeed.bridge import simulate_ds
from tierflow.planner.io.deepspeed.config import parse_ds_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import dos_polaris  # noqa: E402

HW = "polaris-a100-40g"


def small_model():
    return replace(get_model("llama2-7b"), num_layers=4, num_kv_heads=8, seq_len=512)


def ds_run(hw, micro_batches: int = 2):
    m = small_model()
    cfg = {"train_batch_size": 2 * micro_batches, "train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "bf16": {"enabled": True}}
    return simulate_ds(m, hw, parse_ds_config(cfg, "test", m), 3)


def host_copies(res) -> list:
    return [t for t in res.graph.tasks if t.kind == OFFLOAD_GRADS and t.resource == "cpu"]


def test_the_boundary_fp32_gradient_copy_is_a_host_wait_the_backward_waits_for():
    hw = load_profile(HW)
    _, res = ds_run(hw)
    copies = host_copies(res)
    assert copies, "pageable copies modelled: the boundary's fp32 copy runs on the host"
    tasks = res.graph.tasks
    # only at the accumulation boundary: the iteration's last micro-batch's gradients, one copy per block
    per_iteration = {t.iteration for t in copies}
    assert len(copies) == len(per_iteration) * len({t.block for t in copies})
    # a backward step issued after a copy waits for it (the host blocks in copy_)
    waiting = [t for t in tasks if t.kind in (BWD, RECOMPUTE) and any(d in {c.id for c in copies}
                                                                       for d in t.deps)]
    assert waiting
    # without the field the copy is the pinned 4 B per parameter it was, and no host task exists
    _, plain = ds_run(hw.with_overrides({"pcie.pageable_d2h_gbps": "null"}))
    assert not host_copies(plain)


def test_a_slower_pageable_copy_lengthens_the_iteration_by_its_bytes():
    """The copies run alone (GPU and host both wait), so the iteration grows by the 16-bit gradient's bytes at
    the slower rate."""
    hw = load_profile(HW)
    fast, slow = 4.0, 2.0
    _, a = ds_run(hw.with_overrides({"pcie.pageable_d2h_gbps": fast}))
    _, b = ds_run(hw.with_overrides({"pcie.pageable_d2h_gbps": slow}))
    grad_bytes = 2 * small_model().total_params()  # every block's 16-bit gradient, copied once
    expected = grad_bytes / 1e9 * (1 / slow - 1 / fast)
    assert b.iteration_s - a.iteration_s == pytest.approx(expected, rel=0.05)


def test_the_deepspeed_bridge_steps_at_deepspeed_cpu_adam_s_rate():
    """The bridge passes the profile as it is; the run's CPU Adam steps every parameter once per iteration at
    DeepSpeedCPUAdam's rate (cpu.deepspeed_adam_gparams_per_s, polaris' fitted one), at tierflow's kernel's
    rate only where the profile has no DeepSpeed rate."""
    hw = load_profile(HW)
    params = small_model().total_params()
    bare = hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": "null"})
    for box, rate in ((hw, hw.cpu.deepspeed_adam_gparams_per_s), (bare, hw.cpu.adam_gparams_per_s)):
        _, res = ds_run(box)
        adam_s = sum(t.work for t in res.graph.tasks if t.kind in CPU_ADAM_KINDS and t.iteration == 1)
        assert adam_s == pytest.approx(params / (rate * 1e9), rel=1e-6)
    assert hw.cpu.deepspeed_adam_gparams_per_s < hw.cpu.adam_gparams_per_s / 2  # the two cases differ
    _, fast = ds_run(hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": 3.0}))
    _, slow = ds_run(hw.with_overrides({"cpu.deepspeed_adam_gparams_per_s": 1.0}))
    assert slow.iteration_s > fast.iteration_s


def test_unfused_layer_ops_add_their_bytes_at_the_hbm_rate():
    hw = load_profile(HW)
    fused = hw.with_overrides({"compute.layer_ops": "fused"})
    m = small_model()
    blk = layer_cost(m, 2, 512)
    qkv = m.q_dim + m.kv_dim
    extra = unfused_extra_bytes("rmsnorm", 2 * m.hidden, qkv, qkv, m.ffn_hidden, 2)
    cm, cf = CostModel(hw), CostModel(fused)
    assert cm.forward_s(blk) - cf.forward_s(blk) == pytest.approx(extra * blk.tokens / cm.hbm_bps, rel=1e-9)
    assert cm.backward_s(blk) - cf.backward_s(blk) == pytest.approx(2 * extra * blk.tokens / cm.hbm_bps,
                                                                    rel=1e-9)
    # no GQA repeat without GQA, no norm term for LayerNorm, nothing for a GELU MLP
    gpt = get_model("gpt3-125m")
    g = layer_cost(gpt, 2, 512)
    rotary_free = unfused_extra_bytes("layernorm", 2 * gpt.hidden, 0, 0, 0, 2)
    assert rotary_free == 0.0
    assert CostModel(hw).forward_s(g) == pytest.approx(CostModel(fused).forward_s(g))


def test_dos_polaris_quick(tmp_path):
    heads = dos_polaris.run(quick=True, out_dir=tmp_path)
    with open(tmp_path / "dos_polaris.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["phase"] for r in rows} == {"fwd", "bwd", "step", "iteration"}
    for batch in {r["batch"] for r in rows}:
        mine = {r["phase"]: r for r in rows if r["batch"] == batch}
        for col in ("before_s", "after_s", "loo_s"):  # the phases make up the iteration
            assert sum(float(mine[p][col]) for p in ("fwd", "bwd", "step")) == pytest.approx(
                float(mine["iteration"][col]), abs=0.01)
        # leave-one-out fits on the other point only: its values are named and differ from the full fit
        assert "pcie.pageable_d2h_gbps=" in mine["iteration"]["loo_values"]
    assert heads and heads[0]["study"] == "dos_polaris"


def test_deepspeed_s_pipelined_optimizer_reads_stay_about_one_write_ahead():
    """offload_optimizer pipeline_read / pipeline_write: the read of sub-group g is issued in g-1's swap-in,
    after g-2's swap-out completed g-3's write (pipelined_optimizer_swapper.py): at most three sub-groups'
    states are read and not yet written back at any time, whatever the SSD's read and write rates."""
    from tierflow.planner.core.opkinds import READ_OPT_STATES, WRITE_OPT_STATES

    m = replace(get_model("gpt3-13b"), num_layers=12, seq_len=256)
    hw = load_profile("rtx4090-lohan").with_overrides({"ssd.write_gbps": 0.5})  # writes far slower than reads
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "sub_group_size": 100_000_000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                       "pipeline_read": True, "pipeline_write": True,
                                                       "buffer_count": 12}},
           "bf16": {"enabled": True}}
    _, res = simulate_ds(m, hw, parse_ds_config(cfg, "test", m), 3)
    tasks = [t for t in res.graph.tasks if t.iteration == 1]
    reads = {t.block: t for t in tasks if t.kind == READ_OPT_STATES}
    writes = {t.block: t for t in tasks if t.kind == WRITE_OPT_STATES}
    assert len(reads) >= 10
    worst = 0
    for r in reads.values():
        t0 = res.start_s[r.id]
        open_groups = [b for b, x in reads.items()
                       if res.start_s[x.id] <= t0 and res.end_s[writes[b].id] > t0]
        worst = max(worst, len(open_groups))
    assert 2 <= worst <= 3
