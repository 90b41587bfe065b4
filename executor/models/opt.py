"""The OPT family: :class:`OPTBlock`, pre-LN (``do_layer_norm_before``) with a final LayerNorm, ReLU, learned
positions offset by 2. Post-LN OPT (opt-350m) and ``project_in``/``project_out`` are refused. Hugging Face
``OPTForCausalLM`` checkpoints (``model.decoder.`` prefix)."""

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


class OPTAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.heads = spec.num_heads
        kw = {"device": device, "dtype": dtype}
        self.k_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, **kw)
        self.v_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, **kw)
        self.q_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, **kw)
        self.out_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(merge_heads(causal_attention(q, k, v)))


class OPTBlock(nn.Module):
    """Pre-LN OPT decoder layer (``do_layer_norm_before``; names as transformers' ``OPTDecoderLayer``)."""

    def __init__(self, spec: ModelSpec, *, norm_eps: float | None = None, device=None, dtype=None) -> None:
        super().__init__()
        eps = LAYERNORM_EPS if norm_eps is None else norm_eps
        kw = {"device": device, "dtype": dtype}
        self.relu = spec.activation == "relu"
        self.self_attn = OPTAttention(spec, **kw)
        self.self_attn_layer_norm = nn.LayerNorm(spec.hidden, eps=eps, **kw)
        self.fc1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.mlp_bias, **kw)
        self.fc2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.mlp_bias, **kw)
        self.final_layer_norm = nn.LayerNorm(spec.hidden, eps=eps, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        h = self.fc1(self.final_layer_norm(x))
        return x + self.fc2(F.relu(h) if self.relu else F.gelu(h))


def make_layer(spec: ModelSpec, *, norm_eps: float | None, rope_theta: float | None, device) -> OPTBlock:
    return OPTBlock(spec, norm_eps=norm_eps, device=device)


def refuse(spec: ModelSpec) -> str:
    if spec.norm != "layernorm":
        return f"opt blocks need layernorm, got {spec.norm}"
    if spec.embed_proj_dim or not spec.final_norm or spec.position_offset != 2:
        return ("post-LN OPT (do_layer_norm_before=false, e.g. opt-350m), word_embed_proj_dim != hidden_size "
                "(project_in/out) and a removed final norm are not implemented; pre-LN OPT is")
    return ""


def hf_config(spec: ModelSpec) -> dict:
    if not classic_heads(spec):
        raise export_refused(spec, "opt has neither grouped-query attention nor a head_dim other than "
                             "hidden / heads")
    if not (spec.qkv_bias == spec.out_bias == spec.mlp_bias):
        raise export_refused(spec, "OPT's enable_bias switches every bias at once")
    return dict(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                num_attention_heads=spec.num_heads, ffn_dim=spec.ffn_hidden,
                max_position_embeddings=spec.max_positions, do_layer_norm_before=True,
                word_embed_proj_dim=spec.hidden, enable_bias=spec.qkv_bias,
                layer_norm_elementwise_affine=True,
                activation_function="relu" if spec.activation == "relu" else "gelu",
                dropout=0.0, attention_dropout=0.0, layerdrop=0.0)


HF = HFLayout("opt", "OPTForCausalLM", "model.decoder.",
              embedding_keys={"embed_tokens.weight": "wte.weight", "embed_positions.weight": "wpe.weight"},
              head_keys={"final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias"},
              config=hf_config)
FAMILY = register_block_family(BlockFamily("opt", make_layer, refuse, HF, opt_positions=True))
