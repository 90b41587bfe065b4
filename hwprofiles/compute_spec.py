"""The optional `compute:` section of a hardware profile: what a GPU delivers per kernel, by shape.

Without the section a GEMM runs on the profile's size curve (gpu.gemm_efficiency, gpu.gemm_half_gflop).
With it the cost model (tierflow.planner.core.compute) runs each GEMM as the GPU runs it: the output is cut
into tiles of `gemm_tile_m` x `gemm_tile_n`, one per thread block, and the tiles run in waves of `sm_count`
(tile and wave quantization, NVIDIA's "Matrix Multiplication Background User's Guide"); attention runs at the
fraction of peak a published flash-attention kernel reaches on that GPU; and every kernel costs at least
`kernel_launch_us` of the host's time to issue, so a block of many short kernels is bound by its launches.

Only the standard library is imported here (hwprofiles sits below the planner).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeSpec:
    """Per-kernel compute of one GPU (the `compute:` section)."""

    sm_count: int  # streaming multiprocessors: the tiles one wave runs (datasheet)
    gemm_tile_m: int  # rows of the output tile one thread block computes (cuBLAS's large-GEMM tile)
    gemm_tile_n: int  # columns of that tile
    # fraction of gpu.peak_tflops the forward / backward flash-attention kernel reaches at long sequences
    # (published per GPU); None: attention runs like a GEMM of its size
    attention_fwd_fraction: float | None = None
    attention_bwd_fraction: float | None = None
    # host time to issue one kernel (framework dispatch + the CUDA launch) while the GPU is busy; None: 0
    kernel_launch_us: float | None = None
    # how the framework the profile describes runs a layer's norms, rotary positions, gated activation and
    # GQA's key/value heads: "fused" (one kernel each, as workload.layer_cost counts their bytes) or
    # "unfused" (separate PyTorch ops, each reading and writing HBM: Megatron-LM / Megatron-DeepSpeed's
    # transformer_impl local; tierflow.planner.core.compute.unfused_extra_bytes)
    layer_ops: str = "fused"

    @property
    def kernel_launch_s(self) -> float:
        return (self.kernel_launch_us or 0.0) * 1e-6


# keys a profile may leave out of the section
OPTIONAL_KEYS = ("attention_fwd_fraction", "attention_bwd_fraction", "kernel_launch_us", "layer_ops")
LAYER_OPS_CHOICES = ("fused", "unfused")


def default_section() -> dict:
    """The values an override starts from when it sets a compute key on a profile without the section: one
    wave of 108 SMs (an A100's), the 256 x 128 tile of NVIDIA's GEMM guide, nothing else modelled."""
    return {"sm_count": 108, "gemm_tile_m": 256, "gemm_tile_n": 128, "attention_fwd_fraction": None,
            "attention_bwd_fraction": None, "kernel_launch_us": None, "layer_ops": "fused"}
