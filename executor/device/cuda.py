"""The CUDA device (`CudaBackend`, `--device cuda[:N]`): one stream per stream resource, CUDA events, pinned
host memory, the caching allocator (expandable segments) and deterministic kernels where PyTorch has them. The
rules it keeps are in device/base.py.
"""

from __future__ import annotations

import torch

from tierflow.executor.device.base import CaptureError, DeviceBackend, TierOutOfMemory, host_empty
from tierflow.planner.core.devicemem import CUBLAS_WORKSPACE_CONFIG

STREAM_PRIORITY = {"gpu": 0, "h2d": -1, "d2h": -1}  # CUDA: lower is higher; copy streams ahead of the GEMMs


class CudaBackend(DeviceBackend):
    """One CUDA device: a stream per stream resource (copy streams at high priority), blocking events (a
    waiting host thread sleeps instead of spinning on the cores CPU Adam needs), pinned host memory."""

    streams_async = True
    pins = True

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.name = str(self.device)
        enable_expandable_segments()
        enable_determinism()

    def thread_init(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self, resource: str):
        return torch.cuda.Stream(self.device, priority=STREAM_PRIORITY.get(resource, 0))

    def record(self, stream):
        ev = torch.cuda.Event(enable_timing=True, blocking=True)
        if stream is None:
            with torch.cuda.device(self.device):
                ev.record()
        else:
            ev.record(stream)
        return ev

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize_event(self, event) -> None:
        self.check_host_sync("synchronize_event")
        event.synchronize()

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def launch(self, stream, fn, label: str) -> None:
        with torch.cuda.stream(stream):
            fn()

    def synchronize(self) -> None:
        self.check_host_sync("synchronize")
        torch.cuda.synchronize(self.device)

    def current_stream(self):
        cur = torch.cuda.current_stream(self.device)
        return None if cur == torch.cuda.default_stream(self.device) else cur

    def query_event(self, event) -> bool:
        return event.query()

    def host_bytes_raw(self, nbytes: int, pinned: bool, exact: bool) -> torch.Tensor:
        """Pinned: torch's pinned caching allocator (cudaHostAlloc, rounded up to a power of two), or for
        `exact` (the transfer area) pageable memory page-locked in place with cudaHostRegister (unregistered
        when it is freed): one allocation of whole pages of its own."""
        if not (pinned and exact):
            return host_empty(max(nbytes, 1), torch.uint8, pinned)
        import weakref

        page = 4096
        padded = -(-max(nbytes, 1) // page) * page
        t = host_empty(padded + page, torch.uint8, False)
        skip = (-t.data_ptr()) % page
        ptr = t.data_ptr() + skip
        rc = torch.cuda.cudart().cudaHostRegister(ptr, padded, 0)
        if int(rc) != 0:
            raise TierOutOfMemory("cpu (pinned)", padded, f"cudaHostRegister returned {rc}")
        arr = t.numpy()[skip: skip + padded]  # keeps t; every view of the returned tensor keeps arr
        weakref.finalize(arr, torch.cuda.cudart().cudaHostUnregister, ptr)
        return torch.from_numpy(arr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.check_copy(dst, src)
        dst.copy_(src, non_blocking=True)
        self._note_arena_use(dst, src)

    def record_stream(self, t: torch.Tensor | None, stream) -> None:
        if t is not None and t.is_cuda:
            t.record_stream(stream)

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def new_graph(self, pool, persistent) -> CudaGraph:
        return CudaGraph(pool)

    def memory_stats(self) -> dict[str, float]:
        return {"max_allocated_bytes": float(torch.cuda.max_memory_allocated(self.device)),
                "max_reserved_bytes": float(torch.cuda.max_memory_reserved(self.device))}

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def close_streams(self, streams) -> None:
        """The round's streams are done: free the cuBLAS workspaces PyTorch keeps per (handle, stream), or
        each round's new streams would add one more (tierflow.planner.core.devicemem counts one pair)."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            torch.cuda.synchronize(self.device)
            clear()

    def cap_memory(self, cap_bytes: float) -> None:
        """Cap the caching allocator at the plan's GPU capacity. The CUDA context lies outside the allocator
        (and outside the cap): a cap larger than what the device has free beside it and other processes
        could not be met, and is refused before the first op (DoesNotFit, exit 3)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        held = torch.cuda.memory_reserved(self.device)
        check_cap_fits(cap_bytes, free, total, held, str(self.device))
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), self.device)

    def check_compute_dtype(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(self.device)
            raise ValueError(f"--device {self.device}: {name} has no bf16 support (compute capability < "
                             "8.0); use an Ampere or newer GPU")


class CudaGraph:
    """One torch.cuda.CUDAGraph captured on the current stream (the run's gpu stream, not the default
    one, where the warm-up ran too) into the shared private pool. `thread_local` capture: the other workers'
    CUDA calls (copies, event queries, allocations) go on during the capture without invalidating it; an
    unsafe call of the capturing thread itself (a host synchronization) fails it. A capture runs nothing: the
    runner replays once right after it (`capture_executes` False)."""

    capture_executes = False

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn) -> None:
        """cuBLAS's workspaces are cleared (after a device synchronization: no queued kernel uses them) on
        entering and on leaving the capture, as torch's own cudagraph trees do: the workspace the captured
        GEMMs use is then allocated inside the capture, from the private pool, which keeps it while the graph
        lives; otherwise the graph would hold a pointer into the eager workspace that close_streams frees at
        the end of every round."""
        stream = torch.cuda.current_stream()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
        torch.cuda.synchronize()
        clear()
        try:
            with torch.cuda.graph(self.graph, pool=self.pool, stream=stream,
                                  capture_error_mode="thread_local"):
                fn()
        except CaptureError:
            raise
        except RuntimeError as e:  # cudaErrorStreamCapture*: what the captured code did that CUDA refuses
            raise CaptureError(" ".join(str(e).split())[:200]) from None
        finally:
            clear()

    def replay(self) -> None:
        self.graph.replay()


def enable_expandable_segments() -> bool:
    """The caching allocator maps growing segments instead of fixed blocks, so that the three streams' pools
    do not fragment device memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the first CUDA
    allocation; a user's own setting is kept)."""
    import os

    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # an older torch, or a platform without it
        return False
    return True


def enable_determinism() -> None:
    """Deterministic CUDA kernels where PyTorch has them (index_add_ of the embedding gradient, cuBLAS with a
    fixed workspace), so that a resumed run repeats an uninterrupted one's losses; kernels without a
    deterministic version (the backward of fused attention) only warn, so bit-identical resume is not
    guaranteed on a GPU."""
    import os

    # read when cuBLAS creates its handle; the plan counts this workspace (tierflow.planner.core.devicemem)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)


def check_cap_fits(cap_bytes: float, free_bytes: int, total_bytes: int, reserved_bytes: int,
                   device: str) -> None:
    """Refuse a device cap the GPU cannot give: more than its free memory plus what this process's allocator
    already holds (the CUDA context and other processes' memory are outside both)."""
    available = free_bytes + reserved_bytes
    if cap_bytes > available:
        raise TierOutOfMemory(
            "gpu", int(cap_bytes),
            f"the plan is for {cap_bytes / 1e9:.2f} GB of device memory, but {device} has "
            f"{available / 1e9:.2f} GB free of {total_bytes / 1e9:.2f} GB beside the CUDA context and other "
            f"processes; plan for it with gpu.reserved_gib raised by "
            f"{(cap_bytes - available) / 2**30:.2f} or more")
