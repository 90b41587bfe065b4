"""Tests for tierflow.planner.core.models: exact parameter counts against transformers (built on the meta
device), config.json reading for every supported kind, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.planner.core.models import (
    MODELS,
    SUPPORTED_HF_KINDS,
    ModelError,
    ModelSpec,
    from_hf_config,
    get_model,
    list_models,
)

REPO = Path(__file__).resolve().parents[3]

# Exact totals (equal to transformers, checked below); the LLaMA-2 numbers are the well-known published ones.
EXPECTED_TOTALS = {
    "gpt3-125m": 125_226_240,
    "gpt3-350m": 355_871_744,
    "gpt3-760m": 760_300_032,
    "gpt3-1.3b": 1_315_723_264,
    "gpt3-2.7b": 2_651_553_280,
    "gpt3-6.7b": 6_658_404_352,
    "gpt3-13b": 12_853_386_240,
    "gpt3-175b": 174_604_259_328,
    # LoHan's benchmark models: the same parameters (its embedding counted, the head was tied anyway)
    "gpt3-13b-lohan": 12_853_386_240,
    "gpt3-175b-lohan": 174_604_259_328,
    "gpt-65b": 64_861_528_064,
    "gpt-70b": 64_861_528_064,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "tiny-gpt": 834_304,
    "tiny-llama": 791_680,
}

_GPT3 = {"n_positions": 2048, "vocab_size": 50257}
# The Hugging Face equivalent of every zoo model, written out independently of tierflow.planner.core.models.
ZOO_HF = {
    "gpt3-125m": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, **_GPT3)),
    "gpt3-350m": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, **_GPT3)),
    "gpt3-760m": ("gpt2", dict(n_embd=1536, n_layer=24, n_head=16, **_GPT3)),
    "gpt3-1.3b": ("gpt2", dict(n_embd=2048, n_layer=24, n_head=16, **_GPT3)),
    "gpt3-2.7b": ("gpt2", dict(n_embd=2560, n_layer=32, n_head=32, **_GPT3)),
    "gpt3-6.7b": ("gpt2", dict(n_embd=4096, n_layer=32, n_head=32, **_GPT3)),
    "gpt3-13b": ("gpt2", dict(n_embd=5120, n_layer=40, n_head=40, **_GPT3)),
    "gpt3-175b": ("gpt2", dict(n_embd=12288, n_layer=96, n_head=96, **_GPT3)),
    "gpt3-13b-lohan": ("gpt2", dict(n_embd=5120, n_layer=40, n_head=40, **_GPT3)),
    "gpt3-175b-lohan": ("gpt2", dict(n_embd=12288, n_layer=96, n_head=96, **_GPT3)),
    "gpt-65b": ("gpt2", dict(n_embd=8192, n_layer=80, n_head=64, **_GPT3)),
    "gpt-70b": ("gpt2", dict(n_embd=8192, n_layer=80, n_head=64, **_GPT3)),
    "tiny-gpt": ("gpt2", dict(n_embd=128, n_layer=4, n_head=4, n_positions=64, vocab_size=256)),
    "llama2-7b": (
        "llama",
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=32000,
        ),
    ),
    "llama2-13b": (
        "llama",
        dict(
            hidden_size=5120,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            intermediate_size=13824,
            vocab_size=32000,
        ),
    ),
    "llama2-70b": (
        "llama",
        dict(
            hidden_size=8192,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=32000,
        ),
    ),
    "tiny-llama": (
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=344,
            vocab_size=256,
        ),
    ),
}

# config.json variants for from_hf_config: name -> (model_type, config kwargs).
HF_VARIANTS = {
    "llama-plain": (
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=352,
            vocab_size=500,
            max_position_embeddings=256,
        ),
    ),
    "llama-tied-gqa-bias": (
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=320,
            vocab_size=300,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "llama-head-dim": (
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=48,
            intermediate_size=256,
            vocab_size=300,
            max_position_embeddings=8192,
        ),
    ),
    "mistral-gqa": (
        "mistral",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=448,
            vocab_size=320,
        ),
    ),
    "mistral-head-dim": (
        "mistral",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=256,
            vocab_size=320,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-tied": (
        "qwen2",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=384,
            vocab_size=640,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
        ),
    ),
    "qwen2-untied": (
        "qwen2",
        dict(
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=6,
            intermediate_size=200,
            vocab_size=640,
        ),
    ),
    "gpt2-plain": ("gpt2", dict(n_embd=96, n_layer=2, n_head=4, n_positions=128, vocab_size=400)),
    "gpt2-inner-untied": (
        "gpt2",
        dict(
            n_embd=96,
            n_layer=3,
            n_head=3,
            n_positions=64,
            vocab_size=400,
            n_inner=200,
            tie_word_embeddings=False,
        ),
    ),
    "opt-125m-style": (
        "opt",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=512,
            vocab_size=500,
            max_position_embeddings=256,
        ),
    ),
    "opt-350m-style": (
        "opt",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=512,
            vocab_size=500,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            do_layer_norm_before=False,
        ),
    ),
    "opt-nobias-untied": (
        "opt",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=256,
            vocab_size=500,
            max_position_embeddings=128,
            enable_bias=False,
            _remove_final_layer_norm=True,
            tie_word_embeddings=False,
            word_embed_proj_dim=96,
        ),
    ),
    "opt-no-affine": (
        "opt",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=256,
            vocab_size=300,
            max_position_embeddings=64,
            layer_norm_elementwise_affine=False,
        ),
    ),
    "neox-untied": (
        "gpt_neox",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            vocab_size=500,
            max_position_embeddings=2048,
        ),
    ),
    "neox-tied": (
        "gpt_neox",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            intermediate_size=384,
            vocab_size=500,
            tie_word_embeddings=True,
            use_parallel_residual=False,
        ),
    ),
    "neox-no-attn-bias": (
        "gpt_neox",
        dict(
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=384,
            vocab_size=500,
            attention_bias=False,
        ),
    ),
    # Gemma: GeGLU, its own head_dim, tied; GQA down to one kv head
    "gemma-mqa": (
        "gemma",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=256,
            vocab_size=300,
        ),
    ),
    "gemma-bias-untied": (
        "gemma",
        dict(
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            intermediate_size=200,
            vocab_size=300,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma2: 4 norms a layer, soft-capping, every other layer sliding over 4096 tokens
    "gemma2-sandwich": (
        "gemma2",
        dict(
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=48,
            intermediate_size=256,
            vocab_size=300,
        ),
    ),
    # Qwen3: qk-norm over head_dim 128 (the default), with and without attention biases
    "qwen3-qk-norm": (
        "qwen3",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=300,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-bias-sliding": (
        "qwen3",
        dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=160,
            vocab_size=300,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=1024,
            max_window_layers=1,
        ),
    ),
    # Phi-3: fused qkv_proj and gate_up_proj, a 2047-token window (as Phi-3-mini-4k), partial rotary
    "phi3-fused": (
        "phi3",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=300,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            sliding_window=2047,
            partial_rotary_factor=0.5,
        ),
    ),
}

# Hand-written minimal config.json files: keys left out must take transformers' defaults (mistral: 8 kv heads,
# qwen2: 32 kv heads, gpt2: tied and n_inner = 4h, opt: tied with a final norm, gpt_neox: untied, ...).
MINIMAL_CONFIGS = {
    "min-llama": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
    },
    "min-mistral": {
        "model_type": "mistral",
        "hidden_size": 256,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
    },
    "min-qwen2": {
        "model_type": "qwen2",
        "hidden_size": 512,
        "num_attention_heads": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
    },
    "min-gpt2": {"model_type": "gpt2", "n_embd": 128, "n_head": 4, "n_layer": 2, "vocab_size": 1000},
    "min-gpt2-generic-keys": {
        "model_type": "gpt2",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "vocab_size": 1000,
    },
    "min-opt": {
        "model_type": "opt",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "ffn_dim": 256,
        "vocab_size": 1000,
    },
    "min-gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
    },
    # gemma, gemma2, qwen3: head_dim defaults to 256, 256, 128 (not hidden / heads); gemma2 slides by default;
    # kv heads default to 16, 4, 32
    "min-gemma": {
        "model_type": "gemma",
        "hidden_size": 128,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
    },
    "min-gemma2": {
        "model_type": "gemma2",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
    },
    "min-qwen3": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_attention_heads": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
    },
    "min-phi3": {
        "model_type": "phi3",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
        "pad_token_id": 0,
    },
}


# ------------------------------------------------------------------------------------------------------------
# transformers helpers
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("torch")
    return pytest.importorskip("transformers")


def _config_class(transformers, kind: str):
    return {
        "gpt2": transformers.GPT2Config,
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "opt": transformers.OPTConfig,
        "gpt_neox": transformers.GPTNeoXConfig,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
    }[kind]


def _build_meta(transformers, config):
    import torch

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _n(module) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _hf_parts(model, kind: str) -> dict:
    """Parameter counts of the parts of a transformers causal LM, module by module."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out.weight is inp.weight
    project_in = project_out = None
    if kind == "gpt2":
        base = model.transformer
        layers, embedding, final = base.h, _n(base.wte) + _n(base.wpe), _n(base.ln_f)
        parts = lambda layer: (layer.attn, [layer.mlp], [layer.ln_1, layer.ln_2])  # noqa: E731
    elif kind == "opt":
        base = model.model.decoder
        project_in, project_out = base.project_in, base.project_out
        layers = base.layers
        embedding = _n(base.embed_tokens) + _n(base.embed_positions) + _n(project_in)
        final = _n(base.final_layer_norm)
        parts = lambda layer: (  # noqa: E731
            layer.self_attn,
            [layer.fc1, layer.fc2],
            [layer.self_attn_layer_norm, layer.final_layer_norm],
        )
    elif kind == "gpt_neox":
        base = model.gpt_neox
        layers, embedding, final = base.layers, _n(base.embed_in), _n(base.final_layer_norm)
        parts = lambda layer: (  # noqa: E731
            layer.attention,
            [layer.mlp],
            [layer.input_layernorm, layer.post_attention_layernorm],
        )
    else:
        base = model.model
        layers, embedding, final = base.layers, _n(base.embed_tokens), _n(base.norm)
        # Gemma2's sandwich norms: two more around the MLP (qwen3's q_norm / k_norm live inside self_attn)
        extra = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        parts = lambda layer: (  # noqa: E731
            layer.self_attn,
            [layer.mlp],
            [layer.input_layernorm, layer.post_attention_layernorm,
             *(getattr(layer, n) for n in extra if hasattr(layer, n))],
        )
    attn, mlps, norms = parts(layers[0])
    norm_ids = {id(p) for m in norms for p in m.parameters()}
    result = {
        "total": _n(model),
        "embedding": embedding,
        "layers": [_n(layer) for layer in layers],
        "attention": _n(attn),
        "mlp": sum(_n(m) for m in mlps),
        "norms": sum(_n(m) for m in norms),
        # the GEMM weights: every 2-D parameter of the layer (biases and norm weights are 1-D)
        "matmul": sum(p.numel() for p in layers[0].parameters() if p.dim() == 2 and id(p) not in norm_ids),
        "final_norm": final,
        "head": (0 if tied else _n(out)) + _n(project_out),
        "tied": tied,
    }
    assert result["total"] == embedding + sum(result["layers"]) + final + result["head"], "decomposition"
    assert result["layers"][0] == result["attention"] + result["mlp"] + result["norms"], "layer decomposition"
    return result


def _assert_counts_match(spec: ModelSpec, hf_parts: dict) -> None:
    assert spec.num_layers == len(hf_parts["layers"])
    assert set(hf_parts["layers"]) == {spec.layer_params()}
    got = {
        "total": spec.total_params(),
        "embedding": spec.embedding_params(),
        "attention": spec.attention_params(),
        "mlp": spec.mlp_params(),
        "norms": spec.layer_norm_params(),
        "matmul": spec.layer_matmul_params(),
        "final_norm": spec.final_norm_params(),
        "head": spec.head_params(),
        "tied": spec.tied_embeddings,
    }
    want = {k: hf_parts[k] for k in got}
    assert got == want, spec.name


# ------------------------------------------------------------------------------------------------------------
# The zoo against transformers
# ------------------------------------------------------------------------------------------------------------


def test_zoo_table_covers_every_model():
    assert set(ZOO_HF) == set(MODELS) == set(EXPECTED_TOTALS)
    assert list_models() == list(MODELS)
    assert all(name == name.lower() == MODELS[name].name for name in MODELS)


@pytest.mark.parametrize("name", list(ZOO_HF))
def test_zoo_counts_match_transformers(hf, name):
    kind, kwargs = ZOO_HF[name]
    config = _config_class(hf, kind)(**kwargs)
    parts = _hf_parts(_build_meta(hf, config), kind)
    spec = get_model(name)
    _assert_counts_match(spec, parts)
    assert spec.total_params() == EXPECTED_TOTALS[name]


@pytest.mark.parametrize("name", list(ZOO_HF))
def test_zoo_shapes(name):
    spec = MODELS[name]
    kind, kw = ZOO_HF[name]
    if kind == "gpt2":
        assert (spec.family, spec.num_layers, spec.hidden, spec.num_heads) == (
            "gpt",
            kw["n_layer"],
            kw["n_embd"],
            kw["n_head"],
        )
        assert spec.num_kv_heads == spec.num_heads and spec.ffn_hidden == 4 * spec.hidden
        assert spec.max_positions == kw["n_positions"] == spec.seq_len
        assert (spec.norm, spec.activation, spec.tied_embeddings) == ("layernorm", "gelu", True)
        assert spec.qkv_bias and spec.out_bias and spec.mlp_bias
    else:
        assert (
            spec.family,
            spec.num_layers,
            spec.hidden,
            spec.num_heads,
            spec.num_kv_heads,
            spec.ffn_hidden,
        ) == (
            "llama",
            kw["num_hidden_layers"],
            kw["hidden_size"],
            kw["num_attention_heads"],
            kw["num_key_value_heads"],
            kw["intermediate_size"],
        )
        assert spec.max_positions == 0
        assert spec.seq_len == (64 if name.startswith("tiny") else 4096)
        assert (spec.norm, spec.activation, spec.tied_embeddings) == ("rmsnorm", "swiglu", False)
        assert not (spec.qkv_bias or spec.out_bias or spec.mlp_bias)
    assert spec.head_dim * spec.num_heads == spec.hidden
    assert spec.vocab_size == kw["vocab_size"]


def test_zoo_specific_shapes():
    assert MODELS["gpt3-1.3b"].head_dim == 128 and MODELS["gpt3-1.3b"].num_heads == 16
    assert MODELS["gpt3-2.7b"].head_dim == 80
    assert MODELS["gpt3-13b"].hidden == 5120
    gpt70 = MODELS["gpt-70b"]
    assert gpt70 == MODELS["gpt-65b"].__class__(**{**MODELS["gpt-65b"].__dict__, "name": "gpt-70b"})
    assert MODELS["llama2-70b"].num_kv_heads == 8 and MODELS["llama2-70b"].head_dim == 128
    assert MODELS["tiny-gpt"].max_positions == 64 and MODELS["tiny-gpt"].seq_len == 64


def test_describe_and_with_seq():
    assert (
        get_model("gpt3-175b").describe()
        == "gpt3-175b: 96 layers x 12288 (96 heads), 174.6B params, seq 2048"
    )
    assert get_model("llama2-70b").describe() == (
        "llama2-70b: 80 layers x 8192 (64 heads, 8 kv heads), 69.0B params, seq 4096"
    )
    assert "\n" not in get_model("tiny-llama").describe()
    llama = get_model("llama2-7b").with_seq(8192)
    assert llama.seq_len == 8192 and llama.total_params() == get_model("llama2-7b").total_params()
    assert get_model("gpt3-175b").with_seq(1024).seq_len == 1024
    with pytest.raises(ModelError, match="2048 learned positions"):
        get_model("gpt3-175b").with_seq(4096)
    with pytest.raises(ModelError):
        get_model("tiny-gpt").with_seq(0)


def test_get_model_is_case_insensitive():
    assert get_model("GPT3-175B") is MODELS["gpt3-175b"]
    assert get_model(" LLaMA2-7b ") is MODELS["llama2-7b"]


def test_matmul_params_exclude_biases_and_norms():
    spec = get_model("gpt3-175b")
    h = spec.hidden
    assert spec.layer_matmul_params() == 12 * h * h
    assert spec.layer_params() == 12 * h * h + 13 * h
    llama = get_model("llama2-7b")
    assert llama.layer_matmul_params() == llama.layer_params() - 2 * llama.hidden


def test_models_module_does_not_import_torch():
    code = (
        "import sys, tierflow.planner.core.models\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ------------------------------------------------------------------------------------------------------------
# config.json files against transformers
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_from_hf_config_matches_transformers(hf, tmp_path, variant):
    kind, kwargs = HF_VARIANTS[variant]
    config = _config_class(hf, kind)(**kwargs)
    directory = tmp_path / variant
    directory.mkdir()
    config.to_json_file(str(directory / "config.json"))

    spec = from_hf_config(directory / "config.json")
    assert spec.name == variant
    assert spec.family == ("gpt" if kind == "gpt2" else kind)
    assert get_model(str(directory)) == spec  # a directory holding config.json works too
    _assert_counts_match(spec, _hf_parts(_build_meta(hf, config), kind))


def test_hf_variant_details(hf, tmp_path):
    def load(variant: str) -> ModelSpec:
        kind, kwargs = HF_VARIANTS[variant]
        path = tmp_path / f"{variant}.json"
        _config_class(hf, kind)(**kwargs).to_json_file(str(path))
        return from_hf_config(path)

    llama = load("llama-head-dim")
    assert (llama.name, llama.head_dim, llama.num_kv_heads, llama.seq_len) == ("llama-head-dim", 48, 2, 4096)
    assert (llama.max_positions, llama.position_offset) == (0, 0)
    assert load("llama-plain").seq_len == 256
    biased = load("llama-tied-gqa-bias")
    assert biased.qkv_bias and biased.out_bias and biased.mlp_bias and biased.tied_embeddings
    qwen = load("qwen2-tied")
    assert qwen.qkv_bias and not qwen.out_bias and not qwen.mlp_bias and qwen.tied_embeddings
    mistral = load("mistral-gqa")
    assert not (mistral.qkv_bias or mistral.out_bias or mistral.mlp_bias) and mistral.num_kv_heads == 2
    opt350 = load("opt-350m-style")
    assert (opt350.embed_proj_dim, opt350.position_offset, opt350.max_positions) == (64, 2, 256)
    assert not opt350.final_norm and opt350.final_norm_params() == 0 and opt350.activation == "relu"
    assert load("opt-125m-style").embed_proj_dim == 0
    neox = load("neox-untied")
    assert not neox.tied_embeddings and neox.parallel_residual and neox.max_positions == 0
    assert neox.seq_len == 2048
    assert not load("neox-tied").parallel_residual
    gpt2 = load("gpt2-inner-untied")
    assert (gpt2.ffn_hidden, gpt2.tied_embeddings, gpt2.max_positions) == (200, False, 64)


@pytest.mark.parametrize("variant", list(MINIMAL_CONFIGS))
def test_minimal_config_uses_transformers_defaults(hf, tmp_path, variant):
    data = MINIMAL_CONFIGS[variant]
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = hf.AutoConfig.from_pretrained(str(tmp_path))
    spec = get_model(str(tmp_path / "config.json"))
    _assert_counts_match(spec, _hf_parts(_build_meta(hf, config), data["model_type"]))


def test_minimal_config_defaults_spelled_out(tmp_path):
    # No transformers needed: the defaults the planner assumes for keys a config.json leaves out.
    def load(variant: str) -> ModelSpec:
        path = tmp_path / f"{variant}.json"
        path.write_text(json.dumps(MINIMAL_CONFIGS[variant]))
        return from_hf_config(path)

    assert load("min-mistral").num_kv_heads == 8
    assert load("min-qwen2").num_kv_heads == 32
    assert load("min-llama").num_kv_heads == 8
    gpt2 = load("min-gpt2")
    assert (gpt2.ffn_hidden, gpt2.tied_embeddings, gpt2.max_positions, gpt2.seq_len) == (
        512,
        True,
        1024,
        1024,
    )
    assert load("min-gpt2-generic-keys").max_positions == 256
    assert load("min-opt").final_norm and load("min-opt").tied_embeddings
    assert not load("min-gpt_neox").tied_embeddings
    assert load("min-mistral").seq_len == 4096  # 131072 advertised positions, capped for training


# ------------------------------------------------------------------------------------------------------------
# Errors: ModelError, one line each
# ------------------------------------------------------------------------------------------------------------


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert message and "\n" not in message
    return message


def test_unknown_name_lists_close_names():
    with pytest.raises(ModelError) as exc_info:
        get_model("gpt3-175")
    message = _one_line(exc_info)
    assert "gpt3-175" in message and "gpt3-175b" in message
    with pytest.raises(ModelError) as exc_info:
        get_model("lama2-7b")
    assert "llama2-7b" in _one_line(exc_info)
    with pytest.raises(ModelError) as exc_info:
        get_model("zzzzzz")
    message = _one_line(exc_info)
    assert "tiny-gpt" in message  # nothing close: every known name is listed
    assert isinstance(exc_info.value, ValueError)


def test_unsupported_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    with pytest.raises(ModelError) as exc_info:
        get_model(str(path))
    message = _one_line(exc_info)
    assert str(path) in message and "bert" in message
    assert all(kind in message for kind in SUPPORTED_HF_KINDS)
    path.write_text(json.dumps({"hidden_size": 768}))
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(path)
    assert str(path) in _one_line(exc_info)


def test_missing_and_broken_files(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ModelError) as exc_info:
        get_model(str(missing))
    assert str(missing) in _one_line(exc_info)
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(tmp_path)  # a directory without config.json
    assert "config.json" in _one_line(exc_info)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json\n\n")
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(broken)
    assert str(broken) in _one_line(exc_info)


def test_bad_values_in_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MINIMAL_CONFIGS["min-llama"], "num_hidden_layers": -1}))
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(path)
    message = _one_line(exc_info)
    assert str(path) in message and "num_hidden_layers" in message
    path.write_text(json.dumps({**MINIMAL_CONFIGS["min-llama"], "num_key_value_heads": 3}))
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(path)
    assert "num_kv_heads" in _one_line(exc_info)
    path.write_text(json.dumps({**MINIMAL_CONFIGS["min-gpt2"], "add_cross_attention": True}))
    with pytest.raises(ModelError) as exc_info:
        from_hf_config(path)
    assert "cross" in _one_line(exc_info)


def test_spec_validation():
    base = MODELS["tiny-llama"]
    fields = {**base.__dict__}
    with pytest.raises(ModelError):
        ModelSpec(**{**fields, "family": "bert"})
    with pytest.raises(ModelError):
        ModelSpec(**{**fields, "hidden": 0})
    with pytest.raises(ModelError):
        ModelSpec(**{**fields, "norm": "batchnorm"})


# ------------------------------------------------------------------------------------------------------------
# Gemma, Gemma2, Qwen3, Phi-3: what each config says, and what is refused
# ------------------------------------------------------------------------------------------------------------


def _write(tmp_path, variant: str, **override) -> Path:
    kind, kwargs = HF_VARIANTS[variant]
    data = {"model_type": kind, **kwargs, **override}
    path = tmp_path / f"{variant}.json"
    path.write_text(json.dumps(data))
    return path


def test_newer_llama_like_details(tmp_path):
    gemma = from_hf_config(_write(tmp_path, "gemma-mqa"))
    assert (gemma.family, gemma.activation, gemma.head_dim, gemma.num_kv_heads) == ("gemma", "geglu", 64, 1)
    assert gemma.tied_embeddings and gemma.gated_mlp and gemma.sliding_window == 0 and gemma.seq_len == 4096
    gemma2 = from_hf_config(_write(tmp_path, "gemma2-sandwich"))
    assert gemma2.sandwich_norm and gemma2.layer_norm_params() == 4 * gemma2.hidden
    assert (gemma2.sliding_window, gemma2.seq_len) == (4096, 4096)  # every other layer slides by default
    no_slide = from_hf_config(_write(tmp_path, "gemma2-sandwich", layer_types=["full_attention"] * 3))
    assert no_slide.sliding_window == 0
    qwen3 = from_hf_config(_write(tmp_path, "qwen3-qk-norm"))
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.qkv_bias
    assert qwen3.attention_params() == qwen3.attention_matmul_params() + 2 * 128
    sliding = from_hf_config(_write(tmp_path, "qwen3-bias-sliding"))
    assert sliding.qkv_bias and sliding.out_bias and (sliding.sliding_window, sliding.seq_len) == (1024, 1024)
    # max_window_layers >= layers: no layer slides
    assert from_hf_config(_write(tmp_path, "qwen3-bias-sliding", max_window_layers=3)).sliding_window == 0
    phi3 = from_hf_config(_write(tmp_path, "phi3-fused"))
    assert (phi3.sliding_window, phi3.seq_len, phi3.rotary_fraction) == (2047, 2047, 0.5)
    assert not (phi3.qkv_bias or phi3.mlp_bias) and phi3.activation == "swiglu"
    # the same FLOPs basis as a LLaMA of these shapes: qk-norm and extra norms are not GEMMs
    # q, k, v, o + gated MLP
    assert qwen3.layer_matmul_params() == 128 * (512 + 2 * 256) + 512 * 128 + 3 * 128 * 256


def test_sliding_window_bounds_the_sequence(tmp_path):
    phi3 = from_hf_config(_write(tmp_path, "phi3-fused"))
    assert phi3.with_seq(2047).seq_len == 2047
    with pytest.raises(ModelError) as exc_info:
        phi3.with_seq(4096)
    message = _one_line(exc_info)
    assert "sliding attention window of 2047" in message and "--seq 2047" in message
    mistral = get_model(str(_write(tmp_path, "mistral-gqa")))  # MistralConfig's default window: 4096
    assert mistral.sliding_window == 4096
    with pytest.raises(ModelError, match="sliding attention window of 4096"):
        mistral.with_seq(8192)
    unbounded = get_model(str(_write(tmp_path, "mistral-gqa", sliding_window=None)))
    assert unbounded.sliding_window == 0 and unbounded.with_seq(8192).seq_len == 8192
    with pytest.raises(ModelError, match="sliding attention window"):
        ModelSpec(**{**phi3.__dict__, "seq_len": 4096})


def test_newer_kinds_refusals_say_why(tmp_path):
    def refused(variant: str, **override) -> str:
        with pytest.raises(ModelError) as exc_info:
            from_hf_config(_write(tmp_path, variant, **override))
        return _one_line(exc_info)

    assert "bidirectional" in refused("gemma-mqa", use_bidirectional_attention=True)
    assert "gated MLP with 'relu'" in refused("gemma-mqa", hidden_act="relu")
    path = tmp_path / "config.json"
    for kind, why in (("mixtral", "mixture-of-experts"), ("qwen3_moe", "mixture-of-experts"),
                      ("t5", "encoder"), ("phi", "one LayerNorm")):
        path.write_text(json.dumps({"model_type": kind}))
        with pytest.raises(ModelError) as exc_info:
            from_hf_config(path)
        message = _one_line(exc_info)
        assert why in message and repr(kind) in message and "qwen3" in message
