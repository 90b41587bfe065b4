"""The model zoo: decoder-only transformer shapes and their exact parameter counts.

A :class:`ModelSpec` holds only shapes (no weights). Its ``*_params()`` methods count parameters exactly as
Hugging Face ``transformers`` does for the same architecture (tied weights counted once), so the planner can
size every tensor without importing torch or transformers.

Models come from two places:

* the named zoo :data:`MODELS` (GPT-3 paper family, the GPT-65B/70B shapes of the seed papers, LLaMA-2, and
  two tiny models for tests and demos), looked up case-insensitively by :func:`get_model`;
* a Hugging Face ``config.json`` (or a directory holding one) read by :func:`from_hf_config`, for the
  ``model_type`` kinds in :data:`SUPPORTED_HF_KINDS`;
* a hub id (``org/name``) whose config.json is in the local Hugging Face cache (:func:`find_cached_config`;
  nothing is downloaded).

    >>> from tierflow.planner.core.models import get_model
    >>> get_model("gpt3-175b").describe()
    'gpt3-175b: 96 layers x 12288 (96 heads), 174.6B params, seq 2048'

Every problem raises :class:`ModelError`, whose message is one line.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tierflow.errors import TierflowError
from tierflow.hwprofiles.inputs import MIB, InputLimitError, loads_json_limited, read_limited_text
from tierflow.planner.core.optstates import STATE_FORMATS

FAMILIES = ("gpt", "llama", "mistral", "qwen2", "opt", "gpt_neox", "qwen3", "gemma", "gemma2", "phi3")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu", "relu", "geglu")  # swiglu / geglu: gated MLPs (silu / tanh-GELU gate)
# training precisions (tierflow.planner.core.workload.PRECISIONS: the bytes and GEMM peak of each)
PRECISION_NAMES = ("bf16", "fp16", "fp32", "tf32", "fp32-inplace", "tf32-inplace")
# optimizer-state formats (tierflow.planner.core.optstates: the bytes of the master copy and moments of each)
OPTIMIZER_STATE_NAMES = STATE_FORMATS
SUPPORTED_HF_KINDS = (
    "gemma", "gemma2", "gpt2", "gpt_neox", "llama", "mistral", "opt", "phi3", "qwen2", "qwen3",
)

# Rotary models advertise very long context windows (Mistral: 131072, Qwen2: 32768) that are not a sensible
# default *training* length; configs read from config.json train at min(max_position_embeddings, this).
DEFAULT_MAX_TRAIN_SEQ = 4096

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
MAX_CONFIG_BYTES = 16 * MIB  # a config.json is a few KiB


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
    family: str  # "gpt" (GPT-2/GPT-3 style), "llama", "mistral", "qwen2", "opt", "gpt_neox"
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

    def __post_init__(self) -> None:
        def bad(field: str, problem: str) -> ModelError:
            return ModelError(f"model {self.name!r}: {field}: {problem}")

        if not isinstance(self.name, str) or not self.name:
            raise ModelError("model name must be a non-empty string")
        if self.family not in FAMILIES:
            raise bad("family", f"{self.family!r} is not one of {', '.join(FAMILIES)}")
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
        fraction = self.rotary_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise bad("rotary_fraction", f"must be in (0, 1], got {self.rotary_fraction!r}")

    def with_precision(self, precision: str | None) -> ModelSpec:
        """This model trained in `precision` (None or "bf16": the default)."""
        return replace(self, precision=None if precision in (None, "bf16") else precision)

    def with_optimizer_states(self, states: str | None) -> ModelSpec:
        """This model trained with optimizer states in format `states` (None or "fp32": the default)."""
        return replace(self, optimizer_states=None if states in (None, "fp32") else states)

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
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.final_norm_params()
            + self.head_params()
        )

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
        )


def model_dict(model: ModelSpec) -> dict[str, Any]:
    """`model` as the JSON object of a plan file or checkpoint: every field, the optimizer-state format only
    when it is not the default (so that fp32 plans and their digests stay as they were before the field)."""
    d = asdict(model)
    if d["optimizer_states"] is None:
        del d["optimizer_states"]
    return d


def _human_count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


# ------------------------------------------------------------------------------------------------------------
# The named zoo
# ------------------------------------------------------------------------------------------------------------


# What each family's layers are unless a builder says otherwise: norm, MLP activation, positions (0 learned
# position rows: rotary), biases, tied embeddings and the per-family extras. `_spec` fills every field a
# family builder leaves out from here.
_LLAMA_LIKE: dict[str, Any] = {
    "max_positions": 0, "norm": "rmsnorm", "activation": "swiglu", "qkv_bias": False, "out_bias": False,
    "mlp_bias": False, "tied_embeddings": False,
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    # GPT-2/GPT-3 block: pre-LN LayerNorm, biases everywhere, learned positions, tied embeddings, GELU
    "gpt": {"norm": "layernorm", "activation": "gelu", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
            "tied_embeddings": True},
    # OPT: learned positions with 2 extra rows, biases everywhere (enable_bias), ReLU
    "opt": {"norm": "layernorm", "activation": "relu", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
            "tied_embeddings": True, "position_offset": 2},
    # GPT-NeoX: rotary positions on a fraction of each head, LayerNorm, parallel residual, MLP biases
    "gpt_neox": {"max_positions": 0, "norm": "layernorm", "activation": "gelu", "qkv_bias": True,
                 "out_bias": True, "mlp_bias": True, "tied_embeddings": False, "parallel_residual": True},
    # LLaMA block: RMSNorm, SwiGLU, rotary positions, no biases, untied lm_head
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": {**_LLAMA_LIKE, "qkv_bias": True},  # Qwen2Attention: bias on q, k, v but not on o_proj
    "qwen3": {**_LLAMA_LIKE, "qk_norm": True},
    "gemma": {**_LLAMA_LIKE, "activation": "geglu", "tied_embeddings": True},
    "gemma2": {**_LLAMA_LIKE, "activation": "geglu", "tied_embeddings": True, "sandwich_norm": True},
    "phi3": _LLAMA_LIKE,
}


def _spec(name: str, family: str, *, hidden: int, heads: int, **fields: Any) -> ModelSpec:
    """A ModelSpec of `family` from the fields given; every other field from the family's defaults
    (_FAMILY_DEFAULTS), with num_kv_heads = heads (no GQA) and head_dim = hidden // heads unless given."""
    shape = {"num_kv_heads": heads, "head_dim": hidden // heads}
    return ModelSpec(name=name, family=family, hidden=hidden, num_heads=heads,
                     **{**shape, **_FAMILY_DEFAULTS[family], **fields})


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 50257, seq: int = 2048,
         positions: int = 2048, **fields: Any) -> ModelSpec:
    """GPT-2/GPT-3 block (_FAMILY_DEFAULTS["gpt"]) with a 4h MLP."""
    return _spec(name, "gpt", num_layers=layers, hidden=hidden, heads=heads, ffn_hidden=4 * hidden,
                 vocab_size=vocab, max_positions=positions, seq_len=seq, **fields)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *, vocab: int = 32000,
           seq: int = 4096) -> ModelSpec:
    """LLaMA block (_FAMILY_DEFAULTS["llama"])."""
    return _spec(name, "llama", num_layers=layers, hidden=hidden, heads=heads, num_kv_heads=kv_heads,
                 ffn_hidden=ffn, vocab_size=vocab, seq_len=seq)


_ZOO: list[ModelSpec] = [
    # GPT-3 paper (Brown et al. 2020), Table 2.1.
    _gpt("gpt3-125m", 12, 768, 12),
    _gpt("gpt3-350m", 24, 1024, 16),
    _gpt("gpt3-760m", 24, 1536, 16),
    # The paper lists 1.3B ("XL") as d_model 2048, n_heads 24, d_head 128, which is inconsistent (24 * 128 =
    # 3072 != 2048); we keep d_model 2048 and d_head 128, i.e. 16 heads.
    _gpt("gpt3-1.3b", 24, 2048, 16),
    _gpt("gpt3-2.7b", 32, 2560, 32),  # 32 heads x 80
    _gpt("gpt3-6.7b", 32, 4096, 32),
    # The paper lists d_model 5140, which its 40 heads do not divide; the seed papers and Megatron use 5120.
    _gpt("gpt3-13b", 40, 5120, 40),
    _gpt("gpt3-175b", 96, 12288, 96),
    # GPT-style 65B shape used by the seed papers; gpt-70b is the same shape under the other name they use.
    _gpt("gpt-65b", 80, 8192, 64),
    _gpt("gpt-70b", 80, 8192, 64),
    # LLaMA-2 (Touvron et al. 2023); 70B uses grouped-query attention with 8 kv heads.
    _llama("llama2-7b", 32, 4096, 32, 32, 11008),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672),
    # LoHan's benchmark models (RC4ML/LoHan gpt_model.py:196-212): the GPT-3 shapes with no LM head, the loss
    # an MSE on the final hidden states. Its published runs (Fuyou 13B 156 TFLOPS, the SSD sweeps) trained
    # these; the executor refuses to train them (a language model needs its head).
    _gpt("gpt3-13b-lohan", 40, 5120, 40, lm_head=False),
    _gpt("gpt3-175b-lohan", 96, 12288, 96, lm_head=False),
    # Tiny models for tests and demos.
    _gpt("tiny-gpt", 4, 128, 4, vocab=256, seq=64, positions=64),
    _llama("tiny-llama", 4, 128, 4, 2, 344, vocab=256, seq=64),
]

MODELS: dict[str, ModelSpec] = {m.name.lower(): m for m in _ZOO}


def list_models() -> list[str]:
    """Names of the zoo models, in zoo order (small to large within each family)."""
    return list(MODELS)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(".json") or text.startswith((".", "~"))


def get_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A zoo model by name (case-insensitive), a model read from a config.json file or a model directory
    holding one, or a Hugging Face hub id (``org/name``) found in the local Hugging Face cache (never
    downloaded)."""
    text = os.fspath(name_or_path)
    key = text.strip().lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(text).expanduser()
    if not path.exists() and is_hub_id(text):
        return from_hf_config(hub_config_path(text), name=text)
    if path.exists() or _looks_like_path(text):
        return from_hf_config(path)
    close = difflib.get_close_matches(key, list(MODELS), n=4, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    else:
        hint = f"known models: {', '.join(MODELS)}."
    raise ModelError(f"unknown model {text!r}: {hint} (or give a path to a Hugging Face config.json)")


# ------------------------------------------------------------------------------------------------------------
# Hugging Face hub ids in the local cache
# ------------------------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(text: str) -> bool:
    """``org/name`` as the Hugging Face hub spells repository ids (one slash, no .json file name)."""
    return bool(_HUB_ID.match(text)) and not text.endswith(".json") and ".." not in text


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    ($XDG_CACHE_HOME/huggingface/hub when that is set)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def find_cached_config(repo_id: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """config.json of hub model ``repo_id`` in the local cache, or None; never touches the network.

    With huggingface_hub importable, ``try_to_load_from_cache`` (the snapshot ``refs/main`` points to); else,
    or when no ``main`` ref was cached, the newest ``models--org--name/snapshots/<rev>/config.json``."""
    cache = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache), repo_type="model")
        except Exception:  # an id huggingface_hub rejects: look for the folder ourselves
            found = None
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        main = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if main.is_file():
            return main
    configs = [p for p in (repo / "snapshots").glob("*/config.json") if p.is_file()]
    return max(configs, key=lambda p: p.stat().st_mtime) if configs else None


def hub_config_path(repo_id: str) -> Path:
    """config.json of a cached hub model; a :class:`ModelError` saying how to download it when it is not
    cached."""
    found = find_cached_config(repo_id)
    if found is None:
        raise ModelError(
            f"{repo_id!r} is neither a local path nor a model in the Hugging Face cache ({hf_cache_dir()}); "
            f"tierflow does not download: fetch its config with `hf download {repo_id} config.json` "
            "(or set HF_HUB_CACHE / HF_HOME to the cache that holds it, or give a path to its config.json)"
        )
    return found


# ------------------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ------------------------------------------------------------------------------------------------------------

# transformers' default for every key we read, per model_type (used when config.json leaves a key out).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "tie_word_embeddings": True,
        "add_cross_attention": False,
        "activation_function": "gelu_new",
    },
    "opt": {
        "vocab_size": 50272,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "ffn_dim": 3072,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "word_embed_proj_dim": None,
        "num_attention_heads": 12,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
    },
    "gpt_neox": {
        "vocab_size": 50432,
        "hidden_size": 6144,
        "num_hidden_layers": 44,
        "num_attention_heads": 64,
        "intermediate_size": 24576,
        "hidden_act": "gelu",
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "use_parallel_residual": True,
        "attention_bias": True,
    },
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": None,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": None,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
}
_HF_DEFAULTS.update(
    {
        "gemma": {
            "vocab_size": 256000,
            "hidden_size": 3072,
            "intermediate_size": 24576,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 256,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": None,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "use_bidirectional_attention": None,
        },
        "gemma2": {
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "sliding_window": 4096,
            "layer_types": None,
            "use_bidirectional_attention": None,
        },
        "qwen3": {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": 4096,
            "max_window_layers": 28,
            "layer_types": None,
        },
        "phi3": {
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": None,
            "head_dim": None,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "sliding_window": None,
        },
    }
)
# Sliding windows of the older llama-like kinds (Mistral-7B-v0.1 slides over 4096 tokens; Qwen2 only with
# use_sliding_window).
_HF_DEFAULTS["mistral"].update({"sliding_window": 4096})
_HF_DEFAULTS["qwen2"].update({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28})

# GPT2Config.attribute_map: the generic names a gpt2 config.json may use instead of the GPT-2 ones.
_GPT2_ALIASES = {
    "n_embd": "hidden_size",
    "n_positions": "max_position_embeddings",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
}


class _Config:
    """Typed access to one config.json with transformers' defaults and one-line errors naming the file."""

    def __init__(self, source: Path, data: dict[str, Any], kind: str) -> None:
        self.source = source
        self.data = data
        self.defaults = _HF_DEFAULTS[kind]
        self.kind = kind

    def raw(self, key: str) -> Any:
        if key in self.data:
            return self.data[key]
        alias = _GPT2_ALIASES.get(key) if self.kind == "gpt2" else None
        if alias and alias in self.data:
            return self.data[alias]
        return self.defaults[key]

    def get_int(self, key: str, *, optional: bool = False, positive: bool = True) -> int | None:
        value = self.raw(key)
        if value is None and optional:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
            raise ModelError(f"{self.source}: {key}: expected a positive integer, got {value!r}")
        return value

    def get_bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ModelError(f"{self.source}: {key}: expected true or false, got {value!r}")
        return value

    def get_str(self, key: str) -> str:
        value = self.raw(key)
        return value if isinstance(value, str) else ""


def _config_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.exists() and not p.is_file():
        raise ModelError(f"{p}: is not a regular file (give a Hugging Face config.json)")
    if not p.is_file():
        raise ModelError(f"{p}: model config not found (give a zoo name or a Hugging Face config.json)")
    return p


def _activation(name: str, default: str) -> str:
    name = name.lower()
    if name == "relu":
        return "relu"
    if name.startswith("gelu"):
        return "gelu"
    return default


def _train_seq(max_pos: int) -> int:
    return min(max_pos, DEFAULT_MAX_TRAIN_SEQ)


_MOE = "a mixture-of-experts MLP (tierflow's layer has one dense MLP, and its FLOPs count every weight)"
_ENCODER = "an encoder or encoder-decoder model (tierflow trains decoder-only causal language models)"
# model_type -> why tierflow cannot express it (the unknown rest are just "unsupported")
_WHY_NOT_KINDS = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx",
                     "granitemoe", "phimoe", "jamba"), _MOE),
    **dict.fromkeys(("bert", "roberta", "t5", "bart", "mt5", "electra", "deberta", "deberta-v2"), _ENCODER),
    "phi": "Phi-1/2 layers run attention and MLP in parallel from one LayerNorm (one norm a layer) and its "
           "lm_head has a bias: no tierflow layer shape",
    "gemma3": "a vision-language model (gemma3_text is the text-only kind)",
    "gemma3_text": "not read yet: its layers are expressible (qk-norm, sandwich norms, GeGLU) but 5 of every "
                   "6 slide over a 512- or 1024-token window, so only sequences that short would be modelled "
                   "exactly",
    "mamba": "a state-space model without attention",
}


def unsupported_kind_reason(kind: object) -> str:
    """Why a Hugging Face model_type is refused, when it is known ('' otherwise)."""
    return _WHY_NOT_KINDS.get(kind, "") if isinstance(kind, str) else ""


def from_hf_config(path: str | os.PathLike[str], name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a directory containing one) into a :class:`ModelSpec`.

    Supported ``model_type``: :data:`SUPPORTED_HF_KINDS`. Keys that the file leaves out take
    transformers' defaults for that model type. The name is the directory name for ``config.json`` files, else
    the file stem, unless ``name`` is given (a hub id). The default training sequence is the learned position
    table (gpt2, opt) or ``min(max_position_embeddings, 4096)`` for rotary models.
    """
    file = _config_file(path)
    try:
        data = loads_json_limited(read_limited_text(file, MAX_CONFIG_BYTES))
    except InputLimitError as exc:
        raise ModelError(f"{file}: {exc} (give a Hugging Face config.json)") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise ModelError(f"{file}: cannot read JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("model_type")
    if kind not in SUPPORTED_HF_KINDS:
        why = f": {unsupported_kind_reason(kind)}" if unsupported_kind_reason(kind) else ""
        raise ModelError(
            f"{file}: unsupported model_type {kind!r}{why} (supported: {', '.join(SUPPORTED_HF_KINDS)})"
        )
    name = name or (file.resolve().parent.name if file.name == "config.json" else file.stem) or kind
    cfg = _Config(file, data, kind)
    try:
        return _BUILDERS[kind](name, cfg)
    except ModelError as exc:
        msg = str(exc)
        raise ModelError(msg if msg.startswith(str(file)) else f"{file}: {msg}") from None


def _heads(cfg: _Config, hidden: int, heads: int, kv_heads: int | None) -> tuple[int, int]:
    # gemma, gemma2 and qwen3 default to a head_dim of their own (256, 256, 128), not hidden / heads
    own_head_dim = "head_dim" in cfg.data or cfg.defaults.get("head_dim")
    head_dim = cfg.get_int("head_dim", optional=True) if own_head_dim else None
    if head_dim is None:
        if hidden % heads:
            raise ModelError(
                f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}"
            )
        head_dim = hidden // heads
    return head_dim, kv_heads if kv_heads is not None else heads


def _from_gpt2(name: str, cfg: _Config) -> ModelSpec:
    if cfg.raw("add_cross_attention"):
        raise ModelError(
            f"{cfg.source}: add_cross_attention: cross-attention (encoder-decoder) is not supported"
        )
    hidden, heads = cfg.get_int("n_embd"), cfg.get_int("n_head")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: n_head {heads} does not divide n_embd {hidden}")
    positions = cfg.get_int("n_positions")
    return _spec(
        name, "gpt", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("n_layer"),
        ffn_hidden=cfg.get_int("n_inner", optional=True) or 4 * hidden,
        vocab_size=cfg.get_int("vocab_size"),
        max_positions=positions,
        seq_len=positions,
        activation=_activation(cfg.get_str("activation_function"), "gelu"),
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
    )


def _from_opt(name: str, cfg: _Config) -> ModelSpec:
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}")
    proj = cfg.get_int("word_embed_proj_dim", optional=True) or hidden
    bias = cfg.get_bool("enable_bias")
    positions = cfg.get_int("max_position_embeddings")
    return _spec(
        name, "opt", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        ffn_hidden=cfg.get_int("ffn_dim"),
        vocab_size=cfg.get_int("vocab_size"),
        max_positions=positions,
        seq_len=positions,
        activation=_activation(cfg.get_str("activation_function"), "relu"),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        embed_proj_dim=proj if proj != hidden else 0,
        # OPTDecoder: final_layer_norm exists only if do_layer_norm_before and not _remove_final_layer_norm.
        final_norm=cfg.get_bool("do_layer_norm_before") and not cfg.get_bool("_remove_final_layer_norm"),
        norm_affine=cfg.get_bool("layer_norm_elementwise_affine"),
    )


def _rotary_fraction(cfg: _Config, legacy_key: str, default: float) -> float:
    """Share of head_dim that rotary positions rotate: ``rope_parameters.partial_rotary_factor`` (transformers
    5), else the legacy top-level key (GPT-NeoX ``rotary_pct``, Phi-3 ``partial_rotary_factor``), else
    ``default``."""
    rope = cfg.data.get("rope_parameters")
    value = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if value is None:
        value = cfg.data.get(legacy_key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ModelError(f"{cfg.source}: {legacy_key}: expected a number in (0, 1], got {value!r}")
    return float(value)


def _from_gpt_neox(name: str, cfg: _Config) -> ModelSpec:
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}")
    bias = cfg.get_bool("attention_bias")
    return _spec(
        name, "gpt_neox", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=_train_seq(cfg.get_int("max_position_embeddings")),
        activation=_activation(cfg.get_str("hidden_act"), "gelu"),
        qkv_bias=bias,
        out_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        parallel_residual=cfg.get_bool("use_parallel_residual"),
        rotary_fraction=_rotary_fraction(cfg, "rotary_pct", 0.25),
    )


def _from_llama_like(name: str, cfg: _Config) -> ModelSpec:
    """LLaMA, Mistral and Qwen2 (their biases: _FAMILY_DEFAULTS; LLaMA's from attention_bias and mlp_bias)."""
    kind = cfg.kind
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    head_dim, kv_heads = _heads(cfg, hidden, heads, cfg.get_int("num_key_value_heads", optional=True))
    biases: dict[str, bool] = {}
    if kind == "llama":
        biases["qkv_bias"] = biases["out_bias"] = cfg.get_bool("attention_bias")
        biases["mlp_bias"] = cfg.get_bool("mlp_bias")
    window = 0 if kind == "llama" else _sliding_window(cfg)
    max_pos = cfg.get_int("max_position_embeddings")
    return _spec(
        name, kind, hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=min(_train_seq(max_pos), window) if window else _train_seq(max_pos),
        **biases,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        sliding_window=window,
    )


def _gated_activation(cfg: _Config, key: str) -> str:
    """SwiGLU for a silu gate, GeGLU for a GELU gate (Gemma's gelu_pytorch_tanh); other gates are refused."""
    act = cfg.get_str(key).lower()
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    raise ModelError(f"{cfg.source}: {key}: gated MLP with {cfg.raw(key)!r} is not modelled (silu or gelu "
                     "gates only)")


def _sliding_window(cfg: _Config) -> int:
    """The window of the layers that slide (0: none do). Qwen slides only with use_sliding_window, from layer
    max_window_layers on; Gemma2 on the layers layer_types names sliding_attention (every other one by
    default)."""
    if cfg.raw("sliding_window") is None:
        return 0
    window = cfg.get_int("sliding_window")
    types = cfg.raw("layer_types") if "layer_types" in cfg.defaults else None
    if isinstance(types, list):
        return window if "sliding_attention" in types else 0
    if cfg.kind in ("qwen2", "qwen3") and (
        not cfg.get_bool("use_sliding_window")
        or cfg.get_int("max_window_layers", positive=False) >= cfg.get_int("num_hidden_layers")
    ):
        return 0
    return window


def _from_gemma_qwen3_phi3(name: str, cfg: _Config) -> ModelSpec:
    """Gemma, Gemma2, Qwen3 and Phi-3: LLaMA-shaped layers with one or two differences each that change no
    GEMM (so the FLOPs are LLaMA's for the same shapes) and that the parameter count represents exactly:

    * gemma: GeGLU MLP, head_dim 256 by default, tied embeddings (RMSNorm with 1 + weight and an embedding
      scaled by sqrt(hidden) hold the same parameters);
    * gemma2: as gemma plus a norm after attention and after the MLP (4 norms a layer); the tanh soft-capping
      of attention and final logits is elementwise; sliding-window layers are exact while seq <= the window;
    * qwen3: an RMSNorm over head_dim on every query and key head (qk-norm), head_dim 128 by default;
    * phi3: q, k, v fused in one qkv_proj and gate / up in one gate_up_proj (the same weights, concatenated).
    """
    kind = cfg.kind
    if kind in ("gemma", "gemma2") and cfg.raw("use_bidirectional_attention"):
        raise ModelError(f"{cfg.source}: use_bidirectional_attention: an encoder (bidirectional attention) "
                         "is not a causal language model tierflow can train")
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    head_dim, kv_heads = _heads(cfg, hidden, heads, cfg.get_int("num_key_value_heads", optional=True))
    if kind == "gemma":
        act_key = "hidden_activation" if cfg.raw("hidden_activation") is not None else "hidden_act"
    else:
        act_key = "hidden_activation" if kind == "gemma2" else "hidden_act"
    bias = False if kind == "phi3" else cfg.get_bool("attention_bias")
    max_pos = cfg.get_int("max_position_embeddings")
    window = _sliding_window(cfg) if kind != "gemma" else 0
    seq = min(_train_seq(max_pos), window) if window else _train_seq(max_pos)
    return _spec(
        name, kind, hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=seq,
        activation=_gated_activation(cfg, act_key),
        qkv_bias=bias,
        out_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        sliding_window=window,
        **({"rotary_fraction": _rotary_fraction(cfg, "partial_rotary_factor", 1.0)} if kind == "phi3"
           else {}),
    )


_BUILDERS = {
    "gpt2": _from_gpt2,
    "opt": _from_opt,
    "gpt_neox": _from_gpt_neox,
    "llama": _from_llama_like,
    "mistral": _from_llama_like,
    "qwen2": _from_llama_like,
    "gemma": _from_gemma_qwen3_phi3,
    "gemma2": _from_gemma_qwen3_phi3,
    "qwen3": _from_gemma_qwen3_phi3,
    "phi3": _from_gemma_qwen3_phi3,
}

__all__ = [
    "ACTIVATIONS",
    "SHAPE_LIMITS",
    "FAMILIES",
    "MODELS",
    "NORMS",
    "SUPPORTED_HF_KINDS",
    "ModelError",
    "ModelSpec",
    "find_cached_config",
    "from_hf_config",
    "get_model",
    "hf_cache_dir",
    "hub_config_path",
    "is_hub_id",
    "list_models",
]
