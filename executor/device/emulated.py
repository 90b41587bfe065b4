"""An adversarial CPU emulation of a CUDA device (`--device cpu-adversarial[:N]`, for tests): the executor's
CUDA logic runs on it unchanged, and what would be a race on a GPU becomes a NaN loss or an exception here.

    streams      each stream is a thread running its queue in order, after a random delay per item; an op's
                 handler runs there, not in the worker that enqueued it (as a kernel runs after its launch)
    copies       copy_async runs after the handler that issued it has returned (it "lands late"), still in the
                 stream's order; one with pageable host memory on either side is an error (PageableCopyError)
    events       record/wait_event/synchronize_event as CUDA's: waiting on an event not yet recorded does not
                 wait; a host synchronization from inside a stream op is an error (HiddenSyncError)
    allocator    empty()/own() hand out blocks per stream; a block freed (its last tensor dropped) goes to the
                 next request on its stream at once and is filled with NaN (0xFF bytes) when handed out,
                 unless another stream recorded a use (record_stream): then only after that stream has run
                 everything enqueued before the free. A read on another stream without a wait or a record sees
                 NaN. As a handler's compute runs before it returns, a block that an op on another stream
                 touched (every aten op on a stream thread is watched) and that is freed without record_stream
                 for that stream is reported as an error, even where the NaN could not show.
    graphs       a capture records the aten ops it runs and a replay runs them again on the same memory
                 (device/emugraph.py); a copy with host memory or a host allocation during a capture is an
                 error (CaptureError), as a host synchronization already is
    devices      N is an emulated device index: each thread has a current device (0 until thread_init), a
                 stream op enqueued from a thread on another device is an error, and events of two devices
                 cannot be timed against each other (as CUDA's elapsed_time)

Tensors the executor computes without empty()/own() are ordinary CPU tensors that Python keeps alive; only the
allocator's blocks are reused adversarially, which is why the engine hands cross-stream results to own().
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tierflow.executor.device.base import (
    CaptureError,
    DeviceBackend,
    RoundAborted,
    TierOutOfMemory,
)
from tierflow.executor.device.emugraph import EmuGraph, EmuPool, capturing

BLOCK_ROUND_BYTES = 512  # CUDA's caching allocator rounds small requests to 512 bytes
NAN_BYTE = 0xFF  # every float dtype reads 0xFF.. as NaN
POLL_S = 0.02

_tls = threading.local()


def _current_stream() -> EmuStream | None:
    return getattr(_tls, "stream", None)


def _current_device() -> int:
    return getattr(_tls, "device", 0)


@dataclass(eq=False)
class EmuEvent:
    device: int
    enqueued: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    t_s: float = float("nan")

    def fire(self) -> None:
        self.t_s = time.perf_counter()
        self.done.set()


@dataclass(eq=False)
class Block:
    """A block of the emulated device allocator."""

    id: int
    array: np.ndarray
    stream: str | None  # the name of the stream it was allocated on (its pool), None: a host thread
    live: bool = True
    uses: set = field(default_factory=set)  # other streams that recorded a use (record_stream)
    users: dict = field(default_factory=dict)  # stream name -> op label: streams whose ops touched it
    own_copies: int = 0  # late copies on its own stream still to land
    freed: bool = False

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


class EmuStream:
    """A thread running its queue in order; sub-items an item issues (late copies, records, waits, markers
    from its own thread) run right after it, before the next queued item."""

    def __init__(self, backend: AdversarialCpuBackend, name: str, device: int, seed: int) -> None:
        self.backend, self.name, self.device = backend, name, device
        self.rng = random.Random(seed)
        self.q: deque[tuple[Callable[[], None], str]] = deque()
        self.sub: deque[Callable[[], None]] = deque()
        self.cv = threading.Condition()
        self.closed = False
        self.label = ""
        self.thread = threading.Thread(target=self._loop, name=f"tierflow-emu-{name}", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], None], label: str = "") -> None:
        if _current_stream() is self:
            self.sub.append(fn)
            return
        with self.cv:
            if self.closed:
                raise RuntimeError(f"emulated stream {self.name} is closed")
            self.q.append((fn, label))
            self.cv.notify_all()

    def idle(self) -> bool:
        with self.cv:
            return not self.q

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _delay(self, p: float, max_s: float) -> None:
        if self.backend.max_delay_s > 0 and self.rng.random() < p:
            time.sleep(self.rng.uniform(0, max_s * self.backend.max_delay_s))

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            with _UseTracker(self):
                fn()
        except RoundAborted:
            pass
        except BaseException as e:  # noqa: BLE001 - passed to the round, as an asynchronous CUDA error is
            self.backend.report(self.label or self.name, e)

    def _loop(self) -> None:
        _tls.device = self.device
        _tls.stream = self
        while True:
            with self.cv:
                while not self.q and not self.closed:
                    self.cv.wait()
                if not self.q:
                    return
                fn, self.label = self.q[0]
            self._delay(0.5, 1.0)
            self._run(fn)
            while self.sub:
                self._delay(0.7, 1.5)
                self._run(self.sub.popleft())
            with self.cv:
                self.q.popleft()
                self.cv.notify_all()


class _UseTracker(TorchDispatchMode):
    """While a stream runs an item: every aten op's tensors that live in the allocator's blocks are noted as
    used by that stream (the record_stream check in AdversarialCpuBackend._free)."""

    def __init__(self, stream: EmuStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        be, name = self.stream.backend, self.stream.name
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                block = be.blocks.get(t.untyped_storage().data_ptr())
                if block is not None and block.stream != name and name not in block.users:
                    block.users[name] = self.stream.label or name
        return func(*args, **kwargs)


class AdversarialCpuBackend(DeviceBackend):
    """See the module docstring."""

    streams_async = True
    pins = True
    pinned_limit_bytes: float | None = None  # tests: an emulated pinned-memory limit

    def __init__(self, index: int = 0, seed: int = 0, max_delay_s: float = 0.002) -> None:
        self.index = index
        self.device = torch.device("cpu")
        self.name = f"cpu-adversarial:{index}"
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.lock = threading.RLock()
        self.streams: list[EmuStream] = []
        self.blocks: dict[int, Block] = {}  # data pointer -> block
        self.free: dict[str | None, list[Block]] = {}  # per stream name: blocks outlive a round's streams
        self.host: dict[int, bool] = {}  # data pointer of a host buffer -> pinned
        self.allocated_bytes = self.reserved_bytes = 0
        self.max_allocated_bytes = self.max_reserved_bytes = 0
        self.cap_bytes: float | None = None
        self.pinned_bytes = 0
        self.reuses = 0  # blocks handed out again (the adversary really reused memory)
        self._abort = threading.Event()
        self._on_error: Callable[[str, BaseException], None] | None = None
        self._next_id = 0

    # -- threads, streams, events ----------------------------------------------------------------------------

    def thread_init(self) -> None:
        _tls.device = self.index

    def start_round(self, abort, on_error) -> None:
        self._abort, self._on_error = abort, on_error

    def report(self, label: str, e: BaseException) -> None:
        if self._on_error is not None:
            self._on_error(label, e)
        self._abort.set()

    def new_stream(self, resource: str) -> EmuStream:
        s = EmuStream(self, resource, self.index, self.seed * 1000 + len(self.streams))
        with self.lock:
            self.streams.append(s)
        return s

    def close_streams(self, streams) -> None:
        for s in streams:
            s.close()
            with self.lock:
                self.streams.remove(s)

    def _check_device(self, stream: EmuStream, what: str) -> None:
        if _current_stream() is None and _current_device() != stream.device:
            raise RuntimeError(f"{what} on a stream of device {stream.device} from a thread whose "
                               f"current device is {_current_device()} (the worker did not call "
                               "thread_init / set_device)")

    def record(self, stream: EmuStream | None) -> EmuEvent:
        if stream is None:
            stream = _current_stream()
            if stream is None:  # the current device's default stream: synchronous for the host
                ev = EmuEvent(_current_device(), enqueued=True)
                ev.fire()
                return ev
        self._check_device(stream, "record")
        ev = EmuEvent(stream.device, enqueued=True)
        stream.submit(ev.fire)
        return ev

    def _wait_done(self, ev: EmuEvent) -> None:
        while not ev.done.wait(POLL_S):
            if self._abort.is_set():
                raise RoundAborted()

    def wait_event(self, stream: EmuStream, event: EmuEvent) -> None:
        if not event.enqueued:  # CUDA: waiting on an event never recorded does not wait
            return
        stream.submit(lambda: self._wait_done(event))

    def synchronize_event(self, event: EmuEvent) -> None:
        self.check_host_sync("synchronize_event")
        if event.enqueued:
            self._wait_done(event)

    def elapsed_s(self, start: EmuEvent, end: EmuEvent) -> float:
        if start.device != end.device:
            raise RuntimeError(f"elapsed time between events of device {start.device} and device "
                               f"{end.device} (CUDA: both events must be recorded on the same device)")
        if not (start.done.is_set() and end.done.is_set()):
            raise RuntimeError("elapsed time of an event that has not completed")
        return end.t_s - start.t_s

    def launch(self, stream: EmuStream, fn, label: str) -> None:
        self._check_device(stream, "launch")
        stream.submit(fn, label)

    def current_stream(self):
        return _current_stream()

    def query_event(self, event: EmuEvent) -> bool:
        return not event.enqueued or event.done.is_set()

    def synchronize(self) -> None:
        self.check_host_sync("synchronize")
        for s in list(self.streams):
            while not s.idle():
                time.sleep(0.001)

    # -- device memory ---------------------------------------------------------------------------------------

    def graph_pool(self) -> EmuPool:
        return EmuPool()

    def new_graph(self, pool: EmuPool, persistent) -> EmuGraph:
        return EmuGraph(pool, persistent, self.is_host_tensor)

    def is_host_tensor(self, t: torch.Tensor) -> bool:
        """Host memory of this backend (a host buffer or the transfer area), as opposed to emulated device
        memory."""
        if not t.numel():
            return False
        ptr = t.untyped_storage().data_ptr()
        arena = self.arena
        return ptr in self.host or (arena is not None and arena.contains(ptr))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        want = max(BLOCK_ROUND_BYTES, -(-nbytes // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES)
        stream = _current_stream()
        name = stream.name if stream is not None else None
        with self.lock:
            if self.cap_bytes is not None and self.allocated_bytes + want > self.cap_bytes:
                raise torch.OutOfMemoryError(f"emulated device out of memory: tried to allocate {want} bytes "
                                             f"with {self.allocated_bytes} of {self.cap_bytes:.0f} allocated")
            pool = self.free.setdefault(name, [])
            fits = [b for b in pool if want <= b.nbytes <= 2 * want]
            if fits:
                block = min(fits, key=lambda b: b.nbytes)
                pool.remove(block)
                block.live, block.freed, block.uses, block.users = True, False, set(), {}
                self.reuses += 1
            else:
                arr = np.empty(want, dtype=np.uint8)
                block = Block(self._next_id, arr, name)
                self._next_id += 1
                self.blocks[arr.ctypes.data] = block
                self.reserved_bytes += want
                self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)
            self.allocated_bytes += block.nbytes
            self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        block.array.fill(NAN_BYTE)  # the new owner's memory holds garbage until it writes it
        view = block.array[:]
        weakref.finalize(view, self._free, block)
        base = torch.from_numpy(view)
        graph = capturing()
        if graph is not None:  # allocated during a capture: the graph's pool holds it from now on
            graph.pool.hold(base)
        return base[:nbytes].view(dtype)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.is_contiguous():
            out = self.empty(t.numel(), t.dtype).view(t.shape)
            out.copy_(t)
            return out
        perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
        tp = t.permute(*perm)
        if not tp.is_contiguous():
            return t  # not dense: stays an ordinary tensor
        out = self.empty(t.numel(), t.dtype).view(tp.shape)
        out.copy_(tp)
        return out.permute(*[perm.index(i) for i in range(len(perm))])

    def _block_of(self, t: torch.Tensor) -> Block | None:
        if t.numel() == 0:
            return None
        return self.blocks.get(t.untyped_storage().data_ptr())

    def _free(self, block: Block) -> None:
        recorded = {s.name for s in block.uses}
        unrecorded = {s: op for s, op in block.users.items() if s != block.stream and s not in recorded}
        for s, op in unrecorded.items():
            self.report(op, RuntimeError(
                f"a device block allocated on stream {block.stream} was used on stream {s} by op {op} "
                f"and freed without record_stream({s}): on CUDA its memory can be reused while that use is "
                "still queued"))
        with self.lock:
            block.live = False
            self.allocated_bytes -= block.nbytes
            if block.own_copies:
                return  # back to the pool when its own stream's late copies have landed (_copied)
            self._release(block)

    def _release(self, block: Block) -> None:
        """(under the lock) A freed block: to its stream's pool now, or after the streams that used it."""
        waits = [s for s in block.uses if s.name != block.stream and not s.closed]
        if not waits:
            self._to_pool(block)
            return
        left = [len(waits)]

        def marker() -> None:
            with self.lock:
                left[0] -= 1
                if left[0] == 0:
                    self._to_pool(block)

        for s in waits:
            s.submit(marker)

    def _to_pool(self, block: Block) -> None:
        if not block.freed:
            block.freed = True
            self.free.setdefault(block.stream, []).append(block)

    def record_stream(self, t: torch.Tensor | None, stream: EmuStream) -> None:
        if t is None:
            return
        block = self._block_of(t)
        if block is not None:
            with self.lock:
                block.uses.add(stream)

    # -- host memory and copies ------------------------------------------------------------------------------

    def host_bytes_raw(self, nbytes: int, pinned: bool, exact: bool) -> torch.Tensor:
        """numpy memory filled with NaN bytes, registered as pinned or pageable (copy_async checks it), within
        an emulated pinned-memory limit when a test sets one."""
        if capturing() is not None:
            raise CaptureError(f"a host allocation of {nbytes:,} bytes inside a capture (CUDA: memory "
                               "outside the graph's pool)")
        limit = self.pinned_limit_bytes
        if pinned and limit is not None and self.pinned_bytes + nbytes > limit:
            raise TierOutOfMemory("cpu (pinned)", nbytes, "emulated pinned-memory limit")
        arr = np.empty(max(nbytes, 1), dtype=np.uint8)
        arr.fill(NAN_BYTE)
        ptr = arr.ctypes.data
        with self.lock:
            self.host[ptr] = pinned
            if pinned:
                self.pinned_bytes += arr.nbytes
        weakref.finalize(arr, self._host_freed, ptr, arr.nbytes if pinned else 0)
        return torch.from_numpy(arr)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return not self._pageable(t)

    def poison_host(self, t: torch.Tensor, stream: EmuStream | None) -> None:
        """A transfer-area range handed out again holds garbage: NaN bytes, written in the new owner's stream
        order (after the waits for the previous owners' uses) or at once on a host thread."""
        if stream is None:
            t.fill_(NAN_BYTE)
        else:
            stream.submit(lambda: t.fill_(NAN_BYTE))

    def _pageable(self, t: torch.Tensor) -> bool:
        if not t.numel() or t.device.type != "cpu":
            return False
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.host:
            return not self.host[ptr]
        arena = self.arena
        return arena is not None and arena.contains(ptr) and not arena.pinned

    def _host_freed(self, ptr: int, pinned_bytes: int) -> None:
        with self.lock:
            self.host.pop(ptr, None)
            self.pinned_bytes -= pinned_bytes

    def _raw(self, t: torch.Tensor) -> torch.Tensor:
        """A view of t's memory that does not keep its block (or transfer-area range) allocated (as a queued
        kernel does not): a range given back while a copy is queued is handed out again at once."""
        arena = self.arena
        if arena is not None and t.numel() and arena.range_of(t) is not None:
            base = torch.from_numpy(arena.base).view(t.dtype)
            return base.as_strided(t.shape, t.stride(), (t.data_ptr() - arena.base_ptr) // t.element_size())
        block = self._block_of(t)
        if block is None:
            return t
        base = torch.from_numpy(block.array).view(t.dtype)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.check_copy(dst, src)
        if capturing() is not None:
            raise CaptureError("copy_async inside a capture (a transfer belongs outside the segment: its "
                               "host memory and its event are not the graph's)")
        stream = _current_stream()
        own = [b for b in (self._block_of(dst), self._block_of(src))
               if b is not None and b.stream == stream.name]
        with self.lock:
            for b in own:
                b.own_copies += 1
        d, s = self._raw(dst), self._raw(src)

        def land() -> None:
            try:
                d.copy_(s)
            finally:
                self._copied(own)

        stream.submit(land)
        self._note_arena_use(dst, src)

    def _copied(self, blocks: list[Block]) -> None:
        with self.lock:
            for b in blocks:
                b.own_copies -= 1
                if not b.own_copies and not b.live:
                    self._release(b)

    # -- measurement -----------------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, float]:
        return {"max_allocated_bytes": float(self.max_allocated_bytes),
                "max_reserved_bytes": float(self.max_reserved_bytes)}

    def reset_peaks(self) -> None:
        with self.lock:
            self.max_allocated_bytes, self.max_reserved_bytes = self.allocated_bytes, self.reserved_bytes

    def cap_memory(self, cap_bytes: float) -> None:
        self.cap_bytes = cap_bytes
