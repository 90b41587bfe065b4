"""One rank of the data-parallel LoRA tests (tests/executor/test_lora_dist.py): started by torchrun, it trains
the cases of a JSON file one after the other in one process group, and EVERY rank saves its own losses, final
adapters and their first moments to OUT/<name>.rank<r>.pt (or the error it raised), so that the test can
compare the ranks' adapters with each other and with one rank's.

    python -m torch.distributed.run --nproc-per-node 2 tests/support/lora_dist_worker.py cases.json OUT

A case: {"name", "family", "steps", "ssd_dir", "weights": [gpu, cpu, ssd] of the frozen base, "device"?
("cpu" or "cpu-adversarial", the CUDA emulation), "checkpoint_dir"?, "checkpoint_every"?, "export_peft"?}.
The model: tiny-llama with LORA's adapters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tierflow.executor.checkpoint import CheckpointError
from tierflow.executor.run import CheckpointOptions, OptimizerOptions, OutputOptions, RunConfig, run_plan
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.lora import LoraConfig
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import plan_from_graph

BATCH, MICRO, SEQ = 4, 1, 32
LORA = LoraConfig(rank=4, alpha=8, dropout=0.1)  # dropout: the ranks must drop what one rank drops
OPTIMIZER = OptimizerOptions(lr=2e-3, weight_decay=0.0)


def make_plan(family: str, weights: list[float], gpus: int, iterations: int = 2):
    """A LoRA plan of tiny-llama for `gpus` ranks on the test box, the base split over the tiers as
    `weights` says (the checkpoints in host memory)."""
    model = get_model("tiny-llama").with_lora(LORA)
    hw = load_profile("rtx3090-desktop").with_overrides({"topology.gpu_count": max(gpus, 1)})
    placement = Placement(weights=Split(*weights), checkpoints=Split(0.0, 1.0, 0.0))
    cfg = make_schedule(family, model, hw, batch=BATCH, micro_batch=MICRO, seq=SEQ, placement=placement,
                        iterations=iterations, gpus=gpus)
    return plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))


def run_config(case: dict) -> RunConfig:
    return RunConfig(steps=case["steps"], ssd_dir=case["ssd_dir"], device=case.get("device", "cpu"),
                     optimizer=OPTIMIZER,
                     checkpoint=CheckpointOptions(case.get("checkpoint_dir"),
                                                  every=case.get("checkpoint_every", 0)),
                     output=OutputOptions(quiet=True, collect_final=True,
                                          export_peft=case.get("export_peft")))


def run_case(case: dict, out: Path, ranks: int, rank: int) -> None:
    plan = make_plan(case["family"], case["weights"], ranks)
    Path(case["ssd_dir"]).mkdir(parents=True, exist_ok=True)
    path = out / f"{case['name']}.rank{rank}.pt"
    try:
        res = run_plan(plan, run_config(case))
    except CheckpointError as e:
        torch.save({"error": str(e), "type": type(e).__name__}, path)
        return
    torch.save({"losses": res.losses, "first_step": res.first_step, "adapters": res.final_lora,
                "adam_m": res.final_lora_adam_m, "ssd_read": res.ssd_bytes_read,
                "ssd_written": res.ssd_bytes_written,
                "kinds": sorted({t.kind for t in plan.graph.tasks})}, path)


def main(cases_path: str, out_dir: str) -> int:
    ranks, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    for case in json.loads(Path(cases_path).read_text()):
        run_case(case, Path(out_dir), ranks, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
