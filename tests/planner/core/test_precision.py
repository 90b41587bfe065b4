"""Precision as an input: the bytes of every tensor class and the GEMM peak follow the training precision
(workload.PRECISIONS), from `--precision`, a DeepSpeed config's bf16 / fp16 keys, and a plan file."""

from __future__ import annotations

import json

import pytest

from tierflow.cli import main
from tierflow.hwprofiles import ProfileError, load_profile
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.memory import placed_bytes, schedule_memory
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.simulate import simulate
from tierflow.planner.core.workload import head_cost, layer_cost, precision_of
from tierflow.planner.io.deepspeed.config import parse_ds_config


def test_fp32_doubles_the_compute_dtype_bytes_and_keeps_the_states():
    m16 = get_model("gpt3-125m")
    m32 = m16.with_precision("fp32")
    assert m16.with_precision("bf16") == m16 and precision_of(m16).name == "bf16"
    l16, l32 = layer_cost(m16, 2, 256), layer_cost(m32, 2, 256)
    assert l32.checkpoint_bytes == 2 * l16.checkpoint_bytes
    assert l32.weight_bytes == 2 * l16.weight_bytes
    assert l32.fwd_flops == l16.fwd_flops
    # weights on the GPU, everything else on the CPU: weights double, master + Adam (12 B) do not
    p = Placement(weights=Split(gpu=1.0, cpu=0.0), master=Split(), adam_m=Split(), adam_v=Split(),
                  grads=Split(), checkpoints=Split())
    P = m16.total_params()
    assert placed_bytes(m16, p)["gpu"] == 2 * P and placed_bytes(m32, p)["gpu"] == 4 * P
    assert placed_bytes(m16, p)["cpu"] == placed_bytes(m32, p)["cpu"] == 12 * P
    kw = dict(micro_batch=2, seq=256, num_micro_batches=4, group=1, alpha=0.0, optimizer_overlap=True,
              prefetch_depth=1)
    staging = [schedule_memory(m, **kw).weight_staging_bytes for m in (m16, m32)]
    assert staging[1] == 2 * staging[0]


def test_each_precision_runs_at_its_own_gemm_peak():
    hw = load_profile("a100-80g-nvme")
    cm = CostModel(hw)
    m = get_model("gpt3-1.3b")
    big = layer_cost(m, 8, 2048)
    t16 = cm.forward_s(big)
    t32 = cm.forward_s(layer_cost(m.with_precision("fp32"), 8, 2048))
    tf32 = cm.forward_s(layer_cost(m.with_precision("tf32"), 8, 2048))
    # GEMM-bound: the time goes with the peaks (A100: 312 / 19.5 / 156 TFLOPS), less the elementwise part
    assert 10 < t32 / t16 <= 312 / 19.5 * (1 + 1e-9)
    assert 1.5 < tf32 / t16 <= 312 / 156 * (1 + 1e-9)
    with pytest.raises(ProfileError, match=r"gpu.tf32_tflops is not set.*--set gpu.tf32_tflops"):
        CostModel(load_profile("v100-32g")).forward_s(layer_cost(m.with_precision("tf32"), 1, 128))


def test_an_fp32_iteration_is_slower_and_needs_more_memory():
    r16 = simulate("gpt3-1.3b", "a100-80g-nvme", "horizontal", batch=8, micro_batch=4, iterations=3)
    r32 = simulate(get_model("gpt3-1.3b").with_precision("fp32"), "a100-80g-nvme", "horizontal", batch=8,
                   micro_batch=4, iterations=3)
    assert r32.iteration_s > 3 * r16.iteration_s
    assert r32.peak_bytes["gpu"] > r16.peak_bytes["gpu"]


def test_a_deepspeed_config_without_16_bit_is_simulated_as_fp32():
    m = get_model("gpt3-125m")
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    fp32 = parse_ds_config(base, "fp32.json", m)
    bf16 = parse_ds_config({**base, "bf16": {"enabled": True}}, "bf16.json", m)
    auto = parse_ds_config({**base, "fp16": {"enabled": "auto"}}, "auto.json", m)
    assert fp32.trained(m).precision == "fp32" and not any("fp32" in x for x in fp32.not_modelled)
    assert bf16.trained(m) == m and auto.trained(m) == m


def test_cli_precision_reaches_the_plan_file_and_the_result(tmp_path, capsys):
    out = {}
    for precision in ("bf16", "fp32"):
        plan = tmp_path / f"{precision}.json"
        assert main(["simulate", "--model", "tiny-gpt", "--hw", "a100-80g-nvme", "--schedule", "horizontal",
                     "--batch", "4", "--micro-batch", "2", "--precision", precision, "--json",
                     "--write-plan", str(plan)]) == 0
        out[precision] = json.loads(capsys.readouterr().out)
        written = json.loads(plan.read_text())
        assert written["model"]["precision"] == (None if precision == "bf16" else "fp32")
        assert main(["simulate", "--plan", str(plan), "--json"]) == 0  # loads, digest and bytes agree
        capsys.readouterr()
    res16, res32 = out["bf16"], out["fp32"]
    assert res32["peak_bytes"]["gpu"] > res16["peak_bytes"]["gpu"]
    assert res32["iteration_s"] > res16["iteration_s"]


def test_head_memory_counts_a_loss_chunk_not_the_whole_logits():
    m = get_model("gpt3-1.3b")  # vocabulary 50,257
    h = head_cost(m, 8, 2048)
    full_fp32_logits = 4 * 8 * 2048 * m.vocab_size
    assert h.bwd_working_bytes < full_fp32_logits
