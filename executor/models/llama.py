"""The LLaMA family and those that share its layer: :class:`LlamaBlock`, RMSNorm, SwiGLU, rotary positions,
grouped-query attention, biases only where the spec says.

* ``llama``, ``mistral``, ``qwen2`` (``qkv_bias``): the same layer. Mistral's sliding window is not modelled:
  it equals plain causal attention while ``seq_len <= sliding_window`` (4096 for Mistral-7B).
* ``qwen3``: an RMSNorm over head_dim on every query and key head (``q_norm``, ``k_norm``).
* ``gemma``: GeGLU (tanh GELU gate), RMSNorms that scale by ``1 + weight`` (``GemmaRMSNorm``) and the
  embedding scaled by sqrt(hidden).
* ``gemma2`` is refused (attention-logit soft-capping and ``query_pre_attn_scalar`` are not in the spec).

Hugging Face ``*ForCausalLM`` checkpoints of each (``model.`` prefix).
"""

from __future__ import annotations

import torch
from torch import nn

from tierflow.executor.models.layers import (
    RMSNORM_EPS,
    ROPE_THETA,
    RMSNorm,
    apply_rope,
    causal_attention,
    glu,
    merge_heads,
    rms_norm,
    rope_cos_sin,
    split_heads,
)
from tierflow.executor.models.registry import BlockFamily, HFLayout, export_refused, register_block_family
from tierflow.planner.core.models import ModelSpec


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, *, rope_theta: float, norm_eps: float = RMSNORM_EPS, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.rope_theta = rope_theta
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, **kw)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, **kw)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, **kw)
        self.o_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, **kw)
        if spec.qk_norm:  # Qwen3: RMSNorm over head_dim of every query and key head, before rotary
            self.q_norm = RMSNorm(spec.head_dim, eps=norm_eps, **kw)
            self.k_norm = RMSNorm(spec.head_dim, eps=norm_eps, **kw)
        self.qk_norm = spec.qk_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.kv_heads)
        v = split_heads(self.v_proj(x), self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(x.size(1), self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(merge_heads(causal_attention(q, k, v)))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": spec.mlp_bias, "device": device, "dtype": dtype}
        self.geglu = spec.activation == "geglu"
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.geglu))


class LlamaBlock(nn.Module):
    """Pre-norm LLaMA decoder layer (names as transformers' ``LlamaDecoderLayer``). A family whose layer
    differs only in its attention or MLP subclasses it and overrides :meth:`make_attention` or
    :meth:`make_mlp`."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        norm_eps: float | None = None,
        rope_theta: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        eps = RMSNORM_EPS if norm_eps is None else norm_eps
        theta = ROPE_THETA if rope_theta is None else rope_theta
        self.parallel_residual = spec.parallel_residual
        self.input_layernorm = rms_norm(spec, spec.hidden, eps, device, dtype)
        self.self_attn = self.make_attention(spec, rope_theta=theta, norm_eps=eps, device=device, dtype=dtype)
        self.post_attention_layernorm = rms_norm(spec, spec.hidden, eps, device, dtype)
        self.mlp = self.make_mlp(spec, device=device, dtype=dtype)

    def make_attention(self, spec: ModelSpec, *, rope_theta: float, norm_eps: float, device,
                       dtype) -> nn.Module:
        return LlamaAttention(spec, rope_theta=rope_theta, norm_eps=norm_eps, device=device, dtype=dtype)

    def make_mlp(self, spec: ModelSpec, *, device, dtype) -> nn.Module:
        return LlamaMLP(spec, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.self_attn(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def make_layer(spec: ModelSpec, *, norm_eps: float | None, rope_theta: float | None, device) -> LlamaBlock:
    return LlamaBlock(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)


def refuse(spec: ModelSpec) -> str:
    if (spec.norm, spec.activation) not in (("rmsnorm", "swiglu"), ("rmsnorm", "geglu")):
        return f"LLaMA blocks need rmsnorm with swiglu or geglu, got {spec.norm} with {spec.activation}"
    return ""


# family -> its fixed (qkv, out, mlp) biases (None: switched by attention_bias / mlp_bias)
FIXED_BIASES = {"llama": None, "qwen3": None, "gemma": None, "mistral": (False, False, False),
                "qwen2": (True, False, False), "phi3": (False, False, False)}


def hf_config(spec: ModelSpec) -> dict:
    """config.json keys of the LLaMA-shaped families (llama, mistral, qwen2, qwen3, gemma, phi3)."""
    kind = spec.family
    if kind in ("qwen2", "qwen3") and spec.sliding_window:
        raise export_refused(spec, "which Qwen layers slide (max_window_layers) is not kept in the model "
                             "spec")
    biases = FIXED_BIASES[kind]
    if biases is not None and (spec.qkv_bias, spec.out_bias, spec.mlp_bias) != biases:
        raise export_refused(spec, f"{kind} layers have biases {biases} (qkv, out, mlp)")
    if kind in ("qwen3", "gemma", "llama") and spec.qkv_bias != spec.out_bias:
        raise export_refused(spec, f"{kind}'s attention_bias covers q, k, v and o together")
    if kind != "llama" and spec.mlp_bias:
        raise export_refused(spec, f"{kind} has no MLP biases")
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    cfg = dict(hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden, num_hidden_layers=spec.num_layers,
               num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
               head_dim=spec.head_dim,
               max_position_embeddings=spec.seq_len, rms_norm_eps=RMSNORM_EPS, rope_parameters=rope,
               rope_theta=ROPE_THETA, attention_dropout=0.0,
               hidden_act="gelu_pytorch_tanh" if spec.activation == "geglu" else "silu")
    if kind in ("llama", "qwen3", "gemma"):
        cfg["attention_bias"] = spec.qkv_bias
    if kind == "llama":
        cfg["mlp_bias"] = spec.mlp_bias
    if kind in ("mistral", "phi3"):
        cfg["sliding_window"] = spec.sliding_window or None
    if kind in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    return cfg


def hf_layout(model_type: str, architecture: str, config=hf_config) -> HFLayout:
    """The checkpoint layout of a LLaMA-shaped transformers class (``model.layers.N...``)."""
    return HFLayout(model_type, architecture, "model.", embedding_keys={"embed_tokens.weight": "wte.weight"},
                    head_keys={"norm.weight": "norm.weight"}, config=config)


def _register(name: str, architecture: str, **flags: bool) -> BlockFamily:
    family = BlockFamily(name, make_layer, refuse, hf_layout(name, architecture), **flags)
    return register_block_family(family)


LLAMA = _register("llama", "LlamaForCausalLM")
MISTRAL = _register("mistral", "MistralForCausalLM")
QWEN2 = _register("qwen2", "Qwen2ForCausalLM")
QWEN3 = _register("qwen3", "Qwen3ForCausalLM", qk_norm=True)
GEMMA = _register("gemma", "GemmaForCausalLM", gemma_norms=True)
