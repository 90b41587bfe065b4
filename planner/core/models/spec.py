"""A model's shapes: :class:`ModelSpec` and its exact parameter counts, and :class:`ModelError`.

A :class:`ModelSpec` holds only shapes (no weights). Its ``*_params()`` methods count parameters exactly as
Hugging Face ``transformers`` does for the same architecture (tied weights counted once), so the planner can
size every tensor without importing torch or transformers. Its ``family`` is one of the registered families
(:mod:`tierflow.planner.core.models.registry`); :func:`build_spec` fills the fields a family fixes.

    >>> from tierflow.planner.core.models import get_model
    >>> get_model("gpt3-175b").describe()
    'gpt3-175b: 96 layers x 12288 (96 heads), 174.6B params, seq 2048'

Every problem raises :class:`ModelError`, whose message is one line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tierflow.errors import TierflowError
from tierflow.planner.core.lora import LoraConfig, LoraConfigError, adapter_params_per_layer
from tierflow.planner.core.models.registry import family_names, get_family, is_family
from tierflow.planner.core.optstates import STATE_FORMATS

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu", "relu", "geglu")  # swiglu / geglu: gated MLPs (silu / tanh-GELU gate)
# training precisions (tierflow.planner.core.workload.PRECISIONS: the bytes and GEMM peak of each)
PRECISION_NAMES = ("bf16", "fp16", "fp32", "tf32", "fp32-inplace", "tf32-inplace")
# optimizer-state formats (tierflow.planner.core.optstates: the bytes of the master copy and moments of each)
OPTIMIZER_STATE_NAMES = STATE_FORMATS

# Shape limits: generous (the largest published models are ~10x below each) but finite, so that a config with
# num_hidden_layers: 1000000 or 10**400 is refused with one line instead of growing a task graph past memory
# or overflowing a numpy index.
SHAPE_LIMITS: dict[str, int] = {
    "num_layers": 4096,  # `tierflow capacity` searches up to it (3.2T params on the 4090 box with SSDs)
    "hidden": 1 << 17,
    "num_heads": 4096,
    "num_kv_heads": 4096,
    "head_dim": 1 << 14,
    "ffn_hidden": 1 << 20,
    "vocab_size": 1 << 24,
    "seq_len": 1 << 22,
    "max_positions": 1 << 22,
    "embed_proj_dim": 1 << 17,
    "position_offset": 1024,
}


class ModelError(TierflowError, ValueError):
    """A model could not be found, read or validated. ``str(e)`` is always one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# ------------------------------------------------------------------------------------------------------------
# ModelSpec
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one decoder-only transformer. All counts are exact (equal to transformers')."""

    name: str
    family: str  # a registered family: "gpt" (GPT-2/GPT-3 style), "llama", "mistral", "opt", ...
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int  # == num_heads without GQA
    head_dim: int  # usually hidden // num_heads
    ffn_hidden: int  # MLP inner size (4*hidden for GPT; intermediate_size for LLaMA)
    vocab_size: int
    max_positions: int  # rows of a learned position table; 0 when positions are rotary
    seq_len: int  # default training sequence length (GPT-3: 2048; LLaMA-2: 4096)
    norm: str  # "layernorm" | "rmsnorm"
    activation: str  # "gelu" | "swiglu" | "relu"
    qkv_bias: bool
    out_bias: bool  # attention output projection bias
    mlp_bias: bool
    tied_embeddings: bool
    parallel_residual: bool = False
    embed_proj_dim: int = 0  # OPT word_embed_proj_dim when != hidden (adds project_in/out); else 0
    position_offset: int = 0  # OPT learned positions have 2 extra rows
    final_norm: bool = True  # False for post-LN OPT (do_layer_norm_before=False, e.g. opt-350m)
    # False: no lm_head and no logits: the loss is taken on the final hidden states, as in LoHan's benchmark
    # model (RC4ML/LoHan gpt_model.py:196-212, docs/baselines-as-coded.md section B); the token embedding
    # stays
    lm_head: bool = True
    norm_affine: bool = True  # False for OPT with layer_norm_elementwise_affine=False (norms hold no params)
    # Qwen3: an RMSNorm over head_dim on every query and key head (2 x head_dim params a layer)
    qk_norm: bool = False
    sandwich_norm: bool = False  # Gemma2: a norm before and after both attention and MLP (4 norms a layer)
    # Tokens a sliding-window attention layer sees (Mistral, Gemma2, Phi-3, Qwen with use_sliding_window); 0:
    # none. seq_len may not exceed it: within the window such a layer is plain causal attention, which is what
    # the FLOPs and cost model count (attention over a window shorter than the sequence is not modelled).
    sliding_window: int = 0
    rotary_fraction: float = 1.0  # share of each head's dims rotary positions rotate (GPT-NeoX rotary_pct)
    # The precision the model is trained in (PRECISION_NAMES; `tierflow simulate --precision`); None: the
    # default, bf16 (so that plans written before the field existed load unchanged)
    precision: str | None = None
    # The optimizer-state format (OPTIMIZER_STATE_NAMES; `--optimizer-states`); None: fp32 (left out of plan
    # files and checkpoints then: model_dict)
    optimizer_states: str | None = None
    # LoRA (tierflow.planner.core.lora): only the adapters train, the base is frozen; None: full
    # fine-tuning (left out of plan files and checkpoints then: model_dict). A plan file's object becomes the
    # config
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        def bad(field: str, problem: str) -> ModelError:
            return ModelError(f"model {self.name!r}: {field}: {problem}")

        if not isinstance(self.name, str) or not self.name:
            raise ModelError("model name must be a non-empty string")
        if not is_family(self.family):
            raise bad("family", f"{self.family!r} is not one of {', '.join(family_names())}")
        if self.norm not in NORMS:
            raise bad("norm", f"{self.norm!r} is not one of {', '.join(NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise bad("activation", f"{self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        for field in (
            "num_layers",
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_hidden",
            "vocab_size",
            "seq_len",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise bad(field, f"must be a positive integer, got {value!r}")
        for field in ("max_positions", "embed_proj_dim", "position_offset", "sliding_window"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(field, f"must be a non-negative integer, got {value!r}")
        for field, limit in SHAPE_LIMITS.items():
            value = getattr(self, field)
            if value > limit:
                shown = f"{value}" if value < 10**30 else f"about 10^{int(value.bit_length() * 0.30103)}"
                raise bad(field, f"{shown} is above the limit of {limit} (a shape limit of tierflow; is the "
                          "value a typo?)")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.max_positions and self.seq_len > self.max_positions:
            raise bad("seq_len", f"{self.seq_len} exceeds the {self.max_positions} learned positions")
        if self.sliding_window and self.seq_len > self.sliding_window:
            raise bad("seq_len", f"{self.seq_len} exceeds the sliding attention window of "
                      f"{self.sliding_window} tokens (attention over a window shorter than the sequence is "
                      "not modelled)")
        if self.precision is not None and self.precision not in PRECISION_NAMES:
            raise bad("precision", f"{self.precision!r} is not one of {', '.join(PRECISION_NAMES)}")
        if self.optimizer_states is not None:
            if self.optimizer_states not in OPTIMIZER_STATE_NAMES:
                raise bad("optimizer_states", f"{self.optimizer_states!r} is not one of "
                          f"{', '.join(OPTIMIZER_STATE_NAMES)}")
            if self.optimizer_states == "8bit-bf16master" and self.precision not in (None, "bf16", "fp16"):
                raise bad("optimizer_states", f"a bf16 master needs 16-bit training, not {self.precision} "
                          "(use --optimizer-states 8bit)")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            try:
                object.__setattr__(self, "lora", LoraConfig.from_dict(self.lora))
            except (LoraConfigError, TypeError) as e:
                raise bad("lora", str(e)) from None
        fraction = self.rotary_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise bad("rotary_fraction", f"must be in (0, 1], got {self.rotary_fraction!r}")

    def with_precision(self, precision: str | None) -> ModelSpec:
        """This model trained in `precision` (None or "bf16": the default)."""
        return replace(self, precision=None if precision in (None, "bf16") else precision)

    def with_optimizer_states(self, states: str | None) -> ModelSpec:
        """This model trained with optimizer states in format `states` (None or "fp32": the default)."""
        return replace(self, optimizer_states=None if states in (None, "fp32") else states)

    def with_lora(self, lora: LoraConfig | None) -> ModelSpec:
        """This model fine-tuned with LoRA adapters `lora` (None: full fine-tuning)."""
        return replace(self, lora=lora)

    # ---- derived sizes -------------------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding and the lm_head input (OPT word_embed_proj_dim, else hidden)."""
        return self.embed_proj_dim or self.hidden

    @property
    def gated_mlp(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    # ---- exact parameter counts ----------------------------------------------------------------------------

    def _norm_params(self) -> int:
        if not self.norm_affine:
            return 0
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def attention_matmul_params(self) -> int:
        """q, k, v and o projection weights of one layer."""
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden

    def mlp_matmul_params(self) -> int:
        """MLP weights of one layer (3 matrices when gated, else 2)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    def attention_params(self) -> int:
        """q, k, v, o weights + biases of one layer."""
        n = self.attention_matmul_params()
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.out_bias:
            n += self.hidden
        if self.qk_norm and self.norm_affine:
            n += 2 * self.head_dim
        return n

    def mlp_params(self) -> int:
        """MLP weights + biases of one layer."""
        n = self.mlp_matmul_params()
        if self.mlp_bias:
            n += (2 if self.gated_mlp else 1) * self.ffn_hidden + self.hidden
        return n

    def layer_norm_params(self) -> int:
        """The two norms inside one layer (four with Gemma2's sandwich norms)."""
        return (4 if self.sandwich_norm else 2) * self._norm_params()

    def layer_params(self) -> int:
        """One decoder layer: attention + MLP + norms."""
        return self.attention_params() + self.mlp_params() + self.layer_norm_params()

    def layer_matmul_params(self) -> int:
        """Only the GEMM weights of one layer (no biases, no norms): the count FLOPs are based on."""
        return self.attention_matmul_params() + self.mlp_matmul_params()

    def position_params(self) -> int:
        """Learned position table (0 for rotary models)."""
        return (self.max_positions + self.position_offset) * self.hidden if self.max_positions else 0

    def embedding_params(self) -> int:
        """Token (+ position) embedding (+ OPT project_in)."""
        n = self.vocab_size * self.embed_dim + self.position_params()
        if self.embed_proj_dim:
            n += self.embed_proj_dim * self.hidden
        return n

    def final_norm_params(self) -> int:
        return self._norm_params() if self.final_norm else 0

    def head_params(self) -> int:
        """lm_head (0 when tied to the token embedding) + OPT project_out."""
        n = 0 if self.tied_embeddings or not self.lm_head else self.vocab_size * self.embed_dim
        if self.embed_proj_dim:
            n += self.hidden * self.embed_proj_dim
        return n

    def total_params(self) -> int:
        """The base model's parameters (LoRA's adapters not included: adapter_params)."""
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.final_norm_params()
            + self.head_params()
        )

    def layer_adapter_params(self) -> int:
        """LoRA's trainable parameters of one decoder layer (0 without LoRA)."""
        return 0 if self.lora is None else adapter_params_per_layer(self, self.lora)

    def adapter_params(self) -> int:
        """LoRA's trainable parameters, every layer's adapters (0 without LoRA)."""
        return self.num_layers * self.layer_adapter_params()

    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer states: the adapters under LoRA, else every one."""
        return self.total_params() if self.lora is None else self.adapter_params()

    # ---- helpers -------------------------------------------------------------------------------------------

    def with_seq(self, seq_len: int) -> ModelSpec:
        """The same model trained at another sequence length (must fit a learned position table)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ModelError(f"model {self.name!r}: seq_len must be a positive integer, got {seq_len!r}")
        if self.max_positions and seq_len > self.max_positions:
            raise ModelError(
                f"model {self.name!r}: seq_len {seq_len} exceeds its {self.max_positions} learned positions "
                f"(use seq_len <= {self.max_positions} or a model with more positions)"
            )
        if self.sliding_window and seq_len > self.sliding_window:
            raise ModelError(
                f"model {self.name!r}: seq_len {seq_len} exceeds its sliding attention window of "
                f"{self.sliding_window} tokens; tierflow models attention as causal over the whole sequence, "
                f"which is that window only while seq_len <= {self.sliding_window} (use --seq "
                f"{self.sliding_window} or less)"
            )
        return replace(self, seq_len=seq_len)

    def describe(self) -> str:
        """One line, e.g. ``gpt3-175b: 96 layers x 12288 (96 heads), 174.6B params, seq 2048``."""
        heads = f"{self.num_heads} heads"
        if self.num_kv_heads != self.num_heads:
            heads += f", {self.num_kv_heads} kv heads"
        return (
            f"{self.name}: {self.num_layers} layers x {self.hidden} ({heads}), "
            f"{_human_count(self.total_params())} params, seq {self.seq_len}"
            + ("" if self.lm_head else ", no LM head")
            + ("" if self.precision is None else f", {self.precision}")
            + ("" if self.optimizer_states is None else f", {self.optimizer_states} optimizer states")
            + ("" if self.lora is None else f", {self.lora.describe()} "
               f"({_human_count(self.adapter_params())} trainable)")
        )


def model_dict(model: ModelSpec) -> dict[str, Any]:
    """`model` as the JSON object of a plan file or checkpoint: every field, the optimizer-state format only
    when it is not the default (so that fp32 plans and their digests stay as they were before the field)."""
    d = asdict(model)
    if d["optimizer_states"] is None:
        del d["optimizer_states"]
    if model.lora is None:  # full fine-tuning: as before the field
        del d["lora"]
    else:
        d["lora"] = model.lora.to_dict()
    return d


def _human_count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def build_spec(name: str, family: str, *, hidden: int, heads: int, **fields: Any) -> ModelSpec:
    """A ModelSpec of `family` from the fields given; every other field from the family's layer defaults
    (its registry entry), with num_kv_heads = heads (no GQA) and head_dim = hidden // heads unless given."""
    shape = {"num_kv_heads": heads, "head_dim": hidden // heads}
    return ModelSpec(name=name, family=family, hidden=hidden, num_heads=heads,
                     **{**shape, **get_family(family).layer_defaults, **fields})


__all__ = ["ACTIVATIONS", "NORMS", "OPTIMIZER_STATE_NAMES", "PRECISION_NAMES", "SHAPE_LIMITS", "ModelError",
           "ModelSpec", "build_spec", "model_dict"]
