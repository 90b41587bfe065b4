"""`tierflow run`: train with a plan file. Builds the state on the plan's tiers, replays the plan's ops for
the requested number of steps (a *round* runs the plan's iterations once; the last round of a run, or one that
ends at a checkpoint, runs only the first iterations of the plan), prints loss, tokens/s and TFLOPS per step,
checkpoints atomically and resumes from the last checkpoint, and writes the measured trace in the simulator's
format (timeline.csv, trace.json, gantt.png) plus steps.csv; with --profile also torch.profiler's Chrome trace
(torch_trace.json), each op under a record_function named after its plan op.

A run holds a lock on its checkpoint and SSD directories, removes what killed runs left there, and stops
cleanly: at the first non-finite loss (exit 4), on SIGINT / SIGTERM (130 / 143), or when a checkpoint cannot
be written, keeping the last good checkpoint and writing the results so far (`RunStopped`).

A plan for several ranks (gpus x nodes) runs as that many processes under torchrun (dist.py): `--nproc N`
starts torchrun here; each rank trains its share of every batch on its shard of the state, with its SSD tier
under `<ssd-dir>/rank-<r>/` and its checkpoint shard under `<checkpoint>/rank-<r>/` (checkpoint.py). Rank 0
prints the steps (the loss is the mean over the ranks) and writes --out and --export-hf.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierflow.errors import TierflowError
from tierflow.executor.adamw import TrainHyper, check_hyper_extra, norms_of
from tierflow.executor.checkpoint import (
    CheckpointWriteError,
    NonFiniteState,
    check_same_training,
    remove_temporaries,
    resume,
    save_checkpoint,
    training_digest,
)
from tierflow.executor.clipping import GradNorms
from tierflow.executor.corpus import (
    MAX_LINE_MIB,
    TEXT_SUFFIXES,
    Fields,
    copy_tokenizer,
    has_tokenizer,
    is_corpus,
    tokenize,
)
from tierflow.executor.data import DataError, TokenData
from tierflow.executor.device.base import DeviceBackend, TierOutOfMemory
from tierflow.executor.device.factory import make_backend
from tierflow.executor.dist import (
    DistWorld,
    LaunchError,
    RankLost,
    check_launch,
    current_world,
    init_world,
    leave_cleanly,
    lost_ranks,
    note_exit,
    peer_gone,
    rank_device,
)
from tierflow.executor.engine import (
    ExecutionError,
    Executor,
    Hyper,
    OutOfMemory,
    UnsupportedPlan,
    measured_result,
)
from tierflow.executor.evaluate import evaluate
from tierflow.executor.models import check_supported, export_hf, hf_config
from tierflow.executor.signals import Interrupted, StopOnSignals, deferred_stop, pending_signal, stop_now
from tierflow.executor.tblog import LogDirError, TbLog
from tierflow.executor.tiers.arena import TransferAreaOutOfMemory
from tierflow.executor.tiers.dirlock import DirLock, LockError, remove_stale_run_dirs
from tierflow.executor.tiers.ssd_store import ChecksumError, SsdError, SsdStore, check_ssd_dir
from tierflow.executor.tiers.state import StateError, TrainState
from tierflow.outputs import OutputError, atomic_path, check_output_dir
from tierflow.planner.core.clipwait import OPTIMIZER_KINDS, wait_for_norm, waits_for_norm
from tierflow.planner.core.graph import CycleError
from tierflow.planner.core.models import model_dict
from tierflow.planner.core.opkinds import ENTRY_TENSORS
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.core.workload import model_flops_per_token, precision_of
from tierflow.planner.io.logs import QUIET, level_of
from tierflow.planner.io.planfile import Plan, PlanError, check_ops_match_decisions, load_plan, simulate_plan
from tierflow.planner.io.progress import bar

LOG = logging.getLogger(__name__)  # debug: each round's wall time and peak bytes per tier (tierflow -v run)


class RunError(TierflowError, ValueError):
    """Bad input to `tierflow run` (one line)."""


class Diverged(TierflowError, RuntimeError):
    """A non-finite loss (or state): training stops there."""

    exit_code = 4


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
    # torch.profiler around the run, its Chrome trace to out/torch_trace.json (needs out)
    profile: bool = False
    resume_fallback: bool = False  # a corrupt latest checkpoint: resume from the previous one that verifies
    # resume although the seed / hyper-parameters / data differ from the checkpoint's
    allow_changed_hyper: bool = False
    # return the final fp32 master weights and Adam m (RunResult.final_*), e.g. for tests
    collect_final: bool = False
    export_hf: str | None = None  # after the last step, write the fp32 master weights here in the HF layout
    # "bf16" | "fp32"; None: bf16 on CUDA, fp32 on a CPU (hidden --compute-dtype)
    compute_dtype: str | None = None
    eval_every: int = 0  # validation loss every N steps (and after the last), 0: never
    val_fraction: float = 0.0  # hold out the last fraction of --data for validation
    val_data: str | None = None  # or a file of held-out tokens
    eval_batches: int = 4  # batches of the plan's batch size per evaluation
    log_dir: str | None = None  # TensorBoard event files
    tokenizer: str | None = None  # Hugging Face tokenizer directory (default: --init's, when it has one)
    fields: Fields = field(default_factory=Fields)  # JSON Lines / Parquet fields trained on
    cache_dir: str | None = None  # --cache-dir: where --data's token cache lives (corpus.py)
    # called at each round's end with the run under way (`_Training`); True ends the run at that step
    # boundary (`tierflow run --adapt`'s switch)
    on_round: Callable[[Any], bool] | None = None


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
    checkpoint: Path | None = None  # the last checkpoint written or resumed from
    ssd_cpu_s: float = 0.0  # CPU seconds of the SSD tier's requests and checksums (SsdStore.cpu_s)
    # the host optimizer ops' intra-op threads (executor/host_threads.py); None: torch's setting, unchanged
    optimizer_threads: int | None = None

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


class RunStopped(Exception):  # noqa: N818 - the run stopped; not necessarily an error
    """Training stopped before --steps: diverged (exit 4), interrupted (130, 143), or a checkpoint could not
    be written (3 when the disk is full, else 2). `result` holds the steps so far; the last good checkpoint is
    kept and --out was written."""

    def __init__(self, message: str, exit_code: int, result: RunResult) -> None:
        super().__init__(message)
        self.exit_code, self.result = exit_code, result


def plan_fingerprint(plan: Plan) -> str:
    d = {"model": model_dict(plan.model), "decisions": plan.config.to_dict()}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


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


def _device(name: str, seed: int = 0) -> DeviceBackend:
    """The device backend of --device (cpu, cuda[:N]; cpu-adversarial[:N], not in --help, for tests)."""
    try:
        return make_backend(name, seed)
    except ValueError as e:
        raise RunError(str(e)) from None


def _ssd_need_bytes(plan: Plan, state: TrainState) -> float:
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


def check_hyper(h: Hyper) -> None:
    """The optimizer's settings, refused up front (RunError) rather than diverging at step 1."""
    if not math.isfinite(h.lr) or h.lr <= 0:
        raise RunError(f"--lr {h.lr}: must be a finite number > 0 (e.g. 1e-3)")
    if not math.isfinite(h.weight_decay) or h.weight_decay < 0:
        raise RunError(f"--weight-decay {h.weight_decay}: must be a finite number >= 0 (e.g. 0.1)")
    if isinstance(h, TrainHyper) and check_hyper_extra(h):
        raise RunError(check_hyper_extra(h)[0])


def _clipping_plan(plan: Plan, opts: RunOptions, log) -> Plan:
    """The plan to run: with --clip global, one whose optimizer steps wait for the step's last gradient
    (prepare_norms), checked to still fit its tiers and said."""
    waiting = prepare_norms(plan, opts.hyper)
    if waiting is plan:
        return plan
    if not opts.quiet:
        log("tierflow run: --clip global: the plan's optimizer steps now wait for the step's last gradient "
            "(its queues re-ordered; tierflow plan --clip-grad-norm shows the cost)", file=sys.stderr)
    simulate_plan(waiting)  # gradients held until the norm: the re-ordered plan must still fit its tiers
    return waiting


def prepare_norms(plan: Plan, h: Hyper) -> Plan:
    """Fresh step norms for this run, and the plan to run. With global clipping the plan's optimizer ops must
    wait for the step's gradients: a plan that does not yet is returned with the waits, its queues
    re-ordered (planner/core/clipwait.py), or refused (RunError) if that cannot be done."""
    if not isinstance(h, TrainHyper):
        return plan
    parts = sum(1 for t in plan.graph.tasks if t.kind in OPTIMIZER_KINDS and t.iteration == 0)
    if plan.config.world.ranks > 1:
        parts = 0  # each rank steps its shard: no whole-model gradient norm (steps.csv leaves it empty)
    object.__setattr__(h, "norms", GradNorms(h.clip_grad_norm, h.clip, parts))
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


def run_plan(plan: Plan, opts: RunOptions, log=print) -> RunResult:
    """Train `opts.steps` steps (in total, counting those of a checkpoint resumed from) with `plan`. Raises
    RunStopped when training stops early (diverged, interrupted, a checkpoint that cannot be written)."""
    try:
        check_supported(plan.model)
    except NotImplementedError as e:
        raise RunError(str(e)) from None
    if opts.steps < 1:
        raise RunError(f"--steps {opts.steps}: must be >= 1")
    if opts.export_hf:
        check_export_hf(opts.export_hf, plan)
    check_hyper(opts.hyper)
    plan = _clipping_plan(plan, opts, log)
    if opts.profile and not opts.out:
        raise RunError("--profile needs --out DIR: torch_trace.json is written there beside the measured "
                       "trace.json")
    cfg = plan.config
    check_launch(cfg.world.ranks, cfg.gpus, cfg.nodes, str(plan.source))
    backend = _device(rank_device(opts.device, cfg.world.ranks), opts.seed)
    world = init_world(cfg.world.ranks, backend.device)
    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    if opts.compute_dtype is not None:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[opts.compute_dtype]
    check_in_place(plan, dtype, backend.device.type)
    probe = TrainState(plan.model, cfg.placement, cfg.alpha, backend, dtype, None, world)
    need_ssd = _ssd_need_bytes(plan, probe)
    uses_ssd = need_ssd > (1 << 20) or any(t.resource in ("ssd_read", "ssd_write") for t in plan.graph.tasks)
    who = "" if world.single else f" [rank {world.rank}]"

    def warn(msg: str) -> None:
        log(f"tierflow run{who}: {msg}", file=sys.stderr)

    ssd = None
    # runs in reverse: SSD store closed, its run directory removed, locks released
    with ExitStack() as cleanup:
        locked: set[Path] = set()
        if opts.checkpoint_dir:
            ck = Path(opts.checkpoint_dir)
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
            root = check_ssd_dir(opts.ssd_dir, need_ssd * world.local_ranks,
                                 "optimizer states, weights, gradients or activations placed there")
            if not world.single:  # each rank's SSD tier in a directory of its own
                root = root / f"rank-{world.rank}"
                root.mkdir(exist_ok=True)
            _lock(cleanup, root, "--ssd-dir", locked, warn)
            remove_stale_run_dirs(root, warn)
            run_dir = root / f"tierflow-run-{os.getpid()}"
            run_dir.mkdir(exist_ok=True)
            cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
            ssd = SsdStore(run_dir, backend=backend, warn=warn)
            cleanup.callback(ssd.close)
        # every rank has its directories (rank 0: the checkpoint directory cleaned) before resuming
        world.barrier()
        return _train(plan, opts, backend, dtype, ssd, log, warn, world)


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
class _Training:
    """One run under way (`_train`): what it trains and where, and the steps so far."""

    plan: Plan
    opts: RunOptions
    backend: DeviceBackend
    ssd: SsdStore | None
    log: Callable[..., None]
    world: DistWorld
    state: TrainState
    settings: dict  # what a checkpoint records and a resume checks (plan, seed, hyper-parameters, data)
    tokens: int  # per step, over the ranks
    flops_per_step: float
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

    @property
    def quiet(self) -> bool:
        return self.opts.quiet or self.world.rank != 0  # rank 0 reports for all

    @property
    def lead(self) -> bool:
        return self.world.rank == 0  # writes --out, --export-hf

    def result(self) -> RunResult:
        ssd = self.ssd
        return RunResult(self.plan, self.start_step, self.records, self.state, self.measured,
                         ssd.bytes_read if ssd else 0, ssd.bytes_written if ssd else 0,
                         ssd.direct if ssd else None, checkpoint=self.last_ckpt,
                         ssd_cpu_s=ssd.cpu_s if ssd else 0.0, optimizer_threads=self.optimizer_threads)


def _train(plan: Plan, opts: RunOptions, backend: DeviceBackend, dtype: torch.dtype, ssd: SsdStore | None,
           log, warn, world: DistWorld) -> RunResult:
    cfg, spec = plan.config, plan.model
    state = TrainState(spec, cfg.placement, cfg.alpha, backend, dtype, ssd, world)
    data = load_data(opts.data, opts, spec.vocab_size)
    data, val = _held_out(data, opts, spec.vocab_size)
    if opts.data:
        data.check_batch(cfg.batch, cfg.seq)
    settings = {"plan": plan_fingerprint(plan), "seed": opts.seed, "hyper": asdict(opts.hyper),
                "data": data.source, "training": training_digest(spec, cfg.batch, cfg.seq),
                "shape": {"model": spec.name, "batch": cfg.batch, "seq": cfg.seq}}
    tokens = cfg.batch * cfg.seq
    tr = _Training(plan, opts, backend, ssd, log, world, state, settings, tokens,
                   tokens * model_flops_per_token(spec, cfg.seq), val=val)
    if opts.log_dir and tr.lead:
        tr.tb = TbLog(opts.log_dir)
    where = _start_state(tr, warn)
    ex = Executor(plan, state, data, backend, opts.hyper, ssd, profile=opts.profile)
    tr.optimizer_threads = ex.optimizer_threads
    if not tr.quiet:
        _log_start(tr, dtype, where, data)
        if ex.optimizer_threads is not None:
            log(f"  host optimizer on {ex.optimizer_threads} of {ex.threads} threads: the thread launching "
                "GPU work keeps a core")
    try:
        _run_rounds(tr, ex)
    finally:
        if tr.tb is not None:
            tr.tb.close()
    return _finish(tr)


def tokenizer_dir(opts: RunOptions) -> str | None:
    """The model's tokenizer: --tokenizer, else the --init directory when it has one."""
    return opts.tokenizer or (opts.init if opts.init and has_tokenizer(opts.init) else None)


def load_data(path: str | None, opts: RunOptions, vocab_size: int) -> TokenData:
    """--data (or --val-data): tokenized with the model's tokenizer (corpus.py) when it is JSON Lines,
    Parquet or a directory, or text and a tokenizer is given (--tokenizer, or an --init directory that has
    one); else as data.py reads it (uint16 tokens, byte-level text, synthetic)."""
    tok = tokenizer_dir(opts)
    fmt = opts.data_format
    text = fmt == "auto" and tok is not None and Path(path or "").suffix in TEXT_SUFFIXES
    if path is not None and fmt != "text" and (is_corpus(path, fmt) or text):
        tokens, mask, what = tokenize(path, tok, opts.fields, vocab_size, opts.cache_dir)
        data = TokenData(tokens, what, mask)
        top = int(tokens.max())
        if top >= vocab_size:
            raise DataError(f"--data {path}: token id {top} is outside the model's vocabulary of "
                            f"{vocab_size} (is --tokenizer the model's own?)")
        return data
    return TokenData.load(path, vocab_size, fmt, seed=opts.seed)


def _held_out(data: TokenData, opts: RunOptions, vocab_size: int) -> tuple[TokenData, TokenData | None]:
    """(training data, held-out data or None) of --val-fraction / --val-data; --eval-every needs one."""
    if opts.val_fraction and opts.val_data:
        raise RunError("--val-fraction and --val-data: pass one of them")
    val = None
    if opts.val_data:
        val = load_data(opts.val_data, opts, vocab_size)
    elif opts.val_fraction:
        data, val = data.split(opts.val_fraction)
    if opts.eval_every and val is None:
        raise RunError(f"--eval-every {opts.eval_every}: needs held-out tokens (--val-fraction 0.05, or "
                       "--val-data FILE)")
    return data, val


def _eval_due(tr: _Training) -> bool:
    every = tr.opts.eval_every
    return bool(every) and tr.val is not None and (tr.step % every == 0 or tr.step == tr.opts.steps)


def _run_eval(tr: _Training) -> None:
    """Validation loss and perplexity after step tr.step (evaluate.py), into its record, the log and
    TensorBoard."""
    cfg = tr.plan.config
    res = evaluate(tr.state, tr.val, tr.step, cfg.batch, cfg.seq, cfg.micro_batch, tr.opts.eval_batches)
    if tr.records and tr.records[-1].step == tr.step:
        tr.records[-1].val_loss, tr.records[-1].val_ppl = res.val_loss, res.val_ppl
    if tr.tb is not None:
        tr.tb.step(tr.step, {"val/loss": res.val_loss, "val/perplexity": res.val_ppl})
    if not tr.quiet:
        tr.log(f"  eval after step {tr.step}: validation loss {res.val_loss:.4f}, perplexity "
               f"{res.val_ppl:,.2f} ({res.tokens:,} held-out tokens)", flush=True)


def _start_state(tr: _Training, warn) -> str:
    """The state to start from: the last checkpoint of --checkpoint-dir (which sets the first step), --init's
    weights, or a random init; says which."""
    opts, state = tr.opts, tr.state

    def check(ckpt: Path, manifest: dict) -> None:
        _check_resume(ckpt, manifest, tr.settings, opts, warn)

    found = resume(state, opts.checkpoint_dir, fallback=opts.resume_fallback, check=check,
                   log=warn) if opts.checkpoint_dir else None
    if found is not None:
        tr.last_ckpt, manifest = found
        tr.start_step = tr.step = tr.saved_step = int(manifest["step"])
        norms = norms_of(opts.hyper)
        if norms is not None and manifest.get("grad_norm") is not None:  # delayed clipping goes on from it
            norms.norms[tr.start_step] = float(manifest["grad_norm"])
        return f"resumed from {tr.last_ckpt} (step {tr.start_step})"
    if opts.init:
        return f"weights from {state.init_hf(opts.init)}"
    state.init_random(opts.seed)
    return f"random init (seed {opts.seed})"


def _log_start(tr: _Training, dtype: torch.dtype, where: str, data: TokenData) -> None:
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


def _run_rounds(tr: _Training, ex: Executor) -> None:
    """Rounds until --steps, under torch.profiler with --profile;
    RunStopped (with --out written) when training stops early."""
    opts = tr.opts
    profiler = _profiler(tr.backend.device) if opts.profile and tr.lead else None
    if profiler is not None:
        profiler.start()  # stopped and exported when the rounds end, also when a run stops early
    # with a checkpoint directory a stop signal ends the round under way and saves its last step
    deferred = (deferred_stop(stop_at_once=peer_gone) if opts.checkpoint_dir
                else nullcontext())
    try:
        with deferred:
            while tr.step < opts.steps:
                _run_round(tr, ex, _round_iterations(tr))
                _stop_if_signalled(tr)
                if opts.on_round is not None and opts.on_round(tr):
                    break
    except (Diverged, CheckpointWriteError, Interrupted) as e:
        code, msg = _stop_message(tr, e)
        if opts.out and tr.lead:
            write_run_outputs(tr.measured, tr.records, opts.out, f"{tr.plan.model.name}: measured "
                                                                 f"({tr.backend.name})")
            msg += f"; the results so far are under {opts.out}"
        raise RunStopped(msg, code, tr.result()) from None
    finally:
        if profiler is not None:
            _export_profile(tr, profiler)


def _stop_if_signalled(tr: _Training) -> None:
    """After a round: a stop signal noted during it (on any rank: they agree) saves this step's checkpoint,
    then stops the run (Interrupted). Without a checkpoint directory a signal has stopped it at once."""
    if not tr.opts.checkpoint_dir:
        return
    signum = pending_signal()
    if not tr.world.single:
        signum = next((s for s in tr.world.gather_objects(signum) if s is not None), None)
    if signum is None:
        return
    stop = stop_now(signum)  # later signals are ignored while the checkpoint is written
    _save_checkpoint(tr)
    raise stop


def _round_iterations(tr: _Training) -> int:
    """Iterations of the next round: the plan's, fewer for the last steps of the run or up to a checkpoint."""
    opts, every = tr.opts, tr.opts.checkpoint_every
    r = min(tr.plan.graph.num_iterations, opts.steps - tr.step)
    if opts.checkpoint_dir and every:
        r = min(r, every - tr.step % every)
    if opts.eval_every:  # an evaluation sees the weights after exactly its step
        r = min(r, opts.eval_every - tr.step % opts.eval_every)
    return r


def _run_round(tr: _Training, ex: Executor, r: int) -> None:
    """One round of `r` iterations: its steps reported, its measured trace kept if it is the longest so far,
    and a checkpoint at its end where --checkpoint-every falls."""
    opts, step = tr.opts, tr.step
    local: list[float] = []  # this rank's own losses of the round (the reported ones are the ranks' mean)
    rr = ex.run_round(r, step, on_step=_step_reporter(tr, step, local))
    LOG.debug("round of %d iteration(s) from step %d: %.3f s wall; peak %s", r, step + 1, rr.wall_s,
              ", ".join(f"{t} {b / 1e6:,.1f} MB" for t, b in rr.peak_bytes.items()))
    # the reporter's losses are the round's own (read after each iteration's last GPU op)
    if local != rr.losses:
        raise ExecutionError(f"internal: the reported losses {local} are not the round's {rr.losses}")
    _note_norms(tr, step, r, rr.peak_bytes)
    res = measured_result(tr.plan, rr)
    if r >= tr.best_iters:
        tr.best_iters, tr.measured = r, res
    tr.step += r
    if _eval_due(tr):
        _run_eval(tr)
    every = opts.checkpoint_every
    # at --checkpoint-every, and the last step whatever the interval: a run never ends without its state
    if opts.checkpoint_dir and (every and tr.step % every == 0 or tr.step >= opts.steps):
        _save_checkpoint(tr)


def _note_norms(tr: _Training, step: int, r: int, peak: dict[str, float]) -> None:
    """The learning rate, gradient norm and the round's peak tier bytes of the round's steps `step`+1 ..
    `step`+r, into their records and TensorBoard."""
    h = tr.opts.hyper
    norms = norms_of(h)
    for rec in tr.records[-r:]:
        rec.lr = h.lr_at(rec.step) if isinstance(h, TrainHyper) else h.lr
        if norms is not None:
            rec.grad_norm = norms.value(rec.step)
        rec.gpu_bytes, rec.cpu_bytes, rec.ssd_bytes = (peak.get(t, 0.0) for t in ("gpu", "cpu", "ssd"))
        if tr.tb is not None:
            tr.tb.step(rec.step, {"train/loss": rec.loss, "train/lr": rec.lr,
                                  "train/grad_norm": rec.grad_norm, "train/tokens_per_s": rec.tokens_per_s})
    if norms is not None:
        norms.forget_before(step + r)


def _step_reporter(tr: _Training, step: int, local: list[float]) -> Callable[[int, float, float], None]:
    """The round's on_step: the ranks' mean loss of iteration i (Diverged if not finite),
    recorded and printed."""
    opts, log = tr.opts, tr.log
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
            log(f"step {rec.step:>5}/{opts.steps} {bar(rec.step, opts.steps, fill=' ')} loss {rec.loss:.4f}  "
                f"{rec.step_s * 1e3:8.1f} ms  {rec.tokens_per_s:10,.0f} tok/s  {rec.tflops:7.3f} TFLOPS",
                flush=True)

    return on_step


def _save_checkpoint(tr: _Training) -> None:
    """This step's checkpoint (once: a step already saved or resumed from is not written again)."""
    if tr.saved_step == tr.step or not tr.opts.checkpoint_dir:
        return
    norms = norms_of(tr.opts.hyper)
    if norms is not None:  # the last step's gradient norm: delayed clipping of a resumed run goes on from it
        tr.settings["grad_norm"] = norms.value(tr.step)
    try:
        tr.last_ckpt = save_checkpoint(tr.state, tr.opts.checkpoint_dir, tr.step, tr.settings, world=tr.world)
    except NonFiniteState as e:
        raise Diverged(str(e)) from None
    tr.saved_step = tr.step
    if not tr.quiet:
        tr.log(f"  checkpoint {tr.last_ckpt}" + (" (the last step)" if tr.step >= tr.opts.steps else ""))


def _stop_message(tr: _Training, e: Diverged | CheckpointWriteError | Interrupted) -> tuple[int, str]:
    """(exit code, message) of a run that stopped early."""
    opts = tr.opts
    kept = (f"the last good checkpoint {tr.last_ckpt} is kept" if tr.last_ckpt is not None
            else "no checkpoint was written" if opts.checkpoint_dir else "no --checkpoint-dir")
    done = f"{len(tr.records)} step(s) done ({tr.start_step + len(tr.records)} of {opts.steps})"
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


def _export_profile(tr: _Training, profiler: torch.profiler.profile) -> None:
    profiler.stop()
    out = tr.opts.out
    Path(out).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(out) / "torch_trace.json") as tmp:
        profiler.export_chrome_trace(str(tmp))
    if not tr.quiet:
        tr.log(f"  wrote torch_trace.json (torch.profiler; each op under a record_function 'op ID KIND "
               f"bBLOCK ...') under {out}")


def _finish(tr: _Training) -> RunResult:
    """After the last step: --out (rank 0), --export-hf, and the result (with collect_final,
    the final state)."""
    opts, state, log = tr.opts, tr.state, tr.log
    if opts.out and tr.measured is not None and tr.lead:
        write_run_outputs(tr.measured, tr.records, opts.out, f"{tr.plan.model.name}: measured "
                                                             f"({tr.backend.name})")
        if not tr.quiet:
            log(f"  wrote timeline.csv, trace.json, gantt.png, steps.csv under {opts.out}"
                + ("" if tr.world.single else " (rank 0's ops)"))
    if opts.export_hf:
        path = export_trained(state, opts.export_hf)  # a collective with several ranks; rank 0 writes
        tok = tokenizer_dir(opts)
        names = copy_tokenizer(tok, path) if tok and tr.lead else []  # the model's tokenizer beside it
        if not tr.quiet:
            log(f"  exported the fp32 weights after step {tr.step} to {path} (config.json, "
                f"model.safetensors{''.join(', ' + n for n in names)})")
    res = tr.result()
    if opts.collect_final:
        res.final_master = state.master_blocks()
        res.final_adam_m = [state.gathered("adam_m", b) for b in range(len(state.layout.numel))]
    return res


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
    layout). With several ranks every rank calls it (the weights are gathered from the shards) and rank 0
    writes."""
    blocks = [state.layout.params(b, state.gathered("master", b)) for b in range(len(state.layout.numel))]
    if state.world.rank != 0:
        return Path(directory)
    return export_hf(state.spec, blocks, directory)


def _profiler(device: torch.device) -> torch.profiler.profile:
    """torch.profiler over every thread (the executor runs its ops on one worker thread per resource; by
    default the profiler records only the thread that started it)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(activities=activities, experimental_config=every_thread)


HYPER_NAMES = {"seed": "--seed", "lr": "--lr", "weight_decay": "--weight-decay", "beta1": "--adam-betas",
               "beta2": "--adam-betas", "eps": "--adam-eps", "data": "--data", "schedule": "--lr-schedule",
               "warmup_steps": "--warmup-steps", "total_steps": "--steps (of the schedule)",
               "clip_grad_norm": "--clip-grad-norm", "clip": "--clip"}


def changed_settings(manifest: dict, settings: dict) -> list[tuple[str, object, object]]:
    """(name, checkpoint's value, this run's) of every seed / hyper-parameter / data source that differs."""
    old = {"seed": manifest.get("seed"), "data": manifest.get("data"), **(manifest.get("hyper") or {})}
    new = {"seed": settings["seed"], "data": settings["data"], **settings["hyper"]}
    return [(k, old[k], new.get(k)) for k in old if old[k] is not None and old[k] != new.get(k)]


def _check_resume(ckpt: Path, manifest: dict, settings: dict, opts: RunOptions, warn) -> None:
    """A checkpoint of another plan is refused; one of other settings too, unless --allow-changed-hyper."""
    if check_same_training(ckpt, manifest, settings, f"--checkpoint-dir {opts.checkpoint_dir}"):
        warn(f"resuming {ckpt.name}, written under another plan of the same model and batch: its state moves "
             "to this plan's tiers")
    diff = changed_settings(manifest, settings)
    if not diff:
        return
    what = ", ".join(f"{HYPER_NAMES.get(k, k)} {a!r} -> {b!r}" for k, a, b in diff)
    if not opts.allow_changed_hyper:
        raise RunError(f"--checkpoint-dir {opts.checkpoint_dir}: {ckpt.name} was written with other settings "
                       f"(checkpoint -> this run: {what}); resume with the checkpoint's, or pass "
                       "--allow-changed-hyper to continue with this run's")
    warn(f"resuming {ckpt.name} with changed settings ({what}), as --allow-changed-hyper asks")


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


# -- command line --------------------------------------------------------------------------------------------


def launch_ranks(args: argparse.Namespace) -> int:
    """`--nproc N`: check the plan's world, then start its ranks here through torchrun."""
    from tierflow.executor.dist import launch, strip_launch_flags

    if "WORLD_SIZE" in os.environ:
        raise LaunchError("--nproc inside a torchrun launch: pass either --nproc or torchrun, not both")
    plan = load_plan(args.plan)
    cfg = plan.config
    ranks = cfg.world.ranks
    if args.nproc * args.nnodes != ranks:
        raise LaunchError(f"--nproc {args.nproc} x --nnodes {args.nnodes} = {args.nproc * args.nnodes} "
                          f"ranks, but plan {args.plan} is for {ranks} ({cfg.gpus} GPU(s) x {cfg.nodes} "
                          f"box(es)); pass --nproc {cfg.gpus} --nnodes {cfg.nodes}, or plan again with "
                          f"--gpus {args.nproc} --nodes {args.nnodes}")
    argv = sys.argv[1:]  # the command line as typed: every rank runs it without the launch flags
    if "run" not in argv or str(args.plan) not in argv:
        raise LaunchError("--nproc starts `tierflow run` from the command line only (call torchrun yourself "
                          "to launch from a program)")
    return launch(args.nproc, args.nnodes, args.rdzv_endpoint, args.rdzv_id, strip_launch_flags(argv))


def cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "nproc", None) is not None:
        try:
            return launch_ranks(args)
        except (PlanError, LaunchError) as e:
            print(f"tierflow run: error: {e}", file=sys.stderr)
            return 2
    return leave_world(_cmd_run_here(args))


def leave_world(code: int) -> int:
    """The end of a rank of several: a clean exit passes a bounded final barrier and leaves the process groups
    (bounded too), a failed one at once, so that no collective the other ranks will never join, nor a process
    group's teardown, nor a thread left at interpreter exit holds it; torchrun then sees every rank end. With
    one rank: `code`."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return code
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
    os._exit(code)


def _says(e: BaseException | None = None) -> bool:
    """Does this process print the failure? With several ranks a failure all of them share (the checkpoint
    they agreed on, a stopped run: the mean loss, a checkpoint write) is printed by rank 0 only."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        return True
    return not (e is None or getattr(e, "agreed", False))


def _rank_lost(args: argparse.Namespace, res: RunResult | None, error: BaseException | None = None) -> int:
    """Another rank died (or a collective broke): remove the SSD-tier directories of this box's dead ranks
    (this rank's own went with run_plan's cleanup), say in one line which rank, the steps done, the checkpoint
    kept and any SSD files left (named, never claimed removed), and exit RankLost's code."""
    world = current_world()
    me = world.rank if world is not None else 0
    lost = lost_ranks()
    who = (", ".join(f"rank {r} (pid {pid})" for r, pid in lost) + " died"
           if lost else f"a collective failed ({' '.join(str(error).split())[:80]}): another rank stopped")
    left = []
    if args.ssd_dir:
        root = Path(args.ssd_dir)
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
             else "the SSD tier's files of every rank on this box removed" if args.ssd_dir else "")
    done = f" after {len(res.records)} step(s)" if res is not None else ""
    ck = Path(args.checkpoint_dir) / "latest" if args.checkpoint_dir else None
    # the dead rank's shard of the state is gone: the directory keeps the last checkpoint the ranks agreed on
    held = ck.read_text().strip() if ck is not None and ck.is_file() else ""
    kept = (f"checkpoint {ck.parent / held} kept (the directory holds step {int(held[4:])}; later steps are "
            "lost)" if held.startswith("step") and held[4:].isdigit() else "no checkpoint written")
    print(f"tierflow run [rank {me}]: {who}; this rank stopped{done}, {kept}"
          + (f", {files}" if files else "") + "; run again to resume", file=sys.stderr)
    return RankLost.exit_code


def check_run_outputs(args: argparse.Namespace) -> None:
    """--out, --export-hf and --checkpoint-dir, checked before the plan is loaded and any step runs
    (tierflow.outputs): an unwritable place or a user's non-empty --out (unless --overwrite) is refused with
    one line, exit 2 (a non-empty --export-hf too, by check_export_hf)."""
    overwrite = getattr(args, "overwrite", False)
    if args.out:
        check_output_dir(args.out, "--out", overwrite=overwrite)
    if args.export_hf:
        check_output_dir(args.export_hf, "--export-hf", overwrite=True)  # writable; new or empty: run_plan
    if args.checkpoint_dir:  # resumed from: may hold checkpoints, must be writable
        check_output_dir(args.checkpoint_dir, "--checkpoint-dir", overwrite=True)


def train_hyper(args: argparse.Namespace) -> TrainHyper:
    """The optimizer settings of the command line: a flag given > --ds-config's sections > the defaults."""
    from tierflow.planner.io.dstrain import ds_training_settings
    given: dict[str, Any] = {}
    if getattr(args, "ds_config", None):
        given, notes = ds_training_settings(args.ds_config)
        for n in notes:
            print(f"tierflow run: note: {n}", file=sys.stderr)
    flags = {"lr": args.lr, "weight_decay": args.weight_decay, "eps": args.adam_eps,
             "schedule": args.lr_schedule, "warmup_steps": args.warmup_steps,
             "clip_grad_norm": args.clip_grad_norm, "clip": args.clip}
    if args.adam_betas is not None:
        flags["beta1"], flags["beta2"] = args.adam_betas
    given.update({k: v for k, v in flags.items() if v is not None})
    schedule = given.get("schedule", "constant")
    total = args.steps if schedule in ("linear", "cosine") else 0
    return TrainHyper(**given, total_steps=total)


def run_options(args: argparse.Namespace, hyper: TrainHyper) -> RunOptions:
    """RunOptions of the command line."""
    return RunOptions(steps=args.steps, device=args.device, ssd_dir=args.ssd_dir, data=args.data,
                      data_format=args.data_format, init=args.init, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every or 0, out=args.out, hyper=hyper, seed=args.seed,
                      quiet=args.json or level_of(args) >= QUIET, export_hf=args.export_hf,
                      resume_fallback=args.resume_fallback, profile=args.profile,
                      allow_changed_hyper=args.allow_changed_hyper,
                      compute_dtype=getattr(args, "compute_dtype", None),
                      eval_every=args.eval_every, val_fraction=args.val_fraction, val_data=args.val_data,
                      eval_batches=args.eval_batches, log_dir=args.log_dir, tokenizer=args.tokenizer,
                      fields=Fields(args.text_field, args.prompt_field, args.response_field,
                                    getattr(args, "max_line_mib", MAX_LINE_MIB)),
                      cache_dir=getattr(args, "cache_dir", None))


def _cmd_run_here(args: argparse.Namespace) -> int:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        hyper = train_hyper(args)
    except (TierflowError, TypeError) as e:
        print(f"tierflow run: error: {e}", file=sys.stderr)
        return 2
    opts = run_options(args, hyper)
    stopped = None
    try:
        with StopOnSignals():
            check_run_outputs(args)
            plan = load_plan(args.plan)
            check_ops_match_decisions(plan)  # every decision the ops depend on, before op 1
            # a plan that overflows a tier is refused as `tierflow simulate --plan` refuses it
            simulate_plan(plan)
            if args.init:
                check_init_dir(args.init)
            if args.checkpoint_dir and args.checkpoint_every is None:
                opts.checkpoint_every = plan.graph.num_iterations
            t0 = time.perf_counter()
            res = run_plan(plan, opts)
    except RunStopped as e:
        if e.exit_code in (130, 143) and lost_ranks():  # torchrun's SIGTERM after another rank died
            return _rank_lost(args, e.result)
        if _says():
            print(f"tierflow run: {e}", file=sys.stderr)
        res, stopped = e.result, e
    except Interrupted as e:
        if lost_ranks():
            return _rank_lost(args, None)
        if _says():
            print(f"tierflow run: interrupted by {e.name} outside the training steps; stopped cleanly, the "
                  "SSD tier's files removed", file=sys.stderr)
        return e.exit_code
    # the exit codes are the errors' own (tierflow.errors): 2 bad input, 3 does not fit, 1 the executor failed
    except (PlanError, RunError, DataError, StateError, SsdError, ChecksumError, UnsupportedPlan, LockError,
            LaunchError, LogDirError, OutputError) as e:
        # a failure the ranks agreed on is this run's own (the first rank to exit may be gone already)
        if not getattr(e, "agreed", False) and lost_ranks():
            return _rank_lost(args, None)
        if _says(e):
            print(f"tierflow run: error: {e}", file=sys.stderr)
        return e.exit_code
    except CapacityError as e:
        print(f"tierflow run: does not fit: {e}", file=sys.stderr)
        return e.exit_code
    # an op out of memory, or the pinned transfer area allocated at start
    except (OutOfMemory, TransferAreaOutOfMemory) as e:
        print(f"tierflow run: {e}", file=sys.stderr)
        return e.exit_code
    except TierOutOfMemory as e:  # building the state on its tiers, before any op
        print(f"tierflow run: {e.tier} out of memory for the training state: {e}; plan again for this "
              "machine (tierflow calibrate, then tierflow plan --hw box.yaml)", file=sys.stderr)
        return e.exit_code
    except ExecutionError as e:
        if lost_ranks():
            return _rank_lost(args, None)
        print(f"tierflow run: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # a collective of several ranks whose peer is gone (gloo: connection reset)
        if current_world() is None:
            raise
        return _rank_lost(args, None, e)
    if args.json and _says():
        out: dict[str, Any] = {"plan": str(args.plan), "first_step": res.first_step,
                               "steps": [asdict(r) for r in res.records], "wall_s": time.perf_counter() - t0,
                               "ssd_bytes_read": res.ssd_bytes_read,
                               "ssd_bytes_written": res.ssd_bytes_written, "o_direct": res.o_direct,
                               "optimizer_threads": res.optimizer_threads,
                               "checkpoint": str(res.checkpoint) if res.checkpoint is not None else None}
        if stopped is not None:
            out["stopped"] = {"exit_code": stopped.exit_code, "reason": str(stopped)}
        if res.measured is not None:
            out["measured"] = res.measured.to_dict()
        if args.export_hf and stopped is None:  # a run that stopped early exports nothing
            out["export_hf"] = str(args.export_hf)
        print(json.dumps(out, indent=2))
    return stopped.exit_code if stopped is not None else 0
