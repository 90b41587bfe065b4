"""The executor tests' harness (tests/executor/test_executor.py and the executor's other tests): plans of the
tiny models under named placements, plain PyTorch AdamW as the reference, and one call that runs a plan."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tierflow.executor.data import TokenData
from tierflow.executor.engine import Hyper
from tierflow.executor.models import BlockModel, build_blocks
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.optim.decay import decayed
from tierflow.executor.run import OptimizerOptions, OutputOptions, RunConfig, RunResult, run_plan
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import plan_from_graph

HW = load_profile("rtx3090-desktop")
BATCH, MICRO, SEQ, STEPS = 4, 1, 64, 5
HYPER = Hyper(lr=1e-3, weight_decay=0.1)
ALL = Split(0.0, 0.0, 1.0)
PLACEMENTS = {
    "device": Placement.uniform("gpu"),
    "weights_cpu": Placement(checkpoints=Split(1.0, 0.0, 0.0)),
    "states_ssd": Placement(master=ALL, adam_m=ALL, adam_v=ALL),
    "ckpt_ssd": Placement(checkpoints=ALL),
    "mix": Placement(weights=Split(0.3, 0.4, 0.3), master=Split(0.0, 0.5, 0.5), adam_m=Split(0.0, 0.3, 0.7),
                     adam_v=Split(0.0, 1.0, 0.0), grads=Split(0.0, 0.5, 0.5),
                     checkpoints=Split(0.2, 0.3, 0.5)),
}


def make_plan(model_name: str, family: str, placement: str = "weights_cpu", alpha: float = 0.0,
              iterations: int = 2, swap_layers: int | None = None, batch: int = BATCH, micro: int = MICRO):
    model = get_model(model_name)
    swap = (2 if placement == "mix" else 0) if swap_layers is None else swap_layers
    cfg = make_schedule(family, model, HW, batch=batch, micro_batch=micro, seq=SEQ,
                        placement=PLACEMENTS[placement], alpha=alpha, iterations=iterations,
                        swap_layers=swap)
    return plan_from_graph(model, HW, cfg, build_graph(model, HW, cfg))


@functools.cache
def reference(model_name: str, steps: int = STEPS, batch: int = BATCH, micro: int = MICRO, seed: int = 0):
    """Plain PyTorch: the same blocks chained, torch.optim.AdamW, gradient accumulation over the
    micro-batches."""
    model = get_model(model_name)
    torch.manual_seed(seed)
    ref = BlockModel(model, build_blocks(model))
    opt = torch.optim.AdamW(decay_groups(ref, HYPER.weight_decay), lr=HYPER.lr,
                            betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps)
    data = TokenData.load(None, model.vocab_size, seed=seed)
    losses = []
    M = batch // micro
    for s in range(steps):
        x, y = data.batch(s, batch, SEQ)
        opt.zero_grad()
        total = 0.0
        for m in range(M):
            loss = lm_loss(ref(x[m * micro:(m + 1) * micro]), y[m * micro:(m + 1) * micro])
            (loss / M).backward()
            total += loss.item() / M
        opt.step()
        losses.append(total)
    return losses, [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in ref.blocks]


def decay_groups(ref: BlockModel, weight_decay: float) -> list[dict]:
    """torch.optim.AdamW's two parameter groups: biases and norm weights without weight decay."""
    named = [(n, p) for b in ref.blocks for n, p in b.named_parameters()]
    return [{"params": [p for n, p in named if decayed(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not decayed(n)], "weight_decay": 0.0}]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


OPTIMIZER = OptimizerOptions(lr=HYPER.lr, weight_decay=HYPER.weight_decay)  # the reference's AdamW
QUIET = OutputOptions(quiet=True, collect_final=True)


def run(plan, tmp_path: Path, steps: int = STEPS, device: str = "cpu", **groups) -> RunResult:
    """run_plan on a CPU device (or `device`) with the SSD tier under tmp_path; `groups`: RunConfig's other
    fields (the optimizer: the reference's; the output: quiet, with the final state)."""
    ssd = tmp_path / "ssd"
    ssd.mkdir(exist_ok=True)
    groups.setdefault("optimizer", OPTIMIZER)
    groups.setdefault("output", QUIET)
    return run_plan(plan, RunConfig(steps=steps, device=device, ssd_dir=str(ssd), **groups))
