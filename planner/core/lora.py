"""LoRA (Hu et al. 2021, as Hugging Face PEFT trains it): the adapters' configuration (`LoraConfig`) and what
they add to a decoder layer: their parameters and their GEMM shapes. No torch.

A LoRA model trains only the adapters: each target projection W (in -> out) gets A (in -> rank) and B (rank ->
out), its output W x + (alpha / rank) B A dropout(x). The base weights are frozen: stored once in the compute
dtype (no master copy, no Adam moments, no gradient), never written back; the backward through a frozen GEMM
computes only the input gradient. The adapters have their own forward and backward GEMMs, fp32 gradients and
AdamW states (master and moments).

Targets take PEFT's names of the LLaMA projections (its default for llama-shaped models,
peft.utils.constants TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, and the common "all linear" choice):
q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. Each family's executor maps them onto its own
projections (fused q/k/v: one adapter per part, as PEFT's `fan_in_fan_out` GPT-2 Conv1D does not split it; the
planner counts the split shapes, whose parameters and FLOPs are the same as one adapter per part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierflow.errors import TierflowError

# PEFT's names of the projections of a LLaMA layer, in the order a layer runs them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = LORA_TARGETS
MAX_RANK = 1 << 14


class LoraConfigError(TierflowError, ValueError):
    """A LoRA setting that cannot be used; one line."""


@dataclass(frozen=True)
class LoraConfig:
    """The adapters of a LoRA run: `rank` r, scaling `alpha` / r, the `targets` (LORA_TARGETS names) and the
    `dropout` probability on the adapters' input (PEFT's lora_dropout)."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 < self.rank <= MAX_RANK:
            raise LoraConfigError(f"lora rank must be an integer in 1..{MAX_RANK}, got {self.rank!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < float("inf"):
            raise LoraConfigError(f"lora alpha must be a positive number, got {a!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            raise LoraConfigError(f"lora dropout must be in [0, 1), got {d!r}")
        targets = tuple(self.targets) if isinstance(self.targets, (list, tuple)) else None
        if not targets:
            raise LoraConfigError(f"lora targets must be a non-empty list of {', '.join(LORA_TARGETS)}")
        for t in targets:
            if t not in LORA_TARGETS:
                raise LoraConfigError(f"lora target {str(t)[:40]!r} is not one of {', '.join(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise LoraConfigError("lora targets name a projection twice")
        # canonical order, so that equal sets compare (and hash in a plan's digest) equal
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scaling(self) -> float:
        """PEFT's scaling of the adapters' output: alpha / rank."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}

    @classmethod
    def from_dict(cls, data: object) -> LoraConfig:
        """A config from its plan-file object (`to_dict`); a bad one is one line (LoraConfigError)."""
        if isinstance(data, LoraConfig):
            return data
        if not isinstance(data, dict):
            raise LoraConfigError(f"lora: expected an object with rank, alpha, targets, dropout, got "
                                  f"{type(data).__name__}")
        unknown = set(data) - {"rank", "alpha", "targets", "dropout"}
        if unknown:
            raise LoraConfigError(f"lora: unknown key {sorted(unknown)[0]!r} (known: rank, alpha, "
                                  "targets, dropout)")
        if "rank" not in data:
            raise LoraConfigError("lora: rank is missing")
        return cls(**data)

    def describe(self) -> str:
        return f"LoRA r{self.rank} alpha {self.alpha:g} on {len(self.targets)} projections"


def parse_targets(text: str) -> tuple[str, ...]:
    """`--lora-targets`: comma-separated PEFT names, or `all` / `attention` / `mlp`."""
    groups = {"all": LORA_TARGETS, "attention": LORA_TARGETS[:4], "mlp": LORA_TARGETS[4:]}
    if text in groups:
        return groups[text]
    return tuple(t.strip() for t in text.split(",") if t.strip())


def target_shapes(model: Any, lora: LoraConfig) -> list[tuple[str, int, int]]:
    """(target, in features, out features) of every adapted projection of one decoder layer of `model` (a
    ModelSpec): a model without a gated MLP has no gate_proj (its up and down projections are the MLP's two
    matrices)."""
    h, f, q, kv = model.hidden, model.ffn_hidden, model.q_dim, model.kv_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, f) if model.gated_mlp else None, "up_proj": (h, f), "down_proj": (f, h)}
    return [(t, *shapes[t]) for t in lora.targets if shapes[t] is not None]


def adapter_params_per_layer(model: Any, lora: LoraConfig) -> int:
    """Trainable parameters of one layer's adapters: rank x (in + out) per target."""
    return sum(lora.rank * (i + o) for _, i, o in target_shapes(model, lora))


def adapter_input_elements(model: Any, lora: LoraConfig) -> int:
    """Elements per token the adapters' dropout reads and writes (one masked copy of each target's input)."""
    return sum(i for _, i, _ in target_shapes(model, lora)) if lora.dropout > 0 else 0
