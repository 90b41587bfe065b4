"""What one block of a model costs per micro-batch: FLOPs, GEMM shapes, bytes of state and activations.

A model is split into *blocks*: the embedding, one block per decoder layer, and the head (final norm + lm_head
+ loss). Every figure here is exact arithmetic on the model's shape; nothing depends on hardware.

Conventions (see docs/planning.md, "FLOP conventions"):
- model FLOPs per token = 6 * P_matmul + 12 * layers * q_dim * seq (attention, causal mask not discounted);
- hardware FLOPs add the recompute forward pass (another 2 * P_matmul + 4 * layers * q_dim * seq per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tierflow.planner.core.lora import adapter_input_elements, target_shapes
from tierflow.planner.core.models import ModelSpec, get_family
from tierflow.planner.core.optstates import DEFAULT_STATE_FORMAT, state_format

COMPUTE_BYTES = 2  # bf16/fp16 weights, activations and gradients on the GPU (the default precision's)
MASTER_BYTES = 4  # fp32 master copy of the weights
ADAM_STATE_BYTES = 4  # each of Adam m and v, fp32
GRAD_ACCUM_BYTES = 4  # fp32 gradient accumulation buffer (on whichever side accumulates)
GRAD_WIRE_BYTES = 2  # gradients cross PCIe in the compute dtype
# The executor's cross-entropy runs over chunks of tokens whose fp32 logits fit in this many bytes
# (executor.models.chunked_lm_loss; loss_chunk_tokens): the loss's memory is one chunk's logits, not the
# micro-batch's. 64 MiB keeps a chunk's logits GEMM large (GPT-2's vocabulary: 333 tokens x 50,257 x hidden)
LOSS_CHUNK_LOGIT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Precision:
    """The training precision: the bytes of each tensor class and which GEMM peak of the profile applies
    (`gemm_peak`: the profile field, tierflow.planner.core.costmodel). 16-bit mixed precision computes, stores
    activations and moves weights and gradients in 2 bytes; fp32 (and tf32: fp32 tensors, TF32 tensor-core
    GEMMs, PyTorch's `allow_tf32`) in 4. These keep an fp32 master copy beside the weights, as DeepSpeed's
    ZeRO optimizers do (stage 1/2 `single_partition_of_fp32_groups`, stage_1_and_2.py:400-401, and stage 3
    `_create_fp32_partitions`, stage3.py:901-905, DeepSpeed 0.16.5: `.clone().float()` of the model's
    partitions even when they are fp32), and fp32 Adam moments and gradient accumulation.

    `in_place` (fp32-inplace, tf32-inplace): fp32 as plain PyTorch, Megatron-LM (its FP32Optimizer without
    fp16/bf16) and DeepSpeed without ZeRO train it (engine.py:1346, _do_optimizer_sanity_check: no wrapper
    for fp32; engine.py:1398 `self.optimizer = basic_optimizer`): the optimizer steps the weights themselves.
    Where it runs beside them on the GPU there is no master copy and no copy into the compute weights after
    the step (`master_bytes_at`); an optimizer off the GPU keeps its own fp32 copy on the host, as every
    offloading framework must."""

    name: str
    compute_bytes: int  # weights, activations, gradients on the GPU and on the wire
    gemm_peak: str  # the profile's gpu field with this precision's GEMM peak
    master_bytes: float = MASTER_BYTES
    adam_state_bytes: float = ADAM_STATE_BYTES  # each of m and v (8-bit: block scales included)
    grad_accum_bytes: int = GRAD_ACCUM_BYTES
    in_place: bool = False
    optimizer_states: str = DEFAULT_STATE_FORMAT  # the format of master and moments (optstates)

    def with_states(self, states: str | None) -> Precision:
        """This precision with its optimizer states in format `states` (optstates.state_format: the one
        place that says how many bytes the master copy and the moments take)."""
        f = state_format(states, self.master_bytes)
        if f.name == self.optimizer_states:
            return self
        return replace(self, master_bytes=f.master_bytes, adam_state_bytes=f.moment_bytes,
                       optimizer_states=f.name)

    def master_bytes_at(self, gpu_optimizer: bool) -> float:
        """Bytes per parameter of the master copy for a placement whose optimizer runs on the GPU or not: none
        where an in-place precision's optimizer steps the GPU's weights themselves."""
        return 0 if self.in_place and gpu_optimizer else self.master_bytes

    @property
    def state_traffic_saved_bytes(self) -> float:
        """Bytes per parameter an optimizer step moves less than with fp32 states: the master and both
        moments are each read and written once."""
        return 2 * (MASTER_BYTES - self.master_bytes) + 2 * 2 * (ADAM_STATE_BYTES - self.adam_state_bytes)

    @property
    def grad_wire_bytes(self) -> int:
        """Gradients leave the GPU in the compute dtype."""
        return self.compute_bytes

    @property
    def state_bytes(self) -> float:
        """Master copy + Adam m + v, per parameter."""
        return self.master_bytes + 2 * self.adam_state_bytes


PRECISIONS = {
    "bf16": Precision("bf16", COMPUTE_BYTES, "peak_tflops"),
    "fp16": Precision("fp16", COMPUTE_BYTES, "peak_tflops"),
    "fp32": Precision("fp32", 4, "fp32_tflops"),
    "tf32": Precision("tf32", 4, "tf32_tflops"),
    "fp32-inplace": Precision("fp32-inplace", 4, "fp32_tflops", in_place=True),
    "tf32-inplace": Precision("tf32-inplace", 4, "tf32_tflops", in_place=True),
}
DEFAULT_PRECISION = "bf16"


def precision_of(model: ModelSpec) -> Precision:
    """The precision `model` is trained in (ModelSpec.precision; None: the default, bf16), with its optimizer
    states in the model's format (ModelSpec.optimizer_states)."""
    pr = PRECISIONS[model.precision or DEFAULT_PRECISION]
    return pr if model.optimizer_states is None else pr.with_states(model.optimizer_states)


@dataclass(frozen=True)
class Gemm:
    """One matrix product of an (m x k) by a (k x n) operand, counted once per forward pass."""

    m: int
    n: int
    k: int
    count: int = 1  # how many identical GEMMs (e.g. batched attention heads)
    elem_bytes: int = COMPUTE_BYTES  # bytes of one operand element (the precision's compute dtype)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def bytes(self) -> float:
        return float(self.elem_bytes * (self.m * self.k + self.k * self.n + self.m * self.n) * self.count)


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
    precision: Precision = PRECISIONS[DEFAULT_PRECISION]
    # LoRA (ModelSpec.lora): the block's own weights are frozen: its gradient is only its adapters'
    # (owned_params, none in the embedding and head), and the first `frozen_gemms` of fwd_gemms (the base's)
    # run one GEMM in the backward (the input gradient) instead of two
    frozen: bool = False
    frozen_gemms: int = 0

    @property
    def fwd_flops(self) -> float:
        return sum(g.flops for g in self.fwd_gemms) + self.attn_fwd_flops

    @property
    def bwd_flops(self) -> float:
        """Two GEMMs per forward GEMM (input and weight gradient), one for a frozen weight's."""
        return 2.0 * self.fwd_flops - sum(g.flops for g in self.fwd_gemms[:self.frozen_gemms])

    @property
    def grad_params(self) -> int:
        """Elements of the block's weight gradient: every fetched parameter (a tied head's too), or under
        LoRA only the adapters'."""
        return self.owned_params if self.frozen else self.fetch_params

    @property
    def weight_bytes(self) -> int:
        return self.precision.compute_bytes * self.fetch_params


def layer_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    """One decoder layer for a micro-batch of `micro_batch` sequences of length `seq`."""
    pr = precision_of(model)
    cb = pr.compute_bytes
    t = micro_batch * seq
    h, f, q, kv = model.hidden, model.ffn_hidden, model.q_dim, model.kv_dim
    gemms = [Gemm(t, q + 2 * kv, h, elem_bytes=cb), Gemm(t, h, q, elem_bytes=cb)]
    gemms += ([Gemm(t, 2 * f, h, elem_bytes=cb), Gemm(t, h, f, elem_bytes=cb)] if model.gated_mlp
              else [Gemm(t, f, h, elem_bytes=cb), Gemm(t, h, f, elem_bytes=cb)])
    frozen = len(gemms) if model.lora is not None else 0
    adapter_elementwise = 0
    if model.lora is not None:  # each adapter: x A (t x rank), then (x A) B (t x out), scaled and added
        r = model.lora.rank
        for _, n_in, n_out in target_shapes(model, model.lora):
            gemms += [Gemm(t, r, n_in, elem_bytes=cb), Gemm(t, n_out, r, elem_bytes=cb)]
            # the scaling folded into B, the sum made by the second GEMM (addmm, beta 1: executor/models/
            # lora.py): beyond its GEMM's bytes it reads the base's output once
            adapter_elementwise += n_out
        adapter_elementwise += 2 * adapter_input_elements(model, model.lora)  # dropout's masked copy
    attn = 4.0 * micro_batch * seq * seq * q
    # non-GEMM kernels, in elements read + written per token: 2 norms (r+w of h each), 2 residual adds (2r+w),
    # bias/rotary on q,k (r+w), activation (gelu: r+w of f; swiglu: 2r+w of f), attention output r+w.
    act_elems = 3 * f if model.gated_mlp else 2 * f
    elementwise = cb * t * (4 * h + 6 * h + 2 * (q + kv) + act_elems + 2 * q + adapter_elementwise)
    ckpt = cb * t * h
    full_act = cb * t * saved_elements_per_token(model) + saved_stats_bytes(model, micro_batch, seq)
    fwd_work = layer_fwd_working_bytes(model, micro_batch, seq)
    bwd_work = full_act + layer_bwd_transient_bytes(model, micro_batch, seq)
    return BlockCost(
        name="layer",
        kind="layer",
        owned_params=model.layer_params() if model.lora is None else model.layer_adapter_params(),
        fetch_params=model.layer_params(),
        fwd_gemms=tuple(gemms),
        frozen=model.lora is not None,
        frozen_gemms=frozen,
        attn_fwd_flops=attn,
        fwd_elementwise_bytes=float(elementwise),
        fwd_activation_bytes=float(cb * t * act_elems),
        checkpoint_bytes=ckpt,
        full_activation_bytes=full_act,
        fwd_working_bytes=fwd_work,
        bwd_working_bytes=bwd_work,
        tokens=t,
        precision=pr,
        # per token, what an unfused framework runs as separate ops (compute.unfused_extra_bytes)
        extras={"norm": model.norm, "rmsnorm_elems": (h if model.parallel_residual else 2 * h),
                "rotary_elems": 0 if model.max_positions else q + kv,
                "kv_repeat_elems": q + kv if kv < q else 0,
                "gated_ffn_elems": f if model.gated_mlp else 0},
    )


def mlp_forward_elements(model: ModelSpec) -> int:
    """Elements per token a decoder layer's MLP holds at once in a forward without autograd (a recomputed
    layer's, executor.models GPTMLP / LlamaMLP under no_grad): a gated MLP the gate and up projections, the
    gate's activation and the product (4 ffn); GELU / ReLU the up projection and the activation's output
    (2 ffn)."""
    return (4 if model.gated_mlp else 2) * model.ffn_hidden


def attention_forward_elements(model: ModelSpec) -> int:
    """Elements per token attention holds at once in a forward without autograd: the q, k, v projections and
    their split-head or rotary copies (2 (q + 2 kv)), attention's output and its merged-heads copy (2 q)."""
    return 2 * (model.q_dim + 2 * model.kv_dim) + 2 * model.q_dim


def layer_fwd_working_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """Peak bytes a decoder layer's forward allocates when nothing is kept for a backward (ComputeOps.fwd of
    a recomputed layer; its output included): the residual stream and the norm's output (2 hidden) beside the
    wider of the MLP (mlp_forward_elements) and attention (attention_forward_elements); a parallel-residual
    layer keeps attention's output (hidden) while its MLP runs; attention's fp32 log-sum-exp per query head
    and token. Measured against the executor's own op code: experiments/device_memory.py."""
    cb = precision_of(model).compute_bytes
    t = micro_batch * seq
    h = model.hidden
    widest = max(mlp_forward_elements(model), attention_forward_elements(model))
    return cb * t * (2 * h + (h if model.parallel_residual else 0) + widest) + 4 * t * model.num_heads


def mlp_backward_elements(model: ModelSpec) -> int:
    """Elements per token an MLP's backward creates beside its saved activations: a gated MLP (whose fused
    activation keeps only its inputs, executor.models._SaveInputs) recomputes the gate's activation and the
    product, then the gradients of the product, of up and of the gate's activation (5 ffn); GELU / ReLU the
    gradients of the activation's output and of its input (2 ffn)."""
    return (5 if model.gated_mlp else 2) * model.ffn_hidden


def attention_backward_bytes(model: ModelSpec, tokens: int) -> int:
    """Bytes attention's backward creates beside its saved activations: dq, dk, dv and their concatenation
    for the fused projection's backward (or the rotary backward's copies): 2 (q + 2 kv) elements per token in
    the compute dtype; and what a CUDA flash-attention backward allocates inside its kernel
    (FlashAttention-2's mha_bwd, vendored by PyTorch: aten/src/ATen/native/transformers/cuda/flash_attn/
    flash_api.cpp): dq accumulated in fp32 (4 q bytes per token), softmax_d (fp32 per query head and token)
    and, with grouped-query attention, dk and dv expanded to every query head (2 q elements per token)."""
    cb = precision_of(model).compute_bytes
    q, kv = model.q_dim, model.kv_dim
    gqa = 2 * cb * q if kv < q else 0
    return tokens * (cb * 2 * (q + 2 * kv) + 4 * q + 4 * model.num_heads + gqa)


def layer_bwd_transient_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """Peak bytes a decoder layer's backward allocates beyond its saved activations (which the caller adds
    for a recomputed layer): every weight gradient in the compute dtype (the autograd leaves' .grad, until
    GradBuffers adds them into the fp32 buffer), the input gradient and the recomputed output (2 hidden), and
    the widest of the phases that follow one another: the MLP's backward (mlp_backward_elements), attention's
    (attention_backward_bytes) and a norm's (norm_backward_bytes). Measured against the executor's own op
    code: experiments/device_memory.py."""
    cb = precision_of(model).compute_bytes
    t = micro_batch * seq
    widest = max(cb * t * mlp_backward_elements(model), attention_backward_bytes(model, t),
                 norm_backward_bytes(model, t))
    grads = model.layer_params() if model.lora is None else model.layer_adapter_params()
    return cb * grads + cb * t * 2 * model.hidden + widest


def saved_elements_per_token(model: ModelSpec) -> int:
    """Elements per token (compute dtype) one decoder layer saves for its backward when it is not recomputed,
    as the executor's layers save them (tests/planner/core/test_saved_activations.py compares the two): the
    first norm's input (the layer input), the qkv input, q, k, v after rotary (attention saves them at their
    own size with GQA), the attention output (the output projection's input is a view of it), the second
    norm's input, the MLP input, and the MLP's inner tensors: GELU keeps its input and the down projection its
    output (2 ffn); SwiGLU / GeGLU keep the gate and up projections and the down projection's input (3 ffn:
    the gate is recomputed in backward, as a fused SwiGLU kernel does); ReLU only its output (its backward
    reads the output, which the down projection saves too). RMSNorm keeps only its input
    (executor.models.RMSNorm, as a fused kernel), rotary positions only their tables (executor.models._Rope).
    A parallel-residual layer normalises one input twice (saved once); a Qwen3 layer's q/k norms keep q and k
    before them."""
    h, f, q, kv = model.hidden, model.ffn_hidden, model.q_dim, model.kv_dim
    norms = h if model.parallel_residual else 2 * h
    mlp = 3 * f if model.gated_mlp else f if model.activation == "relu" else 2 * f
    qk_norm = q + kv if model.qk_norm else 0
    adapters = 0
    if model.lora is not None:  # each adapter's x A (rank), and its dropout's output where it drops
        adapters = len(target_shapes(model, model.lora)) * model.lora.rank \
            + adapter_input_elements(model, model.lora)
    return norms + h + q + 2 * kv + q + qk_norm + h + mlp + adapters


def saved_stats_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """The small tensors a layer saves besides saved_elements_per_token: attention's softmax statistics (fp32
    per query head and token), LayerNorm's mean and rstd (fp32 per token, two norms: a CUDA kernel's; a CPU
    one keeps them in the input's dtype), the rotary tables cos and sin (seq x rotary dims, compute dtype)."""
    t = micro_batch * seq
    out = 4 * micro_batch * model.num_heads * seq
    if model.norm == "layernorm":
        out += 2 * 2 * 4 * t
    if not model.max_positions:  # rotary positions
        out += 2 * precision_of(model).compute_bytes * seq * int(model.head_dim * model.rotary_fraction)
    return out


def embed_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    pr = precision_of(model)
    cb = pr.compute_bytes
    t = micro_batch * seq
    gemms = (Gemm(t, model.hidden, model.embed_proj_dim, elem_bytes=cb),) if model.embed_proj_dim else ()
    # a gather of t rows (+ position rows) and the sum
    elementwise = cb * t * model.hidden * 4
    return BlockCost(
        name="embed",
        kind="embed",
        owned_params=model.embedding_params() if model.lora is None else 0,
        fetch_params=model.embedding_params(),
        fwd_gemms=gemms,
        frozen=model.lora is not None,
        frozen_gemms=len(gemms) if model.lora is not None else 0,
        attn_fwd_flops=0.0,
        fwd_elementwise_bytes=float(elementwise),
        checkpoint_bytes=0,
        full_activation_bytes=0,
        fwd_working_bytes=embed_fwd_working_bytes(model, micro_batch, seq),
        bwd_working_bytes=embed_bwd_working_bytes(model, micro_batch, seq),
        tokens=t,
        precision=pr,
    )


def loss_chunk_tokens(vocab: int, tokens: int) -> int:
    """Tokens per chunk of the chunked cross-entropy (executor.models.chunked_lm_loss): as many as keep one
    chunk's fp32 logits within LOSS_CHUNK_LOGIT_BYTES, at least one, at most the micro-batch's tokens."""
    return max(1, min(tokens, LOSS_CHUNK_LOGIT_BYTES // (4 * max(vocab, 1))))


def loss_working_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """Peak bytes of the head's loss as the executor computes it (executor.models.chunked_lm_loss): the
    gradient of the normalised hidden states (tokens x hidden, compute dtype), the chunks' logits
    (loss_chunk_logits_bytes), each chunk's per-token vectors (LOSS_CHUNK_VECTOR_BYTES) and the mask of the
    targets that count. The weight
    gradient is counted with the head's working bytes (head_cost)."""
    cb = precision_of(model).compute_bytes
    t = micro_batch * seq
    vocab = model.vocab_size if model.lm_head else 0
    if not vocab:
        return 0
    c = loss_chunk_tokens(vocab, t)
    counted = t  # the mask of the targets that count (bool per token), for their number
    return (cb * t * model.embed_dim + loss_chunk_logits_bytes(vocab, t, cb) + LOSS_CHUNK_VECTOR_BYTES * c
            + counted)


# a chunk's per-token vectors in chunked_lm_loss: log-sum-exp (fp32), the row indices and the clamped targets
# (int64, twice), the picked logits and their difference and masked product (fp32), the ignore mask (bool)
LOSS_CHUNK_VECTOR_BYTES = 4 + 8 + 8 + 8 + 4 + 4 + 4 + 1


def loss_chunk_logits_bytes(vocab: int, tokens: int, compute_bytes: int) -> int:
    """The peak of the chunks' logits in chunked_lm_loss, chunks of c tokens (loss_chunk_tokens): a chunk's
    fp32 logits beside the fp32 temporary torch.logsumexp makes of them (ATen's logsumexp_out_impl
    materialises self - max before its exp and sum: 8 bytes per logit; the compute-dtype logits before
    their cast and the softmax gradient cast back hold less, 4 + compute bytes); from the second chunk on,
    the previous chunk's gradient in the compute dtype is still bound (to `g`) while the next chunk's logits
    are made."""
    c = loss_chunk_tokens(vocab, tokens)
    first = min(c, tokens)
    second = min(c, tokens - c) if tokens > c else 0
    per_logit = 4 + max(4, compute_bytes)  # fp32 logits + logsumexp's temporary (or the cast)
    peak = per_logit * first * vocab
    if second:
        peak = max(peak, compute_bytes * c * vocab + per_logit * second * vocab)
    return peak


def embed_fwd_working_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """Peak bytes of the embedding's forward (executor.models.Embedding): the token rows; with learned
    positions the position rows (seq x hidden), their int64 indices (arange, + offset) and the sum; with
    Gemma's scaling its scaled copy."""
    cb = precision_of(model).compute_bytes
    t = micro_batch * seq
    h = model.hidden
    out = cb * t * h
    if model.max_positions:
        return 2 * out + cb * seq * h + 2 * 8 * seq
    return 2 * out if get_family(model.family).scaled_embedding else out


def embed_bwd_working_bytes(model: ModelSpec, micro_batch: int, seq: int) -> int:
    """Peak bytes of the embedding's backward as the executor runs it (ComputeOps._embedding_grads): an fp32
    gradient per embedding matrix, all alive until they are added into the gradient buffer; the fp32 copy of
    the output gradient that index_add_ reads (learned positions: that copy and its sum over the batch,
    seq x hidden fp32); Gemma's scaled copy of the output gradient."""
    cb = precision_of(model).compute_bytes
    t = micro_batch * seq
    h = model.hidden
    grads = model.embedding_params() if model.lora is None else 0  # LoRA: a frozen embedding
    out = 4 * grads + 4 * t * h
    if model.max_positions:
        out += 4 * seq * h
    if get_family(model.family).scaled_embedding:
        out += cb * t * h
    return out


def head_cost(model: ModelSpec, micro_batch: int, seq: int) -> BlockCost:
    """Final norm + lm_head + softmax cross-entropy. A tied head also needs the embedding matrix. Without an
    lm_head (`model.lm_head` False) only the final norm and a loss on the hidden states remain. The loss is
    the executor's chunked cross-entropy (loss_working_bytes): the full logits never exist at once."""
    pr = precision_of(model)
    cb = pr.compute_bytes
    t = micro_batch * seq
    vocab = model.vocab_size if model.lm_head else 0
    tied = vocab * model.embed_dim if model.tied_embeddings else 0
    gemms = [Gemm(t, vocab, model.embed_dim, elem_bytes=cb)] if vocab else []
    if model.embed_proj_dim:
        gemms.append(Gemm(t, model.embed_proj_dim, model.hidden, elem_bytes=cb))
    owned = model.final_norm_params() + model.head_params()
    fetched = owned + tied
    lora = model.lora is not None
    if lora:  # LoRA: a frozen head (its input gradient only)
        owned = tied = 0
    # HBM traffic of the loss: logits in fp32 written, read by softmax, gradient written
    logits = 4 * t * vocab
    elementwise = cb * t * model.hidden * (2 if vocab else 5) + 3 * logits
    # held while the head's forward and backward run (one task): the weight gradient throughout; first the
    # normalised hidden states and the loss's working bytes (their gradient and one chunk), then that gradient
    # and the final norm's backward; a LayerNorm's mean and rstd (fp32 per token on CUDA) with its output
    hidden = cb * t * max(model.hidden, model.embed_dim) + (2 * 4 * t if model.norm == "layernorm" else 0)
    loss = loss_working_bytes(model, micro_batch, seq)
    work = hidden + loss
    dx_loss = cb * t * model.embed_dim if vocab else 0
    return BlockCost(
        name="head",
        kind="head",
        owned_params=owned,
        fetch_params=fetched,
        fwd_gemms=tuple(gemms),
        frozen=lora,
        frozen_gemms=len(gemms) if lora else 0,
        attn_fwd_flops=0.0,
        fwd_elementwise_bytes=float(elementwise),
        checkpoint_bytes=cb * t * model.hidden,
        full_activation_bytes=cb * t * model.hidden * 2,
        fwd_working_bytes=work,
        bwd_working_bytes=(max(work, dx_loss + norm_backward_bytes(model, t))
                           + pr.grad_wire_bytes * (owned + tied)),  # LoRA: none
        tokens=t,
        precision=pr,
    )


def norm_backward_bytes(model: ModelSpec, tokens: int) -> int:
    """Transient bytes of one norm's backward over `tokens` tokens as the executor runs it: a LayerNorm kernel
    writes the input gradient beside one temporary (2 x compute dtype per element); the executor's RMSNorm
    recomputes its fp32 forward under autograd in the backward (executor.models.RMSNorm), which holds up to
    six fp32 copies of the input at once plus one in the compute dtype; both keep two fp32 statistics per
    token (mean and rstd, or the mean square and its rsqrt), and the loss a few scalars
    (tests/planner/core/test_loss_memory.py measures both)."""
    cb = precision_of(model).compute_bytes
    per_element = 2 * cb if model.norm == "layernorm" else 6 * 4 + cb
    return per_element * tokens * model.hidden + 2 * 4 * tokens + 64


def model_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Training FLOPs per token without recompute: 6 * matmul params + 12 * L * q_dim * seq (fwd + bwd).
    Under LoRA the frozen matmul params count 4 (forward and input gradient, no weight gradient) and the
    adapters 6."""
    matmul = (model.num_layers * model.layer_matmul_params()
              + (model.vocab_size * model.embed_dim if model.lm_head else 0))
    if model.embed_proj_dim:
        matmul += 2 * model.embed_proj_dim * model.hidden
    attention = 12.0 * model.num_layers * model.q_dim * seq
    if model.lora is not None:
        return 4.0 * matmul + 6.0 * model.adapter_params() + attention
    return 6.0 * matmul + attention


def recompute_flops_per_token(model: ModelSpec, seq: int) -> float:
    """Extra FLOPs per token of recomputing every layer's forward in backward (its adapters' too)."""
    matmul = model.layer_matmul_params() + model.layer_adapter_params()
    return 2.0 * model.num_layers * matmul + 4.0 * model.num_layers * model.q_dim * seq


def state_bytes_per_param(precision: Precision = PRECISIONS[DEFAULT_PRECISION]) -> dict[str, float]:
    """Bytes per parameter of each tensor class of Adam in `precision`."""
    return {
        "weights": precision.compute_bytes,
        "master": precision.master_bytes,
        "adam_m": precision.adam_state_bytes,
        "adam_v": precision.adam_state_bytes,
        "grads": precision.grad_accum_bytes,
    }
