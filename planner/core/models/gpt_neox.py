"""The GPT-NeoX family: rotary positions on a fraction of each head, LayerNorm, parallel residual, MLP
biases."""

from __future__ import annotations

from typing import Any

from tierflow.planner.core.models.hfconfig import HFConfig, activation, rotary_fraction, train_seq
from tierflow.planner.core.models.registry import Family, register_family
from tierflow.planner.core.models.spec import ModelError, ModelSpec, build_spec

LAYER_DEFAULTS: dict[str, Any] = {
    "max_positions": 0, "norm": "layernorm", "activation": "gelu", "qkv_bias": True, "out_bias": True,
    "mlp_bias": True, "tied_embeddings": False, "parallel_residual": True,
}

HF_DEFAULTS: dict[str, Any] = {
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
}


def from_gpt_neox(name: str, cfg: HFConfig) -> ModelSpec:
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}")
    bias = cfg.get_bool("attention_bias")
    return build_spec(
        name, "gpt_neox", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        ffn_hidden=cfg.get_int("intermediate_size"),
        vocab_size=cfg.get_int("vocab_size"),
        seq_len=train_seq(cfg.get_int("max_position_embeddings")),
        activation=activation(cfg.get_str("hidden_act"), "gelu"),
        qkv_bias=bias,
        out_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        parallel_residual=cfg.get_bool("use_parallel_residual"),
        rotary_fraction=rotary_fraction(cfg, "rotary_pct", 0.25),
    )


FAMILY = register_family(Family("gpt_neox", LAYER_DEFAULTS, hf_model_type="gpt_neox",
                                hf_defaults=HF_DEFAULTS, from_hf=from_gpt_neox))
