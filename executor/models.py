"""PyTorch model code for the executor, built from a :class:`tierflow.planner.core.models.ModelSpec`, one module per block.

The executor runs a model *block by block* (embedding, each decoder layer, head) while it streams the weights
between GPU memory, CPU memory and NVMe, so the model is not one monolithic ``nn.Module``:
:func:`build_blocks` returns ``[Embedding, block_1, ..., block_L, Head]`` and the caller chains them.

* ``family="gpt"`` (GPT-2/GPT-3): :class:`GPTBlock`, pre-LN LayerNorm with bias, tanh-GELU (GPT-2's
  ``gelu_new``), learned positions (they live in :class:`Embedding`), biases as the spec says.
* ``family`` in ``llama``, ``mistral``, ``qwen2``: :class:`LlamaBlock`, RMSNorm, SwiGLU, rotary positions,
  grouped-query attention, biases only where the spec says (``qkv_bias`` for Qwen2). Mistral's sliding window
  is not modelled: it equals plain causal attention while ``seq_len <= sliding_window`` (4096 for Mistral-7B).
* ``opt`` and ``gpt_neox`` raise :class:`NotImplementedError` (see :func:`check_supported`).

Parameter names inside each block equal Hugging Face's (``self_attn.q_proj.weight``, ``attn.c_attn.weight``,
...) so :func:`hf_state_dict_to_blocks` is mostly prefix stripping; the parameter count of every block equals
the spec's (``embedding_params``, ``layer_params``, ``final_norm_params + head_params``).

A tied lm_head owns no weight: :meth:`Head.forward` takes the embedding's weight as ``tied_weight``, so the
executor can stream the one copy to wherever the head runs. :class:`BlockModel` chains the blocks for a plain
full forward; it is the PyTorch reference in correctness tests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tierflow.planner.core.models import ModelSpec

LAYERNORM_EPS = 1e-5  # GPT-2 layer_norm_epsilon
RMSNORM_EPS = 1e-5  # LLaMA-2 / Mistral rms_norm_eps (transformers' LlamaConfig default is 1e-6)
ROPE_THETA = 10000.0  # LLaMA / LLaMA-2 rope_theta (Qwen2 checkpoints use 1e6: pass rope_theta=)
INIT_STD = 0.02  # GPT-2 initializer_range

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED_FAMILIES = ("gpt", *LLAMA_LIKE)

_WHY_UNSUPPORTED = {
    "opt": "OPT needs post-LN layers, a position offset of 2 and project_in/out",
    "gpt_neox": "GPT-NeoX needs partial rotary embeddings and a per-head interleaved fused qkv",
}


def check_supported(spec: ModelSpec) -> None:
    """Raise :class:`NotImplementedError` (one line) if the executor cannot build ``spec``."""

    def no(what: str) -> NotImplementedError:
        return NotImplementedError(f"tierflow.executor.models: model {spec.name!r} (family {spec.family!r}): {what}")

    if spec.family not in SUPPORTED_FAMILIES:
        why = _WHY_UNSUPPORTED.get(spec.family, "unknown family")
        raise no(f"not supported yet ({why}); supported families: {', '.join(SUPPORTED_FAMILIES)}")
    if spec.family == "gpt" and (spec.norm, spec.activation) not in (
        ("layernorm", "gelu"),
        ("layernorm", "relu"),
    ):
        raise no(f"GPT blocks need layernorm with gelu or relu, got {spec.norm} with {spec.activation}")
    if spec.family in LLAMA_LIKE and (spec.norm, spec.activation) != ("rmsnorm", "swiglu"):
        raise no(f"LLaMA blocks need rmsnorm with swiglu, got {spec.norm} with {spec.activation}")
    if spec.embed_proj_dim or spec.position_offset or not spec.final_norm or not spec.norm_affine:
        raise no("OPT-only features (embed_proj_dim, position_offset, no final norm, non-affine norms)")
    if spec.family == "gpt" and not spec.max_positions:
        raise no("GPT blocks need a learned position table (max_positions > 0)")
    if not spec.lm_head:
        raise no("a model without an lm_head (a benchmark stand-in whose loss is on the hidden states) is simulated, "
                 "not trained")


# --------------------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """LLaMA RMSNorm, computed in float32 like transformers' ``LlamaRMSNorm``."""

    def __init__(self, dim: int, eps: float = RMSNORM_EPS, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over (B, heads, T, head_dim); k and v may have fewer (grouped-query) heads: kv head j serves
    query heads j*groups .. (j+1)*groups-1, as transformers' repeat_kv, but without repeating them (enable_gqa),
    so that autograd saves K and V at their own size, not groups times it."""
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
    """Rotate (B, heads, T, head_dim) by the tables (the "rotate half" layout of transformers' LLaMA)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, _ = x.shape
    return x.view(B, T, heads, -1).transpose(1, 2)  # (B, heads, T, head_dim)


def _merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


# --------------------------------------------------------------------------------------------------------------
# Embedding and head
# --------------------------------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token embedding ``wte`` (+ learned positions ``wpe`` for GPT). tokens (B, T) -> hidden (B, T, hidden)."""

    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden, device=device, dtype=dtype)
        self.wpe = (
            nn.Embedding(spec.max_positions, spec.hidden, device=device, dtype=dtype)
            if spec.max_positions
            else None
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            T = tokens.size(-1)
            if T > self.wpe.num_embeddings:
                raise ValueError(
                    f"sequence of {T} tokens exceeds the {self.wpe.num_embeddings} learned positions"
                )
            x = x + self.wpe(torch.arange(T, device=tokens.device))
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
            self.norm = RMSNorm(
                spec.hidden, eps=RMSNORM_EPS if norm_eps is None else norm_eps, device=device, dtype=dtype
            )
        self.lm_head = (
            None
            if self.tied
            else nn.Linear(spec.hidden, spec.vocab_size, bias=False, device=device, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.tied and tied_weight is None:
            raise ValueError(
                "this head is tied to the token embedding: pass tied_weight=embedding.wte.weight"
            )
        if not self.tied and tied_weight is not None:
            raise ValueError("this head has its own lm_head (untied embeddings): do not pass tied_weight")
        x = self.norm(x)
        return F.linear(x, tied_weight) if self.tied else self.lm_head(x)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(logits, targets)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32; targets equal to -100 are ignored (transformers' convention)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
    )


# --------------------------------------------------------------------------------------------------------------
# GPT-2 / GPT-3 block
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# LLaMA / Mistral / Qwen2 block
# --------------------------------------------------------------------------------------------------------------


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, *, rope_theta: float, device=None, dtype=None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.rope_theta = rope_theta
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(spec.hidden, spec.q_dim, bias=spec.qkv_bias, **kw)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, **kw)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.qkv_bias, **kw)
        self.o_proj = nn.Linear(spec.q_dim, spec.hidden, bias=spec.out_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = _split_heads(self.q_proj(x), self.heads)
        k = _split_heads(self.k_proj(x), self.kv_heads)
        v = _split_heads(self.v_proj(x), self.kv_heads)
        cos, sin = rope_cos_sin(x.size(1), self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(_merge_heads(causal_attention(q, k, v)))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": spec.mlp_bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, **kw)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


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
        self.parallel_residual = spec.parallel_residual
        self.input_layernorm = RMSNorm(spec.hidden, eps=eps, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(
            spec, rope_theta=ROPE_THETA if rope_theta is None else rope_theta, device=device, dtype=dtype
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden, eps=eps, device=device, dtype=dtype)
        self.mlp = LlamaMLP(spec, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + self.self_attn(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------------


def _make_blocks(
    spec: ModelSpec, device, norm_eps: float | None, rope_theta: float | None
) -> list[nn.Module]:
    """Uninitialised blocks (meant for ``device="meta"``)."""
    check_supported(spec)
    if spec.family == "gpt":
        layers = [GPTBlock(spec, norm_eps=norm_eps, device=device) for _ in range(spec.num_layers)]
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


# --------------------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# --------------------------------------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^(?:h|layers)\.(\d+)\.(.+)$")
# Non-parameter buffers that older checkpoints saved: GPT-2's causal mask, LLaMA's rotary table.
_IGNORED_KEY = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
# GPT-2 stores these as Conv1D, whose weight is (in, out): the transpose of nn.Linear's (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _outer_keys(spec: ModelSpec) -> dict[str, tuple[int, str]]:
    last = spec.num_layers + 1
    if spec.family == "gpt":  # HF name -> (block index, our name)
        return {
            "wte.weight": (0, "wte.weight"),
            "wpe.weight": (0, "wpe.weight"),
            "ln_f.weight": (last, "norm.weight"),
            "ln_f.bias": (last, "norm.bias"),
        }
    return {"embed_tokens.weight": (0, "wte.weight"), "norm.weight": (last, "norm.weight")}


def hf_key_target(spec: ModelSpec, key: str) -> tuple[int, str, bool] | None | bool:
    """Where a transformers checkpoint tensor goes: (block index, our parameter name, transpose it?), ``None``
    for tensors to skip (buffers, a tied lm_head), ``False`` for a key this model does not have."""
    gpt = spec.family == "gpt"
    last = spec.num_layers + 1
    if _IGNORED_KEY.search(key):
        return None
    if key == "lm_head.weight":
        return None if spec.tied_embeddings else (last, "lm_head.weight", False)
    name = key.removeprefix("transformer." if gpt else "model.")
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
    """Names and shapes of per-block state dicts against the blocks we would build (meta device: no memory)."""
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

    Accepts ``LlamaForCausalLM``/``MistralForCausalLM``/``Qwen2ForCausalLM`` (``model.`` prefix optional) and
    ``GPT2LMHeadModel`` (``transformer.`` prefix optional, as in the original GPT-2 checkpoints). GPT-2 Conv1D
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
    "RMSNorm",
    "build_blocks",
    "check_supported",
    "check_block_state_dicts",
    "hf_key_target",
    "hf_state_dict_to_blocks",
    "init_weights",
    "loss",
    "param_count",
]
