"""The device the executor runs on, behind one small interface (`DeviceBackend`): streams, events,
asynchronous copies, device and host allocations and `record_stream`. The engine and the ops use only this
interface, so that the CUDA logic (which waits, which copies are asynchronous, which buffer is pinned, which
use is recorded) also runs on a CPU, against an adversary (device/emulated.py) that makes every missing wait
or record visible. device/factory.py's `make_backend` picks the backend for `--device NAME`:

    --device cpu                   PlainCpuBackend: no streams; every op runs in its worker thread, copies are
                                   plain copies (the default on a CPU)
    --device cuda[:N]              CudaBackend (cuda.py): one stream per stream resource (gpu, h2d, d2h), CUDA
                                   events, pinned host memory, the caching allocator
    --device cpu-adversarial[:N]   AdversarialCpuBackend (emulated.py, tests): each stream a thread running
                                   its queue with random delays, late non-blocking copies, a block allocator
                                   that hands a freed block to the next request at once (filled with NaN)
                                   unless another stream recorded a use; N is an emulated device index (events
                                   of different devices cannot be timed against each other, as on CUDA)

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


class TierOutOfMemory(DoesNotFit, RuntimeError):
    """An allocation on a tier failed (the executor maps it to exit 3,
    naming the tier and the plan's decision)."""

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


class CaptureError(TierflowError, RuntimeError):
    """A graph capture refused (CUDA's capture error, or what the emulation refuses as CUDA would): the
    executor runs that segment with eager launches and says why (executor/graphs.py)."""

    exit_code = 1


class GraphReplayError(TierflowError, RuntimeError):
    """A graph replay that would read memory no longer where the capture saw it: a bug of the executor."""

    exit_code = 1


class DeviceBackend:
    """What the executor needs of a device. `streams_async` says whether stream ops run asynchronously to the
    worker that enqueues them (CUDA, the adversary) or inside it (a plain CPU, where streams are None)."""

    name = "device"
    device: torch.device
    streams_async = False
    pins = False  # host buffers asked for as pinned really are page-locked
    # the executor's transfer area (tiers/arena.py): copy_async notes its views' stream uses
    arena = None

    # -- threads, streams, events ----------------------------------------------------------------------------

    def thread_init(self) -> None:
        """Called first by every thread that uses the device (CUDA: set_device)."""

    def start_round(self, abort: threading.Event, on_error: Callable[[str, BaseException], None]) -> None:
        """A round begins: waits poll `abort`;
        errors the backend catches itself are passed to on_error(op, e)."""

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

    # -- memory ----------------------------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory, allocated on the current stream."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A compute result that other streams will read, in the device allocator's memory (identity except in
        the adversary, which copies it into a block of its own allocator)."""
        return t

    # Host memory has one code path on every backend (host_buffer, pinned_area -> host_bytes_raw): a buffer
    # asked for as pinned is pinned wherever the backend pins (`pins`), and the backends differ only in the
    # primitive `host_bytes_raw` (torch's allocators on CUDA, registered numpy memory in the emulation). Until
    # 2026-11-28 the CUDA backend's host_buffer ignored `pinned` while the emulation's pinned it.

    def host_buffer(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """Host memory; `pinned` for what crosses PCIe (copy_async needs it), pageable for host-only state."""
        nbytes = numel * _element_size(dtype)
        raw = self.host_bytes_raw(nbytes, pinned and self.pins, exact=False)
        return raw[:nbytes].view(dtype)

    def pinned_area(self, nbytes: int) -> torch.Tensor:
        """One host allocation of `nbytes` (uint8) for the transfer area: page-locked where the backend pins,
        without the pinned caching allocator's rounding to a power of two. TierOutOfMemory if it fails."""
        return self.host_bytes_raw(nbytes, self.pins, exact=True)[:nbytes]

    def host_bytes_raw(self, nbytes: int, pinned: bool, exact: bool) -> torch.Tensor:
        """The primitive: at least max(nbytes, 1) bytes of host memory (uint8), page-locked if `pinned`;
        `exact`: one allocation of its own, not rounded up by a caching allocator. TierOutOfMemory if it
        fails."""
        return host_empty(max(nbytes, 1), torch.uint8, pinned)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """The primitive copy_async checks: whether host tensor `t` lies in page-locked memory."""
        return not self.pins or t.is_pinned()

    def check_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """What every backend's copy_async refuses, as CUDA would fail or silently misbehave: a copy outside
        an op on a stream (CUDA: it would run on the default stream, ordered with nothing), tensors of other
        shapes (copy_ would broadcast), a host side in pageable memory (CUDA copies it synchronously)."""
        if self.streams_async and self.current_stream() is None:
            raise RuntimeError("copy_async outside an op on a stream")
        if dst.shape != src.shape:
            raise RuntimeError(f"copy_async: shapes {tuple(dst.shape)} and {tuple(src.shape)} differ")
        for side, t in (("destination", dst), ("source", src)):
            if t.numel() and t.device.type == "cpu" and not self.is_pinned(t):
                raise PageableCopyError(f"non-blocking copy with pageable host memory as its {side} "
                                        f"({tuple(t.shape)} {t.dtype}); allocate it pinned")

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src on the current stream, not waiting for it to land."""
        self.check_copy(dst, src)
        dst.copy_(src)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """copy_async of each (dst, src) pair, in order (an offload's pieces)."""
        for dst, src in pairs:
            self.copy_async(dst, src)

    def check_host_sync(self, what: str) -> None:
        """What every backend with streams refuses: the host waiting (synchronize_event, synchronize) from
        inside an op on a stream (on CUDA it stalls that stream's worker and every op queued behind it)."""
        cur = self.current_stream()
        if self.streams_async and cur is not None:
            name = getattr(cur, "name", None) or str(cur)
            raise HiddenSyncError(f"a host synchronization ({what}) inside an op on stream {name} (on CUDA "
                                  "it stalls that stream's worker)")

    def poison_host(self, t: torch.Tensor, stream) -> None:
        """A transfer-area view handed to a new owner (the adversary fills it with NaN,
        in `stream`'s order)."""

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

    # -- graphs (executor/graphs.py) ------------------------------------------------------------------------

    def graph_pool(self):
        """A private memory pool that the graphs captured with it share (captured and replayed in one order).
        None where the backend has no graphs."""
        return None

    def new_graph(self, pool, persistent):
        """A graph to capture on the current stream with `pool`; `persistent()` gives the device tensors kept
        across iterations ({storage data pointer: tensor}) that a capture may read besides its own memory
        (checked by the emulation). The graph has capture(fn), replay() and `capture_executes`."""
        raise CaptureError(f"{self.name}: no CUDA graphs on this backend")

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


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def host_empty(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)
    except RuntimeError as e:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        tier = "cpu (pinned)" if pinned else "cpu"
        raise TierOutOfMemory(tier, nbytes, " ".join(str(e).split())[:120]) from None


class PlainCpuBackend(DeviceBackend):
    """A CPU as the device, without streams: every op runs in its worker, in the plan's order per resource."""

    name = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def record(self, stream):
        raise RuntimeError("the plain CPU backend has no events")

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The copies at once, in one torch call (no stream, no pinned memory to check: only the shapes)."""
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise RuntimeError(f"copy_async: shapes {tuple(dst.shape)} and {tuple(src.shape)} differ")
        if pairs:
            torch._foreach_copy_([d for d, _s in pairs], [s for _d, s in pairs])
