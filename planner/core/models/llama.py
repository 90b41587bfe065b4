"""The LLaMA family and the two that share its layers exactly: RMSNorm, SwiGLU, rotary positions, no biases
(Qwen2: on q, k and v), untied lm_head, grouped-query attention; Mistral and Qwen2 may slide their
attention over a window."""

from __future__ import annotations

from typing import Any

from tierflow.planner.core.models.hfconfig import HFConfig, head_shape, sliding_window, train_seq
from tierflow.planner.core.models.registry import Family, register_family
from tierflow.planner.core.models.spec import ModelSpec, build_spec

LLAMA_LIKE: dict[str, Any] = {
    "max_positions": 0, "norm": "rmsnorm", "activation": "swiglu", "qkv_bias": False, "out_bias": False,
    "mlp_bias": False, "tied_embeddings": False,
}

HF_DEFAULTS: dict[str, dict[str, Any]] = {
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
        "sliding_window": 4096,  # Mistral-7B-v0.1 slides over 4096 tokens
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
        "sliding_window": 4096,  # only with use_sliding_window
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
}


def from_llama_like(name: str, cfg: HFConfig) -> ModelSpec:
    """LLaMA, Mistral and Qwen2 (their biases: the layer defaults; LLaMA's from attention_bias and
    mlp_bias)."""
    kind = cfg.kind
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    head_dim, kv_heads = head_shape(cfg, hidden, heads, cfg.get_int("num_key_value_heads", optional=True))
    biases: dict[str, bool] = {}
    if kind == "llama":
        biases["qkv_bias"] = biases["out_bias"] = cfg.get_bool("attention_bias")
        biases["mlp_bias"] = cfg.get_bool("mlp_bias")
    window = 0 if kind == "llama" else sliding_window(cfg)
    max_pos = cfg.get_int("max_position_embeddings")
    return build_spec(
        name, kind, hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=min(train_seq(max_pos), window) if window else train_seq(max_pos),
        **biases,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        sliding_window=window,
    )


def llama_model(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, *,
                vocab: int = 32000, seq: int = 4096) -> ModelSpec:
    """A LLaMA block model (LLAMA_LIKE), for the named zoo."""
    return build_spec(name, "llama", num_layers=layers, hidden=hidden, heads=heads, num_kv_heads=kv_heads,
                      ffn_hidden=ffn, vocab_size=vocab, seq_len=seq)


LLAMA = register_family(Family("llama", LLAMA_LIKE, hf_model_type="llama", hf_defaults=HF_DEFAULTS["llama"],
                               from_hf=from_llama_like))
MISTRAL = register_family(Family("mistral", LLAMA_LIKE, hf_model_type="mistral",
                                 hf_defaults=HF_DEFAULTS["mistral"], from_hf=from_llama_like))
# Qwen2Attention: bias on q, k, v but not on o_proj
QWEN2 = register_family(Family("qwen2", {**LLAMA_LIKE, "qkv_bias": True}, hf_model_type="qwen2",
                               hf_defaults=HF_DEFAULTS["qwen2"], from_hf=from_llama_like))
