"""The OPT family: learned positions with 2 extra rows, biases everywhere (``enable_bias``), ReLU; pre-LN or
post-LN (``do_layer_norm_before``), an optional ``word_embed_proj_dim``."""

from __future__ import annotations

from typing import Any

from tierflow.planner.core.models.hfconfig import HFConfig, activation
from tierflow.planner.core.models.registry import Family, register_family
from tierflow.planner.core.models.spec import ModelError, ModelSpec, build_spec

LAYER_DEFAULTS: dict[str, Any] = {
    "norm": "layernorm", "activation": "relu", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
    "tied_embeddings": True, "position_offset": 2,
}

HF_DEFAULTS: dict[str, Any] = {
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
}


def from_opt(name: str, cfg: HFConfig) -> ModelSpec:
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}")
    proj = cfg.get_int("word_embed_proj_dim", optional=True) or hidden
    bias = cfg.get_bool("enable_bias")
    positions = cfg.get_int("max_position_embeddings")
    return build_spec(
        name, "opt", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("num_hidden_layers"),
        ffn_hidden=cfg.get_int("ffn_dim"),
        vocab_size=cfg.get_int("vocab_size"),
        max_positions=positions,
        seq_len=positions,
        activation=activation(cfg.get_str("activation_function"), "relu"),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
        embed_proj_dim=proj if proj != hidden else 0,
        # OPTDecoder: final_layer_norm exists only if do_layer_norm_before and not _remove_final_layer_norm.
        final_norm=cfg.get_bool("do_layer_norm_before") and not cfg.get_bool("_remove_final_layer_norm"),
        norm_affine=cfg.get_bool("layer_norm_elementwise_affine"),
    )


FAMILY = register_family(Family("opt", LAYER_DEFAULTS, hf_model_type="opt", hf_defaults=HF_DEFAULTS,
                                from_hf=from_opt))
