"""`tierflow run PLAN` as a library call (`run_file`), and its ranks: the configuration's checks before the
plan is loaded, the run (train_loop.run_plan), and what ends a rank of several. The command line
(tierflow/cli/run.py) builds the configuration (executor/options.py: RunConfig), prints what this returns,
maps what it raises to the exit code (tierflow/cli/exits.py) and ends the process.

A plan for several ranks (gpus x nodes) runs as that many processes under torchrun (dist.py): `launch_ranks`
starts torchrun here for `--nproc N`, and every rank comes back through `run_file`. When another rank dies
(or a collective breaks) a rank removes its box's dead ranks' SSD-tier directories and raises `RankLost`
naming the rank, the steps done and the checkpoint kept; `leave_world` readies a rank's process to end,
bounded, so that torchrun sees every rank end.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tierflow.errors import DoesNotFit, TierflowError
from tierflow.executor.device.base import TierOutOfMemory
from tierflow.executor.dist import (
    LaunchError,
    RankLost,
    current_world,
    launched_ranks,
    launcher_gone,
    launcher_pid,
    leave_cleanly,
    lost_ranks,
    note_exit,
)
from tierflow.executor.engine import OutOfMemory
from tierflow.executor.lora_peft import check_peft_dir, check_peft_options
from tierflow.executor.options import RunConfig
from tierflow.executor.preflight import check_init_dir
from tierflow.executor.signals import Interrupted, StopOnSignals
from tierflow.executor.tiers.arena import TransferAreaOutOfMemory
from tierflow.executor.train_loop import RunResult, RunStopped, run_plan
from tierflow.outputs import check_output_dir
from tierflow.planner.core.simulator import CapacityError
from tierflow.planner.io.planfile import check_ops_match_decisions, load_plan, simulate_plan


class StateOutOfMemory(DoesNotFit):
    """A tier out of memory while the training state is built on it, before any op (exit 3)."""

    prefix = ""  # the message says it

    def __init__(self, e: TierOutOfMemory) -> None:
        super().__init__(f"{e.tier} out of memory for the training state: {e}; plan again for this machine "
                         "(tierflow calibrate, then tierflow plan --hw box.yaml)")


def check_run_outputs(config: RunConfig) -> None:
    """--out, --export-hf, --export-peft and --checkpoint-dir, checked before the plan is loaded and any step
    runs (tierflow.outputs): an unwritable place or a user's non-empty --out (unless --overwrite) or
    --export-peft is refused with one line, exit 2 (a non-empty --export-hf too, by export.check_export_hf);
    --init-peft must be an adapter directory (lora_peft.check_peft_dir)."""
    out, ck = config.output, config.checkpoint.directory
    if out.out:
        check_output_dir(out.out, "--out", overwrite=out.overwrite)
    if out.export_hf:
        check_output_dir(out.export_hf, "--export-hf", overwrite=True)  # writable; new or empty: run_plan
    if out.export_peft:
        check_output_dir(out.export_peft, "--export-peft")
    if config.model_data.init_peft:
        check_peft_dir(config.model_data.init_peft)
    if ck:  # resumed from: may hold checkpoints, must be writable
        check_output_dir(ck, "--checkpoint-dir", overwrite=True)


def run_file(config: RunConfig, log=print) -> RunResult:
    """`tierflow run PLAN` on this process (one rank of several, or the only one): the outputs checked, the
    plan file loaded and checked against its ops and tiers, then trained (train_loop.run_plan). Raises the
    run's errors (TierflowError), and RunStopped (its result: the steps so far) when the run stopped early;
    a rank whose launcher died (dist.watch_launcher) raises RankLost, whatever stopped it (the SIGTERM, a
    collective its peers left, a checkpoint they did not finish)."""
    try:
        return _run_file(config, log)
    except (Exception, Interrupted) as e:
        if launcher_gone() and not isinstance(e, RankLost):
            raise rank_lost(config, getattr(e, "result", None)) from None
        raise


def _run_file(config: RunConfig, log=print) -> RunResult:
    t0 = time.perf_counter()
    try:
        # a rank of several that meets an error says why and ends (leave_world) before a signal can end it
        with StopOnSignals(hold_on_error=launched_ranks() > 1):
            check_run_outputs(config)
            plan = load_plan(config.plan)
            check_ops_match_decisions(plan)  # every decision the ops depend on, before op 1
            # a plan that overflows a tier is refused as `tierflow simulate --plan` refuses it
            simulate_plan(plan)
            if config.model_data.init:
                check_init_dir(config.model_data.init)
            md = config.model_data
            check_peft_options(config.output.export_peft, md.init_peft, md.init, plan.model)
            t0 = time.perf_counter()
            res = run_plan(plan, config, log)
            res.wall_s = time.perf_counter() - t0
            return res
    except RunStopped as e:
        # torchrun's SIGTERM after another rank died, or the kernel's when the launcher did (watch_launcher)
        if e.exit_code in (130, 143) and (lost_ranks() or launcher_gone()):
            raise rank_lost(config, e.result) from None
        if e.result is not None:
            e.result.wall_s = time.perf_counter() - t0
        raise
    except Interrupted as e:
        if lost_ranks() or launcher_gone():
            raise rank_lost(config, None) from None
        raise RunStopped(f"interrupted by {e.name} outside the training steps; stopped cleanly, the SSD "
                         "tier's files removed", e.exit_code, None) from None
    # out of memory: an op, the pinned transfer area allocated at start, or a plan over a tier (said as is)
    except (OutOfMemory, TransferAreaOutOfMemory, CapacityError):
        raise
    except TierOutOfMemory as e:  # building the state on its tiers, before any op
        raise StateOutOfMemory(e) from None
    except TierflowError as e:
        # a failure the ranks agreed on is this run's own (the first rank to exit may be gone already)
        if not getattr(e, "agreed", False) and lost_ranks():
            raise rank_lost(config, None) from None
        raise
    except RuntimeError as e:  # a collective of several ranks whose peer is gone (gloo: connection reset)
        if current_world() is None:
            raise
        raise rank_lost(config, None, e) from None


def outcome_dict(config: RunConfig, res: RunResult, stopped: RunStopped | None = None) -> dict[str, Any]:
    """What `tierflow run --json` prints: the steps, the measured summary, where the state went, and why the
    run stopped early (`stopped`, None: it trained to the end)."""
    out: dict[str, Any] = {"plan": str(config.plan), "first_step": res.first_step,
                           "steps": [asdict(r) for r in res.records], "wall_s": res.wall_s,
                           "ssd_bytes_read": res.ssd_bytes_read, "ssd_bytes_written": res.ssd_bytes_written,
                           "o_direct": res.o_direct, "optimizer_threads": res.optimizer_threads,
                           "checkpoint": str(res.checkpoint) if res.checkpoint is not None else None}
    if stopped is not None:
        out["stopped"] = {"exit_code": stopped.exit_code, "reason": str(stopped)}
    if res.measured is not None:
        out["measured"] = res.measured.to_dict()
    if config.output.export_hf and stopped is None:  # a run that stopped early exports nothing
        out["export_hf"] = str(config.output.export_hf)
    return out


def launch_ranks(config: RunConfig) -> int:
    """`--nproc N`: check the plan's world, then start its ranks here through torchrun; the exit code is that
    of the first rank that failed."""
    from tierflow.executor.dist import launch, strip_launch_flags

    d = config.distributed
    if "WORLD_SIZE" in os.environ:
        raise LaunchError("--nproc inside a torchrun launch: pass either --nproc or torchrun, not both")
    plan = load_plan(config.plan)
    cfg = plan.config
    ranks = cfg.world.ranks
    if d.nproc * d.nnodes != ranks:
        raise LaunchError(f"--nproc {d.nproc} x --nnodes {d.nnodes} = {d.nproc * d.nnodes} "
                          f"ranks, but plan {config.plan} is for {ranks} ({cfg.gpus} GPU(s) x {cfg.nodes} "
                          f"box(es)); pass --nproc {cfg.gpus} --nnodes {cfg.nodes}, or plan again with "
                          f"--gpus {d.nproc} --nodes {d.nnodes}")
    argv = list(d.argv)  # the command line as typed: every rank runs it without the launch flags
    if "run" not in argv or str(config.plan) not in argv:
        raise LaunchError("--nproc starts `tierflow run` from the command line only (call torchrun yourself "
                          "to launch from a program)")
    return launch(d.nproc, d.nnodes, d.rdzv_endpoint, d.rdzv_id, strip_launch_flags(argv))


def leave_world(code: int) -> bool:
    """The end of a rank of several, before its process ends with `code`: a clean exit passes a bounded final
    barrier and leaves the process groups (bounded too), a failed one notes its exit for the ranks left.
    Returns whether the process must now end at once (os._exit, by the command: tierflow/cli/run.py), so
    that no collective the other ranks will never join, nor a process group's teardown, nor a thread left at
    interpreter exit holds it; torchrun then sees every rank end. False with one rank: nothing to leave."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    if code == 0:
        problem = leave_cleanly()
        if problem:
            world = current_world()
            print(f"tierflow run [rank {world.rank if world else '?'}]: note: training ended, but {problem}; "
                  "this rank exits anyway", file=sys.stderr)
    else:
        note_exit(code)  # an end of its own, not a death, for the ranks left (dist.lost_ranks)
    sys.stdout.flush()
    sys.stderr.flush()
    return True


LOST_RANK_WAIT_S = 3.0  # how long a rank whose collective broke looks for the dead rank of this host


def rank_lost(config: RunConfig, res: RunResult | None, error: BaseException | None = None) -> RankLost:
    """Another rank died (or a collective broke): remove the SSD-tier directories of this box's dead ranks
    (this rank's own went with run_plan's cleanup); the error says which rank, the steps done, the checkpoint
    kept and any SSD files left (named, never claimed removed)."""
    world = current_world()
    me = world.rank if world is not None else 0
    lost = lost_ranks()
    # a collective fails as the killed rank's sockets close, which the kernel does before the process shows
    # as ended (a zombie): on a busy host that takes a moment
    deadline = time.monotonic() + LOST_RANK_WAIT_S
    while error is not None and not lost and time.monotonic() < deadline:
        time.sleep(0.05)
        lost = lost_ranks()
    who = (f"its launcher (pid {launcher_pid()}) died" if launcher_gone()
           else ", ".join(f"rank {r} (pid {pid})" for r, pid in lost) + " died"
           if lost else f"a collective failed ({' '.join(str(error).split())[:80]}): another rank stopped")
    left = []
    if config.ssd_dir:
        root = Path(config.ssd_dir)
        # the dead ranks' and this one's (whose I/O workers may still have been writing when the run's own
        # cleanup removed it): a few tries while the last writes land
        runs = [root / f"rank-{r}" / f"tierflow-run-{pid}" for r, pid in [*lost, (me, os.getpid())]]
        for _ in range(20):
            for d in runs:
                shutil.rmtree(d, ignore_errors=True)
            if not any(d.exists() for d in runs):
                break
            time.sleep(0.1)
        left = [str(d) for d in runs if d.exists()]
    files = (f"SSD-tier files left under {', '.join(left)} (remove them)" if left
             else "the SSD tier's files of every rank on this box removed" if config.ssd_dir else "")
    done = f" after {len(res.records)} step(s)" if res is not None else ""
    ck = Path(config.checkpoint.directory) / "latest" if config.checkpoint.directory else None
    # the dead rank's shard of the state is gone: the directory keeps the last checkpoint the ranks agreed on
    held = ck.read_text().strip() if ck is not None and ck.is_file() else ""
    kept = (f"checkpoint {ck.parent / held} kept (the directory holds step {int(held[4:])}; later steps are "
            "lost)" if held.startswith("step") and held[4:].isdigit() else "no checkpoint written")
    return RankLost(f"{who}; this rank stopped{done}, {kept}" + (f", {files}" if files else "")
                    + "; run again to resume", rank=me)
