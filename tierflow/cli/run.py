"""`tierflow run`: train with a plan file on this machine, measuring every op (tierflow.executor.run). The
parser, and `run`, which turns its flags into the run's configuration once (tierflow.executor.options:
`RunConfig`, `run_config`), calls the executor, maps what it raises to the exit code (exits.py) and ends the
process (`_end`: a rank of several at once). torch (seconds to
import, and a heap that slows the planner's garbage collection) is imported when the command runs, not when
the parser is built."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from tierflow.cli.argtypes import MAX_STEPS, int_in, non_negative_float, positive_float, positive_int
from tierflow.cli.exits import exit_code, lead_rank
from tierflow.errors import TierflowError
from tierflow.logs import QUIET, level_of
from tierflow.planner.core.trainopts import CLIP_MODES, SCHEDULES

if TYPE_CHECKING:
    from tierflow.executor.options import RunConfig

EXTRA = "run"  # torch and safetensors: tierflow.cli.main checks them before the command runs
WHO = "tierflow run"  # how its error lines start


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run", help="train with a plan file on this machine (GPU or CPU), measuring every op",
        description="Replay a plan file (tierflow plan -o, or tierflow simulate --write-plan) as real "
        "training: the plan's ops run in the plan's order on per-resource workers, tensors live where the "
        "plan puts them (device, pinned host memory, files under --ssd-dir). Prints loss, tokens/s and "
        "TFLOPS per step.")
    p.add_argument("plan", help="plan file (JSON, docs/plan-format.md)")
    p.add_argument("--steps", type=positive_int(MAX_STEPS), default=5,
                   help="training steps in total, counting resumed ones (default 5)")
    p.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda when available); on cpu, transfers are copies but the "
                   "SSD tier is real file I/O")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the plan's runs of compute ops that stay on the device as CUDA graphs and "
                   "replay each with one launch (default: on for cuda, off elsewhere; cpu-adversarial "
                   "emulates them); a segment that cannot be captured runs eagerly, with one line saying why")
    p.add_argument("--ssd-dir", default=None, metavar="DIR",
                   help="directory on the SSD (array) for the SSD tier")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="training data: text, JSON Lines (.jsonl) or Parquet files or a directory of them, "
                   "tokenized with the model's tokenizer and cached beside them; or a nanoGPT-style uint16 "
                   "token file (.bin), or text as byte tokens; default: seeded random tokens")
    p.add_argument("--data-format", default="auto", choices=["auto", "uint16", "text", "tokenize"],
                   help="how to read --data: uint16 token ids, text as bytes, or tokenize (with the model's "
                   "tokenizer); default auto: .bin/.u16 = uint16; a directory, .jsonl or .parquet = "
                   "tokenize; other text = tokenize when a tokenizer is given (--tokenizer, or --init with "
                   "one), else bytes")
    _add_data_args(p)
    from tierflow.cli.args import add_lora_args

    add_lora_args(p)  # must match the plan's adapters (tierflow plan --lora records them; docs/lora.md)
    p.add_argument("--init", default=None, metavar="DIR",
                   help="Hugging Face model directory (*.safetensors) to start from, loaded block by block")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the training state here and resume from its latest checkpoint")
    p.add_argument("--checkpoint-every", type=positive_int(MAX_STEPS), default=None, metavar="K",
                   help="steps between checkpoints, >= 1 (default: the plan's iterations per round)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the measured timeline.csv, trace.json (Perfetto), gantt.png and steps.csv "
                   "here")
    p.add_argument("--overwrite", action="store_true", help="let --out write into a non-empty directory")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="after the last step, write the trained fp32 weights as a Hugging Face model "
                   "directory (config.json + model.safetensors) that transformers' from_pretrained loads; "
                   "DIR must be new or empty")
    p.add_argument("--export-peft", default=None, metavar="DIR",
                   help="with a LoRA plan (tierflow plan --lora RANK): after the last step, write the "
                   "adapters as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                   "that peft.PeftModel.from_pretrained loads onto the Hugging Face base model; DIR must be "
                   "new or empty (docs/lora.md)")
    p.add_argument("--init-peft", default=None, metavar="DIR",
                   help="with a LoRA plan: start the adapters from a PEFT adapter directory (PEFT's "
                   "save_pretrained, or --export-peft); its rank, alpha and targets must be the plan's, and "
                   "the base it names --init's or the model's")
    _add_optimizer_args(p)
    _add_eval_args(p)
    p.add_argument("--seed", type=int_in(0, 2**63 - 1, "a non-negative integer"), default=0,
                   help="seed of the random init and synthetic data (default 0)")
    p.add_argument("--profile", action="store_true",
                   help="run under torch.profiler and write its Chrome trace, torch_trace.json, under --out "
                   "(each op in a record_function named after the plan's op, e.g. 'op 123 fwd b3 mb1 it0'); "
                   "needs --out")
    p.add_argument("--resume-fallback", action="store_true",
                   help="if the latest checkpoint is corrupt, truncated or unreadable, resume from the "
                   "previous one that verifies (default: refuse with one line)")
    p.add_argument("--allow-changed-hyper", action="store_true",
                   help="resume although --seed, --data or the optimizer's settings differ from the "
                   "checkpoint's (default: refuse, naming what differs)")
    g = p.add_argument_group("several GPUs (a plan made with --gpus/--nodes; or launch with torchrun "
                             "yourself)")
    g.add_argument("--nproc", type=positive_int(1024), default=None, metavar="N",
                   help="start N ranks on this box through torchrun (torch.distributed.run), as `torchrun "
                   "--nproc-per-node N -m tierflow run ...` does; N x --nnodes must be the plan's gpus x "
                   "nodes")
    g.add_argument("--nnodes", type=positive_int(1024), default=1, metavar="M",
                   help="boxes of the run, each starting its --nproc ranks with this same command (default "
                   "1)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="where the boxes' launchers meet (torchrun's c10d rendezvous); needed with --nnodes "
                   "> 1")
    g.add_argument("--rdzv-id", default="tierflow", metavar="ID",
                   help="the run's rendezvous id (default tierflow)")
    a = p.add_argument_group("adapting the plan (docs/adapting.md)")
    a.add_argument("--adapt", action="store_true",
                   help="after --adapt-warmup steps compare measured and predicted times per resource; "
                   "beyond --adapt-threshold refit the profile from the trace, plan again and switch to the "
                   "new plan if it is predicted faster by more than --adapt-margin (one line per decision)")
    a.add_argument("--adapt-warmup", type=positive_int(MAX_STEPS), default=3, metavar="K",
                   help="steps before the comparison (default 3)")
    a.add_argument("--adapt-threshold", type=positive_float(), default=0.10, metavar="F",
                   help="relative difference that triggers a refit (default 0.10)")
    a.add_argument("--adapt-margin", type=non_negative_float(), default=0.05, metavar="F",
                   help="predicted gain the new plan needs to be switched to (default 0.05)")
    a.add_argument("--adapt-time-limit", type=positive_float(3600), default=30.0, metavar="S",
                   help="seconds for the re-plan's search (default 30)")
    a.add_argument("--adapt-fit-evaluations", type=positive_int(100000), default=400, metavar="N",
                   help="the refit's budget of simulations (default 400)")
    a.add_argument("--adapt-decide-within", type=int_in(0, MAX_STEPS), default=None, metavar="K",
                   help="wait for the refit and re-plan at the latest K steps after the warm-up (0: at its "
                   "end, nothing trains meanwhile; default: never wait, training goes on under the old plan "
                   "and a decision that arrives after the last step is not applied)")
    p.add_argument("--json", action="store_true", help="print the steps and the measured summary as JSON")
    # hidden (tests): compute in bf16 on a CPU device too, as on CUDA (bf16 is the default there, fp32 on a
    # CPU)
    p.add_argument("--compute-dtype", choices=["bf16", "fp32"], default=None, help=argparse.SUPPRESS)
    return p


def _add_optimizer_args(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("optimizer and schedule (AdamW; docs/finetuning.md)")
    o.add_argument("--lr", type=positive_float(), default=None,
                   help="AdamW peak learning rate (default 1e-3)")
    o.add_argument("--weight-decay", type=non_negative_float(), default=None,
                   help="AdamW decoupled weight decay (default 0.1); biases and the weights of norm layers "
                   "(LayerNorm, RMSNorm) are never decayed, as in Hugging Face's Trainer")
    o.add_argument("--adam-betas", type=_betas, default=None, metavar="B1,B2",
                   help="AdamW betas (default 0.9,0.95)")
    o.add_argument("--adam-eps", type=positive_float(), default=None, help="AdamW eps (default 1e-8)")
    o.add_argument("--lr-schedule", choices=SCHEDULES, default=None,
                   help="learning-rate schedule, Hugging Face's names and formulas (transformers."
                   "get_scheduler) over --steps: constant (ignores warmup), constant_with_warmup, linear, "
                   "cosine (default constant)")
    o.add_argument("--warmup-steps", type=int_in(0, MAX_STEPS, "an integer >= 0"), default=None, metavar="N",
                   help="linear warmup from 0 over the first N steps (default 0)")
    o.add_argument("--clip-grad-norm", type=non_negative_float(), default=None, metavar="X",
                   help="clip the gradients to global L2 norm X, as torch.nn.utils.clip_grad_norm_ (default "
                   "0: no clipping)")
    o.add_argument("--clip", choices=CLIP_MODES, default=None,
                   help="global (default): exact, the optimizer waits for the step's last gradient (a plan "
                   "that overlaps the optimizer with the backward is refused); delayed: the previous step's "
                   "norm clips this step (any plan; the first step is not clipped)")
    o.add_argument("--ds-config", default=None, metavar="FILE",
                   help="read AdamW's lr/betas/eps/weight_decay, the scheduler (WarmupLR, WarmupDecayLR, "
                   "WarmupCosineLR with linear warmup) and gradient_clipping from a DeepSpeed config; the "
                   "flags above override it")


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("evaluation and logs (docs/finetuning.md)")
    e.add_argument("--eval-every", type=positive_int(MAX_STEPS), default=0, metavar="N",
                   help="validation loss and perplexity every N steps and after the last (needs "
                   "--val-fraction or --val-data); the forward reads each block's weights from its tier, as "
                   "training does")
    e.add_argument("--val-fraction", type=_fraction, default=0.0, metavar="F",
                   help="hold out the last fraction F of --data's tokens for validation (e.g. 0.05)")
    e.add_argument("--val-data", default=None, metavar="FILE",
                   help="held-out tokens for validation, read as --data is")
    e.add_argument("--eval-batches", type=positive_int(1 << 20), default=4, metavar="K",
                   help="batches of the plan's batch size per evaluation, the same ones each time "
                   "(default 4)")
    e.add_argument("--log-dir", default=None, metavar="DIR",
                   help="TensorBoard event files here: train/loss, lr, grad_norm, tokens_per_s, val/loss, "
                   "perplexity (needs the tensorboard package; steps.csv under --out has the same numbers)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """How --data's text is tokenized (executor/corpus.py)."""
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="Hugging Face tokenizer directory for --data (default: --init's, when it has one)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field of a JSON Lines / Parquet record that is trained on (default text)")
    p.add_argument("--prompt-field", default=None, metavar="NAME",
                   help="with --response-field: train on prompt + response, the loss masked on the prompt")
    p.add_argument("--response-field", default=None, metavar="NAME", help="see --prompt-field")
    p.add_argument("--max-line-mib", type=positive_float(2**20), default=64, metavar="MIB",
                   help="the longest JSON Lines line of --data read, in MiB (default 64): a longer one is "
                   "refused in one line, so memory stays bounded whatever the file")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="keep --data's token cache under DIR (default: beside the data, or the user's cache "
                   "directory when the data's folder is not writable)")


def _lora_options(args: argparse.Namespace):
    """--lora and its settings as the run's LoraOptions (None without --lora): checked against the plan."""
    from tierflow.cli.args import lora_of
    from tierflow.executor.options import LoraOptions

    lora = lora_of(args)
    if lora is None:
        return None
    return LoraOptions(lora.rank, lora.alpha, lora.targets, lora.dropout)


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0 <= f < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction in [0, 1), e.g. 0.05")
    return f


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give two numbers B1,B2, e.g. 0.9,0.95") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: each beta must be in [0, 1), e.g. 0.9,0.95")
    return b1, b2


def run(args: argparse.Namespace) -> int:
    """`tierflow run`: the configuration built once from the flags (`run_config`), the run, and its end: what
    the library raised mapped to an exit code (exits.py), and a rank of several ended at once (`_end`)."""
    from tierflow.executor import launch  # torch is imported here, when the command runs
    from tierflow.executor.train_loop import RunStopped

    try:
        config = run_config(args)
        if config.distributed.nproc is not None:  # torchrun starts the ranks; each comes back without --nproc
            return launch.launch_ranks(config)
    except TierflowError as e:
        return exit_code(e, WHO)
    code = 0
    try:
        if config.adapt is not None:
            from tierflow.executor.adapt import adapt_file

            out = adapt_file(config)
        else:
            out = launch.outcome_dict(config, launch.run_file(config))
    except RunStopped as e:  # stopped early: the steps so far are printed too, and its code returned
        code = exit_code(e, WHO)
        if e.result is None or config.adapt is not None:
            return _end(code)
        out = launch.outcome_dict(config, e.result, e)
    except TierflowError as e:
        return _end(exit_code(e, WHO))
    if args.json and lead_rank():
        print(json.dumps(out, indent=2))
    return _end(code)


def _end(code: int) -> int:
    """The exit code of this process; a rank of several ends here and now (its process groups left first,
    launch.leave_world), so that no collective, teardown or thread left holds it."""
    from tierflow.executor import launch

    if launch.leave_world(code):
        os._exit(code)
    return code


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run's configuration (tierflow.executor.options.RunConfig) of the command line, a --ds-config's
    settings under the flags given (its notes printed once)."""
    from tierflow.executor.options import (
        AdaptOptions,
        CheckpointOptions,
        DistOptions,
        EvalOptions,
        ModelDataOptions,
        OptimizerOptions,
        OutputOptions,
        RunConfig,
    )

    model_data = ModelDataOptions(
        init=args.init, init_peft=args.init_peft, data=args.data, data_format=args.data_format,
        tokenizer=args.tokenizer,
        text_field=args.text_field, prompt_field=args.prompt_field, response_field=args.response_field,
        max_line_mib=args.max_line_mib, cache_dir=args.cache_dir, seed=args.seed)
    optimizer = OptimizerOptions(
        lr=args.lr, weight_decay=args.weight_decay, betas=args.adam_betas, eps=args.adam_eps,
        schedule=args.lr_schedule, warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm,
        clip=args.clip)
    if args.ds_config:
        from tierflow.planner.io.deepspeed.train import ds_training_settings

        settings, notes = ds_training_settings(args.ds_config)
        for n in notes:
            print(f"{WHO}: note: {n}", file=sys.stderr)
        optimizer = optimizer.with_ds_settings(settings)
    checkpoint = CheckpointOptions(directory=args.checkpoint_dir, every=args.checkpoint_every,
                                   resume_fallback=args.resume_fallback,
                                   allow_changed_hyper=args.allow_changed_hyper)
    evaluation = EvalOptions(every=args.eval_every, val_fraction=args.val_fraction, val_data=args.val_data,
                             batches=args.eval_batches, log_dir=args.log_dir)
    distributed = DistOptions(nproc=args.nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                              rdzv_id=args.rdzv_id, argv=tuple(sys.argv[1:]))
    output = OutputOptions(out=args.out, overwrite=args.overwrite, export_hf=args.export_hf,
                           export_peft=args.export_peft,
                           profile=args.profile, json=args.json, quiet=args.json or level_of(args) >= QUIET)
    adapt = (AdaptOptions(warmup=args.adapt_warmup, threshold=args.adapt_threshold, margin=args.adapt_margin,
                          time_limit_s=args.adapt_time_limit, fit_evaluations=args.adapt_fit_evaluations,
                          decide_within=args.adapt_decide_within,
                          clip=bool(args.clip_grad_norm) and args.clip != "delayed") if args.adapt else None)
    # (new option groups: built here from their flags, and passed below)
    return RunConfig(plan=args.plan, steps=args.steps, device=args.device, ssd_dir=args.ssd_dir,
                     compute_dtype=args.compute_dtype, cuda_graphs=args.cuda_graphs, model_data=model_data,
                     optimizer=optimizer, checkpoint=checkpoint, evaluation=evaluation,
                     distributed=distributed, output=output, adapt=adapt, lora=_lora_options(args))
