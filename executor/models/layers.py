"""The layers every family shares: norms, attention, rotary positions, gated MLP activations, and the two
outer blocks, :class:`Embedding` and :class:`Head` (final norm + lm_head).

A tied lm_head owns no weight: :meth:`Head.forward` takes the embedding's weight as ``tied_weight``, so the
executor can stream the one copy to wherever the head runs. Family-specific choices (Gemma's norms and
embedding scale) are read from the family's registry entry (:mod:`tierflow.executor.models.registry`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.executor.models.lmloss import chunked_lm_loss, loss
from tierflow.executor.models.registry import get_block_family
from tierflow.planner.core.models import ModelSpec

LAYERNORM_EPS = 1e-5  # GPT-2 layer_norm_epsilon
RMSNORM_EPS = 1e-5  # LLaMA-2 / Mistral rms_norm_eps (transformers' LlamaConfig default is 1e-6)
ROPE_THETA = 10000.0  # LLaMA / LLaMA-2 rope_theta (Qwen2 checkpoints use 1e6: pass rope_theta=)
INIT_STD = 0.02  # GPT-2 initializer_range


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


def rms_norm(spec: ModelSpec, dim: int, eps: float, device=None, dtype=None) -> RMSNorm:
    """The RMSNorm of `spec`'s family (Gemma's scales by 1 + weight)."""
    cls = GemmaRMSNorm if get_block_family(spec.family).gemma_norms else RMSNorm
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


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, _ = x.shape
    return x.view(B, T, heads, -1).transpose(1, 2)  # (B, heads, T, head_dim)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def glu(gate: torch.Tensor, up: torch.Tensor, geglu: bool) -> torch.Tensor:
    """SwiGLU's silu(gate) * up, or GeGLU's (Gemma's gelu_pytorch_tanh) tanh GELU(gate) * up, keeping only
    gate and up for the backward (as a fused SwiGLU kernel does): autograd alone would also keep the gate's
    output, one more ffn-wide tensor per layer."""
    return save_inputs_only(_geglu if geglu else _swiglu, gate, up)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


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
        # Gemma scales by sqrt(hidden)
        self.scale = spec.hidden**0.5 if get_block_family(spec.family).gemma_norms else None

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
            self.norm = rms_norm(spec, spec.hidden, eps, device, dtype)
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


__all__ = ["INIT_STD", "LAYERNORM_EPS", "RMSNORM_EPS", "ROPE_THETA", "Embedding", "GemmaRMSNorm", "Head",
           "RMSNorm", "apply_rope", "causal_attention", "glu", "merge_heads", "rms_norm", "rope_cos_sin",
           "rotary_dims", "save_inputs_only", "split_heads"]
