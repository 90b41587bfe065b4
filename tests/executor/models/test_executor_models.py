"""tierflow.executor.models: parameter counts equal the spec's, logits equal transformers' for the same
weights."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tierflow.executor.models import (  # noqa: E402
    LAYERNORM_EPS,
    RMSNORM_EPS,
    ROPE_THETA,
    BlockModel,
    Embedding,
    GPTBlock,
    Head,
    LlamaBlock,
    NeoXBlock,
    OPTBlock,
    blocks_to_hf_state_dict,
    build_blocks,
    hf_state_dict_to_blocks,
    loss,
    param_count,
)
from tierflow.planner.core.models import get_model  # noqa: E402

TINY_GPT = get_model("tiny-gpt")
TINY_LLAMA = get_model("tiny-llama")
TINY_QWEN2 = dataclasses.replace(TINY_LLAMA, name="tiny-qwen2", family="qwen2", qkv_bias=True)
TINY_LLAMA_TIED = dataclasses.replace(TINY_LLAMA, name="tiny-llama-tied", tied_embeddings=True)
TINY_OPT = dataclasses.replace(TINY_GPT, name="tiny-opt", family="opt", activation="relu", position_offset=2)
TINY_NEOX = dataclasses.replace(TINY_GPT, name="tiny-neox", family="gpt_neox", max_positions=0,
                                tied_embeddings=False, parallel_residual=True, rotary_fraction=0.25)
TINY_NEOX_SEQUENTIAL = dataclasses.replace(TINY_NEOX, name="tiny-neox-sequential", parallel_residual=False,
                                           qkv_bias=False, out_bias=False, rotary_fraction=0.5)
TINY_QWEN3 = dataclasses.replace(TINY_LLAMA, name="tiny-qwen3", family="qwen3", qk_norm=True, head_dim=48)
TINY_GEMMA = dataclasses.replace(TINY_LLAMA, name="tiny-gemma", family="gemma", activation="geglu",
                                 tied_embeddings=True, head_dim=64)
TINY_PHI3 = dataclasses.replace(TINY_LLAMA, name="tiny-phi3", family="phi3", rotary_fraction=0.5)
NEW_FAMILIES = [TINY_OPT, TINY_NEOX, TINY_NEOX_SEQUENTIAL, TINY_QWEN3, TINY_GEMMA, TINY_PHI3]
ATOL = 1e-5


def tokens(spec, batch=2, seq=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, seq), generator=g)


@pytest.mark.parametrize("spec", [TINY_GPT, TINY_LLAMA, TINY_QWEN2, TINY_LLAMA_TIED, *NEW_FAMILIES],
                         ids=lambda s: s.name)
def test_param_counts_equal_the_spec(spec):
    blocks = build_blocks(spec)
    assert len(blocks) == spec.num_layers + 2
    assert isinstance(blocks[0], Embedding) and isinstance(blocks[-1], Head)
    layer_cls = {"gpt": GPTBlock, "opt": OPTBlock, "gpt_neox": NeoXBlock}.get(spec.family, LlamaBlock)
    assert all(isinstance(b, layer_cls) for b in blocks[1:-1])
    assert param_count(blocks[0]) == spec.embedding_params()
    assert all(param_count(b) == spec.layer_params() for b in blocks[1:-1])
    assert param_count(blocks[-1]) == spec.final_norm_params() + spec.head_params()
    assert sum(param_count(b) for b in blocks) == spec.total_params()


def test_init_is_deterministic_and_gpt2_style():
    torch.manual_seed(0)
    a = build_blocks(TINY_GPT)
    torch.manual_seed(0)
    b = build_blocks(TINY_GPT)
    for x, y in zip(a, b):
        for (name, p), (_, q) in zip(x.named_parameters(), y.named_parameters()):
            assert torch.equal(p, q), name
    layer = a[1]
    assert torch.all(layer.attn.c_attn.bias == 0) and torch.all(layer.ln_1.weight == 1)
    assert abs(layer.mlp.c_fc.weight.std().item() - 0.02) < 0.002
    torch.manual_seed(0)
    bf16 = build_blocks(TINY_GPT, dtype=torch.bfloat16)
    assert bf16[1].attn.c_attn.weight.dtype == torch.bfloat16
    assert torch.equal(bf16[1].attn.c_attn.weight, a[1].attn.c_attn.weight.to(torch.bfloat16))


def _hf_llama_like(spec):
    kw = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.seq_len,
        rms_norm_eps=RMSNORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=spec.tied_embeddings,
    )
    if spec.family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=False, **kw))


def _hf_newer(spec):
    """transformers' model for the families added after gpt2 / llama, from configs written out here."""
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, tie_word_embeddings=spec.tied_embeddings,
                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    llama_like = dict(common, intermediate_size=spec.ffn_hidden, num_key_value_heads=spec.num_kv_heads,
                      rms_norm_eps=RMSNORM_EPS, max_position_embeddings=spec.seq_len)
    if spec.family == "opt":
        config = transformers.OPTConfig(**common, ffn_dim=spec.ffn_hidden,
                                        max_position_embeddings=spec.max_positions,
                                        do_layer_norm_before=True, word_embed_proj_dim=spec.hidden,
                                        dropout=0.0, attention_dropout=0.0, activation_function="relu",
                                        enable_bias=True)
    elif spec.family == "gpt_neox":
        config = transformers.GPTNeoXConfig(**common, intermediate_size=spec.ffn_hidden, hidden_act="gelu",
                                            rope_parameters={**rope,
                                                             "partial_rotary_factor": spec.rotary_fraction},
                                            max_position_embeddings=spec.seq_len,
                                            layer_norm_eps=LAYERNORM_EPS,
                                            use_parallel_residual=spec.parallel_residual,
                                            attention_bias=spec.qkv_bias, hidden_dropout=0.0,
                                            attention_dropout=0.0)
    elif spec.family == "qwen3":
        config = transformers.Qwen3Config(**llama_like, head_dim=spec.head_dim, rope_parameters=rope)
    elif spec.family == "gemma":
        config = transformers.GemmaConfig(**llama_like, head_dim=spec.head_dim, rope_parameters=rope,
                                          hidden_act="gelu_pytorch_tanh")
    else:
        assert spec.family == "phi3"
        config = transformers.Phi3Config(**llama_like,
                                         rope_parameters={**rope,
                                                          "partial_rotary_factor": spec.rotary_fraction})
    return transformers.AutoModelForCausalLM.from_config(config)


def _hf_gpt2(spec):
    config = transformers.GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.max_positions,
        n_embd=spec.hidden,
        n_layer=spec.num_layers,
        n_head=spec.num_heads,
        n_inner=spec.ffn_hidden,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=LAYERNORM_EPS,
        bos_token_id=0,  # GPT-2's 50256 is outside the tiny vocabulary
        eos_token_id=0,
        tie_word_embeddings=spec.tied_embeddings,
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize(
    "spec, make_hf",
    [
        (TINY_LLAMA, _hf_llama_like),
        (TINY_LLAMA_TIED, _hf_llama_like),
        (TINY_QWEN2, _hf_llama_like),
        (TINY_GPT, _hf_gpt2),
        (dataclasses.replace(TINY_GPT, name="tiny-gpt-untied", tied_embeddings=False), _hf_gpt2),
        *((spec, _hf_newer) for spec in NEW_FAMILIES),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_logits_match_transformers(spec, make_hf):
    torch.manual_seed(0)
    hf = make_hf(spec).eval()
    if spec.qkv_bias and spec.family != "gpt":  # HF inits biases to zero: make them matter
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0.0, 0.02)
    if spec in NEW_FAMILIES:  # norms start at 1 (Gemma: 0) and biases at 0: move them all, so each must map
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    model = BlockModel(spec).eval()
    model.load_block_state_dicts(hf_state_dict_to_blocks(spec, hf.state_dict()))
    x = tokens(spec)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        got = model(x)
    assert got.shape == (2, 32, spec.vocab_size)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Block by block, as the executor runs it, gives the same logits.
    with torch.no_grad():
        h = model.blocks[0](x)
        for block in model.blocks[1:-1]:
            h = block(h)
        tied = model.blocks[0].wte.weight if spec.tied_embeddings else None
        torch.testing.assert_close(model.blocks[-1](h, tied_weight=tied), got, atol=0, rtol=0)
        # transformers shifts the labels itself.
        torch.testing.assert_close(
            model.loss(x[:, :-1], x[:, 1:]), hf(input_ids=x, labels=x).loss, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("spec", [TINY_GPT, TINY_LLAMA], ids=lambda s: s.name)
def test_backward_gives_finite_grads_everywhere(spec):
    torch.manual_seed(0)
    model = BlockModel(spec)
    x = tokens(spec, seq=17)
    model.loss(x[:, :-1], x[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_loss_is_cross_entropy_and_ignores_minus_100():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, -100], [0, 4, 3]])
    keep = targets.reshape(-1) != -100
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 5)[keep], targets.reshape(-1)[keep])
    torch.testing.assert_close(loss(logits, targets), want)


def test_tied_head_needs_the_embedding_weight():
    blocks = build_blocks(TINY_GPT)
    h = torch.zeros(1, 4, TINY_GPT.hidden)
    with pytest.raises(ValueError, match="tied_weight"):
        blocks[-1](h)
    untied = build_blocks(TINY_LLAMA)
    with pytest.raises(ValueError, match="tied_weight"):
        untied[-1](h, tied_weight=untied[0].wte.weight)


def test_unsupported_family_raises_a_clear_error():
    spec = dataclasses.replace(TINY_GEMMA, name="tiny-gemma2", family="gemma2", sandwich_norm=True)
    with pytest.raises(NotImplementedError,
                       match="family 'gemma2'.*not supported.*soft-caps.*gpt, llama") as e:
        build_blocks(spec)
    assert "\n" not in str(e.value)
    with pytest.raises(NotImplementedError, match="not supported"):
        hf_state_dict_to_blocks(spec, {})
    post_ln = dataclasses.replace(TINY_OPT, name="tiny-opt-post-ln", final_norm=False)
    with pytest.raises(NotImplementedError, match="post-LN OPT"):
        build_blocks(post_ln)
    with pytest.raises(NotImplementedError, match="partial rotary"):
        build_blocks(dataclasses.replace(TINY_LLAMA, rotary_fraction=0.5))


@pytest.mark.parametrize(
    "spec, make_hf",
    [(TINY_GPT, _hf_gpt2), (TINY_LLAMA_TIED, _hf_llama_like), (TINY_QWEN2, _hf_llama_like),
     *((spec, _hf_newer) for spec in NEW_FAMILIES)],
    ids=lambda x: getattr(x, "name", ""),
)
def test_blocks_to_hf_state_dict_inverts_the_import(spec, make_hf):
    torch.manual_seed(0)
    hf_sd = make_hf(spec).state_dict()
    blocks = hf_state_dict_to_blocks(spec, hf_sd)
    back = blocks_to_hf_state_dict(spec, blocks)
    if spec.family == "gpt_neox":  # written under its checkpoint name, which transformers 5 renames on load
        back["lm_head.weight"] = back.pop("embed_out.weight")
    tied = {"lm_head.weight"} if spec.tied_embeddings else set()
    assert set(back) == set(hf_sd) - tied
    for key, t in back.items():
        assert torch.equal(t, hf_sd[key]), key


def test_state_dict_problems_are_reported():
    sd = {k: v for k, v in BlockModel(TINY_LLAMA).state_dict().items()}  # our names, not HF's
    with pytest.raises(ValueError, match="unexpected tensors"):
        hf_state_dict_to_blocks(TINY_LLAMA, sd)
    torch.manual_seed(0)
    hf = _hf_llama_like(TINY_LLAMA).state_dict()
    del hf["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"block 3 misses mlp\.up_proj\.weight"):
        hf_state_dict_to_blocks(TINY_LLAMA, hf)


def test_sequence_longer_than_learned_positions_is_rejected():
    emb = build_blocks(TINY_GPT)[0]
    with pytest.raises(ValueError, match="learned positions"):
        emb(torch.zeros(1, TINY_GPT.max_positions + 1, dtype=torch.long))
