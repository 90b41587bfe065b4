"""Phi-3: the LLaMA layer with q, k, v fused in ``qkv_proj``, gate and up fused in ``gate_up_proj``, and
partial rotary embeddings (``rotary_fraction``); Hugging Face ``Phi3ForCausalLM`` checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from tierflow.executor.models.layers import (
    apply_rope,
    causal_attention,
    glu,
    merge_heads,
    rope_cos_sin,
    rotary_dims,
    split_heads,
)
from tierflow.executor.models.llama import LlamaBlock, hf_layout, refuse
from tierflow.executor.models.llama import hf_config as llama_hf_config
from tierflow.executor.models.registry import BlockFamily, register_block_family
from tierflow.planner.core.models import ModelSpec


class Phi3Attention(nn.Module):
    """Phi-3: q, k, v in one ``qkv_proj`` (all queries, then keys, then values), partial rotary."""

    def __init__(self, spec: ModelSpec, *, rope_theta: float, device=None, dtype=None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.rope_theta, self.rot = rope_theta, rotary_dims(spec)
        self.sizes = [spec.q_dim, spec.kv_dim, spec.kv_dim]
        self.qkv_proj = nn.Linear(spec.hidden, sum(self.sizes), bias=False, device=device, dtype=dtype)
        self.o_proj = nn.Linear(spec.q_dim, spec.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)
        cos, sin = rope_cos_sin(x.size(1), self.rot, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(merge_heads(causal_attention(q, k, v)))


class Phi3MLP(nn.Module):
    """Phi-3: gate and up in one ``gate_up_proj`` (gate first), SwiGLU."""

    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.geglu = spec.activation == "geglu"
        self.gate_up_proj = nn.Linear(spec.hidden, 2 * spec.ffn_hidden, bias=False, device=device,
                                      dtype=dtype)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(glu(gate, up, self.geglu))


class Phi3Block(LlamaBlock):
    """The LLaMA layer with Phi-3's fused attention and MLP (names as transformers' ``Phi3DecoderLayer``)."""

    def make_attention(self, spec: ModelSpec, *, rope_theta: float, norm_eps: float, device,
                       dtype) -> nn.Module:
        return Phi3Attention(spec, rope_theta=rope_theta, device=device, dtype=dtype)

    def make_mlp(self, spec: ModelSpec, *, device, dtype) -> nn.Module:
        return Phi3MLP(spec, device=device, dtype=dtype)


def make_layer(spec: ModelSpec, *, norm_eps: float | None, rope_theta: float | None, device) -> Phi3Block:
    return Phi3Block(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)


def hf_config(spec: ModelSpec) -> dict:
    cfg = llama_hf_config(spec)
    cfg["rope_parameters"]["partial_rotary_factor"] = spec.rotary_fraction
    cfg.update(partial_rotary_factor=spec.rotary_fraction, original_max_position_embeddings=spec.seq_len,
               resid_pdrop=0.0, embd_pdrop=0.0)
    return cfg


FAMILY = register_block_family(BlockFamily("phi3", make_layer, refuse,
                                           hf_layout("phi3", "Phi3ForCausalLM", hf_config),
                                           partial_rotary=True))
