"""What `tierflow run` asks of the executor, in typed groups (`RunRequest`): the command line builds them
(tierflow/cli/run.py) and the executor never sees its parser. No torch here.

    ModelDataOptions   the starting weights and the data: --init, --data, its tokenizer and fields
    OptimizerOptions   AdamW, its learning-rate schedule and clipping (None: --ds-config's, else the default)
    CheckpointOptions  --checkpoint-dir and how a run resumes from it
    EvalOptions        validation loss and TensorBoard logs
    DistOptions        several ranks: --nproc / --nnodes and torchrun's rendezvous
    OutputOptions      what the run writes and prints: --out, --export-hf, --profile, --json
    AdaptOptions       --adapt (tierflow.executor.decide)

The training loop takes one run's options flat (`tierflow.executor.train_loop.RunOptions`);
`tierflow.executor.launch.run_options` derives them from a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierflow.errors import TierflowError
from tierflow.executor.decide import AdaptOptions


class RunError(TierflowError, ValueError):
    """Bad input to `tierflow run` (one line, exit 2): a flag's value, or flags that do not go together."""


@dataclass(frozen=True)
class ModelDataOptions:
    init: str | None = None  # Hugging Face model directory to start from
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
    """The flags as given (None: not given); a --ds-config's sections fill what is not, then the defaults."""

    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    schedule: str | None = None  # tierflow.planner.core.trainopts.SCHEDULES
    warmup_steps: int | None = None
    clip_grad_norm: float | None = None
    clip: str | None = None  # tierflow.planner.core.trainopts.CLIP_MODES
    ds_config: str | None = None  # a DeepSpeed config file to read them from


@dataclass(frozen=True)
class CheckpointOptions:
    directory: str | None = None  # save the state here and resume from its latest checkpoint
    every: int | None = None  # steps between checkpoints (None: the plan's iterations per round)
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
    profile: bool = False  # torch.profiler's trace under `out`
    json: bool = False  # the steps and the summary as JSON (the command prints it)
    quiet: bool = False  # no progress lines


@dataclass(frozen=True)
class RunRequest:
    """One `tierflow run`: train `steps` steps (in total, counting resumed ones) with the plan file `plan`."""

    plan: str
    steps: int
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
