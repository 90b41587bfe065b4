"""PyTorch model code for the executor, built from a :class:`tierflow.planner.core.models.ModelSpec`, one
module per block.

The executor runs a model *block by block* (embedding, each decoder layer, head) while it streams the weights
between GPU memory, CPU memory and NVMe, so the model is not one monolithic ``nn.Module``:
:func:`build_blocks` returns ``[Embedding, block_1, ..., block_L, Head]`` and the caller chains them.

* ``family="gpt"`` (GPT-2/GPT-3): :class:`GPTBlock`, pre-LN LayerNorm with bias, tanh-GELU (GPT-2's
  ``gelu_new``), learned positions (they live in :class:`Embedding`), biases as the spec says.
* ``family`` in ``llama``, ``mistral``, ``qwen2``: :class:`LlamaBlock`, RMSNorm, SwiGLU, rotary positions,
  grouped-query attention, biases only where the spec says (``qkv_bias`` for Qwen2). Mistral's sliding window
  is not modelled: it equals plain causal attention while ``seq_len <= sliding_window`` (4096 for Mistral-7B).
* ``qwen3``: :class:`LlamaBlock` with an RMSNorm over head_dim on every query and key head (``q_norm``,
``k_norm``).
* ``gemma``: :class:`LlamaBlock` with GeGLU (tanh GELU gate), RMSNorms that scale by ``1 + weight``
  (:class:`GemmaRMSNorm`) and the embedding scaled by sqrt(hidden).
* ``phi3``: :class:`Phi3Block`, LLaMA with q, k, v fused in ``qkv_proj``, gate and up fused in
``gate_up_proj``, and
  partial rotary embeddings (``rotary_fraction``).
* ``opt``: :class:`OPTBlock`, pre-LN (``do_layer_norm_before``) with a final LayerNorm, ReLU, learned
positions
  offset by 2. Post-LN OPT (opt-350m) and ``project_in``/``project_out`` are refused.
* ``gpt_neox``: :class:`NeoXBlock`, parallel (or sequential) residual, the per-head interleaved fused
  ``query_key_value``, partial rotary embeddings, exact GELU.
* ``gemma2`` is refused (attention-logit soft-capping and ``query_pre_attn_scalar`` are not in the spec); see
  :func:`check_supported`.

Parameter names inside each block equal Hugging Face's (``self_attn.q_proj.weight``, ``attn.c_attn.weight``,
...) so :func:`hf_state_dict_to_blocks` is mostly prefix stripping; the parameter count of every block equals
the spec's (``embedding_params``, ``layer_params``, ``final_norm_params + head_params``).

A tied lm_head owns no weight: :meth:`Head.forward` takes the embedding's weight as ``tied_weight``, so the
executor can stream the one copy to wherever the head runs. :class:`BlockModel` chains the blocks for a plain
full forward; it is the PyTorch reference in correctness tests.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.workload import loss_chunk_tokens

LAYERNORM_EPS = 1e-5  # GPT-2 layer_norm_epsilon
RMSNORM_EPS = 1e-5  # LLaMA-2 / Mistral rms_norm_eps (transformers' LlamaConfig default is 1e-6)
ROPE_THETA = 10000.0  # LLaMA / LLaMA-2 rope_theta (Qwen2 checkpoints use 1e6: pass rope_theta=)
INIT_STD = 0.02  # GPT-2 initializer_range

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma")
SUPPORTED_FAMILIES = ("gpt", *LLAMA_LIKE, "phi3", "opt", "gpt_neox")

_WHY_UNSUPPORTED = {
    "gemma2": "Gemma2 soft-caps attention and final logits and scales queries by query_pre_attn_scalar; the "
              "model spec does not carry those constants, so its logits could not match the checkpoint's",
}


def check_supported(spec: ModelSpec) -> None:
    """Raise :class:`NotImplementedError` (one line) if the executor cannot build ``spec``."""

    def no(what: str) -> NotImplementedError:
        return NotImplementedError(
            f"tierflow.executor.models: model {spec.name!r} (family {spec.family!r}): {what}")

    if spec.family not in SUPPORTED_FAMILIES:
        why = _WHY_UNSUPPORTED.get(spec.family, "unknown family")
        raise no(f"not supported yet ({why}); supported families: {', '.join(SUPPORTED_FAMILIES)}")
    if spec.family == "gpt" and (spec.norm, spec.activation) not in (
        ("layernorm", "gelu"),
        ("layernorm", "relu"),
    ):
        raise no(f"GPT blocks need layernorm with gelu or relu, got {spec.norm} with {spec.activation}")
    if spec.family in (*LLAMA_LIKE, "phi3") and (spec.norm, spec.activation) not in (
        ("rmsnorm", "swiglu"),
        ("rmsnorm", "geglu"),
    ):
        raise no(f"LLaMA blocks need rmsnorm with swiglu or geglu, got {spec.norm} with {spec.activation}")
    if spec.family in ("opt", "gpt_neox") and spec.norm != "layernorm":
        raise no(f"{spec.family} blocks need layernorm, got {spec.norm}")
    if spec.family == "opt" and (spec.embed_proj_dim or not spec.final_norm or spec.position_offset != 2):
        raise no("post-LN OPT (do_layer_norm_before=false, e.g. opt-350m), word_embed_proj_dim != "
                 "hidden_size (project_in/out) and a removed final norm are not implemented; pre-LN OPT is")
    if spec.family != "opt" and (spec.embed_proj_dim or spec.position_offset or not spec.final_norm):
        raise no("OPT-only features (embed_proj_dim, position_offset, no final norm) outside an OPT model")
    if not spec.norm_affine:
        raise no("norms without weights (layer_norm_elementwise_affine=false) are not implemented")
    if spec.sandwich_norm or (spec.qk_norm and spec.family != "qwen3"):
        raise no("sandwich norms (Gemma2) and qk-norm outside Qwen3 are not implemented")
    if spec.rotary_fraction != 1.0 and spec.family not in ("gpt_neox", "phi3"):
        raise no("partial rotary embeddings are implemented for GPT-NeoX and Phi-3 only")
    if spec.family == "gpt" and not spec.max_positions:
        raise no("GPT blocks need a learned position table (max_positions > 0)")
    if not spec.lm_head:
        raise no("a model without an lm_head (a benchmark stand-in whose loss is on the hidden states) is "
                 "simulated, not trained")


# ------------------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------------------


class _SaveInputs(torch.autograd.Function):
    """`fn(*inputs)` that saves only its inputs for backward and recomputes the rest there (as fused kernels
    such as Megatron's RMSNorm and SwiGLU do): the backward re-runs `fn` under autograd, so its gradients are
    bit-identical to plain autograd's, while the forward keeps no intermediates (an fp32 copy of a norm's
    input, the activation function's output) alive until the backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(need)
                  for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        want = [x for x in inputs if x.requires_grad]
        got = iter(torch.autograd.grad(out, want, grads, allow_unused=True)) if want else iter(())
        return (None, *(next(got) if x.requires_grad else None for x in inputs))


def save_inputs_only(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), keeping only `inputs` for the backward (see _SaveInputs);
    plain fn(*inputs) without grad."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return _SaveInputs.apply(fn, *inputs)
    return fn(*inputs)


class RMSNorm(nn.Module):
    """LLaMA RMSNorm, computed in float32 like transformers' ``LlamaRMSNorm``. Only its input (in the compute
    dtype) is kept for the backward, as a fused RMSNorm kernel keeps it: autograd alone would keep the fp32
    copy of the input, its normalised bf16 cast and the fp32 statistics (2.5x the input's bytes in bf16
    more)."""

    def __init__(self, dim: int, eps: float = RMSNORM_EPS, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return save_inputs_only(self._norm, x, self.weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight`` in float32 before casting back
    (the weight starts at zero)."""

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + weight.float())).to(x.dtype)


def _rms_norm(spec: ModelSpec, dim: int, eps: float, device=None, dtype=None) -> RMSNorm:
    cls = GemmaRMSNorm if spec.family == "gemma" else RMSNorm
    return cls(dim, eps=eps, device=device, dtype=dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over (B, heads, T, head_dim); k and v may have fewer (grouped-query) heads: kv head j
    serves query heads j*groups .. (j+1)*groups-1, as transformers' repeat_kv, but without repeating them
    (enable_gqa), so that autograd saves K and V at their own size, not groups times it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (seq_len, head_dim) for positions 0..seq_len-1, computed in float32 then cast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by the tables (the "rotate half" layout of transformers' LLaMA). Tables
    narrower than head_dim rotate only the first dims (partial rotary: GPT-NeoX, Phi-3); the rest pass."""
    rot = cos.size(-1)
    if rot < x.size(-1):
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope(x, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Rope(torch.autograd.Function):
    """Rotary positions that keep only the tables for backward (a rotation's gradient is the inverse
    rotation), not the un-rotated queries and keys autograd would keep beside the rotated ones attention
    saves. The gradient is computed with the same bf16 operations autograd runs (g*cos + the halves of g*sin
    swapped, one negated), so it is bit-identical."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        a1, a2 = (g * sin).chunk(2, dim=-1)
        return g * cos + torch.cat((a2, -a1), dim=-1), None, None


def rotary_dims(spec: ModelSpec) -> int:
    """How many of each head's dims rotary positions rotate (transformers: int(head_dim * partial factor))."""
    return int(spec.head_dim * spec.rotary_fraction)


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, _ = x.shape
    return x.view(B, T, heads, -1).transpose(1, 2)  # (B, heads, T, head_dim)


def _merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


# ------------------------------------------------------------------------------------------------------------
# Embedding and head
# ------------------------------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token embedding ``wte`` (+ learned positions ``wpe`` for GPT). tokens (B, T) -> hidden (B,
    T, hidden)."""

    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden, device=device, dtype=dtype)
        self.offset = spec.position_offset  # OPT: position p reads row p + 2
        self.wpe = (
            nn.Embedding(spec.max_positions + self.offset, spec.hidden, device=device, dtype=dtype)
            if spec.max_positions
            else None
        )
        self.scale = spec.hidden**0.5 if spec.family == "gemma" else None  # Gemma scales by sqrt(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.scale is not None:  # as transformers: the factor rounded to the activations' dtype first
            x = x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)
        if self.wpe is not None:
            T = tokens.size(-1)
            if T > self.wpe.num_embeddings - self.offset:
                raise ValueError(
                    f"sequence of {T} tokens exceeds the {self.wpe.num_embeddings - self.offset} learned "
                    "positions"
                )
            x = x + self.wpe(torch.arange(T, device=tokens.device) + self.offset)
        return x


class Head(nn.Module):
    """Final norm + lm_head. hidden (B, T, hidden) -> logits (B, T, vocab).

    With tied embeddings the head owns no lm_head: pass the embedding's ``wte.weight`` as ``tied_weight``.
    """

    def __init__(self, spec: ModelSpec, *, norm_eps: float | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.tied = spec.tied_embeddings
        if spec.norm == "layernorm":
            self.norm = nn.LayerNorm(
                spec.hidden, eps=LAYERNORM_EPS if norm_eps is None else norm_eps, device=device, dtype=dtype
            )
        else:
            eps = RMSNORM_EPS if norm_eps is None else norm_eps
            self.norm = _rms_norm(spec, spec.hidden, eps, device, dtype)
        self.lm_head = (
            None
            if self.tied
            else nn.Linear(spec.hidden, spec.vocab_size, bias=False, device=device, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits; with `targets`, the mean loss instead (chunked_lm_loss: no whole logits)."""
        if self.tied and tied_weight is None:
            raise ValueError(
                "this head is tied to the token embedding: pass tied_weight=embedding.wte.weight"
            )
        if not self.tied and tied_weight is not None:
            raise ValueError("this head has its own lm_head (untied embeddings): do not pass tied_weight")
        x = self.norm(x)
        weight = tied_weight if self.tied else self.lm_head.weight
        if targets is not None:
            return chunked_lm_loss(x, weight, targets)
        return F.linear(x, weight)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(logits, targets)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32;
    targets equal to -100 are ignored (transformers' convention)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """lm_head + mean cross-entropy over chunks of tokens, the gradients computed in the forward (as Liger
    Kernel's fused linear cross-entropy does): per chunk the logits (compute dtype), in fp32, and their
    softmax gradient; what is kept is the hidden states' and the weight's gradient, never the whole logits.
    The planner counts this (tierflow.planner.core.workload.loss_working_bytes). Same values as `loss` on the
    full logits: the fp32 logits are the compute-dtype logits cast, the gradient is cast back to the compute
    dtype before the two GEMMs, as autograd does."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        valid_count = targets.ne(IGNORE_INDEX).sum()
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        need = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dx = torch.empty_like(x) if need else None
        dw = torch.zeros_like(weight) if need else None
        for lo in range(0, x.size(0), chunk):
            xc, tc = x[lo: lo + chunk], targets[lo: lo + chunk]
            logits = F.linear(xc, weight).float()  # in fp32 (the same tensor when fp32)
            lse = torch.logsumexp(logits, dim=-1)
            keep = tc.ne(IGNORE_INDEX)
            rows = torch.arange(tc.numel(), device=x.device)
            picked = logits[rows, tc.clamp(min=0)]
            total += ((lse - picked) * keep).sum()
            if need:
                g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the fp32 logits
                g[rows, tc.clamp(min=0)] -= 1.0
                g = g.mul_(keep.unsqueeze(1)).to(x.dtype)
                dx[lo: lo + chunk] = g @ weight
                dw.addmm_(g.t(), xc)
            del logits
        ctx.save_for_backward(dx, dw, valid_count)
        return total / valid_count

    @staticmethod
    def backward(ctx, grad):
        dx, dw, valid_count = ctx.saved_tensors
        scale = (grad / valid_count).to(dx.dtype)
        return dx.mul_(scale), dw.mul_(scale), None, None  # in place: no second copy (one backward only)


IGNORE_INDEX = -100  # targets equal to it are ignored (transformers' convention)


def chunked_lm_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of `x @ weight.T` (hidden (..., embed) -> vocabulary logits) against
    `targets`, over chunks of tokens (the planner's loss_chunk_tokens), never materialising the full fp32
    logits; equal to `loss(F.linear(x, weight), targets)`."""
    x2 = x.reshape(-1, x.size(-1))
    chunk = loss_chunk_tokens(weight.size(0), x2.size(0))
    return _ChunkedLinearCrossEntropy.apply(x2, weight, targets.reshape(-1), chunk)


# ------------------------------------------------------------------------------------------------------------
# GPT-2 / GPT-3 block
# ------------------------------------------------------------------------------------------------------------


class GPTAttention(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.heads, self.kv_heads = spec.num_heads, spec.num_kv_heads
        self.sizes = [spec.q_dim, spec.kv_dim, spec.kv_dim]
        self.c_attn = nn.Linear(spec.hidden, sum(self.sizes), bias=spec.qkv_bias, device=device, dtype=dtype)
        self.c_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.sizes, dim=-1)
        q, k, v = _split_heads(q, self.heads), _split_heads(k, self.kv_heads), _split_heads(v, self.kv_heads)
        return self.c_proj(_merge_heads(causal_attention(q, k, v)))


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


# ------------------------------------------------------------------------------------------------------------
# LLaMA / Mistral / Qwen2 block
# ------------------------------------------------------------------------------------------------------------


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
        q = _split_heads(self.q_proj(x), self.heads)
        k = _split_heads(self.k_proj(x), self.kv_heads)
        v = _split_heads(self.v_proj(x), self.kv_heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(x.size(1), self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(_merge_heads(causal_attention(q, k, v)))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": spec.mlp_bias, "device": device, "dtype": dtype}
        self.geglu = spec.activation == "geglu"
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_glu(self.gate_proj(x), self.up_proj(x), self.geglu))


def _glu(gate: torch.Tensor, up: torch.Tensor, geglu: bool) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, or GeGLU's (Gemma's gelu_pytorch_tanh) tanh GELU(gate) * up, keeping only
    gate and up for the backward (as a fused SwiGLU kernel does): autograd alone would also keep the gate's
    output, one more ffn-wide tensor per layer."""
    return save_inputs_only(_geglu if geglu else _swiglu, gate, up)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class LlamaBlock(nn.Module):
    """Pre-norm LLaMA decoder layer (names as transformers' ``LlamaDecoderLayer``)."""

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
        self.input_layernorm = _rms_norm(spec, spec.hidden, eps, device, dtype)
        if spec.family == "phi3":
            self.self_attn = Phi3Attention(spec, rope_theta=theta, device=device, dtype=dtype)
            self.post_attention_layernorm = _rms_norm(spec, spec.hidden, eps, device, dtype)
            self.mlp = Phi3MLP(spec, device=device, dtype=dtype)
            return
        self.self_attn = LlamaAttention(spec, rope_theta=theta, norm_eps=eps, device=device, dtype=dtype)
        self.post_attention_layernorm = _rms_norm(spec, spec.hidden, eps, device, dtype)
        self.mlp = LlamaMLP(spec, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.self_attn(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


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
        q, k, v = _split_heads(q, self.heads), _split_heads(k, self.kv_heads), _split_heads(v, self.kv_heads)
        cos, sin = rope_cos_sin(x.size(1), self.rot, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(_merge_heads(causal_attention(q, k, v)))


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
        return self.down_proj(_glu(gate, up, self.geglu))


# ------------------------------------------------------------------------------------------------------------
# OPT and GPT-NeoX blocks
# ------------------------------------------------------------------------------------------------------------


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
        q, k, v = (_split_heads(p(x), self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(_merge_heads(causal_attention(q, k, v)))


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
        return self.dense(_merge_heads(causal_attention(q, k, v)))


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


# ------------------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------------------


def _make_blocks(
    spec: ModelSpec, device, norm_eps: float | None, rope_theta: float | None
) -> list[nn.Module]:
    """Uninitialised blocks (meant for ``device="meta"``)."""
    check_supported(spec)
    if spec.family == "gpt":
        layers = [GPTBlock(spec, norm_eps=norm_eps, device=device) for _ in range(spec.num_layers)]
    elif spec.family == "opt":
        layers = [OPTBlock(spec, norm_eps=norm_eps, device=device) for _ in range(spec.num_layers)]
    elif spec.family == "gpt_neox":
        layers = [NeoXBlock(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)
                  for _ in range(spec.num_layers)]
    else:
        layers = [
            LlamaBlock(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)
            for _ in range(spec.num_layers)
        ]
    return [Embedding(spec, device=device), *layers, Head(spec, norm_eps=norm_eps, device=device)]


@torch.no_grad()
def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """GPT-2 style init: Linear/Embedding weights ~ N(0, std), biases 0, norm weights 1 (in module order)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, GemmaRMSNorm):  # scales by 1 + weight: zero is the identity
            nn.init.zeros_(m.weight)
        elif isinstance(m, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def build_blocks(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    norm_eps: float | None = None,
    rope_theta: float | None = None,
) -> list[nn.Module]:
    """``[Embedding, block_1, ..., block_L, Head]`` for ``spec``, initialised GPT-2 style.

    Weights are drawn in float32 on the CPU generator (in block order) and then moved to ``device``/``dtype``,
    so a given ``torch.manual_seed`` gives the same weights on every device and dtype. ``norm_eps`` and
    ``rope_theta`` default to :data:`LAYERNORM_EPS`/:data:`RMSNORM_EPS` and :data:`ROPE_THETA`.
    """
    blocks = _make_blocks(spec, "meta", norm_eps, rope_theta)
    out = []
    for block in blocks:
        block = block.to_empty(device="cpu")
        init_weights(block)
        out.append(block.to(device=device, dtype=dtype))
    return out


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class BlockModel(nn.Module):
    """The blocks chained into one plain model: the PyTorch reference for correctness tests."""

    def __init__(
        self,
        spec: ModelSpec,
        blocks: list[nn.Module] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        norm_eps: float | None = None,
        rope_theta: float | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        if blocks is None:
            blocks = build_blocks(spec, dtype, device, norm_eps=norm_eps, rope_theta=rope_theta)
        if len(blocks) != spec.num_layers + 2:
            raise ValueError(f"expected {spec.num_layers + 2} blocks for {spec.name!r}, got {len(blocks)}")
        self.blocks = nn.ModuleList(blocks)

    @property
    def embedding(self) -> Embedding:
        return self.blocks[0]

    @property
    def head(self) -> Head:
        return self.blocks[-1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks[1:-1]:
            x = block(x)
        tied = self.embedding.wte.weight if self.spec.tied_embeddings else None
        return self.head(x, tied_weight=tied)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(self(tokens), targets)

    def load_block_state_dicts(self, state_dicts: list[Mapping[str, torch.Tensor]]) -> None:
        """Load the output of :func:`hf_state_dict_to_blocks` (strictly)."""
        for block, sd in zip(self.blocks, state_dicts, strict=True):
            block.load_state_dict(sd)


# ------------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ------------------------------------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^(?:h|layers)\.(\d+)\.(.+)$")
# Non-parameter buffers that older checkpoints saved: GPT-2's causal mask, LLaMA's rotary table.
_IGNORED_KEY = re.compile(
    r"(^|\.)(attn\.bias|attn\.masked_bias|attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$"
)
# GPT-2 stores these as Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _outer_keys(spec: ModelSpec) -> dict[str, tuple[int, str]]:
    last = spec.num_layers + 1
    if spec.family == "gpt":  # HF name (without the prefix) -> (block index, our name)
        return {
            "wte.weight": (0, "wte.weight"),
            "wpe.weight": (0, "wpe.weight"),
            "ln_f.weight": (last, "norm.weight"),
            "ln_f.bias": (last, "norm.bias"),
        }
    if spec.family == "opt":
        return {
            "embed_tokens.weight": (0, "wte.weight"),
            "embed_positions.weight": (0, "wpe.weight"),
            "final_layer_norm.weight": (last, "norm.weight"),
            "final_layer_norm.bias": (last, "norm.bias"),
        }
    if spec.family == "gpt_neox":
        return {
            "embed_in.weight": (0, "wte.weight"),
            "final_layer_norm.weight": (last, "norm.weight"),
            "final_layer_norm.bias": (last, "norm.bias"),
        }
    return {"embed_tokens.weight": (0, "wte.weight"), "norm.weight": (last, "norm.weight")}


def _hf_prefix(spec: ModelSpec) -> str:
    """The prefix of the base model's tensors in a transformers checkpoint (optional when reading)."""
    prefixes = {"gpt": "transformer.", "opt": "model.decoder.", "gpt_neox": "gpt_neox."}
    return prefixes.get(spec.family, "model.")


def _hf_lm_head(spec: ModelSpec) -> str:
    """The lm_head's name as written on export: GPT-NeoX checkpoints call it ``embed_out`` (transformers 5
    renames it to ``lm_head`` on load, and older releases know only ``embed_out``)."""
    return "embed_out.weight" if spec.family == "gpt_neox" else "lm_head.weight"


def hf_key_target(spec: ModelSpec, key: str) -> tuple[int, str, bool] | None | bool:
    """Where a transformers checkpoint tensor goes: (block index, our parameter name, transpose it?), ``None``
    for tensors to skip (buffers, a tied lm_head), ``False`` for a key this model does not have."""
    gpt = spec.family == "gpt"
    last = spec.num_layers + 1
    if _IGNORED_KEY.search(key):
        return None
    if key in (_hf_lm_head(spec), "lm_head.weight"):
        return None if spec.tied_embeddings else (last, "lm_head.weight", False)
    name = key
    for part in _hf_prefix(spec).split(".")[:-1]:  # OPT: "model." and "decoder." are each optional
        name = name.removeprefix(part + ".")
    layer = _LAYER_KEY.match(name)
    if layer and int(layer.group(1)) < spec.num_layers:
        sub = layer.group(2)
        return int(layer.group(1)) + 1, sub, gpt and sub in _CONV1D
    outer = _outer_keys(spec)
    if name in outer:
        index, target = outer[name]
        return index, target, False
    return False


def check_block_state_dicts(spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]],
                            only: list[int] | None = None) -> None:
    """Names and shapes of per-block state dicts against the blocks we would build (meta device:
    no memory)."""
    expected = _make_blocks(spec, "meta", None, None)
    for i, (block, got) in enumerate(zip(expected, blocks)):
        if only is not None and i not in only:
            continue
        want = {k: tuple(v.shape) for k, v in block.state_dict().items()}
        missing = sorted(set(want) - set(got))
        if missing:
            raise ValueError(f"{spec.name}: block {i} misses {', '.join(missing)} in the state dict")
        for k, t in got.items():
            if k not in want:
                raise ValueError(f"{spec.name}: block {i} has no parameter {k!r}")
            if tuple(t.shape) != want[k]:
                raise ValueError(f"{spec.name}: block {i} {k}: shape {tuple(t.shape)} != expected {want[k]}")


def hf_state_dict_to_blocks(
    spec: ModelSpec, state_dict: Mapping[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """Split a transformers state dict into one state dict per block of :func:`build_blocks`.

    Accepts the ``*ForCausalLM`` of every family in :data:`SUPPORTED_FAMILIES` (``model.`` prefix optional;
    OPT's ``model.decoder.``, GPT-NeoX's ``gpt_neox.``) and ``GPT2LMHeadModel`` (``transformer.`` prefix
    optional, as in the original GPT-2 checkpoints). GPT-2 Conv1D
    weights are transposed; a tied ``lm_head.weight`` is dropped (the head uses the embedding's). Each result
    loads with ``block.load_state_dict(sd)`` (strict); missing, unexpected or mis-shaped tensors raise
    :class:`ValueError`.
    """
    check_supported(spec)
    blocks: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_layers + 2)]
    unexpected = []
    for key, tensor in state_dict.items():
        target = hf_key_target(spec, key)
        if target is None:
            continue
        if target is False:
            unexpected.append(key)
            continue
        index, name, transpose = target
        blocks[index][name] = tensor.t().contiguous() if transpose else tensor
    if unexpected:
        raise ValueError(f"{spec.name}: unexpected tensors in the state dict: {', '.join(unexpected[:8])}")
    check_block_state_dicts(spec, blocks)
    return blocks


def blocks_to_hf_state_dict(
    spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_state_dict_to_blocks`: one transformers state dict with the full prefixes
    (``model.``, ``transformer.``, ``model.decoder.``, ``gpt_neox.``); a tied lm_head is left out
    (transformers ties it to the embedding on load), GPT-2 Conv1D weights are transposed back."""
    check_supported(spec)
    check_block_state_dicts(spec, blocks)
    prefix, last = _hf_prefix(spec), spec.num_layers + 1
    outer = {target: name for name, target in _outer_keys(spec).items()}  # (block, our name) -> HF name
    layer = "h" if spec.family == "gpt" else "layers"
    out: dict[str, torch.Tensor] = {}
    for i, sd in enumerate(blocks):
        for name, t in sd.items():
            if i == last and name == "lm_head.weight":
                key = _hf_lm_head(spec)
            elif 0 < i < last:
                key = f"{prefix}{layer}.{i - 1}.{name}"
                if spec.family == "gpt" and name in _CONV1D:
                    t = t.t()
            else:
                key = prefix + outer[(i, name)]
            out[key] = t.detach().contiguous()
    return out


# family -> (model_type, architecture) of the transformers class with the same layers
_HF_ARCH = {
    "gpt": ("gpt2", "GPT2LMHeadModel"),
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "opt": ("opt", "OPTForCausalLM"),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM"),
}


def hf_config(spec: ModelSpec) -> dict:
    """The ``config.json`` of the transformers model whose layers compute what tierflow's blocks compute: the
    executor's constants (norm eps 1e-5, rope theta 10000, no dropout) and no special-token ids. Raises
    :class:`ValueError` (one line) for a spec transformers' class for the family cannot express."""
    check_supported(spec)

    def no(why: str) -> ValueError:
        return ValueError(f"{spec.name}: cannot export to the Hugging Face layout: {why}")

    kind, arch = _HF_ARCH[spec.family]
    cfg: dict = {"architectures": [arch], "model_type": kind, "vocab_size": spec.vocab_size,
                 "tie_word_embeddings": spec.tied_embeddings, "torch_dtype": "float32",
                 "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    classic = spec.num_kv_heads == spec.num_heads and spec.q_dim == spec.hidden
    if spec.family in ("gpt", "opt", "gpt_neox") and not classic:
        raise no(f"{kind} has neither grouped-query attention nor a head_dim other than hidden / heads")
    if spec.family == "gpt":
        if spec.parallel_residual or not (spec.qkv_bias and spec.out_bias and spec.mlp_bias):
            raise no("GPT-2 layers have every bias and a sequential residual")
        cfg.update(n_embd=spec.hidden, n_layer=spec.num_layers, n_head=spec.num_heads,
                   n_inner=spec.ffn_hidden, n_positions=spec.max_positions, layer_norm_epsilon=LAYERNORM_EPS,
                   activation_function="relu" if spec.activation == "relu" else "gelu_new",
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return cfg
    if spec.family == "opt":
        if not (spec.qkv_bias == spec.out_bias == spec.mlp_bias):
            raise no("OPT's enable_bias switches every bias at once")
        cfg.update(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                   num_attention_heads=spec.num_heads, ffn_dim=spec.ffn_hidden,
                   max_position_embeddings=spec.max_positions, do_layer_norm_before=True,
                   word_embed_proj_dim=spec.hidden, enable_bias=spec.qkv_bias,
                   layer_norm_elementwise_affine=True,
                   activation_function="relu" if spec.activation == "relu" else "gelu",
                   dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
        return cfg
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if spec.family == "gpt_neox":
        if spec.qkv_bias != spec.out_bias or not spec.mlp_bias:
            raise no("GPT-NeoX's attention_bias covers query_key_value and dense together, and its MLP "
                     "has biases")
        rope["partial_rotary_factor"] = spec.rotary_fraction
        cfg.update(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                   num_attention_heads=spec.num_heads, intermediate_size=spec.ffn_hidden,
                   max_position_embeddings=spec.seq_len,
                   hidden_act="relu" if spec.activation == "relu" else "gelu", rope_parameters=rope,
                   rotary_pct=spec.rotary_fraction, rotary_emb_base=ROPE_THETA, layer_norm_eps=LAYERNORM_EPS,
                   use_parallel_residual=spec.parallel_residual, attention_bias=spec.qkv_bias,
                   hidden_dropout=0.0, attention_dropout=0.0)
        return cfg
    # the llama-like families
    if spec.family in ("qwen2", "qwen3") and spec.sliding_window:
        raise no("which Qwen layers slide (max_window_layers) is not kept in the model spec")
    biases = {"llama": None, "qwen3": None, "gemma": None, "mistral": (False, False, False),
              "qwen2": (True, False, False), "phi3": (False, False, False)}[spec.family]
    if biases is not None and (spec.qkv_bias, spec.out_bias, spec.mlp_bias) != biases:
        raise no(f"{kind} layers have biases {biases} (qkv, out, mlp)")
    if spec.family in ("qwen3", "gemma", "llama") and spec.qkv_bias != spec.out_bias:
        raise no(f"{kind}'s attention_bias covers q, k, v and o together")
    if spec.family != "llama" and spec.mlp_bias:
        raise no(f"{kind} has no MLP biases")
    cfg.update(hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden, num_hidden_layers=spec.num_layers,
               num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
               head_dim=spec.head_dim,
               max_position_embeddings=spec.seq_len, rms_norm_eps=RMSNORM_EPS, rope_parameters=rope,
               rope_theta=ROPE_THETA, attention_dropout=0.0,
               hidden_act="gelu_pytorch_tanh" if spec.activation == "geglu" else "silu")
    if spec.family in ("llama", "qwen3", "gemma"):
        cfg["attention_bias"] = spec.qkv_bias
    if spec.family == "llama":
        cfg["mlp_bias"] = spec.mlp_bias
    if spec.family in ("mistral", "phi3"):
        cfg["sliding_window"] = spec.sliding_window or None
    if spec.family in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if spec.family == "phi3":
        rope["partial_rotary_factor"] = spec.rotary_fraction
        cfg.update(partial_rotary_factor=spec.rotary_fraction, original_max_position_embeddings=spec.seq_len,
                   resid_pdrop=0.0, embd_pdrop=0.0)
    return cfg


def export_hf(spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]],
              directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (the tensors as given, e.g. fp32 master weights) into
    ``directory``, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Each file is written
    under a temporary name and renamed into place."""
    from safetensors.torch import save_file

    config = hf_config(spec)
    tensors = blocks_to_hf_state_dict(spec, blocks)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as any file this process creates (safetensors writes it owner-only)
    os.replace(tmp, out / "model.safetensors")
    tmp = out / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out


__all__ = [
    "INIT_STD",
    "LAYERNORM_EPS",
    "RMSNORM_EPS",
    "ROPE_THETA",
    "SUPPORTED_FAMILIES",
    "BlockModel",
    "Embedding",
    "GPTBlock",
    "Head",
    "LlamaBlock",
    "NeoXBlock",
    "OPTBlock",
    "RMSNorm",
    "blocks_to_hf_state_dict",
    "build_blocks",
    "check_supported",
    "check_block_state_dicts",
    "export_hf",
    "hf_config",
    "hf_key_target",
    "hf_state_dict_to_blocks",
    "init_weights",
    "loss",
    "param_count",
]
