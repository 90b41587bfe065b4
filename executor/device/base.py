"""The device the executor runs on, behind one small interface (`DeviceBackend`): streams, events, asynchronous
copies, device and host allocations and `record_stream`. The engine and the ops use only this interface, so
that the CUDA logic (which waits, which copies are asynchronous, which buffer is pinned, which use is recorded)
also runs on a CPU, against an adversary (device_emulated.py) that makes every missing wait or record visible.

    --device cpu                   PlainCpuBackend: no streams; every op runs in its worker thread, copies are
                                   plain copies (the default on a CPU)
    --device cuda[:N]              CudaBackend: one stream per stream resource (gpu, h2d, d2h), CUDA events,
                                   pinned host memory, the caching allocator
    --device cpu-adversarial[:N]   AdversarialCpuBackend (tests): each stream a thread running its queue with
                                   random delays, late non-blocking copies, a block allocator that hands a freed
                                   block to the next request at once (filled with NaN) unless another stream
                                   recorded a use; N is an emulated device index (events of different devices
                                   cannot be timed against each other, as on CUDA)

Rules every backend enforces or assumes (on CUDA they are what makes the executor correct, and the adversary
turns a broken one into a NaN loss or an exception):
  * an op on a stream runs after `wait_event` on the end event of every dependency of another stream;
  * a host thread reads device results only after `synchronize_event` on the op's end event;
  * a device tensor allocated on one stream and used on another gets `record_stream` before it is dropped;
  * `copy_async` copies between device memory and *pinned* host memory only (from pageable memory CUDA would
    copy synchronously: an error here);
  * no op on a stream synchronizes the host (a stall on CUDA; an error in the adversary).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tierflow.errors import DoesNotFit, TierflowError

STREAM_PRIORITY = {"gpu": 0, "h2d": -1, "d2h": -1}  # CUDA: lower is higher; copy streams ahead of the GEMMs


class TierOutOfMemory(DoesNotFit, RuntimeError):
    """An allocation on a tier failed (the executor maps it to exit 3, naming the tier and the plan's decision)."""

    def __init__(self, tier: str, nbytes: int, detail: str = "") -> None:
        super().__init__(f"{tier}: cannot allocate {nbytes:,} bytes" + (f" ({detail})" if detail else ""))
        self.tier, self.nbytes = tier, nbytes


class RoundAborted(Exception):
    """A wait given up because the round failed elsewhere (the failure is reported by whoever failed)."""


class PageableCopyError(TierflowError, RuntimeError):
    """A non-blocking copy from or to pageable host memory (CUDA would silently copy synchronously)."""

    exit_code = 1  # a bug in the executor that the emulation caught


class HiddenSyncError(TierflowError, RuntimeError):
    """A host synchronization inside an op on a stream (on CUDA it stalls the stream's worker)."""

    exit_code = 1  # a bug in the executor that the emulation caught


class DeviceBackend:
    """What the executor needs of a device. `streams_async` says whether stream ops run asynchronously to the
    worker that enqueues them (CUDA, the adversary) or inside it (a plain CPU, where streams are None)."""

    name = "device"
    device: torch.device
    streams_async = False
    pins = False  # host buffers asked for as pinned really are page-locked
    arena = None  # the executor's transfer area (arena.TransferArena): copy_async notes its views' stream uses

    # -- threads, streams, events ------------------------------------------------------------------------------

    def thread_init(self) -> None:
        """Called first by every thread that uses the device (CUDA: set_device)."""

    def start_round(self, abort: threading.Event, on_error: Callable[[str, BaseException], None]) -> None:
        """A round begins: waits poll `abort`; errors the backend catches itself are passed to on_error(op, e)."""

    def new_stream(self, resource: str):
        return None

    def close_streams(self, streams) -> None:
        """The round's streams are no longer used."""

    def record(self, stream):
        """A new event, recorded on `stream` (None: the current stream of the current device)."""
        raise NotImplementedError

    def wait_event(self, stream, event) -> None:
        """Work enqueued on `stream` after this call runs after `event`."""

    def synchronize_event(self, event) -> None:
        """The host waits until `event` has happened (blocking, not spinning)."""

    def elapsed_s(self, start, end) -> float:
        raise NotImplementedError

    def launch(self, stream, fn: Callable[[], None], label: str) -> None:
        """Run `fn` (an op's handler) with `stream` as the current stream."""
        fn()

    def synchronize(self) -> None:
        """The host waits for all work on the device."""

    def current_stream(self):
        """The stream the calling code runs on inside an op's handler, None on a host thread."""
        return None

    def query_event(self, event) -> bool:
        """Whether `event` has happened (not blocking)."""
        return True

    # -- memory ------------------------------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory, allocated on the current stream."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A compute result that other streams will read, in the device allocator's memory (identity except in
        the adversary, which copies it into a block of its own allocator)."""
        return t

    def host_buffer(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """Host memory; `pinned` for what crosses PCIe (copy_async needs it), pageable for host-only state."""
        return _host_empty(numel, dtype, False)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src on the current stream, not waiting for it to land."""
        dst.copy_(src)

    def pinned_area(self, nbytes: int) -> torch.Tensor:
        """One host allocation of `nbytes` (uint8) for the transfer area: page-locked where the backend pins,
        without the pinned caching allocator's rounding to a power of two. TierOutOfMemory if it fails."""
        return _host_empty(nbytes, torch.uint8, False)

    def poison_host(self, t: torch.Tensor, stream) -> None:
        """A transfer-area view handed to a new owner (the adversary fills it with NaN, in `stream`'s order)."""

    def _note_arena_use(self, *tensors: torch.Tensor) -> None:
        """After a copy_async on the current stream: its transfer-area views get that stream's event."""
        arena = self.arena
        if arena is None:
            return
        ev = None
        for t in tensors:
            if arena.range_of(t) is not None:
                ev = ev if ev is not None else self.record(None)
                arena.note_use(t, ev)

    def record_stream(self, t: torch.Tensor | None, stream) -> None:
        """`t`, allocated on another stream, is used by `stream`: its memory is not reused before that use."""

    def memory_stats(self) -> dict[str, float]:
        """Measured device memory since the last reset_peaks: {"max_allocated_bytes", "max_reserved_bytes"}
        (empty where nothing is measured)."""
        return {}

    def reset_peaks(self) -> None:
        pass

    def cap_memory(self, cap_bytes: float) -> None:
        """Enforce the device capacity the plan assumes (an allocation beyond it fails as out of memory)."""

    def check_compute_dtype(self, dtype: torch.dtype) -> None:
        """Raise ValueError if the device cannot compute in `dtype`."""


def _host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)
    except RuntimeError as e:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        raise TierOutOfMemory("cpu (pinned)" if pinned else "cpu", nbytes, " ".join(str(e).split())[:120]) from None


class PlainCpuBackend(DeviceBackend):
    """A CPU as the device, without streams: every op runs in its worker, in the plan's order per resource."""

    name = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def record(self, stream):
        raise RuntimeError("the plain CPU backend has no events")


class CudaBackend(DeviceBackend):
    """One CUDA device: a stream per stream resource (copy streams at high priority), blocking events (a waiting
    host thread sleeps instead of spinning on the cores CPU Adam needs), pinned host memory."""

    streams_async = True
    pins = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
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
        event.synchronize()

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def launch(self, stream, fn, label: str) -> None:
        with torch.cuda.stream(stream):
            fn()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def current_stream(self):
        cur = torch.cuda.current_stream(self.device)
        return None if cur == torch.cuda.default_stream(self.device) else cur

    def query_event(self, event) -> bool:
        return event.query()

    def pinned_area(self, nbytes: int) -> torch.Tensor:
        """Pageable memory, page-locked in place with cudaHostRegister (unregistered when it is freed): one
        allocation of whole pages of its own, where the pinned caching allocator would round up to a power of
        two. Not yet run on a GPU (see the README's "Known gaps")."""
        import weakref

        page = 4096
        padded = -(-max(nbytes, 1) // page) * page
        t = _host_empty(padded + page, torch.uint8, False)
        skip = (-t.data_ptr()) % page
        ptr = t.data_ptr() + skip
        rc = torch.cuda.cudart().cudaHostRegister(ptr, padded, 0)
        if int(rc) != 0:
            raise TierOutOfMemory("cpu (pinned)", padded, f"cudaHostRegister returned {rc}")
        arr = t.numpy()[skip: skip + nbytes]  # keeps t; every view of the returned tensor keeps arr
        weakref.finalize(arr, torch.cuda.cudart().cudaHostUnregister, ptr)
        return torch.from_numpy(arr)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for t in (dst, src):
            if t.device.type == "cpu" and not t.is_pinned():
                raise PageableCopyError(f"copy_async with pageable host memory ({tuple(t.shape)} {t.dtype})")
        dst.copy_(src, non_blocking=True)
        self._note_arena_use(dst, src)

    def record_stream(self, t: torch.Tensor | None, stream) -> None:
        if t is not None and t.is_cuda:
            t.record_stream(stream)

    def memory_stats(self) -> dict[str, float]:
        return {"max_allocated_bytes": float(torch.cuda.max_memory_allocated(self.device)),
                "max_reserved_bytes": float(torch.cuda.max_memory_reserved(self.device))}

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def cap_memory(self, cap_bytes: float) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), self.device)

    def check_compute_dtype(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(self.device)
            raise ValueError(f"--device {self.device}: {name} has no bf16 support (compute capability < 8.0); "
                             "use an Ampere or newer GPU")


def enable_expandable_segments() -> bool:
    """The caching allocator maps growing segments instead of fixed blocks, so that the three streams' pools do
    not fragment device memory (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the first CUDA
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
    fixed workspace), so that a resumed run repeats an uninterrupted one's losses; kernels without a deterministic
    version (the backward of fused attention) only warn, so bit-identical resume is not guaranteed on a GPU."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS creates its handle
    torch.use_deterministic_algorithms(True, warn_only=True)


def make_backend(name: str, seed: int = 0) -> DeviceBackend:
    """The backend for `--device NAME`; ValueError (one line) for a name it does not know or cannot use."""
    if name == "cpu":
        return PlainCpuBackend()
    if name == "cpu-adversarial" or name.startswith("cpu-adversarial:"):
        from tierflow.executor.device_emulated import AdversarialCpuBackend

        idx = name.partition(":")[2] or "0"
        if not idx.isdigit():
            raise ValueError(f"--device {name!r}: the emulated device index must be a number")
        return AdversarialCpuBackend(int(idx), seed=seed)
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available here (use --device cpu)")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
        return CudaBackend(dev)
    raise ValueError(f"--device {name!r}: use cpu, cuda or cuda:N")


def as_backend(device: torch.device | str | DeviceBackend) -> DeviceBackend:
    if isinstance(device, DeviceBackend):
        return device
    return make_backend(str(device))
