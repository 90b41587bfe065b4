"""The training loop of `tierflow run` (`run_plan`): builds the state on the plan's tiers, replays the plan's
ops for the requested number of steps (a *round* runs the plan's iterations once; the last round of a run, or
one that ends at a checkpoint, runs only the first iterations of the plan), reports loss, tokens/s and TFLOPS
per step, evaluates, checkpoints atomically and resumes from the last checkpoint.

A run holds a lock on its checkpoint and SSD directories, removes what killed runs left there, and stops
cleanly: at the first non-finite loss (exit 4), on SIGINT / SIGTERM (130 / 143), or when a checkpoint cannot
be written, keeping the last good checkpoint and writing the results so far (`RunStopped`). What it checks
before the first step is preflight.py; what it writes (--out, --export-hf, torch.profiler's trace) export.py;
the command around it (the plan file's checks, launching ranks, a rank that died) launch.py.

With several ranks (dist.py) each rank trains its share of every batch on its shard of the state, with its SSD
tier under `<ssd-dir>/rank-<r>/` and its checkpoint shard under `<checkpoint>/rank-<r>/` (checkpoint.py). Rank
0 prints the steps (the loss is the mean over the ranks) and writes --out and --export-hf.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tierflow.errors import TierflowError
from tierflow.executor.checkpoint import (
    CheckpointWriteError,
    NonFiniteState,
    remove_temporaries,
    resume,
    save_checkpoint,
    training_digest,
)
from tierflow.executor.corpus import TEXT_SUFFIXES, Fields, copy_tokenizer, has_tokenizer, is_corpus, tokenize
from tierflow.executor.data import DataError, TokenData
from tierflow.executor.device.base import DeviceBackend
from tierflow.executor.dist import DistWorld, check_launch, init_world, peer_gone, rank_device
from tierflow.executor.engine import ExecutionError, Executor, describe_device, measured_result
from tierflow.executor.evaluate import check_held_out, evaluate
from tierflow.executor.export import (
    StepRecord,
    check_export_hf,
    export_profile,
    export_trained,
    profiler_of,
    write_run_outputs,
)
from tierflow.executor.lora import load_lora_state_dict, lora_state_dict
from tierflow.executor.lora_peft import export_adapters, init_adapters
from tierflow.executor.models import check_supported
from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.optim.clipping import GradNorms
from tierflow.executor.optim.lr_schedule import USES_TOTAL
from tierflow.executor.options import LoraOptions, ModelDataOptions, RunConfig, RunError
from tierflow.executor.preflight import (
    check_hyper,
    check_in_place,
    check_resume,
    clipping_wait,
    device_backend,
    ssd_need_bytes,
    step_norms,
)
from tierflow.executor.signals import Interrupted, deferred_stop, pending_signal, stop_now
from tierflow.executor.tblog import TbLog
from tierflow.executor.tiers.dirlock import DirLock, remove_stale_run_dirs
from tierflow.executor.tiers.ssd_store import SsdStore, check_ssd_dir
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.core.lora import LoraConfig, LoraConfigError
from tierflow.planner.core.models import model_dict
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.core.timefmt import fmt_s
from tierflow.planner.core.workload import model_flops_per_token
from tierflow.planner.io.planfile import Plan, simulate_plan
from tierflow.planner.io.progress import bar

LOG = logging.getLogger(__name__)  # debug: each round's wall time and peak bytes per tier (tierflow -v run)


class Diverged(TierflowError, RuntimeError):
    """A non-finite loss (or state): training stops there."""

    exit_code = 4


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
    final_adam_m: list[torch.Tensor] | None = None  # with collect_final: Adam's first moments (whole blocks)
    # with collect_final and LoRA: the adapters and their first moments (executor/lora.py lora_state_dict)
    final_lora: dict[str, torch.Tensor] | None = None
    final_lora_adam_m: dict[str, torch.Tensor] | None = None
    checkpoint: Path | None = None  # the last checkpoint written or resumed from
    ssd_cpu_s: float = 0.0  # CPU seconds of the SSD tier's requests and checksums (SsdStore.cpu_s)
    # the host optimizer ops' intra-op threads (executor/optim/host_threads.py); None: torch's, unchanged
    optimizer_threads: int | None = None
    wall_s: float = 0.0  # run_file: the training's wall time, from the plan's checks' end

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


class RunStopped(Exception):  # noqa: N818 - the run stopped; not necessarily an error
    """Training stopped before --steps: diverged (exit 4), interrupted (130, 143), or a checkpoint could not
    be written (3 when the disk is full, else 2). `result` holds the steps so far (None: stopped by a signal
    outside the training steps); the last good checkpoint is kept and --out was written."""

    agreed = True  # every rank stops alike: rank 0 says it

    def __init__(self, message: str, exit_code: int, result: RunResult | None) -> None:
        super().__init__(message)
        self.exit_code, self.result = exit_code, result


def plan_fingerprint(plan: Plan) -> str:
    d = {"model": model_dict(plan.model), "decisions": plan.config.to_dict()}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def default_device(device: str | None) -> str:
    """--device, or cuda when available, else cpu."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_hyper(config: RunConfig) -> TrainHyper:
    """The optimizer's settings of a run: those given (config.optimizer), TrainHyper's defaults for the rest;
    a schedule that decays does so over the run's --steps."""
    given = config.optimizer.given()
    total = given.pop("total_steps", config.steps) if given.get("schedule", "constant") in USES_TOTAL else 0
    given.pop("total_steps", None)
    return TrainHyper(**given, total_steps=total)


def data_fields(md: ModelDataOptions) -> Fields:
    """The JSON Lines / Parquet fields trained on (corpus.py)."""
    return Fields(md.text_field, md.prompt_field, md.response_field,
                  *(() if md.max_line_mib is None else (md.max_line_mib,)))


def _clipping_plan(plan: Plan, hyper: TrainHyper, quiet: bool, log) -> Plan:
    """The plan to run: with --clip global, one whose optimizer steps wait for the step's last gradient
    (preflight.clipping_wait), checked to still fit its tiers and said."""
    waiting = clipping_wait(plan, hyper)
    if waiting is plan:
        return plan
    if not quiet:
        log("tierflow run: --clip global: the plan's optimizer steps now wait for the step's last gradient "
            "(its queues re-ordered; tierflow plan --clip-grad-norm shows the cost)", file=sys.stderr)
    simulate_plan(waiting)  # gradients held until the norm: the re-ordered plan must still fit its tiers
    return waiting


def check_lora_options(plan: Plan, lora: LoraOptions | None) -> None:
    """--lora and its settings against the plan's adapters (the plan says what trains: `tierflow plan
    --lora` records it); RunError (one line) where they differ. Without --lora the plan's say goes."""
    if lora is None:
        return
    have = plan.model.lora
    if have is None:
        raise RunError(f"--lora {lora.rank}: plan {plan.source} trains every weight; make a LoRA plan with "
                       f"`tierflow plan ... --lora {lora.rank}` (it places the adapters and their steps)")
    try:
        want = LoraConfig(**lora.as_dict())
    except LoraConfigError as e:
        raise RunError(f"--lora: {e}") from None
    for name in ("rank", "alpha", "targets", "dropout"):
        if getattr(want, name) != getattr(have, name):
            flag = "--lora" if name == "rank" else f"--lora-{name}"
            raise RunError(f"{flag}: {getattr(want, name)} differs from plan {plan.source}'s "
                           f"{getattr(have, name)} (drop the flag, or make the plan with it)")


def run_plan(plan: Plan, config: RunConfig, log=print, on_round: Callable[[Trainer], bool] | None = None
             ) -> RunResult:
    """Train `config.steps` steps (in total, counting those of a checkpoint resumed from) with `plan`.
    `on_round(trainer)` is called at each round's end; True ends the run at that step boundary (`tierflow run
    --adapt`'s switch). Raises RunStopped when training stops early (diverged, interrupted, a checkpoint that
    cannot be written)."""
    try:
        check_supported(plan.model)
    except NotImplementedError as e:
        raise RunError(str(e)) from None
    check_lora_options(plan, config.lora)
    if config.steps < 1:
        raise RunError(f"--steps {config.steps}: must be >= 1")
    out = config.output
    if out.export_hf:
        check_export_hf(out.export_hf, plan)
    hyper = train_hyper(config)
    check_hyper(hyper)
    plan = _clipping_plan(plan, hyper, out.quiet, log)
    if out.profile and not out.out:
        raise RunError("--profile needs --out DIR: torch_trace.json is written there beside the measured "
                       "trace.json")
    cfg = plan.config
    check_launch(cfg.world.ranks, cfg.gpus, cfg.nodes, str(plan.source))
    seed = config.model_data.seed
    backend = device_backend(rank_device(default_device(config.device), cfg.world.ranks), seed)
    world = init_world(cfg.world.ranks, backend.device)
    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    if config.compute_dtype is not None:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[config.compute_dtype]
    check_in_place(plan, dtype, backend.device.type)
    state = TrainState(plan.model, cfg.placement, cfg.alpha, backend, dtype, None, world)  # its SSD: below
    need_ssd = ssd_need_bytes(plan, state)
    uses_ssd = need_ssd > (1 << 20) or any(t.resource in ("ssd_read", "ssd_write") for t in plan.graph.tasks)
    who = "" if world.single else f" [rank {world.rank}]"

    def warn(msg: str) -> None:
        log(f"tierflow run{who}: {msg}", file=sys.stderr)

    # runs in reverse: SSD store closed, its run directory removed, locks released
    with ExitStack() as cleanup:
        locked: set[Path] = set()
        ck_dir = config.checkpoint.directory
        if ck_dir:
            ck = Path(ck_dir)
            try:
                ck.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RunError(f"--checkpoint-dir {ck}: cannot create it ({e.strerror}); pass a writable "
                               "directory") from None
            if world.rank == 0:  # with several ranks rank 0 holds the shared directory for all of them
                _lock(cleanup, ck, "--checkpoint-dir", locked, warn)
                gone = remove_temporaries(ck)
                if gone:
                    warn(f"removed {len(gone)} half-written checkpoint file(s) under {ck} left by a run that "
                         "was killed")
        if uses_ssd:
            # the ranks of a box share the directory: room for all of their tiers
            root = check_ssd_dir(config.ssd_dir, need_ssd * world.local_ranks,
                                 "optimizer states, weights, gradients or activations placed there")
            if not world.single:  # each rank's SSD tier in a directory of its own
                root = root / f"rank-{world.rank}"
                root.mkdir(exist_ok=True)
            _lock(cleanup, root, "--ssd-dir", locked, warn)
            remove_stale_run_dirs(root, warn)
            run_dir = root / f"tierflow-run-{os.getpid()}"
            run_dir.mkdir(exist_ok=True)
            cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
            state.ssd = SsdStore(run_dir, backend=backend, warn=warn)
            cleanup.callback(state.ssd.close)
        # every rank has its directories (rank 0: the checkpoint directory cleaned) before resuming
        world.barrier()
        every = config.checkpoint.every
        tr = Trainer(plan, config, hyper, step_norms(plan, hyper), backend, state.ssd, log, world, state,
                     plan.graph.num_iterations if every is None else every, on_round)
        return _train(tr, dtype, warn)


def _lock(cleanup: ExitStack, directory: Path, what: str, locked: set[Path], warn) -> None:
    """Hold `directory`'s lock until `cleanup` closes (once,
    if the checkpoint and SSD directories are one)."""
    key = directory.resolve()
    if key in locked:
        return
    lock = cleanup.enter_context(DirLock(directory, what))
    locked.add(key)
    if lock.previous_pid is not None:
        warn(f"took over the lock of {what} {directory} from tierflow run pid {lock.previous_pid}, which is "
             "gone")


@dataclass
class Trainer:
    """One run under way, built by run_plan: its configuration (unchanged), the settings resolved from it
    (`hyper`, `checkpoint_every`), where it trains, and the run's state: the step, the records, the gradient
    norms, the measured trace, the last checkpoint. `on_round` (e.g. --adapt's decision, adapt.Deciding) sees
    it at every round's end."""

    plan: Plan
    config: RunConfig
    hyper: TrainHyper  # the optimizer's settings (train_hyper)
    norms: GradNorms  # the steps' gradient norms and clipping factors (the ops add to them)
    backend: DeviceBackend
    ssd: SsdStore | None
    log: Callable[..., None]
    world: DistWorld
    state: TrainState
    checkpoint_every: int  # steps between checkpoints (0: the last only)
    on_round: Callable[[Trainer], bool] | None = None  # True: the run ends at this step boundary
    settings: dict = field(default_factory=dict)  # what a checkpoint records and a resume checks
    tokens: int = 0  # per step, over the ranks
    flops_per_step: float = 0.0
    start_step: int = 0
    step: int = 0
    last_ckpt: Path | None = None  # the last checkpoint written or resumed from
    saved_step: int = -1  # the step of last_ckpt
    records: list[StepRecord] = field(default_factory=list)
    measured: SimResult | None = None  # the measured trace of the longest round so far
    best_iters: int = 0
    val: TokenData | None = None  # held-out tokens (--val-fraction, --val-data)
    tb: TbLog | None = None  # --log-dir
    optimizer_threads: int | None = None  # the Executor's choice (host_threads.py)

    @functools.cached_property
    def measured_on(self) -> dict:
        """The device this run measures on, as its trace says it (tierflow compare checks the plan's box)."""
        return describe_device(self.backend.device)

    @property
    def steps(self) -> int:
        return self.config.steps

    @property
    def quiet(self) -> bool:
        return self.config.output.quiet or self.world.rank != 0  # rank 0 reports for all

    @property
    def lead(self) -> bool:
        return self.world.rank == 0  # writes --out, --export-hf

    def result(self) -> RunResult:
        ssd = self.ssd
        return RunResult(self.plan, self.start_step, self.records, self.state, self.measured,
                         ssd.bytes_read if ssd else 0, ssd.bytes_written if ssd else 0,
                         ssd.direct if ssd else None, checkpoint=self.last_ckpt,
                         ssd_cpu_s=ssd.cpu_s if ssd else 0.0, optimizer_threads=self.optimizer_threads)


def _train(tr: Trainer, dtype: torch.dtype, warn) -> RunResult:
    plan, config, log = tr.plan, tr.config, tr.log
    cfg, spec, md, ev = plan.config, plan.model, config.model_data, config.evaluation
    data = load_data(md.data, config, spec.vocab_size)
    data, tr.val = _held_out(data, config, spec.vocab_size)
    if md.data:
        data.check_batch(cfg.batch, cfg.seq)
    tr.settings = {"plan": plan_fingerprint(plan), "seed": md.seed, "hyper": asdict(tr.hyper),
                   "data": data.source, "training": training_digest(spec, cfg.batch, cfg.seq),
                   "shape": {"model": spec.name, "batch": cfg.batch, "seq": cfg.seq,
                             "optimizer_states": spec.optimizer_states or "fp32"}}
    tr.tokens = cfg.batch * cfg.seq
    tr.flops_per_step = tr.tokens * model_flops_per_token(spec, cfg.seq)
    if tr.val is not None and ev.every:
        # refuses a held-out set shorter than a sequence; says when it holds fewer than asked
        note = check_held_out(tr.val, cfg.seq, cfg.batch, ev.batches)
        if note and tr.lead:
            warn(note)
    if ev.log_dir and tr.lead:
        tr.tb = TbLog(ev.log_dir)
    where = _start_state(tr, warn)
    ex = Executor(plan, tr.state, data, tr.backend, tr.hyper, tr.ssd, profile=config.output.profile,
                  cuda_graphs=config.cuda_graphs, norms=tr.norms)
    tr.optimizer_threads = ex.optimizer_threads
    if not tr.quiet:
        _log_start(tr, dtype, where, data)
        if ex.optimizer_threads is not None:
            log(f"  host optimizer on {ex.optimizer_threads} of {ex.threads} threads: the thread launching "
                "GPU work keeps a core")
    try:
        _run_rounds(tr, ex)
    finally:
        ex.close()  # the rounds' threads end with the run (engine.py: kept from round to round)
        if tr.tb is not None:
            tr.tb.close()
    return _finish(tr)


def tokenizer_dir(md: ModelDataOptions) -> str | None:
    """The model's tokenizer: --tokenizer, else the --init directory when it has one."""
    return md.tokenizer or (md.init if md.init and has_tokenizer(md.init) else None)


def load_data(path: str | None, config: RunConfig, vocab_size: int) -> TokenData:
    """--data (or --val-data): tokenized with the model's tokenizer (corpus.py) when it is JSON Lines,
    Parquet or a directory, or text and a tokenizer is given (--tokenizer, or an --init directory that has
    one); else as data.py reads it (uint16 tokens, byte-level text, synthetic)."""
    md = config.model_data
    tok = tokenizer_dir(md)
    fmt = md.data_format
    text = fmt == "auto" and tok is not None and Path(path or "").suffix in TEXT_SUFFIXES
    if path is not None and fmt != "text" and (is_corpus(path, fmt) or text):
        tokens, mask, what = tokenize(path, tok, data_fields(md), vocab_size, md.cache_dir)
        data = TokenData(tokens, what, mask)
        top = int(tokens.max())
        if top >= vocab_size:
            raise DataError(f"--data {path}: token id {top} is outside the model's vocabulary of "
                            f"{vocab_size} (is --tokenizer the model's own?)")
        return data
    return TokenData.load(path, vocab_size, fmt, seed=md.seed)


def _held_out(data: TokenData, config: RunConfig, vocab_size: int) -> tuple[TokenData, TokenData | None]:
    """(training data, held-out data or None) of --val-fraction / --val-data; --eval-every needs one."""
    ev = config.evaluation
    if ev.val_fraction and ev.val_data:
        raise RunError("--val-fraction and --val-data: pass one of them")
    val = None
    if ev.val_data:
        val = load_data(ev.val_data, config, vocab_size)
    elif ev.val_fraction:
        data, val = data.split(ev.val_fraction)
    if ev.every and val is None:
        raise RunError(f"--eval-every {ev.every}: needs held-out tokens (--val-fraction 0.05, or "
                       "--val-data FILE)")
    return data, val


def _eval_due(tr: Trainer) -> bool:
    every = tr.config.evaluation.every
    return bool(every) and tr.val is not None and (tr.step % every == 0 or tr.step == tr.steps)


def _run_eval(tr: Trainer) -> None:
    """Validation loss and perplexity after step tr.step (evaluate.py), into its record, the log and
    TensorBoard."""
    cfg = tr.plan.config
    res = evaluate(tr.state, tr.val, tr.step, cfg.batch, cfg.seq, cfg.micro_batch,
                   tr.config.evaluation.batches)
    if tr.records and tr.records[-1].step == tr.step:
        tr.records[-1].val_loss, tr.records[-1].val_ppl = res.val_loss, res.val_ppl
    if tr.tb is not None:
        tr.tb.step(tr.step, {"val/loss": res.val_loss, "val/perplexity": res.val_ppl})
    if not tr.quiet:
        tr.log(f"  eval after step {tr.step}: validation loss {res.val_loss:.4f}, perplexity "
               f"{res.val_ppl:,.2f} ({res.tokens:,} held-out tokens: {res.sequences:,} sequences of "
               f"{cfg.seq})", flush=True)


def _start_state(tr: Trainer, warn) -> str:
    """The state to start from: the last checkpoint of --checkpoint-dir (which sets the first step), --init's
    weights, or a random init; says which."""
    ck, md, state = tr.config.checkpoint, tr.config.model_data, tr.state

    def check(ckpt: Path, manifest: dict) -> None:
        check_resume(ckpt, manifest, tr.settings, ck.directory, ck.allow_changed_hyper, warn)

    base = None
    if state.lora is not None:  # LoRA: the base first (a checkpoint holds the adapters and names the base)
        if md.init:
            base = f"weights from {state.init_hf(md.init, md.seed)}"
        else:
            state.init_random(md.seed)
            base = f"random init (seed {md.seed})"
    found = resume(state, ck.directory, fallback=ck.resume_fallback, check=check,
                   log=warn) if ck.directory else None
    if found is not None:
        tr.last_ckpt, manifest = found
        tr.start_step = tr.step = tr.saved_step = int(manifest["step"])
        if manifest.get("grad_norm") is not None:  # delayed clipping goes on from it
            tr.norms.norms[tr.start_step] = float(manifest["grad_norm"])
        unused = (f"; --init-peft {md.init_peft} not used: the checkpoint's adapters go on"
                  if md.init_peft else "")
        return (f"resumed from {tr.last_ckpt} (step {tr.start_step})" + (f", base: {base}" if base else "")
                + unused)
    if base is not None:
        peft = init_adapters(tr.config, tr.plan.model)  # --init-peft: the adapters to start from
        if peft is not None:
            load_lora_state_dict(state.lora, peft)
            return f"{base}, adapters from {md.init_peft} (PEFT)"
        return base
    if md.init:
        return f"weights from {state.init_hf(md.init, md.seed)}"
    state.init_random(md.seed)
    return f"random init (seed {md.seed})"


def _log_start(tr: Trainer, dtype: torch.dtype, where: str, data: TokenData) -> None:
    """What the run trains, with which plan, on which device, from where."""
    plan, cfg, world, log = tr.plan, tr.plan.config, tr.world, tr.log
    log(f"tierflow run: {plan.model.describe()}")
    log(f"  plan {plan.source}: {cfg.describe()}; {plan.graph.num_iterations} iteration(s) per round, "
        f"{len(plan.graph.tasks)} ops")
    log(f"  device {tr.backend.name}, compute {str(dtype).removeprefix('torch.')}; {where}; data "
        f"{data.source}")
    if not world.single:
        share = cfg.world.rank_batch(cfg.batch)
        log(f"  {world.ranks} ranks ({world.backend}): rank r trains sequences [r*{share}, "
            f"(r+1)*{share}) of each batch on its 1/{world.ranks} shard of the state; "
            "the loss is their mean")
    if tr.ssd is not None:
        log(f"  SSD tier: {tr.ssd.root} ({'O_DIRECT' if tr.ssd.direct else 'buffered I/O'})"
            + ("" if world.single else ", one such directory per rank"))


def _run_rounds(tr: Trainer, ex: Executor) -> None:
    """Rounds until --steps, under torch.profiler with --profile;
    RunStopped (with --out written) when training stops early."""
    out = tr.config.output
    profiler = profiler_of(tr.backend.device) if out.profile and tr.lead else None
    if profiler is not None:
        profiler.start()  # stopped and exported when the rounds end, also when a run stops early
    # with a checkpoint directory a stop signal ends the round under way and saves its last step
    deferred = (deferred_stop(stop_at_once=peer_gone) if tr.config.checkpoint.directory
                else nullcontext())
    try:
        with deferred:
            while tr.step < tr.steps:
                _run_round(tr, ex, _round_iterations(tr))
                _stop_if_signalled(tr)
                if tr.on_round is not None and tr.on_round(tr):
                    break
    except (Diverged, CheckpointWriteError, Interrupted) as e:
        code, msg = _stop_message(tr, e)
        if out.out and tr.lead:
            write_run_outputs(tr.measured, tr.records, out.out, f"{tr.plan.model.name}: measured "
                                                                f"({tr.backend.name})")
            msg += f"; the results so far are under {out.out}"
        raise RunStopped(msg, code, tr.result()) from None
    finally:
        if profiler is not None:
            export_profile(profiler, out.out, None if tr.quiet else tr.log)


def _stop_if_signalled(tr: Trainer) -> None:
    """After a round: a stop signal noted during it (on any rank: they agree) saves this step's checkpoint,
    then stops the run (Interrupted). Without a checkpoint directory a signal has stopped it at once."""
    if not tr.config.checkpoint.directory:
        return
    signum = pending_signal()
    if not tr.world.single:
        signum = next((s for s in tr.world.gather_objects(signum) if s is not None), None)
    if signum is None:
        return
    stop = stop_now(signum)  # later signals are ignored while the checkpoint is written
    save_step_checkpoint(tr)
    raise stop


def _round_iterations(tr: Trainer) -> int:
    """Iterations of the next round: the plan's, fewer for the last steps of the run or up to a checkpoint."""
    every, eval_every = tr.checkpoint_every, tr.config.evaluation.every
    r = min(tr.plan.graph.num_iterations, tr.steps - tr.step)
    if tr.config.checkpoint.directory and every:
        r = min(r, every - tr.step % every)
    if eval_every:  # an evaluation sees the weights after exactly its step
        r = min(r, eval_every - tr.step % eval_every)
    return r


def _run_round(tr: Trainer, ex: Executor, r: int) -> None:
    """One round of `r` iterations: its steps reported, its measured trace kept if it is the longest so far,
    and a checkpoint at its end where --checkpoint-every falls."""
    step = tr.step
    local: list[float] = []  # this rank's own losses of the round (the reported ones are the ranks' mean)
    rr = ex.run_round(r, step, on_step=_step_reporter(tr, step, local))
    LOG.debug("round of %d iteration(s) from step %d: %.3f s wall; peak %s", r, step + 1, rr.wall_s,
              ", ".join(f"{t} {b / 1e6:,.1f} MB" for t, b in rr.peak_bytes.items()))
    # the reporter's losses are the round's own (read after each iteration's last GPU op)
    if local != rr.losses:
        raise ExecutionError(f"internal: the reported losses {local} are not the round's {rr.losses}")
    _note_norms(tr, step, r, rr.peak_bytes)
    res = measured_result(tr.plan, rr, tr.measured_on)
    if r >= tr.best_iters:
        tr.best_iters, tr.measured = r, res
    tr.step += r
    if _eval_due(tr):
        _run_eval(tr)
    every = tr.checkpoint_every
    # at --checkpoint-every, and the last step whatever the interval: a run never ends without its state
    if tr.config.checkpoint.directory and (every and tr.step % every == 0 or tr.step >= tr.steps):
        save_step_checkpoint(tr)


def _note_norms(tr: Trainer, step: int, r: int, peak: dict[str, float]) -> None:
    """The learning rate, gradient norm and the round's peak tier bytes of the round's steps `step`+1 ..
    `step`+r, into their records and TensorBoard."""
    h, norms = tr.hyper, tr.norms
    for rec in tr.records[-r:]:
        rec.lr = h.lr_at(rec.step)
        rec.grad_norm = norms.value(rec.step)
        rec.gpu_bytes, rec.cpu_bytes, rec.ssd_bytes = (peak.get(t, 0.0) for t in ("gpu", "cpu", "ssd"))
        if tr.tb is not None:
            tr.tb.step(rec.step, {"train/loss": rec.loss, "train/lr": rec.lr,
                                  "train/grad_norm": rec.grad_norm, "train/tokens_per_s": rec.tokens_per_s})
    norms.forget_before(step + r)


def _step_reporter(tr: Trainer, step: int, local: list[float]) -> Callable[[int, float, float], None]:
    """The round's on_step: the ranks' mean loss of iteration i (Diverged if not finite),
    recorded and printed."""
    steps, log = tr.steps, tr.log
    prev = [0.0]

    def on_step(i: int, loss: float, end_s: float) -> None:
        local.append(loss)
        loss = tr.world.mean(loss)  # on the reporter thread, in iteration order on every rank
        if not math.isfinite(loss):
            raise Diverged(f"loss {loss} at step {step + i + 1}")
        step_s = end_s - prev[0]
        prev[0] = end_s
        rec = StepRecord(step + i + 1, loss, step_s, tr.tokens / step_s if step_s > 0 else 0.0,
                         tr.flops_per_step / step_s / 1e12 if step_s > 0 else 0.0)
        tr.records.append(rec)
        if not tr.quiet:
            took = fmt_s(rec.step_s, 1, sig=4)
            log(f"step {rec.step:>5}/{steps} {bar(rec.step, steps, fill=' ')} loss {rec.loss:.4f}  "
                f"{took:>11}  {rec.tokens_per_s:10,.0f} tok/s  {rec.tflops:7.3f} TFLOPS", flush=True)

    return on_step


def save_step_checkpoint(tr: Trainer) -> None:
    """This step's checkpoint (once: a step already saved or resumed from is not written again)."""
    directory = tr.config.checkpoint.directory
    if tr.saved_step == tr.step or not directory:
        return
    # the last step's gradient norm: delayed clipping of a resumed run goes on from it
    tr.settings["grad_norm"] = tr.norms.value(tr.step)
    try:
        tr.last_ckpt = save_checkpoint(tr.state, directory, tr.step, tr.settings, world=tr.world)
    except NonFiniteState as e:
        raise Diverged(str(e)) from None
    tr.saved_step = tr.step
    if not tr.quiet:
        tr.log(f"  checkpoint {tr.last_ckpt}" + (" (the last step)" if tr.step >= tr.steps else ""))


def _stop_message(tr: Trainer, e: Diverged | CheckpointWriteError | Interrupted) -> tuple[int, str]:
    """(exit code, message) of a run that stopped early."""
    kept = (f"the last good checkpoint {tr.last_ckpt} is kept" if tr.last_ckpt is not None
            else "no checkpoint was written" if tr.config.checkpoint.directory else "no --checkpoint-dir")
    done = f"{len(tr.records)} step(s) done ({tr.start_step + len(tr.records)} of {tr.steps})"
    if isinstance(e, Diverged):
        return 4, (f"training diverged: {e}; stopped after {done}, {kept} (lower --lr, or check --init and "
                   "--data)")
    if isinstance(e, Interrupted):
        if tr.last_ckpt is not None and tr.saved_step == tr.step:
            kept = f"the checkpoint of its last step is saved in {tr.last_ckpt}"
        elif tr.last_ckpt is not None:
            kept = (f"the checkpoint directory holds step {tr.saved_step} ({tr.last_ckpt}): the "
                    f"{tr.step - tr.saved_step} step(s) after it and the round under way are lost")
        return e.exit_code, (f"interrupted by {e.name}: workers stopped after {done}, {kept}; the SSD tier's "
                             "files are removed")
    return 3 if e.full else 2, str(e)


def _finish(tr: Trainer) -> RunResult:
    """After the last step: --out (rank 0), --export-hf, and the result (with collect_final,
    the final state)."""
    out, state, log = tr.config.output, tr.state, tr.log
    if out.out and tr.measured is not None and tr.lead:
        write_run_outputs(tr.measured, tr.records, out.out, f"{tr.plan.model.name}: measured "
                                                            f"({tr.backend.name})")
        if not tr.quiet:
            log(f"  wrote timeline.csv, trace.json, gantt.png, steps.csv under {out.out}"
                + ("" if tr.world.single else " (rank 0's ops)"))
    if out.export_hf:
        path = export_trained(state, out.export_hf)  # a collective with several ranks; rank 0 writes
        tok = tokenizer_dir(tr.config.model_data)
        names = copy_tokenizer(tok, path) if tok and tr.lead else []  # the model's tokenizer beside it
        if not tr.quiet:
            log(f"  exported the fp32 weights after step {tr.step} to {path} (config.json, "
                f"model.safetensors{''.join(', ' + n for n in names)})")
    if out.export_peft and state.lora is not None and tr.lead:
        path = export_adapters(lora_state_dict(state.lora), tr.config, tr.plan.model)
        if not tr.quiet:
            log(f"  exported the adapters after step {tr.step} to {path} (adapter_config.json, "
                f"adapter_model.safetensors: peft.PeftModel.from_pretrained loads them)")
    res = tr.result()
    if out.collect_final:
        res.final_master = state.master_blocks()
        if state.lora is not None:  # LoRA: the adapters and their first moments (canonical names)
            res.final_lora = lora_state_dict(state.lora)
            res.final_lora_adam_m = lora_state_dict(state.lora, "adam_m")
        else:
            res.final_adam_m = [state.gathered("adam_m", b) for b in range(len(state.layout.numel))]
    return res

