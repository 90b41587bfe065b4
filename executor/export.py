"""What `tierflow run` writes: steps.csv and the measured trace under --out (`write_run_outputs`), the
trained weights as a Hugging Face model directory (--export-hf: `check_export_hf` before training,
`export_trained` after it), and torch.profiler's Chrome trace (--profile)."""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from tierflow.executor.lora import merge_into
from tierflow.executor.models import export_hf, hf_config
from tierflow.executor.options import RunError
from tierflow.executor.tiers.state import TrainState
from tierflow.outputs import atomic_path
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.io.planfile import Plan


@dataclass
class StepRecord:
    step: int
    loss: float
    step_s: float
    tokens_per_s: float
    tflops: float
    lr: float = 0.0  # the step's learning rate (its schedule's)
    grad_norm: float | None = None  # the L2 norm of the step's gradients before clipping
    val_loss: float | None = None  # after this step, with --eval-every
    val_ppl: float | None = None
    # peak bytes of the round this step ran in, per tier, by the plan's memory effects
    gpu_bytes: float = 0.0
    cpu_bytes: float = 0.0
    ssd_bytes: float = 0.0


def write_run_outputs(measured: SimResult | None, records: list[StepRecord], out: str, name: str) -> None:
    """steps.csv, and the measured trace (timeline.csv, trace.json,
    gantt.png) of the longest round when one has finished."""
    from tierflow.planner.core.trace import write_outputs

    Path(out).mkdir(parents=True, exist_ok=True)
    if measured is not None:
        write_outputs(measured, out, name=name)
    with atomic_path(Path(out) / "steps.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        names = [f.name for f in dataclasses.fields(StepRecord)]  # step, loss, ..., lr, grad_norm, val_loss
        w.writerow(names)
        for r in records:
            w.writerow(["" if v is None else repr(v) if k == "loss" else v
                        for k, v in ((k, getattr(r, k)) for k in names)])


def check_export_hf(directory: str, plan: Plan) -> None:
    """Before training: the model has a Hugging Face layout and the directory is new or empty
    (never overwritten)."""
    try:
        hf_config(plan.model)
    except ValueError as e:
        raise RunError(f"--export-hf: {e}") from None
    d = Path(directory)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise RunError(f"--export-hf {d}: exists and is not an empty directory (give a new or empty one; "
                       "tierflow does not overwrite it)")
    try:  # made now, so that an unwritable place fails before training rather than after it
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"--export-hf {d}: cannot create it ({e.strerror}); give a writable "
                       "directory") from None


def export_trained(state: TrainState, directory: str) -> Path:
    """The fp32 master weights of every block, written as config.json + model.safetensors (transformers'
    layout); a LoRA run's base with its adapters merged (one rank). With several ranks every rank calls it
    (the weights are gathered from the shards) and rank 0 writes."""
    if state.lora is not None:  # LoRA: the base with the adapters merged (W + alpha / rank * B A)
        base = state.master_blocks()
        blocks = [state.layout.params(b, v) for b, v in enumerate(base)]
        blocks = [merge_into(state.lora, b, p) if b in state.lora.master else p for b, p in enumerate(blocks)]
        return export_hf(state.spec, blocks, directory)
    blocks = [state.layout.params(b, state.gathered("master", b)) for b in range(len(state.layout.numel))]
    if state.world.rank != 0:
        return Path(directory)
    return export_hf(state.spec, blocks, directory)


def profiler_of(device: torch.device) -> torch.profiler.profile:
    """torch.profiler over every thread (the executor runs its ops on one worker thread per resource; by
    default the profiler records only the thread that started it)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(activities=activities, experimental_config=every_thread)


def export_profile(profiler: torch.profiler.profile, out: str, log=None) -> None:
    """Stop `profiler` and write its Chrome trace, torch_trace.json, under `out` (said with `log`)."""
    profiler.stop()
    Path(out).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(out) / "torch_trace.json") as tmp:
        profiler.export_chrome_trace(str(tmp))
    if log is not None:
        log(f"  wrote torch_trace.json (torch.profiler; each op under a record_function 'op ID KIND "
            f"bBLOCK ...') under {out}")
