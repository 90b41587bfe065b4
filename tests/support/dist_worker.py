"""One rank of the data-parallel executor tests (tests/executor/test_dist_executor.py,
experiments/dist_executor.py): started by torchrun, it trains the cases of a JSON file one after the other in
one process group and rank 0 saves each case's losses, final fp32 master weights and Adam m (gathered from the
shards) to OUT/<name>.pt, or the error it raised.

    python -m torch.distributed.run --nproc-per-node 2 tests/support/dist_worker.py cases.json OUT

A case: {"name", "family", "placement", "steps", "model"?, "batch"?, "alpha"?, "device"?, "ssd_dir",
"checkpoint_dir"?, "checkpoint_every"?, "resume_fallback"?, "remove_shard"?: the rank whose shard of the
latest checkpoint rank 0 deletes first, "compute_dtype"?: "bf16" | "fp32", "optimizer_states"?: a format of
tierflow.planner.core.optstates}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from tierflow.executor.checkpoint import CheckpointError, candidates
from tierflow.executor.engine import Hyper
from tierflow.executor.run import CheckpointOptions, OptimizerOptions, OutputOptions, RunConfig, run_plan
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import plan_from_graph

BATCH, MICRO, SEQ = 4, 1, 64
HYPER = Hyper(lr=1e-3, weight_decay=0.1)
OPTIMIZER = OptimizerOptions(lr=HYPER.lr, weight_decay=HYPER.weight_decay)  # the run's: HYPER's
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


def box(gpus: int, nodes: int = 1):
    """The test box with `gpus` GPUs (and a network when there are several boxes)."""
    over = {"topology.gpu_count": max(gpus, 1)}
    if nodes > 1:
        over["network.gbps"] = 12.5
    return load_profile("rtx3090-desktop").with_overrides(over)


def make_plan(model_name: str, family: str, placement: str, gpus: int = 1, nodes: int = 1,
              alpha: float = 0.25, iterations: int = 2, batch: int = BATCH,
              optimizer_states: str | None = None):
    model = get_model(model_name).with_optimizer_states(optimizer_states)
    hw = box(gpus, nodes)
    cfg = make_schedule(family, model, hw, batch=batch, micro_batch=MICRO, seq=SEQ,
                        placement=PLACEMENTS[placement], alpha=alpha, iterations=iterations,
                        swap_layers=2 if placement == "mix" else 0, gpus=gpus, nodes=nodes)
    return plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))


def run_case(case: dict, out: Path, ranks: int, rank: int) -> None:
    plan = make_plan(case.get("model", "tiny-gpt"), case["family"], case["placement"], gpus=ranks,
                     alpha=case.get("alpha", 0.25), batch=case.get("batch", BATCH),
                     optimizer_states=case.get("optimizer_states"))
    ck = case.get("checkpoint_dir")
    if case.get("remove_shard") is not None and rank == 0:
        latest, _steps, _problem = candidates(ck)
        shutil.rmtree(latest / f"rank-{case['remove_shard']}")
    Path(case["ssd_dir"]).mkdir(parents=True, exist_ok=True)
    opts = RunConfig(steps=case["steps"], ssd_dir=case["ssd_dir"], device=case.get("device", "cpu"),
                     compute_dtype=case.get("compute_dtype"), optimizer=OPTIMIZER,
                     checkpoint=CheckpointOptions(ck, every=case.get("checkpoint_every", 0),
                                                  resume_fallback=case.get("resume_fallback", False)),
                     output=OutputOptions(quiet=True, collect_final=True))
    try:
        res = run_plan(plan, opts)
    except CheckpointError as e:
        if rank == 0:
            torch.save({"error": str(e), "type": type(e).__name__}, out / f"{case['name']}.pt")
        return
    if rank == 0:
        torch.save({"losses": res.losses, "adam_m": res.final_adam_m, "first_step": res.first_step,
                    "final": res.final_master,
                    "checkpoint": str(res.checkpoint) if res.checkpoint else None,
                    "ssd_bytes": res.ssd_bytes_read + res.ssd_bytes_written,
                    "kinds": sorted({t.kind for t in plan.graph.tasks})}, out / f"{case['name']}.pt")


def main(cases_path: str, out_dir: str) -> int:
    ranks, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out = Path(out_dir)
    for case in json.loads(Path(cases_path).read_text()):
        t0 = time.perf_counter()
        run_case(case, out, ranks, rank)
        if rank == 0:
            print(f"case {case['name']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
