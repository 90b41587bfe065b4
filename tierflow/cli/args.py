"""The flags several commands share, each declared once here: the model, the box and its ``--set`` overrides,
the batch, micro-batch and sequence length, and the data-parallel world (``--gpus``, ``--nodes``)."""

from __future__ import annotations

import argparse

from tierflow.cli.argtypes import MAX_BATCH, fraction_below_one, positive_float, positive_int
from tierflow.errors import UsageError
from tierflow.planner.core.lora import LoraConfig, LoraConfigError, parse_targets
from tierflow.planner.core.models import OPTIMIZER_STATE_NAMES, PRECISION_NAMES, ModelError, ModelSpec
from tierflow.planner.core.world import World

SET_HELP = "override a profile field, e.g. ssd.count=6"


def add_box_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """--model, --hw and --set, shared by the commands that take a model and a box."""
    if model:
        p.add_argument("--model", default="gpt3-175b",
                       help="zoo name (see `tierflow models`), a HF config.json or model directory, or a hub "
                       "id (org/name) in the local HF cache (never downloaded)")
    add_hw_arg(p)
    add_set_arg(p)


def add_hw_arg(p: argparse.ArgumentParser, default: str | None = "rtx4090-lohan",
               help: str = "profile name (see `tierflow profiles`) or a YAML path") -> None:
    """--hw: the box's hardware profile."""
    p.add_argument("--hw", default=default, help=help)


def add_set_arg(p: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    """--set KEY=VALUE (repeatable): profile overrides (tierflow.hwprofiles.overrides parses them)."""
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE", help=help)


def add_batch_arg(p: argparse.ArgumentParser, default: int) -> None:
    """--batch: the global batch in sequences."""
    p.add_argument("--batch", type=positive_int(MAX_BATCH), default=default,
                   help=f"global batch in sequences (default {default})")


def add_micro_batch_arg(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """--micro-batch: sequences per micro-batch."""
    p.add_argument("--micro-batch", type=positive_int(MAX_BATCH), default=default, help=help)


def add_seq_arg(p: argparse.ArgumentParser, help: str = "sequence length (default: the model's)") -> None:
    """--seq: the sequence length."""
    p.add_argument("--seq", type=positive_int(), default=None, help=help)


def add_precision_arg(p: argparse.ArgumentParser) -> None:
    """--precision: the training precision (tierflow.planner.core.workload.PRECISIONS)."""
    p.add_argument("--precision", choices=PRECISION_NAMES, default=None,
                   help="training precision: bf16 (default) or fp16 (2-byte weights, activations and "
                   "gradients, the 16-bit tensor-core peak), fp32 (4 bytes, the fp32 peak: PyTorch's default "
                   "for fp32 matmuls), tf32 (4 bytes, the TF32 tensor-core peak); each with an fp32 master "
                   "copy, as DeepSpeed's ZeRO keeps one. fp32-inplace / tf32-inplace: fp32 as PyTorch and "
                   "Megatron-LM train it, the optimizer stepping the weights themselves (no master where the "
                   "optimizer runs on the GPU beside them)")


def in_precision(model: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """`model` trained in --precision, its optimizer states in --optimizer-states, with --lora's adapters
    (unchanged without them)."""
    precision = getattr(args, "precision", None)
    model = model if precision is None else model.with_precision(precision)
    return in_state_format(model, args).with_lora(lora_of(args))


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """--lora RANK and its settings: fine-tune LoRA adapters on the frozen model (tierflow.planner.core.lora,
    docs/lora.md)."""
    p.add_argument("--lora", type=positive_int(65536), default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on the frozen model (no master, no moments, no "
                   "gradients of the base: it is only read; docs/lora.md)")
    p.add_argument("--lora-alpha", type=positive_float(), default=None, metavar="A",
                   help="with --lora: the adapters' scaling is A / RANK (default 16, PEFT's)")
    p.add_argument("--lora-targets", default=None, metavar="T,T",
                   help="with --lora: the projections that get adapters, PEFT's names (default all: q_proj, "
                   "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; or attention, mlp)")
    p.add_argument("--lora-dropout", type=fraction_below_one, default=None, metavar="P",
                   help="with --lora: dropout on the adapters' input (default 0)")


def lora_of(args: argparse.Namespace) -> LoraConfig | None:
    """The LoRA config of --lora and its settings (None without --lora); a bad value, or a setting without
    --lora, is a UsageError."""
    rank = getattr(args, "lora", None)
    given = {k: getattr(args, f"lora_{k}", None) for k in ("alpha", "targets", "dropout")}
    if rank is None:
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise UsageError(f"--lora-{extra[0]} applies to LoRA only (add --lora RANK)")
        return None
    fields = {k: v for k, v in given.items() if v is not None}
    if "targets" in fields:
        fields["targets"] = parse_targets(fields["targets"])
    try:
        return LoraConfig(rank, **fields)
    except LoraConfigError as e:
        raise UsageError(f"--lora: {e}") from None


DEFAULT_ACCEPTED_STATES = "fp32,8bit"


def check_accept_states(args: argparse.Namespace) -> None:
    """--accept-states without --optimizer-states auto would change nothing: UsageError, one line."""
    if getattr(args, "accept_states", None) is None or getattr(args, "optimizer_states", None) == "auto":
        return
    given = getattr(args, "optimizer_states", None)
    with_ = f"--optimizer-states {given}" if given else "the default fp32 states"
    raise UsageError(f"--accept-states {args.accept_states}: it lists the formats --optimizer-states auto "
                     f"may choose, and has no effect with {with_}; pass --optimizer-states auto, or leave "
                     "--accept-states out")


def add_optimizer_states_arg(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """--optimizer-states: the format of AdamW's master copy and moments (tierflow.planner.core.optstates);
    with `auto` also "auto" and --accept-states (tierflow plan: the fastest accepted format)."""
    if auto:
        p.add_argument("--accept-states", default=None, metavar="F,F",
                       help="with --optimizer-states auto (refused without it): the formats whose quality "
                       "cost you accept (default fp32,8bit; docs/compressed-states.md measures each)")
    p.add_argument("--optimizer-states", choices=[*OPTIMIZER_STATE_NAMES, *(["auto"] if auto else [])],
                   default=None,
                   help="AdamW's states: fp32 (default: fp32 master, m and v, 12 bytes per parameter), "
                   "8bit (m and v quantized block-wise to 8 bits, an fp32 absmax per 256 elements: 6.03 "
                   "bytes), 8bit-bf16master (also a bf16 master, rounded stochastically: 4.03 bytes; "
                   "16-bit training only); docs/compressed-states.md")


def in_state_format(model: ModelSpec, args: argparse.Namespace) -> ModelSpec:
    """`model` with its optimizer states in --optimizer-states (unchanged without it); a bad combination (a
    bf16 master with fp32 training) is a UsageError."""
    states = getattr(args, "optimizer_states", None)
    if states in (None, "auto"):  # auto: tierflow plan plans each accepted format (auto_states)
        return model
    try:
        return model.with_optimizer_states(states)
    except ModelError as e:
        raise UsageError(f"--optimizer-states {states}: {e}") from e


def add_world_args(p: argparse.ArgumentParser) -> None:
    """--gpus and --nodes: the data-parallel world (tierflow.planner.core.world)."""
    p.add_argument("--gpus", type=positive_int(1024), default=1,
                   help="data-parallel GPUs per box (default 1; at most the profile's topology.gpu_count)")
    p.add_argument("--nodes", type=positive_int(1024), default=1,
                   help="boxes (default 1; more need the profile's network section)")


def world_of(args: argparse.Namespace) -> World:
    """The World of --gpus / --nodes (1 x 1 for a command without them)."""
    return World(getattr(args, "gpus", 1), getattr(args, "nodes", 1))


def accepted_states(args: argparse.Namespace, model: ModelSpec) -> list[str]:
    """--accept-states as a list of formats (UsageError for an unknown one or one the model cannot use)."""
    given = DEFAULT_ACCEPTED_STATES if args.accept_states is None else args.accept_states
    out = [f.strip() for f in given.split(",") if f.strip()]
    for f in out:
        if f not in OPTIMIZER_STATE_NAMES:
            raise UsageError(f"--accept-states: {f!r} is not one of {', '.join(OPTIMIZER_STATE_NAMES)}")
        try:
            model.with_optimizer_states(f)
        except ModelError as e:
            raise UsageError(f"--accept-states {f}: {e}") from e
    if not out:
        raise UsageError("--accept-states: give at least one format, e.g. fp32,8bit")
    return out
