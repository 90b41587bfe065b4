"""The configuration of one run (`RunConfig`), typed and frozen: built once at the edge (the command line,
tierflow/cli/run.py, or a program / test that trains) and passed unchanged to the training loop and the
engine. What changes while the run goes (the step, the gradient norms, the records, the adapt decision) is the
`Trainer`'s (executor/train_loop.py), never the configuration's. Importing this module imports no torch and no
solver (tests/system/test_layering.py checks it).

    RunConfig            steps, the plan file, device, SSD directory, compute dtype; and the groups:
      ModelDataOptions   the starting weights and the data: --init, --init-peft, --data, its tokenizer, fields
      OptimizerOptions   AdamW, its learning-rate schedule and clipping (None: not given: the default)
      CheckpointOptions  --checkpoint-dir and how a run resumes from it
      EvalOptions        validation loss and TensorBoard logs
      DistOptions        several ranks: --nproc / --nnodes and torchrun's rendezvous
      OutputOptions      what the run writes and prints: --out, --export-hf, --export-peft, --profile, --json
      AdaptOptions       --adapt (executor/decide.py takes it)
      LoraOptions        --lora and its settings, checked against the plan's model.lora

A new option group is one frozen dataclass here and one field of `RunConfig` (with its default: a run without
the flags does what it did), its flags in tierflow/cli/run.py (`_add_*_args` and `run_config`), and the code
that reads it through `Trainer.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tierflow.errors import TierflowError


class RunError(TierflowError, ValueError):
    """Bad input to `tierflow run` (one line, exit 2): a flag's value, or flags that do not go together."""


@dataclass(frozen=True)
class ModelDataOptions:
    init: str | None = None  # Hugging Face model directory to start from
    init_peft: str | None = None  # a PEFT adapter directory the LoRA adapters start from (lora_peft.py)
    data: str | None = None  # None: seeded random tokens
    data_format: str = "auto"  # auto | uint16 | text | tokenize
    tokenizer: str | None = None  # None: --init's, when it has one
    text_field: str = "text"  # the JSON Lines / Parquet field trained on
    prompt_field: str | None = None  # with response_field: the prompt's tokens masked out of the loss
    response_field: str | None = None
    max_line_mib: float | None = None  # the longest JSON Lines line read (None: corpus.MAX_LINE_MIB)
    cache_dir: str | None = None  # where --data's token cache lives (None: beside the data)
    seed: int = 0  # of the random init and the synthetic data


@dataclass(frozen=True)
class OptimizerOptions:
    """AdamW's settings (None: not given: the default of tierflow.executor.optim.adamw.TrainHyper). The
    command line fills what a --ds-config sets and no flag did (`with_ds_settings`)."""

    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    schedule: str | None = None  # tierflow.planner.core.trainopts.SCHEDULES
    warmup_steps: int | None = None
    clip_grad_norm: float | None = None
    clip: str | None = None  # tierflow.planner.core.trainopts.CLIP_MODES
    # the steps a decaying schedule (linear, cosine) spans; None: the run's `steps` (the command line's). A
    # program that trains a long run in parts (tests/executor/test_finetune.py) gives the whole run's
    total_steps: int | None = None

    def given(self) -> dict[str, Any]:
        """The settings given, as TrainHyper's fields."""
        out = {k: v for k, v in (("lr", self.lr), ("weight_decay", self.weight_decay), ("eps", self.eps),
                                 ("schedule", self.schedule), ("warmup_steps", self.warmup_steps),
                                 ("clip_grad_norm", self.clip_grad_norm), ("clip", self.clip),
                                 ("total_steps", self.total_steps))
               if v is not None}
        if self.betas is not None:
            out["beta1"], out["beta2"] = self.betas
        return out

    def with_ds_settings(self, ds: dict[str, Any]) -> OptimizerOptions:
        """These options with a DeepSpeed config's settings (TrainHyper's fields, from
        planner/io/deepspeed/train.py) where no flag was given."""
        fill = {k: v for k, v in ds.items() if k not in ("beta1", "beta2") and getattr(self, k) is None}
        if self.betas is None and ("beta1" in ds or "beta2" in ds):
            fill["betas"] = (ds.get("beta1", 0.9), ds.get("beta2", 0.95))  # TrainHyper's defaults
        return replace(self, **fill)


@dataclass(frozen=True)
class CheckpointOptions:
    directory: str | None = None  # save the state here and resume from its latest checkpoint
    every: int | None = None  # steps between checkpoints (None: the plan's iterations per round; 0: the last)
    resume_fallback: bool = False  # a corrupt latest checkpoint: resume from the previous one that verifies
    allow_changed_hyper: bool = False  # resume although the seed / settings / data differ


@dataclass(frozen=True)
class EvalOptions:
    every: int = 0  # validation loss every N steps and after the last (0: never)
    val_fraction: float = 0.0  # hold out the last fraction of --data
    val_data: str | None = None  # or a file of held-out tokens
    batches: int = 4  # batches of the plan's batch size per evaluation
    log_dir: str | None = None  # TensorBoard event files


@dataclass(frozen=True)
class DistOptions:
    nproc: int | None = None  # start N ranks here through torchrun (None: this process is one rank)
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str = "tierflow"
    argv: tuple[str, ...] = ()  # the command line as typed: each rank runs it without the launch flags


@dataclass(frozen=True)
class OutputOptions:
    out: str | None = None  # the measured trace and steps.csv
    overwrite: bool = False  # let `out` be a non-empty directory
    export_hf: str | None = None  # the trained weights in the Hugging Face layout
    export_peft: str | None = None  # the trained LoRA adapters as a PEFT adapter directory (lora_peft.py)
    profile: bool = False  # torch.profiler's trace under `out`
    json: bool = False  # the steps and the summary as JSON (the command prints it)
    quiet: bool = False  # no progress lines
    collect_final: bool = False  # RunResult.final_master / final_adam_m: the final state (tests, experiments)


@dataclass(frozen=True)
class AdaptOptions:
    """`tierflow run --adapt` (executor/adapt.py, executor/decide.py)."""

    warmup: int = 3  # steps before the comparison
    threshold: float = 0.10  # measured vs predicted beyond this: refit and re-plan
    margin: float = 0.05  # the new plan must be predicted faster by more than this
    time_limit_s: float = 30.0  # the re-plan's search
    # the run clips by global norm: the re-plan's graph waits for the step's norm (tierflow plan
    # --clip-grad-norm); the SSD allowed or not as `tierflow plan` (--no-ssd)
    clip: bool = False
    allow_ssd: bool = True
    # the refit's budget of objective evaluations (one simulation each): on the experiment's traces the fit's
    # rms was 0.254 / 0.263 at 400 against 0.253 / 0.254 at 800, in half the time (docs/adapting.md)
    fit_evaluations: int = 400
    # None: decide in a child process while training goes on under the old plan, and switch at the first step
    # boundary after the decision arrived (never, if the run ends first); K: wait for it at the latest at the
    # first boundary K steps after the warm-up's end (0: wait there, nothing trains meanwhile)
    decide_within: int | None = None


@dataclass(frozen=True)
class LoraOptions:
    """`tierflow run --lora RANK --lora-alpha A --lora-targets T,T --lora-dropout P`: the adapters the run is
    to train (tierflow.planner.core.lora.LoraConfig's fields). The plan says what trains and where (its
    `model.lora`, recorded by `tierflow plan --lora`): the flags must match it (a check, never a change of
    the plan; train_loop.check_lora_options)."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ()  # () : every target (LoraConfig's default)
    dropout: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout}
        if self.targets:
            d["targets"] = self.targets
        return d


@dataclass(frozen=True)
class RunConfig:
    """One run: train `steps` steps (in total, counting resumed ones). `plan` is the plan file of `tierflow
    run PLAN` (run_file loads it; run_plan takes a loaded plan and ignores it)."""

    steps: int
    plan: str | None = None
    device: str | None = None  # None: cuda when available, else cpu
    ssd_dir: str | None = None  # the SSD tier's directory
    compute_dtype: str | None = None  # "bf16" | "fp32"; None: bf16 on CUDA, fp32 on a CPU
    cuda_graphs: bool | None = None  # --[no-]cuda-graphs; None: on for CUDA (executor/graphs.py)
    model_data: ModelDataOptions = field(default_factory=ModelDataOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    distributed: DistOptions = field(default_factory=DistOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    adapt: AdaptOptions | None = None  # --adapt: correct the plan from the run's measurements
    # -- new option groups go here, each one field with a default that keeps a run as it was
    lora: LoraOptions | None = None  # --lora RANK --lora-alpha --lora-targets --lora-dropout
