"""Compute as a GPU delivers it, kernel by kernel (a profile's optional `compute:` section).

- A GEMM's output (m x n) is cut into tiles of gemm_tile_m x gemm_tile_n, one thread block each; the tiles run
  in waves of sm_count. A wave takes as long as one tile's 2 x tile_m x tile_n x k FLOPs at one SM's share of
  the large-GEMM rate (peak x gpu.gemm_efficiency / sm_count), so a GEMM whose tiles do not fill the last wave
  (wave quantization) or whose m, n are not multiples of the tile (tile quantization) pays for the padding.
  cuBLAS picks a smaller tile when the large one leaves SMs idle: the model takes the fastest of the tile
  and its halvings down to 64 x 64 at the same per-SM rate (an optimistic bound on that choice: smaller tiles
  reuse less data). A GEMM never beats its bytes at the HBM rate (the roofline on arithmetic intensity).
- Flash attention runs at the published fraction of peak of the profile's GPU (forward and backward apart).
- Launches: the host issues one kernel at a time (framework dispatch + CUDA launch, compute.kernel_launch_us);
  the GPU runs them in order, so a block of n kernels takes at least n launches (`launch_bound_s`).
- Kernels per block: the GEMMs, one attention kernel forward (two backward: the flash backward's pre-pass and
  main kernel), and one kernel per elementwise term that workload.layer_cost counts (2 norms, 2 residual adds,
  bias/rotary on q and k, the activation, the attention output's layout copy); every backward kernel twice.

tierflow.planner.core.costmodel calls these when the profile has the section; without it the GPU runs on the
gpu section's size curve as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierflow.hwprofiles.compute_spec import ComputeSpec
from tierflow.planner.core.opkinds import HEAD
from tierflow.planner.core.workload import BlockCost, Gemm

SMALLEST_TILE = 64  # the smallest tile edge considered (halvings of the large tile stop here)
# elementwise kernels of one forward pass, per block kind: the terms of workload.layer_cost's elementwise
# bytes (2 norms, 2 residual adds, bias/rotary on q,k, activation, attention output), the embedding's gather
# and sum, the head's norm, log-softmax and loss
FWD_ELEMENTWISE_KERNELS = {"layer": 7, "embed": 2, HEAD: 3}  # by BlockCost.kind (the head block's is HEAD)
ATTENTION_FWD_KERNELS = 1
ATTENTION_BWD_KERNELS = 2


@dataclass(frozen=True)
class DeliveredCompute:
    """The per-kernel compute model of one GPU: `gemm_rate_flops` is what large GEMMs reach (peak x
    gpu.gemm_efficiency), `peak_flops` the datasheet peak, `hbm_bps` the sustained HBM rate."""

    spec: ComputeSpec
    peak_flops: float
    gemm_rate_flops: float
    hbm_bps: float

    def _tiles_s(self, g: Gemm, tile_m: int, tile_n: int) -> float:
        tiles = math.ceil(g.m / tile_m) * math.ceil(g.n / tile_n) * g.count
        waves = math.ceil(tiles / self.spec.sm_count)
        per_sm_rate = self.gemm_rate_flops / self.spec.sm_count
        return waves * 2.0 * tile_m * tile_n * g.k / per_sm_rate

    def gemm_s(self, g: Gemm) -> float:
        """One GEMM shape (all its `count` instances in one batched kernel): the fastest tile's waves, never
        faster than its bytes at the HBM rate."""
        tm, tn = self.spec.gemm_tile_m, self.spec.gemm_tile_n
        best = self._tiles_s(g, tm, tn)
        while tm > SMALLEST_TILE or tn > SMALLEST_TILE:
            if tm >= tn and tm > SMALLEST_TILE:
                tm //= 2
            else:
                tn //= 2
            best = min(best, self._tiles_s(g, tm, tn))
        return max(best, g.bytes / self.hbm_bps)

    def attention_s(self, work_flops: float, backward: bool) -> float | None:
        """Causal flash attention doing `work_flops` (the backward's own 2x included by the caller) at the
        profile's published fraction of peak; None where the profile has none (the caller's GEMM curve)."""
        fraction = self.spec.attention_bwd_fraction if backward else self.spec.attention_fwd_fraction
        if fraction is None:
            return None
        return 0.0 if work_flops <= 0 else work_flops / (self.peak_flops * fraction)

    def launch_bound_s(self, device_s: float, kernels: int) -> float:
        """A block's time: its kernels' device time, or the host's launches of them when longer."""
        return max(device_s, kernels * self.spec.kernel_launch_s)


def kernels(block: BlockCost, backward: bool) -> int:
    """Kernels one pass of `block` launches (one per GEMM shape, batched instances together)."""
    n_gemm = len(block.fwd_gemms)
    attention = ATTENTION_FWD_KERNELS if block.attn_fwd_flops > 0 else 0
    elementwise = FWD_ELEMENTWISE_KERNELS.get(block.kind, 0)
    if backward:
        attention = ATTENTION_BWD_KERNELS if attention else 0
        return 2 * n_gemm - block.frozen_gemms + attention + 2 * elementwise
    return n_gemm + attention + elementwise


def unfused_extra_bytes(norm: str, rmsnorm_elems: int, rotary_elems: int, kv_repeat_elems: int,
                        gated_ffn_elems: int, compute_bytes: int) -> float:
    """HBM bytes per token of one layer's forward beyond what workload.layer_cost counts (a fused kernel's
    read and write per term) when the framework runs these terms as separate PyTorch ops (compute.layer_ops
    unfused), as Megatron-DeepSpeed's local transformer does:
    - RMSNorm (megatron/model/rmsnorm.py: `self._norm(x.float()).type_as(x) * self.weight`, _norm =
      `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`): x.float(), pow, mean, mul, type_as, the
      weight's mul = 28 + 4 x compute_bytes bytes per element where a fused norm moves 2 x compute_bytes;
    - rotary positions (megatron/model/rotary_pos_embedding.py apply_rotary_pos_emb: `t * cos + rotate_half(t)
      * sin`, rotate_half = cat(-x2, x1)): five elementwise ops, 10 passes of the tensor where a fused kernel
      makes 2;
    - grouped-query attention's key and value heads repeated to every query head (transformer.py
      ParallelAttention: `repeat_interleave(num_key_value_groups)`) before the unfused attention: read kv,
      write q, for k and v (`kv_repeat_elems` = q + kv per token, 0 without GQA);
    - SwiGLU (`F.silu(x[0]) * x[1]` after torch.chunk): silu then mul, 5 passes of the ffn width where a
      fused kernel makes 3.
    Counts in elements per token: `rmsnorm_elems` (the norms' inputs, 0 for LayerNorm: Megatron's is fused),
    `rotary_elems` (q + kv with rotary positions), `gated_ffn_elems` (ffn width when gated)."""
    cb = compute_bytes
    norms = (28 + 4 * cb - 2 * cb) * rmsnorm_elems if norm == "rmsnorm" else 0
    return float(norms + 8 * cb * rotary_elems + 2 * cb * kv_repeat_elems + 2 * cb * gated_ffn_elems)


def delivered_compute(compute: ComputeSpec | None, peak_flops: float, gemm_efficiency: float,
                      hbm_bps: float) -> DeliveredCompute | None:
    """The model for a profile's compute section, or None without one."""
    if compute is None:
        return None
    return DeliveredCompute(compute, peak_flops, peak_flops * gemm_efficiency, hbm_bps)
