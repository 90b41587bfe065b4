"""fp32 as plain PyTorch, Megatron-LM and DeepSpeed without ZeRO train it (workload.Precision.in_place): the
optimizer steps the fp32 weights themselves, so a placement whose optimizer runs on the GPU beside them holds
no master copy and the step writes no compute copy; an offloaded optimizer keeps its fp32 copy on the host."""

from __future__ import annotations

import json

import pytest
import torch

from tierflow.cli import main
from tierflow.executor.preflight import RunError, check_in_place
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.costmodel import CostModel
from tierflow.planner.core.memory import placed_bytes
from tierflow.planner.core.models import get_model
from tierflow.planner.core.opkinds import ADAM_GPU
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate
from tierflow.planner.core.simulator import CapacityError
from tierflow.planner.core.workload import PRECISIONS, precision_of
from tierflow.planner.io.deepspeed.config import parse_ds_config
from tierflow.planner.io.planfile import plan_from_graph, write_plan

GPU = Placement.uniform("gpu")
OFFLOADED = Placement(weights=Split(gpu=1.0, cpu=0.0), checkpoints=Split(gpu=1.0, cpu=0.0))


def test_no_master_where_the_optimizer_steps_the_gpu_weights_a_host_master_where_it_is_offloaded():
    m = get_model("gpt3-125m")
    P = m.total_params()
    mp, ip = m.with_precision("fp32"), m.with_precision("fp32-inplace")
    # the optimizer on the GPU: weights 4 + master 4 + m, v 8 (+ the SSD space of nothing) against 4 + 8
    assert placed_bytes(mp, GPU)["gpu"] - placed_bytes(ip, GPU)["gpu"] == 4 * P
    assert placed_bytes(ip, GPU)["gpu"] == (4 + 8) * P
    # an offloaded optimizer (ZeRO-Offload) keeps its fp32 copy on the host in both
    assert placed_bytes(mp, OFFLOADED) == placed_bytes(ip, OFFLOADED)
    assert PRECISIONS["fp32-inplace"].master_bytes_at(False) == 4
    assert PRECISIONS["fp32-inplace"].master_bytes_at(True) == 0
    assert PRECISIONS["tf32-inplace"].master_bytes_at(True) == 0
    assert PRECISIONS["fp32"].master_bytes_at(True) == 4


def test_a_model_that_fits_a_24gb_gpu_in_place_is_refused_with_a_master():
    """gpt3-1.3b in fp32 with everything on a 24 GB GPU: 16 B per parameter (about 21 GB) plus activations
    fits, as plain PyTorch trains it; a master copy beside the weights (20 B) does not."""
    m = get_model("gpt3-1.3b")
    kw = dict(batch=1, micro_batch=1, iterations=2, placement=GPU)
    with pytest.raises(CapacityError, match="gpu memory exceeded"):
        simulate(m.with_precision("fp32"), "rtx4090-lohan", "horizontal", **kw)
    r = simulate(m.with_precision("fp32-inplace"), "rtx4090-lohan", "horizontal", **kw)
    assert r.peak_bytes["gpu"] <= load_profile("rtx4090-lohan").gpu.capacity_bytes


def test_the_in_place_step_writes_no_compute_copy():
    hw = load_profile("a100-80g-nvme")
    adam = {}
    for pr in ("fp32", "fp32-inplace"):
        m = get_model("gpt3-125m").with_precision(pr)
        cfg = make_schedule("horizontal", m, hw, batch=2, micro_batch=1, seq=128, placement=GPU, iterations=1)
        adam[pr] = sum(t.work for t in build_graph(m, hw, cfg).tasks if t.kind == ADAM_GPU)
    # GPU Adam moves 36 B per parameter with the copy into the weights, 32 B without the 4-byte fp32 write
    # (each op's fixed overhead is the same in both)
    P = get_model("gpt3-125m").total_params()
    assert adam["fp32"] - adam["fp32-inplace"] == pytest.approx(4 * P / CostModel(hw).hbm_bps, rel=1e-6)


@pytest.mark.parametrize("stage,expected", [(0, "fp32-inplace"), (1, "fp32"), (2, "fp32"), (3, "fp32")])
def test_the_bridge_trains_a_config_without_16_bit_in_place_only_without_zero(stage, expected):
    """DeepSpeed without ZeRO keeps the client optimizer for fp32 (engine.py _do_optimizer_sanity_check);
    ZeRO's optimizers clone an fp32 partition even of fp32 weights (stage_1_and_2.py, stage3.py)."""
    m = get_model("gpt3-125m")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}}
    ds = parse_ds_config(cfg, "ds.json", m)
    assert ds.precision == expected and precision_of(ds.trained(m)).name == expected
    with_bf16 = parse_ds_config({**cfg, "bf16": {"enabled": True}}, "bf16.json", m)
    assert with_bf16.trained(m) == m


def test_simulate_and_plan_accept_the_in_place_precision(tmp_path, capsys):
    out = {}
    for pr in ("fp32", "fp32-inplace"):
        plan = tmp_path / f"{pr}.json"
        assert main(["simulate", "--model", "tiny-gpt", "--hw", "a100-80g-nvme", "--schedule", "horizontal",
                     "--batch", "4", "--micro-batch", "2", "--precision", pr, "--placement", "gpu", "--json",
                     "--write-plan", str(plan)]) == 0
        out[pr] = json.loads(capsys.readouterr().out)
        assert json.loads(plan.read_text())["model"]["precision"] == pr
        assert main(["simulate", "--plan", str(plan), "--json"]) == 0  # loads, digest and bytes agree
        capsys.readouterr()
    assert out["fp32-inplace"]["peak_bytes"]["gpu"] < out["fp32"]["peak_bytes"]["gpu"]
    assert main(["plan", "--model", "tiny-gpt", "--hw", "a100-80g-nvme", "--batch", "4", "--precision",
                 "fp32-inplace", "--time-limit", "5", "-o", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["model"]["precision"] == "fp32-inplace"


def _inplace_plan(tmp_path):
    hw = load_profile("rtx3090-desktop")
    m = get_model("tiny-gpt").with_precision("fp32-inplace")
    cfg = make_schedule("horizontal", m, hw, batch=2, micro_batch=1, seq=32, placement=GPU, iterations=1)
    plan = plan_from_graph(m, hw, cfg, build_graph(m, hw, cfg))
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    return plan, f


def test_run_executes_the_in_place_plan_in_fp32_and_refuses_it_in_bf16(tmp_path, capsys):
    """In fp32 compute the executor's weights and master are one tensor (TrainState.weights_alias_master),
    as the plan counts; in bf16 it would keep a master the plan does not count: one line, exit 2."""
    plan, f = _inplace_plan(tmp_path)
    check_in_place(plan, torch.float32, "cpu")
    with pytest.raises(RunError, match="fp32-inplace.*bf16.*--precision fp32"):
        check_in_place(plan, torch.bfloat16, "cuda")
    assert main(["run", str(f), "--steps", "1", "--device", "cpu", "--compute-dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fp32-inplace" in err and "\n" not in err
    assert main(["run", str(f), "--steps", "1", "--device", "cpu", "--json"]) == 0
