"""What one block of a model costs per micro-batch: FLOPs, GEMM shapes, bytes of state and activations.

A model is split into *blocks*: the embedding, one block per decoder layer, and the head (final norm + lm_head
+ loss). Every figure here is exact arithmetic on the model's shape; nothing depends on hardware.

Conventions (see docs/planning.md, "FLOP conventions"):
- model FLOPs per token = 6 * P_matmul + 12 * layers * q_dim * seq (attention, causal mask not discounted);
- hardware FLOPs add the recompute forward pass (another 2 * P_matmul + 4 * layers * q_dim * seq per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierflow.planner.core.models import ModelSpec

COMPUTE_BYTES = 2  # bf16/fp16 weights, activations and gradients on the GPU
MASTER_BYTES = 4  # fp32 master copy of the weights
ADAM_STATE_BYTES = 4  # each of Adam m and v, fp32
GRAD_ACCUM_BYTES = 4  # fp32 gradient accumulation buffer (on whichever side accumulates)
GRAD_WIRE_BYTES = 2  # gradients cross PCIe in the compute dtype


@dataclass(frozen=True)
class Gemm:
    """One matrix product of an (m x k) by a (k x n) operand, counted once per forward pass."""

    m: int
    n: int
    k: int
    count: int = 1  # how many identical GEMMs (e.g. batched attention heads)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def bytes(self) -> float:
        return float(COMPUTE_BYTES * (self.m * self.k + self.k * self.n + self.m * self.n) * self.count)


@dataclass(frozen=True)
class BlockCost:
    """Per-micro-batch work of one block. FLOPs are model FLOPs (the convention above)."""

    name: str
    kind: str  # "embed" | "layer" | "head"
    owned_params: int  # parameters this block's optimizer step updates
    fetch_params: int  # parameters that must be on the GPU to run it (tied head: + the embedding matrix)
    fwd_gemms: tuple[Gemm, ...]  # GEMMs of one forward pass (backward runs two of each shape)
    attn_fwd_flops: float  # attention score + value FLOPs of one forward pass (causal mask not discounted)
    fwd_elementwise_bytes: float  # HBM traffic of the non-GEMM kernels of one forward pass
    checkpoint_bytes: int  # the layer's input activation, kept between forward and backward
    full_activation_bytes: int  # everything backward needs when the layer is NOT recomputed
    fwd_working_bytes: int  # transient GPU memory of a forward pass (no activations saved)
    bwd_working_bytes: int  # transient GPU memory of recompute + backward, incl. the layer's activations
    tokens: int = 0
    extras: dict = field(default_factory=dict)
    # the part of fwd_elementwise_bytes that the MLP's activation function (GELU, SiLU x gate, ReLU) reads and
    # writes: a transcendental per element, which a CPU computes far below its memory bandwidth
    # (gpu.activation_gbps)
    fwd_activation_bytes: float = 0.0

    @property
    def fwd_flops(self) -> float:
        return sum(g.flops for g in self.fwd_gemms) + self.attn_fwd_flops

    @property
    def bwd_flops(self) -> float:
        return 2.0 * self.fwd_flops

    @property
    def weight_bytes(self) -> int:
        return COMPUTE_BYTES * self.fetch_params


def layer_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    """One decoder layer for a micro-batch of `micro_batch` sequences of length `seq`."""
    t = micro_batch * seq
    h, f, q, kv = model.hidden, model.ffn_hidden, model.q_dim, model.kv_dim
    gemms = [Gemm(t, q + 2 * kv, h), Gemm(t, h, q)]
    gemms += [Gemm(t, 2 * f, h), Gemm(t, h, f)] if model.gated_mlp else [Gemm(t, f, h), Gemm(t, h, f)]
    attn = 4.0 * micro_batch * seq * seq * q
    # non-GEMM kernels, in elements read + written per token: 2 norms (r+w of h each), 2 residual adds (2r+w),
    # bias/rotary on q,k (r+w), activation (gelu: r+w of f; swiglu: 2r+w of f), attention output r+w.
    act_elems = 3 * f if model.gated_mlp else 2 * f
    elementwise = COMPUTE_BYTES * t * (4 * h + 6 * h + 2 * (q + kv) + act_elems + 2 * q)
    ckpt = COMPUTE_BYTES * t * h
    full_act = (COMPUTE_BYTES * t * saved_elements_per_token(model)
                + saved_stats_bytes(model, micro_batch, seq))
    fwd_work = COMPUTE_BYTES * t * (3 * h + q + 2 * kv + (2 * f if model.gated_mlp else f))
    # backward: the recomputed activations + gradient temporaries (dX, d of the widest intermediate)
    # + the layer's bf16 weight gradient before it is accumulated.
    bwd_work = (full_act + COMPUTE_BYTES * t * (2 * h + (2 * f if model.gated_mlp else f))
                + COMPUTE_BYTES * model.layer_params())
    return BlockCost(
        name="layer",
        kind="layer",
        owned_params=model.layer_params(),
        fetch_params=model.layer_params(),
        fwd_gemms=tuple(gemms),
        attn_fwd_flops=attn,
        fwd_elementwise_bytes=float(elementwise),
        fwd_activation_bytes=float(COMPUTE_BYTES * t * act_elems),
        checkpoint_bytes=ckpt,
        full_activation_bytes=full_act,
        fwd_working_bytes=fwd_work,
        bwd_working_bytes=bwd_work,
        tokens=t,
    )


def saved_elements_per_token(model: ModelSpec) -> int:
    """Elements per token (compute dtype) one decoder layer saves for its backward when it is not recomputed,
    as the executor's layers save them (tests/test_saved_activations.py compares the two): the first norm's
    input (the layer input), the qkv input, q, k, v after rotary (attention saves them at their own size with
    GQA), the attention output (the output projection's input is a view of it), the second norm's input, the
    MLP input, and the MLP's inner tensors: GELU keeps its input and the down projection its output (2 ffn);
    SwiGLU / GeGLU keep the gate and up projections and the down projection's input (3 ffn: the gate is
    recomputed in backward, as a fused SwiGLU kernel does); ReLU only its output (its backward reads the
    output, which the down projection saves too). RMSNorm keeps only its input (executor.models.RMSNorm, as a
    fused kernel), rotary positions only their tables (executor.models._Rope). A parallel-residual layer
    normalises one input twice (saved once); a Qwen3 layer's q/k norms keep q and k before them."""
    h, f, q, kv = model.hidden, model.ffn_hidden, model.q_dim, model.kv_dim
    norms = h if model.parallel_residual else 2 * h
    mlp = 3 * f if model.gated_mlp else f if model.activation == "relu" else 2 * f
    qk_norm = q + kv if model.qk_norm else 0
    return norms + h + q + 2 * kv + q + qk_norm + h + mlp


def saved_stats_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """The small tensors a layer saves besides saved_elements_per_token: attention's softmax statistics (fp32
    per query head and token), LayerNorm's mean and rstd (fp32 per token, two norms: a CUDA kernel's; a CPU
    one keeps them in the input's dtype), the rotary tables cos and sin (seq x rotary dims, compute dtype)."""
    t = micro_batch * seq
    out = 4 * micro_batch * model.num_heads * seq
    if model.norm == "layernorm":
        out += 2 * 2 * 4 * t
    if not model.max_positions:  # rotary positions
        out += 2 * COMPUTE_BYTES * seq * int(model.head_dim * model.rotary_fraction)
    return out


def embed_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    t = micro_batch * seq
    gemms = (Gemm(t, model.hidden, model.embed_proj_dim),) if model.embed_proj_dim else ()
    # a gather of t rows (+ position rows) and the sum
    elementwise = COMPUTE_BYTES * t * model.hidden * 4
    out = COMPUTE_BYTES * t * model.hidden
    return BlockCost(
        name="embed",
        kind="embed",
        owned_params=model.embedding_params(),
        fetch_params=model.embedding_params(),
        fwd_gemms=gemms,
        attn_fwd_flops=0.0,
        fwd_elementwise_bytes=float(elementwise),
        checkpoint_bytes=0,
        full_activation_bytes=0,
        fwd_working_bytes=2 * out,
        bwd_working_bytes=2 * out + GRAD_WIRE_BYTES * model.embedding_params(),
        tokens=t,
    )


def head_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    """Final norm + lm_head + softmax cross-entropy. A tied head also needs the embedding matrix. Without an
    lm_head (`model.lm_head` False) only the final norm and a loss on the hidden states remain."""
    t = micro_batch * seq
    vocab = model.vocab_size if model.lm_head else 0
    tied = vocab * model.embed_dim if model.tied_embeddings else 0
    gemms = [Gemm(t, vocab, model.embed_dim)] if vocab else []
    if model.embed_proj_dim:
        gemms.append(Gemm(t, model.embed_proj_dim, model.hidden))
    owned = model.final_norm_params() + model.head_params()
    # logits in fp32 for the loss: written, read by softmax, gradient written
    logits = 4 * t * vocab
    elementwise = COMPUTE_BYTES * t * model.hidden * (2 if vocab else 5) + 3 * logits
    return BlockCost(
        name="head",
        kind="head",
        owned_params=owned,
        fetch_params=owned + tied,
        fwd_gemms=tuple(gemms),
        attn_fwd_flops=0.0,
        fwd_elementwise_bytes=float(elementwise),
        checkpoint_bytes=COMPUTE_BYTES * t * model.hidden,
        full_activation_bytes=COMPUTE_BYTES * t * model.hidden * 2,
        fwd_working_bytes=logits + COMPUTE_BYTES * t * max(vocab, model.hidden),
        bwd_working_bytes=(2 * logits + COMPUTE_BYTES * t * max(vocab, 2 * model.hidden)
                           + GRAD_WIRE_BYTES * (owned + tied)),
        tokens=t,
    )


def model_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Training FLOPs per token without recompute: 6 * matmul params + 12 * L * q_dim * seq (fwd + bwd)."""
    matmul = (model.num_layers * model.layer_matmul_params()
              + (model.vocab_size * model.embed_dim if model.lm_head else 0))
    if model.embed_proj_dim:
        matmul += 2 * model.embed_proj_dim * model.hidden
    return 6.0 * matmul + 12.0 * model.num_layers * model.q_dim * seq


def recompute_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Extra FLOPs per token of recomputing every layer's forward in backward."""
    return 2.0 * model.num_layers * model.layer_matmul_params() + 4.0 * model.num_layers * model.q_dim * seq


def state_bytes_per_param() -> dict[str, int]:
    """Bytes per parameter of each tensor class of mixed-precision Adam."""
    return {
        "weights": COMPUTE_BYTES,
        "master": MASTER_BYTES,
        "adam_m": ADAM_STATE_BYTES,
        "adam_v": ADAM_STATE_BYTES,
        "grads": GRAD_ACCUM_BYTES,
    }
