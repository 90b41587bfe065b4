"""The GPT family (GPT-2 / GPT-3 blocks): pre-LN LayerNorm, biases everywhere, learned positions, tied
embeddings, GELU; read from ``gpt2`` configs."""

from __future__ import annotations

from typing import Any

from tierflow.planner.core.models.hfconfig import HFConfig, activation
from tierflow.planner.core.models.registry import Family, register_family
from tierflow.planner.core.models.spec import ModelError, ModelSpec, build_spec

LAYER_DEFAULTS: dict[str, Any] = {
    "norm": "layernorm", "activation": "gelu", "qkv_bias": True, "out_bias": True, "mlp_bias": True,
    "tied_embeddings": True,
}

# transformers' default for every key read (GPT2Config)
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "tie_word_embeddings": True,
    "add_cross_attention": False,
    "activation_function": "gelu_new",
}
# GPT2Config.attribute_map: the generic names a gpt2 config.json may use instead of the GPT-2 ones.
HF_ALIASES = {
    "n_embd": "hidden_size",
    "n_positions": "max_position_embeddings",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
}


def from_gpt2(name: str, cfg: HFConfig) -> ModelSpec:
    if cfg.raw("add_cross_attention"):
        raise ModelError(
            f"{cfg.source}: add_cross_attention: cross-attention (encoder-decoder) is not supported"
        )
    hidden, heads = cfg.get_int("n_embd"), cfg.get_int("n_head")
    if hidden % heads:
        raise ModelError(f"{cfg.source}: n_head {heads} does not divide n_embd {hidden}")
    positions = cfg.get_int("n_positions")
    return build_spec(
        name, "gpt", hidden=hidden, heads=heads,
        num_layers=cfg.get_int("n_layer"),
        ffn_hidden=cfg.get_int("n_inner", optional=True) or 4 * hidden,
        vocab_size=cfg.get_int("vocab_size"),
        max_positions=positions,
        seq_len=positions,
        activation=activation(cfg.get_str("activation_function"), "gelu"),
        tied_embeddings=cfg.get_bool("tie_word_embeddings"),
    )


def gpt_model(name: str, layers: int, hidden: int, heads: int, *, vocab: int = 50257, seq: int = 2048,
              positions: int = 2048, **fields: Any) -> ModelSpec:
    """A GPT-2/GPT-3 block model (LAYER_DEFAULTS) with a 4h MLP, for the named zoo."""
    return build_spec(name, "gpt", num_layers=layers, hidden=hidden, heads=heads, ffn_hidden=4 * hidden,
                      vocab_size=vocab, max_positions=positions, seq_len=seq, **fields)


FAMILY = register_family(Family("gpt", LAYER_DEFAULTS, hf_model_type="gpt2", hf_defaults=HF_DEFAULTS,
                                hf_aliases=HF_ALIASES, from_hf=from_gpt2))
