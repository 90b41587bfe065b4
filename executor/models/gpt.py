"""The GPT family (GPT-2 / GPT-3): :class:`GPTBlock`, pre-LN LayerNorm with bias, tanh-GELU (GPT-2's
``gelu_new``) or ReLU, learned positions (they live in the Embedding), biases as the spec says; Hugging Face
``GPT2LMHeadModel`` checkpoints (Conv1D weights transposed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.executor.models.layers import LAYERNORM_EPS, causal_attention, merge_heads, split_heads
from tierflow.executor.models.registry import (
    BlockFamily,
    HFLayout,
    classic_heads,
    export_refused,
    register_block_family,
)
from tierflow.planner.core.models import ModelSpec


class GPTAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.heads, self.kv_heads = spec.num_heads, spec.num_kv_heads
        self.sizes = [spec.q_dim, spec.kv_dim, spec.kv_dim]
        self.c_attn = nn.Linear(spec.hidden, sum(self.sizes), bias=spec.qkv_bias, device=device, dtype=dtype)
        self.c_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.sizes, dim=-1)
        q, k, v = split_heads(q, self.heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)
        return self.c_proj(merge_heads(causal_attention(q, k, v)))


class GPTMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.relu = spec.activation == "relu"
        self.c_fc = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.mlp_bias, device=device, dtype=dtype)
        self.c_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.mlp_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = F.relu(h) if self.relu else F.gelu(h, approximate="tanh")  # tanh GELU == GPT-2 "gelu_new"
        return self.c_proj(h)


class GPTBlock(nn.Module):
    """Pre-LN GPT-2 decoder layer (names as transformers' ``GPT2Block``)."""

    def __init__(self, spec: ModelSpec, *, norm_eps: float | None = None, device=None, dtype=None) -> None:
        super().__init__()
        eps = LAYERNORM_EPS if norm_eps is None else norm_eps
        self.parallel_residual = spec.parallel_residual
        self.ln_1 = nn.LayerNorm(spec.hidden, eps=eps, device=device, dtype=dtype)
        self.attn = GPTAttention(spec, device=device, dtype=dtype)
        self.ln_2 = nn.LayerNorm(spec.hidden, eps=eps, device=device, dtype=dtype)
        self.mlp = GPTMLP(spec, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:  # GPT-J / NeoX style: both branches read the same input
            return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def make_layer(spec: ModelSpec, *, norm_eps: float | None, rope_theta: float | None, device) -> GPTBlock:
    return GPTBlock(spec, norm_eps=norm_eps, device=device)


def refuse(spec: ModelSpec) -> str:
    if (spec.norm, spec.activation) not in (("layernorm", "gelu"), ("layernorm", "relu")):
        return f"GPT blocks need layernorm with gelu or relu, got {spec.norm} with {spec.activation}"
    if not spec.max_positions:
        return "GPT blocks need a learned position table (max_positions > 0)"
    return ""


def hf_config(spec: ModelSpec) -> dict:
    if not classic_heads(spec):
        raise export_refused(spec, "gpt2 has neither grouped-query attention nor a head_dim other than "
                             "hidden / heads")
    if spec.parallel_residual or not (spec.qkv_bias and spec.out_bias and spec.mlp_bias):
        raise export_refused(spec, "GPT-2 layers have every bias and a sequential residual")
    return dict(n_embd=spec.hidden, n_layer=spec.num_layers, n_head=spec.num_heads, n_inner=spec.ffn_hidden,
                n_positions=spec.max_positions, layer_norm_epsilon=LAYERNORM_EPS,
                activation_function="relu" if spec.activation == "relu" else "gelu_new",
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# GPT-2 stores these as Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF = HFLayout("gpt2", "GPT2LMHeadModel", "transformer.",
              embedding_keys={"wte.weight": "wte.weight", "wpe.weight": "wpe.weight"},
              head_keys={"ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"},
              config=hf_config, layers="h", conv1d=CONV1D)
FAMILY = register_block_family(BlockFamily("gpt", make_layer, refuse, HF))
