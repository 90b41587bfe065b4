"""Device memory the executor's CUDA runtime takes inside the allocator's cap besides the plan's tensors.

`tierflow run` caps PyTorch's caching allocator at the plan's GPU capacity
(torch.cuda.set_per_process_memory_fraction, executor/device/cuda.py): the cap counts every byte the allocator
has mapped, so whatever it maps besides the tensors the task graph counts must be in the plan too. Each term
is a mechanism of PyTorch's CUDA runtime, with its source:

- **cuBLAS workspaces.** PyTorch gives every (cuBLAS handle, stream) pair that runs a GEMM a workspace from
  the caching allocator, kept for the process's life (aten/src/ATen/cuda/CublasHandlePool.cpp,
  setWorkspaceForHandle), of the size CUBLAS_WORKSPACE_CONFIG gives (":SIZE:COUNT" pairs, SIZE in KiB): the
  executor sets ":4096:8" (executor/device/cuda.py: a fixed workspace for deterministic GEMMs), 32 MiB.
  cuBLASLt GEMMs take a second workspace per pair from a separate map unless
  TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 (getCUDABlasLtWorkspace), of CUBLASLT_WORKSPACE_SIZE KiB (default 1024).
  One worker thread launches every GEMM on the compute stream (executor/engine.py), so one pair per round; the
  streams are new each round, and the backend frees the round's workspaces when it closes its streams
  (CudaBackend.close_streams), so that they do not pile up round after round.
- **The allocator's pages.** With expandable_segments (set by executor/device/cuda.py) each stream's pool maps
  one growing segment in pages of 20 MiB for blocks over 1 MiB (kLargeBuffer) and 2 MiB for smaller ones
  (kSmallBuffer) (c10/cuda/CUDACachingAllocator.cpp, get_expandable_segment): the mapped memory exceeds the
  live blocks by up to one page at the end of each pool's segment. Every stream that allocates (compute,
  H2D, D2H, and the collectives' with several ranks) has its own pools. A request is rounded up to 512 bytes
  (kMinBlockSize) and, with expandable segments, split at that size: under 0.5 KiB a tensor, left out. Free
  gaps between live blocks inside a segment are unmapped page by page when an allocation would exceed the cap
  (release_cached_blocks, then a retry): what stays mapped there (up to a page on each side of a gap) is not
  modelled; `tierflow run` reports the allocator's reserved beside its allocated peak to show it.
- **The CUDA context** (hundreds of MiB: the kernels' code, the driver's buffers) is not in the allocator,
  so not under the cap: it is the profile's `gpu.reserved_gib` (capacity = memory - reserved), and
  CudaBackend.cap_memory refuses a cap larger than the memory the device has free beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile

KIB = 1024
MIB = 1024 * KIB

CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # the executor's setting (executor/device/cuda.py enable_determinism)
CUBLASLT_WORKSPACE_BYTES = 1024 * KIB  # CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB (CublasHandlePool.cpp)
GEMM_STREAMS = 1  # (handle, stream) pairs that run GEMMs at once: the compute stream's worker
LARGE_PAGE_BYTES = 20 * MIB  # kLargeBuffer: an expandable segment's page for blocks over 1 MiB
SMALL_PAGE_BYTES = 2 * MIB  # kSmallBuffer: the page of the small-block pool
# the executor's streams (engine STREAM_RESOURCES); + net with several ranks
ALLOCATING_STREAMS = ("gpu", "h2d", "d2h")


def cublas_workspace_bytes(config: str = CUBLAS_WORKSPACE_CONFIG) -> int:
    """The workspace size a CUBLAS_WORKSPACE_CONFIG value gives: the sum of SIZE KiB x COUNT over its
    ":SIZE:COUNT" pairs (PyTorch's parseChosenWorkspaceSize)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {config!r}: expected :SIZE:COUNT pairs, e.g. :4096:8")
    return sum(int(size) * KIB * int(count) for size, count in pairs)


@dataclass(frozen=True)
class CudaRuntimeMemory:
    """The bytes the CUDA runtime maps inside the allocator's cap besides the plan's tensors (module doc)."""

    workspace_bytes: int  # cuBLAS + cuBLASLt workspaces of the GEMM streams
    page_bytes: int  # the last partly used page of each allocating stream's pools

    @property
    def total_bytes(self) -> int:
        return self.workspace_bytes + self.page_bytes


def cuda_runtime_memory(ranks: int = 1, config: str = CUBLAS_WORKSPACE_CONFIG) -> CudaRuntimeMemory:
    """The CUDA runtime's bytes under the cap for one rank of a run with `ranks` ranks (the collectives'
    stream allocates too when there are several)."""
    streams = len(ALLOCATING_STREAMS) + (1 if ranks > 1 else 0)
    return CudaRuntimeMemory(
        workspace_bytes=GEMM_STREAMS * (cublas_workspace_bytes(config) + CUBLASLT_WORKSPACE_BYTES),
        page_bytes=streams * (LARGE_PAGE_BYTES + SMALL_PAGE_BYTES),
    )


# the runtimes whose plans the executor runs on its own streams (DeepSpeed's plans model DeepSpeed's process,
# whose GPU buffers tierflow.planner.core.memory counts separately)
EXECUTOR_RUNTIMES = ("ideal", "lohan")


def runs_on_cuda(hw: HardwareProfile | None) -> bool:
    """Is the profile's device a GPU (not the host CPU of `tierflow calibrate --device cpu`, whose profiles
    set gpu.host_cores)? Unknown hardware (None): no."""
    return hw is not None and hw.gpu.host_cores is None


def runtime_gpu_reserve_bytes(runtime: str, ranks: int = 1, hw: HardwareProfile | None = None) -> int:
    """The GPU bytes a plan of `runtime` on `hw` holds for the CUDA runtime under the cap: none on a CPU
    device or without a profile, none for DeepSpeed's plans."""
    if not runs_on_cuda(hw) or runtime not in EXECUTOR_RUNTIMES:
        return 0
    return cuda_runtime_memory(ranks).total_bytes
