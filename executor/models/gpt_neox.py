"""The GPT-NeoX family: :class:`NeoXBlock`, parallel (or sequential) residual, the per-head interleaved fused
``query_key_value``, partial rotary embeddings, exact GELU; Hugging Face ``GPTNeoXForCausalLM`` checkpoints
(``gpt_neox.`` prefix, the lm_head written as ``embed_out``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.executor.models.layers import (
    LAYERNORM_EPS,
    ROPE_THETA,
    apply_rope,
    causal_attention,
    merge_heads,
    rope_cos_sin,
    rotary_dims,
)
from tierflow.executor.models.registry import (
    BlockFamily,
    HFLayout,
    classic_heads,
    export_refused,
    register_block_family,
)
from tierflow.planner.core.models import ModelSpec


class NeoXAttention(nn.Module):
    """GPT-NeoX attention: ``query_key_value`` holds q, k, v interleaved per head ((heads, 3,
    head_dim) rows)."""

    def __init__(self, spec: ModelSpec, *, rope_theta: float, device=None, dtype=None) -> None:
        super().__init__()
        self.heads, self.head_dim = spec.num_heads, spec.head_dim
        self.rope_theta, self.rot = rope_theta, rotary_dims(spec)
        kw = {"device": device, "dtype": dtype}
        self.query_key_value = nn.Linear(spec.hidden, 3 * spec.q_dim, bias=spec.qkv_bias, **kw)
        self.dense = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        cos, sin = rope_cos_sin(T, self.rot, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.dense(merge_heads(causal_attention(q, k, v)))


class NeoXMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.relu = spec.activation == "relu"
        self.dense_h_to_4h = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.mlp_bias, device=device,
                                       dtype=dtype)
        self.dense_4h_to_h = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.mlp_bias, device=device,
                                       dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        # exact GELU: NeoX's hidden_act "gelu"
        return self.dense_4h_to_h(F.relu(h) if self.relu else F.gelu(h))


class NeoXBlock(nn.Module):
    """GPT-NeoX decoder layer (names as transformers' ``GPTNeoXLayer``): parallel residual by default."""

    def __init__(self, spec: ModelSpec, *, norm_eps: float | None = None, rope_theta: float | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        eps = LAYERNORM_EPS if norm_eps is None else norm_eps
        kw = {"device": device, "dtype": dtype}
        self.parallel_residual = spec.parallel_residual
        self.input_layernorm = nn.LayerNorm(spec.hidden, eps=eps, **kw)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden, eps=eps, **kw)
        theta = ROPE_THETA if rope_theta is None else rope_theta
        self.attention = NeoXAttention(spec, rope_theta=theta, **kw)
        self.mlp = NeoXMLP(spec, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x))
        if self.parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x))
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def make_layer(spec: ModelSpec, *, norm_eps: float | None, rope_theta: float | None, device) -> NeoXBlock:
    return NeoXBlock(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)


def refuse(spec: ModelSpec) -> str:
    return f"gpt_neox blocks need layernorm, got {spec.norm}" if spec.norm != "layernorm" else ""


def hf_config(spec: ModelSpec) -> dict:
    if not classic_heads(spec):
        raise export_refused(spec, "gpt_neox has neither grouped-query attention nor a head_dim other than "
                             "hidden / heads")
    if spec.qkv_bias != spec.out_bias or not spec.mlp_bias:
        raise export_refused(spec, "GPT-NeoX's attention_bias covers query_key_value and dense together, and "
                             "its MLP has biases")
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": spec.rotary_fraction}
    return dict(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, intermediate_size=spec.ffn_hidden,
                max_position_embeddings=spec.seq_len,
                hidden_act="relu" if spec.activation == "relu" else "gelu", rope_parameters=rope,
                rotary_pct=spec.rotary_fraction, rotary_emb_base=ROPE_THETA, layer_norm_eps=LAYERNORM_EPS,
                use_parallel_residual=spec.parallel_residual, attention_bias=spec.qkv_bias,
                hidden_dropout=0.0, attention_dropout=0.0)


# the lm_head is written under its checkpoint name, embed_out (transformers 5 renames it to lm_head on load,
# and older releases know only embed_out)
HF = HFLayout("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.", embedding_keys={"embed_in.weight": "wte.weight"},
              head_keys={"final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias"},
              config=hf_config, lm_head="embed_out.weight")
FAMILY = register_block_family(BlockFamily("gpt_neox", make_layer, refuse, HF, partial_rotary=True))
