"""Qwen3, Gemma, Gemma2 and Phi-3: LLaMA-shaped layers with one or two differences each that change no GEMM
(so the FLOPs are LLaMA's for the same shapes) and that the parameter count represents exactly:

* gemma: GeGLU MLP, head_dim 256 by default, tied embeddings (RMSNorm with 1 + weight and an embedding
  scaled by sqrt(hidden) hold the same parameters);
* gemma2: as gemma plus a norm after attention and after the MLP (4 norms a layer); the tanh soft-capping
  of attention and final logits is elementwise; sliding-window layers are exact while seq <= the window;
* qwen3: an RMSNorm over head_dim on every query and key head (qk-norm), head_dim 128 by default;
* phi3: q, k, v fused in one qkv_proj and gate / up in one gate_up_proj (the same weights, concatenated).
"""

from __future__ import annotations

from typing import Any

from tierflow.planner.core.models.hfconfig import (
    HFConfig,
    gated_activation,
    head_shape,
    rotary_fraction,
    sliding_window,
    train_seq,
)
from tierflow.planner.core.models.llama import LLAMA_LIKE
from tierflow.planner.core.models.registry import Family, register_family
from tierflow.planner.core.models.spec import ModelError, ModelSpec, build_spec

HF_DEFAULTS: dict[str, dict[str, Any]] = {
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


def from_llama_variant(name: str, cfg: HFConfig) -> ModelSpec:
    """Gemma, Gemma2, Qwen3 and Phi-3 (see the module's docstring for what each changes)."""
    kind = cfg.kind
    if kind in ("gemma", "gemma2") and cfg.raw("use_bidirectional_attention"):
        raise ModelError(f"{cfg.source}: use_bidirectional_attention: an encoder (bidirectional attention) "
                         "is not a causal language model tierflow can train")
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    head_dim, kv_heads = head_shape(cfg, hidden, heads, cfg.get_int("num_key_value_heads", optional=True))
    if kind == "gemma":
        act_key = "hidden_activation" if cfg.raw("hidden_activation") is not None else "hidden_act"
    else:
        act_key = "hidden_activation" if kind == "gemma2" else "hidden_act"
    bias = False if kind == "phi3" else cfg.get_bool("attention_bias")
    max_pos = cfg.get_int("max_position_embeddings")
    window = sliding_window(cfg) if kind != "gemma" else 0
    seq = min(train_seq(max_pos), window) if window else train_seq(max_pos)
    return build_spec(
        name, kind, hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=seq,
        activation=gated_activation(cfg, act_key),
        qkv_bias=bias,
        out_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        sliding_window=window,
        **({"rotary_fraction": rotary_fraction(cfg, "partial_rotary_factor", 1.0)} if kind == "phi3"
           else {}),
    )


def _register(name: str, layer_defaults: dict[str, Any], scaled_embedding: bool = False) -> Family:
    return register_family(Family(name, layer_defaults, hf_model_type=name, hf_defaults=HF_DEFAULTS[name],
                                  from_hf=from_llama_variant, scaled_embedding=scaled_embedding))


QWEN3 = _register("qwen3", {**LLAMA_LIKE, "qk_norm": True})
GEMMA = _register("gemma", {**LLAMA_LIKE, "activation": "geglu", "tied_embeddings": True},
                  scaled_embedding=True)
GEMMA2 = _register("gemma2", {**LLAMA_LIKE, "activation": "geglu", "tied_embeddings": True,
                              "sandwich_norm": True})
PHI3 = _register("phi3", LLAMA_LIKE)
