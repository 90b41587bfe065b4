"""`tierflow run`: train with a plan file. Builds the state on the plan's tiers, replays the plan's ops for the
requested number of steps (a *round* runs the plan's iterations once; the last round of a run, or one that
ends at a checkpoint, runs only the first iterations of the plan), prints loss, tokens/s and TFLOPS per step,
checkpoints atomically and resumes from the last checkpoint, and writes the measured trace in the simulator's
format (timeline.csv, trace.json, gantt.png) plus steps.csv.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierflow.executor.data import DataError, TokenData
from tierflow.executor.device import DeviceBackend, TierOutOfMemory, make_backend
from tierflow.executor.engine import (
    ExecutionError,
    Executor,
    Hyper,
    OutOfMemory,
    UnsupportedPlan,
    measured_result,
)
from tierflow.executor.models import check_supported
from tierflow.executor.state import StateError, TrainState, latest_checkpoint, read_manifest
from tierflow.executor.store import ChecksumError, SsdError, SsdStore, check_ssd_dir
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.core.workload import COMPUTE_BYTES, model_flops_per_token
from tierflow.planner.io.logs import QUIET, level_of
from tierflow.planner.io.planfile import Plan, PlanError, load_plan, simulate_plan
from tierflow.planner.io.progress import bar

LOG = logging.getLogger(__name__)  # debug: each round's wall time and peak bytes per tier (tierflow -v run)


class RunError(ValueError):
    """Bad input to `tierflow run` (one line)."""


@dataclass
class RunOptions:
    steps: int
    device: str = "cpu"
    ssd_dir: str | None = None
    data: str | None = None
    data_format: str = "auto"
    init: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    out: str | None = None
    hyper: Hyper = field(default_factory=Hyper)
    seed: int = 0
    quiet: bool = False
    collect_final: bool = False  # return the final fp32 master weights (RunResult.final_master), e.g. for tests


@dataclass
class StepRecord:
    step: int
    loss: float
    step_s: float
    tokens_per_s: float
    tflops: float


@dataclass
class RunResult:
    plan: Plan
    first_step: int
    records: list[StepRecord]
    state: TrainState
    measured: SimResult | None
    ssd_bytes_read: int = 0
    ssd_bytes_written: int = 0
    o_direct: bool | None = None
    final_master: list[torch.Tensor] | None = None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


def plan_fingerprint(plan: Plan) -> str:
    d = {"model": asdict(plan.model), "decisions": plan.config.to_dict()}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_init_dir(directory: str) -> None:
    """--init: every *.safetensors file must be readable as safetensors and hold only floating-point tensors
    (an int32 weight would otherwise be cast silently). Reads only the headers."""
    from safetensors import SafetensorError, safe_open

    d = Path(directory)
    if not d.is_dir():
        raise RunError(f"--init {d}: not a directory (pass a Hugging Face model directory with *.safetensors)")
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as sf:
                for key in sf.keys():
                    dtype = sf.get_slice(key).get_dtype()
                    if not dtype.startswith(("F", "BF")):
                        raise RunError(f"--init {d}: {f.name}: tensor {key!r} has dtype {dtype}, not floating point "
                                       "(convert the checkpoint to float32/bfloat16/float16)")
        except (SafetensorError, OSError, ValueError) as e:
            if isinstance(e, RunError):
                raise
            raise RunError(f"--init {d}: {f.name} is not a readable safetensors file "
                           f"({' '.join(str(e).split())[:80]}); re-download or re-save it") from None


def _device(name: str, seed: int = 0) -> DeviceBackend:
    """The device backend of --device (cpu, cuda[:N]; cpu-adversarial[:N], not in --help, for tests)."""
    try:
        return make_backend(name, seed)
    except ValueError as e:
        raise RunError(str(e)) from None


def _ssd_need_bytes(plan: Plan, state: TrainState) -> float:
    """SSD bytes this run writes at most: the state's SSD ranges plus the plan's peak of parked activations,
    scaled from the plan's bf16 bytes to the executor's compute dtype."""
    static = state.ssd_static_bytes()
    pred = plan.predicted or {}
    peak = (pred.get("peak_bytes") or {}).get("ssd")
    dynamic = max(0.0, (peak or 0.0) - plan.graph.static_bytes["ssd"])
    if peak is None and any(t.resource == "ssd_write" and t.tensor in ("checkpoint", "act", "act_grad")
                            for t in plan.graph.tasks):
        dynamic = sum(t.work for t in plan.graph.tasks if t.resource == "ssd_write" and t.iteration == 0
                      and t.tensor in ("checkpoint", "act", "act_grad"))
    scale = torch.empty(0, dtype=state.compute_dtype).element_size() / COMPUTE_BYTES
    return static + dynamic * scale * 1.1 + (1 << 20)


def run_plan(plan: Plan, opts: RunOptions, log=print) -> RunResult:
    """Train `opts.steps` steps (in total, counting those of a checkpoint resumed from) with `plan`."""
    try:
        check_supported(plan.model)
    except NotImplementedError as e:
        raise RunError(str(e)) from None
    if opts.steps < 1:
        raise RunError(f"--steps {opts.steps}: must be >= 1")
    backend = _device(opts.device, opts.seed)
    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    cfg = plan.config
    probe = TrainState(plan.model, cfg.placement, cfg.alpha, backend, dtype, None)
    need_ssd = _ssd_need_bytes(plan, probe)
    uses_ssd = need_ssd > (1 << 20) or any(t.resource in ("ssd_read", "ssd_write") for t in plan.graph.tasks)
    ssd = run_dir = None
    if uses_ssd:
        root = check_ssd_dir(opts.ssd_dir, need_ssd, "optimizer states, weights, gradients or activations placed there")
        run_dir = root / f"tierflow-run-{os.getpid()}"
        run_dir.mkdir(exist_ok=True)
        ssd = SsdStore(run_dir, backend=backend, warn=lambda m: log(m, file=sys.stderr))
    try:
        return _train(plan, opts, backend, dtype, ssd, log)
    finally:
        if ssd is not None:
            ssd.close()
            shutil.rmtree(run_dir, ignore_errors=True)


def _train(plan: Plan, opts: RunOptions, backend: DeviceBackend, dtype: torch.dtype, ssd: SsdStore | None,
           log) -> RunResult:
    cfg, spec = plan.config, plan.model
    device = backend.name
    state = TrainState(spec, cfg.placement, cfg.alpha, backend, dtype, ssd)
    fingerprint = plan_fingerprint(plan)
    start_step = 0
    ckpt = latest_checkpoint(opts.checkpoint_dir) if opts.checkpoint_dir else None
    if ckpt is not None:
        manifest = read_manifest(ckpt)
        if manifest.get("plan") != fingerprint:
            raise RunError(f"--checkpoint-dir {opts.checkpoint_dir}: its checkpoint was written with another plan "
                           f"(model {manifest.get('model')!r}); resume with that plan or use another directory")
        state.load(ckpt)
        start_step = int(manifest["step"])
        where = f"resumed from {ckpt} (step {start_step})"
    elif opts.init:
        where = f"weights from {state.init_hf(opts.init)}"
    else:
        state.init_random(opts.seed)
        where = f"random init (seed {opts.seed})"
    data = TokenData.load(opts.data, spec.vocab_size, opts.data_format, seed=opts.seed)
    if opts.data:
        data.check_batch(cfg.batch, cfg.seq)
    ex = Executor(plan, state, data, backend, opts.hyper, ssd)
    per_round = plan.graph.num_iterations
    tokens = cfg.batch * cfg.seq
    flops_per_step = tokens * model_flops_per_token(spec, cfg.seq)
    if not opts.quiet:
        log(f"tierflow run: {spec.describe()}")
        log(f"  plan {plan.source}: {cfg.describe()}; {per_round} iteration(s) per round, {len(plan.graph.tasks)} ops")
        log(f"  device {device}, compute {str(dtype).removeprefix('torch.')}; {where}; data {data.source}")
        if ssd is not None:
            log(f"  SSD tier: {ssd.root} ({'O_DIRECT' if ssd.direct else 'buffered I/O'})")
    records: list[StepRecord] = []
    measured = None
    best_iters = 0
    step = start_step
    every = opts.checkpoint_every
    while step < opts.steps:
        r = min(per_round, opts.steps - step)
        if opts.checkpoint_dir and every:
            r = min(r, every - step % every)
        prev = [0.0]

        def on_step(i: int, loss: float, end_s: float, step=step, prev=prev) -> None:
            step_s = end_s - prev[0]
            prev[0] = end_s
            rec = StepRecord(step + i + 1, loss, step_s, tokens / step_s if step_s > 0 else 0.0,
                             flops_per_step / step_s / 1e12 if step_s > 0 else 0.0)
            records.append(rec)
            if not opts.quiet:
                log(f"step {rec.step:>5}/{opts.steps} {bar(rec.step, opts.steps, fill=' ')} loss {rec.loss:.4f}  {rec.step_s * 1e3:8.1f} ms  "
                    f"{rec.tokens_per_s:10,.0f} tok/s  {rec.tflops:7.3f} TFLOPS", flush=True)

        rr = ex.run_round(r, step, on_step=on_step)
        LOG.debug("round of %d iteration(s) from step %d: %.3f s wall; peak %s", r, step + 1, rr.wall_s,
                  ", ".join(f"{t} {b / 1e6:,.1f} MB" for t, b in rr.peak_bytes.items()))
        res = measured_result(plan, rr)
        # the reporter's losses are the round's own (read after each iteration's last GPU op)
        assert [x.loss for x in records[-r:]] == rr.losses
        if r >= best_iters:
            best_iters, measured = r, res
        step += r
        if opts.checkpoint_dir and every and step % every == 0:
            path = state.save(opts.checkpoint_dir, step, {"plan": fingerprint, "seed": opts.seed,
                                                          "hyper": asdict(opts.hyper), "data": data.source})
            if not opts.quiet:
                log(f"  checkpoint {path}")
    if opts.out and measured is not None:
        write_run_outputs(measured, records, opts.out, f"{spec.name}: measured ({device})")
        if not opts.quiet:
            log(f"  wrote timeline.csv, trace.json, gantt.png, steps.csv under {opts.out}")
    final = state.master_blocks() if opts.collect_final else None
    return RunResult(plan, start_step, records, state, measured,
                     ssd.bytes_read if ssd else 0, ssd.bytes_written if ssd else 0, ssd.direct if ssd else None,
                     final_master=final)


def write_run_outputs(measured: SimResult, records: list[StepRecord], out: str, name: str) -> None:
    from tierflow.planner.core.trace import write_outputs

    write_outputs(measured, out, name=name)
    with open(Path(out) / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "step_s", "tokens_per_s", "tflops"])
        for r in records:
            w.writerow([r.step, repr(r.loss), r.step_s, r.tokens_per_s, r.tflops])


# -- command line -----------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    hyper = Hyper(lr=args.lr, weight_decay=args.weight_decay)
    opts = RunOptions(steps=args.steps, device=args.device, ssd_dir=args.ssd_dir, data=args.data,
                      data_format=args.data_format, init=args.init, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every or 0, out=args.out, hyper=hyper, seed=args.seed,
                      quiet=args.json or level_of(args) >= QUIET)
    try:
        plan = load_plan(args.plan)
        simulate_plan(plan)  # a plan that overflows a tier is refused as `tierflow simulate --plan` refuses it
        if args.init:
            check_init_dir(args.init)
        if args.checkpoint_dir and args.checkpoint_every is None:
            opts.checkpoint_every = plan.graph.num_iterations
        t0 = time.perf_counter()
        res = run_plan(plan, opts)
    except (PlanError, RunError, DataError, StateError, SsdError, ChecksumError, UnsupportedPlan) as e:
        print(f"tierflow run: error: {e}", file=sys.stderr)
        return 2
    except CapacityError as e:
        print(f"tierflow run: does not fit: {e}", file=sys.stderr)
        return 3
    except OutOfMemory as e:
        print(f"tierflow run: {e}", file=sys.stderr)
        return 3
    except TierOutOfMemory as e:  # building the state on its tiers, before any op
        print(f"tierflow run: {e.tier} out of memory for the training state: {e}; plan again for this machine "
              "(tierflow calibrate, then tierflow plan --hw box.yaml)", file=sys.stderr)
        return 3
    except ExecutionError as e:
        print(f"tierflow run: {e}", file=sys.stderr)
        return 1
    if args.json:
        out: dict[str, Any] = {"plan": str(args.plan), "first_step": res.first_step,
                               "steps": [asdict(r) for r in res.records], "wall_s": time.perf_counter() - t0,
                               "ssd_bytes_read": res.ssd_bytes_read, "ssd_bytes_written": res.ssd_bytes_written,
                               "o_direct": res.o_direct}
        if res.measured is not None:
            out["measured"] = res.measured.to_dict()
        print(json.dumps(out, indent=2))
    return 0
