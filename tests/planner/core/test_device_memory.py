"""Device memory as CUDA spends it: the planner's per-op working memory against what the executor's own op
code allocates (experiments/device_memory.py, run here at small shapes in bf16 on the CPU), the CUDA
runtime's bytes under the allocator's cap in every plan the executor runs on a GPU
(tierflow.planner.core.devicemem), and the checks that keep a run within the cap it was planned for."""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tierflow.executor.device import cuda as cuda_backend
from tierflow.executor.device.base import TierOutOfMemory
from tierflow.hwprofiles import load_profile
from tierflow.planner.core import devicemem
from tierflow.planner.core.memory import placed_bytes, schedule_memory, static_bytes
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import CapacityError, simulate_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
import device_memory  # noqa: E402

# How far above the measured peak the planner's figure may lie. The recomputed layer's backward counts every
# saved activation and every weight gradient at once (the measured peak has the MLP's saved tensors and only
# some weight gradients), and a swapped layer's forward counts its no-grad working memory beside the saved
# activations the task graph offloads: those two are 1.3-1.7x, every other op kind 1.0-1.4x (the committed
# sweep, experiments/results/device_memory.csv).
MAX_MARGIN = 1.75
GPU = load_profile("rtx3090-desktop")
CPU_DEVICE = GPU.with_overrides({"gpu.host_cores": 2.0})


@pytest.mark.parametrize("case", device_memory.QUICK, ids=lambda c: f"{c.model}-{c.kind}")
def test_the_planners_per_op_figure_covers_what_the_op_allocates(case):
    row = device_memory.run_case(case)
    measured, planned = row["measured_bytes"], row["planned_bytes"]
    assert measured > 0
    assert planned >= measured, (case, measured, planned)
    assert planned <= MAX_MARGIN * measured, (case, measured, planned)


def test_the_old_embedding_backward_figure_would_fail():
    """The check can fail: the embedding's backward counted as a compute-dtype gradient (the figure before
    the executor's fp32 one was counted) is half the measured peak."""
    case = next(c for c in device_memory.QUICK if c.kind == "embed_bwd")
    row = device_memory.run_case(case)
    spec = case.spec()
    old = 2 * 2 * case.seq * spec.hidden + 2 * spec.embedding_params()
    assert old < 0.6 * row["measured_bytes"]


def test_the_experiment_writes_its_table(tmp_path):
    rows = device_memory.run(out_dir=tmp_path, cases=[device_memory.QUICK[1]])
    with open(tmp_path / "device_memory.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["kind"] for r in table] == ["fwd"] and len(rows) == 1
    assert set(device_memory.FIELDS) == set(table[0])
    assert int(table[0]["planned_bytes"]) >= int(table[0]["measured_bytes"]) > 0


def test_cublas_workspace_sizes_are_pytorchs():
    # PyTorch's parse of CUBLAS_WORKSPACE_CONFIG: SIZE KiB x COUNT summed over the pairs
    assert devicemem.cublas_workspace_bytes(":4096:8") == 32 * 2**20
    assert devicemem.cublas_workspace_bytes(":4096:2:16:8") == 8 * 2**20 + 128 * 2**10
    with pytest.raises(ValueError, match="SIZE:COUNT"):
        devicemem.cublas_workspace_bytes("4096")


def test_the_executor_sets_the_workspace_the_plan_counts(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: None)
    cuda_backend.enable_determinism()
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == devicemem.CUBLAS_WORKSPACE_CONFIG


def test_a_gpu_plan_holds_the_cuda_runtime_and_a_cpu_device_or_deepspeed_none():
    model = get_model("gpt3-125m")
    cpu = Split(0.0, 1.0, 0.0)
    placement = Placement(weights=cpu, master=cpu, adam_m=cpu, adam_v=cpu, grads=cpu, checkpoints=cpu)
    runtime = devicemem.cuda_runtime_memory()
    assert runtime.workspace_bytes == 33 * 2**20 and runtime.page_bytes == 3 * 22 * 2**20
    placed = placed_bytes(model, placement)["gpu"]
    assert static_bytes(model, placement, "ideal", hw=GPU)["gpu"] == placed + runtime.total_bytes
    assert static_bytes(model, placement, "lohan", hw=GPU)["gpu"] == placed + runtime.total_bytes
    assert static_bytes(model, placement, "ideal", hw=CPU_DEVICE)["gpu"] == placed
    ds = static_bytes(model, placement, "deepspeed", hw=GPU)["gpu"] - static_bytes(model, placement,
                                                                                  "deepspeed")["gpu"]
    assert ds == 0
    # two ranks: the collectives' stream has pools of its own
    assert devicemem.cuda_runtime_memory(2).page_bytes == 4 * 22 * 2**20
    # the closed-form estimate counts it as the task graph does
    kw = dict(micro_batch=1, seq=128, num_micro_batches=2, group=2, alpha=0.0, optimizer_overlap=True,
              prefetch_depth=1)
    on_gpu = schedule_memory(model, hw=GPU, **kw).tier_bytes(placement, 0)["gpu"]
    unknown = schedule_memory(model, **kw).tier_bytes(placement, 0)["gpu"]
    assert on_gpu - unknown == runtime.total_bytes


def test_a_cap_below_the_runtimes_bytes_is_refused_before_the_run():
    """The issue's quick check capped tiny-gpt at 0.02 GiB: CUDA's workspaces alone exceed it. The simulator
    (plan, simulate and run alike) now says so up front, naming the tier, the amount and the fix."""
    model = get_model("tiny-gpt")
    hw = GPU.with_overrides({"gpu.memory_gib": 0.02, "gpu.reserved_gib": 0.0})
    cpu = Split(0.0, 1.0, 0.0)
    placement = Placement(weights=cpu, master=cpu, adam_m=cpu, adam_v=cpu, grads=cpu, checkpoints=cpu)
    cfg = make_schedule("vertical", model, hw, batch=2, micro_batch=1, seq=64, placement=placement,
                        iterations=2)
    with pytest.raises(CapacityError) as info:
        simulate_graph(build_graph(model, hw, cfg), hw)
    msg = str(info.value)
    assert info.value.tier == "gpu" and info.value.exit_code == 3
    assert "exceeded by" in msg and "fix:" in msg and "\n" not in msg
    # the same cap on a CPU device (no CUDA runtime) runs
    cpu_dev = hw.with_overrides({"gpu.host_cores": 2.0})
    assert simulate_graph(build_graph(model, cpu_dev, replace(cfg)), cpu_dev).peak_bytes["gpu"] > 0


def test_a_cap_the_gpu_cannot_give_is_refused():
    gib = 2**30
    cuda_backend.check_cap_fits(10 * gib, 9 * gib, 80 * gib, 1 * gib, "cuda:0")  # free + held by us: fits
    with pytest.raises(TierOutOfMemory) as info:
        cuda_backend.check_cap_fits(79.5 * gib, 79 * gib, 80 * gib, 0, "cuda:0")
    msg = str(info.value)
    assert info.value.exit_code == 3 and "cuda:0" in msg and "gpu.reserved_gib raised by 0.50" in msg


def test_cap_memory_asks_cuda_what_is_free(monkeypatch):
    """CudaBackend.cap_memory with torch.cuda faked (no GPU here): it refuses a cap above the free memory
    and sets the allocator's fraction otherwise."""
    gib = 2**30
    fraction = []

    class Props:
        total_memory = 80 * gib

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: fraction.append(f))
    be = object.__new__(cuda_backend.CudaBackend)
    be.device = torch.device("cuda", 0)
    be.cap_memory(40 * gib)
    assert fraction == [0.5]
    with pytest.raises(TierOutOfMemory):
        be.cap_memory(75 * gib)
    assert fraction == [0.5]


def test_closing_a_rounds_streams_frees_their_cublas_workspaces(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append("sync"))
    be = object.__new__(cuda_backend.CudaBackend)
    be.device = torch.device("cuda", 0)
    be.close_streams([])
    assert calls == ["sync", "clear"]
