"""What a run checks before its first step (train_loop.run_plan calls these): the --init files, the device,
the optimizer's settings and the plan's clipping waits, the SSD bytes the run needs, a precision the device
computes as the plan counts it, and a resumed checkpoint's settings against this run's."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from tierflow.executor.checkpoint import check_same_training
from tierflow.executor.device.base import DeviceBackend
from tierflow.executor.device.factory import make_backend
from tierflow.executor.optim.adamw import TrainHyper, check_hyper_extra
from tierflow.executor.optim.clipping import GradNorms
from tierflow.executor.options import RunError
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.core.clipwait import OPTIMIZER_KINDS, wait_for_norm, waits_for_norm
from tierflow.planner.core.graph import CycleError
from tierflow.planner.core.opkinds import ENTRY_TENSORS
from tierflow.planner.core.workload import precision_of
from tierflow.planner.io.planfile import Plan


def check_init_dir(directory: str) -> None:
    """--init: every *.safetensors file must be readable as safetensors and hold only floating-point tensors
    (an int32 weight would otherwise be cast silently). Reads only the headers."""
    from safetensors import SafetensorError, safe_open

    d = Path(directory)
    if not d.is_dir():
        raise RunError(f"--init {d}: not a directory (pass a Hugging Face model directory with "
                       "*.safetensors)")
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as sf:
                for key in sf.keys():
                    dtype = sf.get_slice(key).get_dtype()
                    if not dtype.startswith(("F", "BF")):
                        raise RunError(f"--init {d}: {f.name}: tensor {key!r} has dtype {dtype}, not "
                                       "floating point (convert the checkpoint to float32/bfloat16/float16)")
        except (SafetensorError, OSError, ValueError) as e:
            if isinstance(e, RunError):
                raise
            raise RunError(f"--init {d}: {f.name} is not a readable safetensors file "
                           f"({' '.join(str(e).split())[:80]}); re-download or re-save it") from None


def device_backend(name: str, seed: int = 0) -> DeviceBackend:
    """The device backend of --device (cpu, cuda[:N]; cpu-adversarial[:N], not in --help, for tests)."""
    try:
        return make_backend(name, seed)
    except ValueError as e:
        raise RunError(str(e)) from None


def ssd_need_bytes(plan: Plan, state: TrainState) -> float:
    """SSD bytes this run writes at most: the state's SSD ranges plus the plan's peak of parked activations,
    scaled from the plan's compute dtype (its precision) to the executor's."""
    static = state.ssd_static_bytes()
    pred = plan.predicted or {}
    peak = (pred.get("peak_bytes") or {}).get("ssd")
    dynamic = max(0.0, (peak or 0.0) - plan.graph.static_bytes["ssd"])
    parked = [t for t in plan.graph.tasks if t.resource == "ssd_write" and t.tensor in ENTRY_TENSORS]
    if peak is None and parked:
        dynamic = sum(t.work for t in parked if t.iteration == 0)
    scale = (torch.empty(0, dtype=state.compute_dtype).element_size()
             / precision_of(plan.model).compute_bytes)
    return static + dynamic * scale * 1.1 + (1 << 20)


def check_in_place(plan: Plan, dtype: torch.dtype, device: str) -> None:
    """A plan in an in-place precision (workload.Precision.in_place) counts no fp32 master beside weights that
    lie with the optimizer on the GPU. The executor matches it when it computes in fp32: the compute weights
    and the master are then one tensor (TrainState.weights_alias_master), and an offloaded optimizer keeps
    its master on the host as the plan counts. In 16-bit compute it keeps a master the plan does not count."""
    pr = precision_of(plan.model)
    if pr.in_place and dtype != torch.float32:
        raise RunError(f"{plan.source}: precision {pr.name}: on {device} the executor computes in bf16 and "
                       "keeps an fp32 master the plan does not count (it does not yet compute in the plan's "
                       "fp32 on CUDA); run it with --device cpu, or plan with --precision fp32")


def check_hyper(h: TrainHyper) -> None:
    """The optimizer's settings, refused up front (RunError) rather than diverging at step 1."""
    if not math.isfinite(h.lr) or h.lr <= 0:
        raise RunError(f"--lr {h.lr}: must be a finite number > 0 (e.g. 1e-3)")
    if not math.isfinite(h.weight_decay) or h.weight_decay < 0:
        raise RunError(f"--weight-decay {h.weight_decay}: must be a finite number >= 0 (e.g. 0.1)")
    if check_hyper_extra(h):
        raise RunError(check_hyper_extra(h)[0])


def step_norms(plan: Plan, h: TrainHyper) -> GradNorms:
    """Fresh step norms for a run of `plan` (the Trainer's): each optimizer op of a step adds its squares;
    with several ranks none (each rank steps its shard: no whole-model norm, steps.csv leaves it empty)."""
    parts = sum(1 for t in plan.graph.tasks if t.kind in OPTIMIZER_KINDS and t.iteration == 0)
    if plan.config.world.ranks > 1:
        parts = 0
    return GradNorms(h.clip_grad_norm, h.clip, parts)


def clipping_wait(plan: Plan, h: TrainHyper) -> Plan:
    """The plan to run. With global clipping the plan's optimizer ops must wait for the step's gradients: a
    plan that does not yet is returned with the waits, its queues re-ordered (planner/core/clipwait.py), or
    refused (RunError) if that cannot be done."""
    if h.clip_grad_norm <= 0:
        return plan
    if plan.config.world.ranks > 1:
        raise RunError(f"--clip-grad-norm: plan {plan.source} has {plan.config.world.ranks} ranks; clipping "
                       "runs on one rank only for now (drop --clip-grad-norm or plan for one GPU)")
    if h.clip == "global" and not waits_for_norm(plan.graph):
        try:
            return dataclasses.replace(plan, graph=wait_for_norm(plan.graph))
        except CycleError:
            raise RunError(f"--clip-grad-norm: plan {plan.source} cannot wait for the step's last gradient "
                           "before its optimizer steps (exact global clipping); pass --clip delayed (the "
                           "previous step's norm)") from None
    return plan


HYPER_NAMES = {"seed": "--seed", "lr": "--lr", "weight_decay": "--weight-decay", "beta1": "--adam-betas",
               "beta2": "--adam-betas", "eps": "--adam-eps", "data": "--data", "schedule": "--lr-schedule",
               "warmup_steps": "--warmup-steps", "total_steps": "--steps (of the schedule)",
               "clip_grad_norm": "--clip-grad-norm", "clip": "--clip"}


def changed_settings(manifest: dict, settings: dict) -> list[tuple[str, object, object]]:
    """(name, checkpoint's value, this run's) of every seed / hyper-parameter / data source that differs."""
    old = {"seed": manifest.get("seed"), "data": manifest.get("data"), **(manifest.get("hyper") or {})}
    new = {"seed": settings["seed"], "data": settings["data"], **settings["hyper"]}
    return [(k, old[k], new.get(k)) for k in old if old[k] is not None and old[k] != new.get(k)]


def check_resume(ckpt: Path, manifest: dict, settings: dict, directory: str, allow_changed: bool,
                 warn) -> None:
    """A checkpoint of another plan is refused; one of other settings too, unless --allow-changed-hyper."""
    if check_same_training(ckpt, manifest, settings, f"--checkpoint-dir {directory}"):
        warn(f"resuming {ckpt.name}, written under another plan of the same model and batch: its state moves "
             "to this plan's tiers")
    diff = changed_settings(manifest, settings)
    if not diff:
        return
    what = ", ".join(f"{HYPER_NAMES.get(k, k)} {a!r} -> {b!r}" for k, a, b in diff)
    if not allow_changed:
        raise RunError(f"--checkpoint-dir {directory}: {ckpt.name} was written with other settings "
                       f"(checkpoint -> this run: {what}); resume with the checkpoint's, or pass "
                       "--allow-changed-hyper to continue with this run's")
    warn(f"resuming {ckpt.name} with changed settings ({what}), as --allow-changed-hyper asks")
