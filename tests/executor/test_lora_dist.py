"""LoRA on several ranks (docs/lora.md): 2 gloo ranks on the CPU train tiny-llama's adapters (dropout 0.1) as
1 rank training the whole batch does (losses and adapters within float tolerance), every rank's adapters and
moments identical after the run, the frozen base all-gathered and read only (no SSD write after set-up), a
checkpoint of 2 ranks resumed bit for bit, and --export-peft written once. All 2-rank cases run in one
torchrun launch (tests/support/lora_dist_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.lora_dist_worker import make_plan, run_config

from tierflow.executor.lora_peft import read_peft
from tierflow.executor.run import run_plan

HERE = Path(__file__).resolve().parents[1]  # tests/
HOST = [0.0, 1.0, 0.0]  # the frozen base in host memory
TIERED = [0.3, 0.3, 0.4]  # over the device, host memory and the SSD tier
CASES = {  # name: (family, base's split, steps, device)
    "fuyou-host": ("fuyou", HOST, 3, "cpu"),
    "vertical-tiered": ("vertical", TIERED, 3, "cpu"),
    "horizontal-tiered": ("horizontal", TIERED, 4, "cpu"),
    # the all-reduce on the net worker's stream, handed to the compute stream's adam_gpu, on the adversarial
    # emulation of a CUDA device (executor/device/emulated.py)
    "fuyou-tiered-emulated": ("fuyou", TIERED, 3, "cpu-adversarial"),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank case, one torchrun launch: {"<case>.rank<r>": that rank's result} and the directories."""
    tmp = tmp_path_factory.mktemp("lora-dist")
    out, ck, peft = tmp / "out", tmp / "ck", tmp / "peft"
    out.mkdir()
    cases = [{"name": n, "family": f, "weights": w, "steps": s, "device": d, "ssd_dir": str(tmp / "ssd")}
             for n, (f, w, s, d) in CASES.items()]
    cases[0]["export_peft"] = str(peft)
    ck_case = {"family": "horizontal", "weights": TIERED, "ssd_dir": str(tmp / "ssd"),
               "checkpoint_dir": str(ck), "checkpoint_every": 2}
    cases += [{**ck_case, "name": "ck-first", "steps": 2}, {**ck_case, "name": "ck-resumed", "steps": 4}]
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        "2", str(HERE / "support" / "lora_dist_worker.py"), str(spec), str(out)],
                       capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return {f.stem: torch.load(f) for f in out.glob("*.pt")} | {"_ck": ck, "_peft": peft}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_train_the_adapters_as_one_rank(two_ranks, name, tmp_path):
    family, weights, steps, device = CASES[name]
    r0, r1 = two_ranks[f"{name}.rank0"], two_ranks[f"{name}.rank1"]
    assert "all_reduce_grads" in r0["kinds"] and "all_gather_weights" in r0["kinds"]
    assert "reduce_scatter_grads" not in r0["kinds"]
    for r in (r0, r1):  # each rank's shard of the base on the SSD tier: written at set-up, then read
        assert (r["ssd_written"] > 0) == (r["ssd_read"] > 0) == (weights[2] > 0)
    # every rank ends with the same adapters and moments, bit for bit (each steps the all-reduced sum)
    assert r0["losses"] == r1["losses"]
    for key, value in r0["adapters"].items():
        assert torch.equal(r1["adapters"][key], value), key
        assert torch.equal(r1["adam_m"][key], r0["adam_m"][key]), key
    # against one rank training the whole batch of 4 (the same base, adapters, data and dropout masks)
    one = run_plan(make_plan(family, weights, 1),
                   run_config({"steps": steps, "ssd_dir": str(tmp_path), "device": device}))
    assert r0["losses"] == pytest.approx(one.losses, rel=1e-5)
    for key, value in one.final_lora.items():
        assert _rel(r0["adapters"][key], value) < 1e-4, key
        if key.endswith("lora_B"):  # it trains: every B moved off its zeros
            assert value.abs().max() > 0, key


def test_a_checkpoint_of_two_ranks_resumes_bit_for_bit(two_ranks):
    straight, first = two_ranks["horizontal-tiered.rank0"], two_ranks["ck-first.rank0"]
    assert first["losses"] == straight["losses"][:2]
    for r in range(2):  # the SSD tier written at set-up only: 2 steps write what 4 steps write
        runs = [two_ranks[f"{n}.rank{r}"] for n in ("ck-first", "horizontal-tiered")]
        assert runs[0]["ssd_written"] == runs[1]["ssd_written"] > 0
        assert 2 * runs[0]["ssd_read"] == runs[1]["ssd_read"]
    ck: Path = two_ranks["_ck"]
    latest = ck / (ck / "latest").read_text().strip()
    manifest = json.loads((latest / "manifest.json").read_text())
    assert manifest["world"] == {"ranks": 2} and manifest["lora"]["rank"] == 4
    assert manifest["base"]["model"] == "tiny-llama"
    for r in range(2):  # each rank's copy of the adapters: no base block in the checkpoint
        shard = json.loads((latest / f"rank-{r}" / "manifest.json").read_text())
        assert sorted(shard["files"]) == ["adapters.safetensors"]
    for r in range(2):
        resumed = two_ranks[f"ck-resumed.rank{r}"]
        assert resumed["first_step"] == 2
        assert resumed["losses"] == straight["losses"][2:]  # bit for bit
        for key, value in straight["adapters"].items():
            assert torch.equal(resumed["adapters"][key], value), key
            assert torch.equal(resumed["adam_m"][key], straight["adam_m"][key]), key


def test_export_peft_is_written_once(two_ranks):
    peft: Path = two_ranks["_peft"]
    assert sorted(p.name for p in peft.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in peft.parent.iterdir() if p.name.startswith(".") and "peft" in p.name]
    plan = make_plan("fuyou", HOST, 2)
    _config, adapters = read_peft(peft, plan.model)
    for key, value in two_ranks["fuyou-host.rank0"]["adapters"].items():
        assert torch.equal(adapters[key], value), key
