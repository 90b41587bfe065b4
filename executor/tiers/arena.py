"""The pinned transfer area: every host buffer that crosses PCIe while training (weight-fetch staging,
gradient wire buffers, activation / checkpoint staging, SSD reads that go to the device) is a view into ONE
host allocation made at start, pinned on CUDA (pageable on a plain CPU), sized from the plan.

Size (`planned_buffers`, `plan_peak_bytes`): the transfer buffers of the plan's ops, each from the op that
takes it to the op that gives it back, with the op's bytes (scaled from the plan's compute dtype to the run's)
rounded up to a page; replayed in the plan's order (graph.plan_order: dependencies and queues; until
2026-11-29 the ops sorted by key, which numbers each queue on its own, so a fetch could give back its buffer
before its offload took it and the area came out too small), the peak of their sum is the area's size.

    entry host part        offload_<t>  -> the entry's last fetch_<t>       offload bytes - write bytes
    entry SSD staging      offload_<t>  -> write_<t>                        write bytes
    entry SSD read         read_<t>     -> the fetch_<t> that copies it     read bytes
    weights SSD read       read_weights -> its fetch_weights                read bytes
    updated weights wire   adam(_deferred) -> update_weights                update bytes
    gradient wire          offload_grads (with streams; added on the host)  offload bytes

These are the plan's memory effects on the cpu tier for the entry and weight ops, and the op bytes of the two
wires (which the plan counts inside their ops). Handing out (`TransferArena.take`) is best fit over a free
list by byte offset (neighbours coalesce), so no request is rounded beyond a page. A stream that reads or
writes a view records an event (the backend's copy_async calls `note_use`); a freed range keeps those events,
and the next owner waits for them: a host thread synchronizes on them, an op on a stream makes its stream
wait. A request that does not fit (the run's order kept more buffers alive than the plan's order) is served
outside the area from the backend's pinned allocator and counted (`ArenaStats.overflow_bytes`), never silently
dropped.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierflow.executor.device.base import TierOutOfMemory
from tierflow.executor.tiers.direct_io import ALIGN, page_round
from tierflow.executor.tiers.ssd_store import aligned_empty
from tierflow.planner.core import opkinds as k
from tierflow.planner.core.graph import Task, plan_order
from tierflow.planner.core.workload import COMPUTE_BYTES, precision_of


@dataclass(frozen=True)
class PlannedBuffer:
    what: str
    take_op: int  # taken when this op starts
    give_op: int  # given back when this op ends
    nbytes: int  # page-rounded, in the run's compute dtype


def planned_buffers(tasks: list[Task], binding, state, elem_bytes: int, grad_wire: bool,
                    page: int = ALIGN, plan_elem_bytes: int = COMPUTE_BYTES) -> list[PlannedBuffer]:
    """The plan's transfer buffers (see the module docstring); `elem_bytes` of the run's compute dtype, the
    gradient wire only where offload_grads copies asynchronously (`grad_wire`); each rounded up to `page`.
    The weight and gradient buffers are one per owner block and the placement's element ranges (`state`):
    the plan's op bytes of those ops split proportionally over the optimizer parts and join a tied head's
    owners, where the executor moves whole element ranges per owner. The plan's op bytes count
    `plan_elem_bytes` per element (its precision's compute dtype)."""
    scale = elem_bytes / plan_elem_bytes
    out: list[PlannedBuffer] = []

    def add(what: str, take: int, give: int, nbytes: float) -> None:
        n = page_round(nbytes * scale, page)
        if n:
            out.append(PlannedBuffer(what, take, give, n))

    entries: dict = {}
    for t in tasks:
        if t.tensor in k.ENTRY_TENSORS:
            entries.setdefault(binding.entry_key(t), []).append(t)
    for key, ops in entries.items():
        kind = {t.kind.split("_", 1)[0]: t for t in ops}  # offload, write (one each)
        off, wr = kind.get("offload"), kind.get("write")
        fetches = [t for t in ops if t.kind.startswith("fetch_")]
        if off is None:
            continue
        ssd = wr.work if wr is not None else 0.0
        last = [t.id for t in fetches if t.id in binding.last_fetch]
        if last:
            add(f"{tuple(key)} host part", off.id, last[0], off.work - ssd)
        if wr is not None:
            add(f"{tuple(key)} SSD staging", off.id, wr.id, ssd)
        for r in (t for t in ops if t.kind.startswith("read_")):
            users = [f.id for f in fetches if binding.dep_of_kind[f.id].get(r.kind) == r.id]
            if users:
                add(f"{tuple(key)} SSD read", r.id, users[0], r.work)
    for t in tasks:
        if t.kind == k.FETCH_WEIGHTS and k.READ_WEIGHTS in binding.dep_of_kind[t.id]:
            r = binding.dep_of_kind[t.id][k.READ_WEIGHTS]
            for o, n in _weight_reads(tasks[r], state):  # one buffer per owner (a tied head reads two)
                add(f"weights b{t.block} it{t.iteration} owner {o} SSD read", r, t.id, n * plan_elem_bytes)
        elif t.kind == k.UPDATE_WEIGHTS:
            lo, hi = state.parts[t.block][binding.part_of[t.id]]  # the part's range on the device
            n = max(min(hi, state.vec["weights"][t.block].g) - lo, 0)
            add(f"weights b{t.block} it{t.iteration} update wire", t.deps[0], t.id, n * plan_elem_bytes)
        elif t.kind == k.OFFLOAD_GRADS and grad_wire:
            for (g, o), (lo, hi) in binding.grad_range.items():
                if g == t.id:
                    add(f"grads b{t.block} it{t.iteration} owner {o} "
                        "wire", t.id, t.id, (hi - lo) * plan_elem_bytes)
    return out


def _weight_reads(t: Task, state) -> list[tuple[int, int]]:
    """(owner, elements) of what read_weights t reads: every owner's range past the start of its SSD part
    (with several ranks: of this rank's shard, WeightOps.owners)."""
    out = []
    for o, lo, hi in state.owner_ranges(t.block):
        a = max(lo, state.vec["weights"][o].ssd_lo)
        if hi > a:
            out.append((o, hi - a))
    return out


def plan_peak_bytes(tasks: list[Task], buffers: list[PlannedBuffer]) -> int:
    """The peak of the live buffers' bytes, replaying the ops in the plan's order (graph.plan_order: its
    dependencies and queues, not the keys alone, which order each resource's queue only)."""
    take: dict[int, int] = {}
    give: dict[int, int] = {}
    for b in buffers:
        take[b.take_op] = take.get(b.take_op, 0) + b.nbytes
        give[b.give_op] = give.get(b.give_op, 0) + b.nbytes
    live = peak = 0
    for i in plan_order(tasks):
        live += take.get(i, 0)
        peak = max(peak, live)
        live -= give.get(i, 0)
    return peak


def arena_bytes_for(plan, binding, state, streams_async: bool) -> int:
    """The transfer area a run of `plan` on `state` (its compute dtype and element ranges) needs."""
    elem = torch.empty(0, dtype=state.compute_dtype).element_size()
    tasks = plan.graph.tasks
    plan_elem = precision_of(plan.model).compute_bytes
    return plan_peak_bytes(tasks, planned_buffers(tasks, binding, state, elem, streams_async,
                                                  plan_elem_bytes=plan_elem))


class TransferAreaOutOfMemory(TierOutOfMemory):
    """The transfer area could not be allocated at start (exit 3, one line naming the tier and the size)."""

    prefix = ""  # the message says it ("<tier> out of memory: ...")

    def __init__(self, tier: str, nbytes: int, detail: str) -> None:
        super().__init__(tier, nbytes, detail)
        self.line = (f"{tier} out of memory: the plan's pinned transfer area needs {nbytes / 2**30:.3f} GiB "
                     f"({nbytes:,} bytes) and the allocation failed ({detail}); raise the pinned-memory "
                     "limit (ulimit -l, see tierflow env) or plan with fewer bytes in flight (tierflow plan "
                     "--hw box.yaml)")

    def __str__(self) -> str:
        return self.line


@dataclass
class ArenaStats:
    size_bytes: int
    used_bytes: int = 0
    max_used_bytes: int = 0
    takes: int = 0
    waits: int = 0  # takes that had to wait for a previous owner's stream use
    overflows: int = 0
    overflow_bytes: int = 0  # served outside the area (the backend's pinned allocator)


@dataclass
class _Range:
    off: int
    size: int
    events: list = field(default_factory=list)  # stream uses of the memory not known to be complete


class TransferArena:
    """One host allocation of `size_bytes` (pinned where the backend pins),
    handed out as page-aligned views."""

    def __init__(self, backend, size_bytes: int, warn: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.size_bytes = page_round(size_bytes)
        self.pinned = backend.pins
        self.warn = warn
        self.lock = threading.Lock()
        self.stats = ArenaStats(self.size_bytes)
        self.live: dict[int, _Range] = {}  # data pointer of a handed-out view -> its range
        self.returned: deque[_Range] = deque()  # freed by finalizers (any thread), merged at the next take
        self.free: list[_Range] = []
        if self.size_bytes:
            try:
                raw = backend.pinned_area(self.size_bytes + ALIGN)
            except TierOutOfMemory as e:
                raise TransferAreaOutOfMemory(e.tier, self.size_bytes, str(e)) from None
            skip = (-raw.data_ptr()) % ALIGN
            self.base = raw.numpy()[skip: skip + self.size_bytes]
            self.free.append(_Range(0, self.size_bytes))
        else:
            self.base = None
        self.base_ptr = self.base.ctypes.data if self.base is not None else 0

    # -- ownership -------------------------------------------------------------------------------------------

    def contains(self, ptr: int) -> bool:
        return self.base is not None and self.base_ptr <= ptr < self.base_ptr + self.size_bytes

    def range_of(self, t: torch.Tensor) -> _Range | None:
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        return self.live.get(t.untyped_storage().data_ptr())

    def note_use(self, t: torch.Tensor, event) -> None:
        """A stream op reads or writes `t` (an event recorded after it on that stream)."""
        r = self.range_of(t)
        if r is not None:
            with self.lock:
                r.events.append(event)

    # -- handing out -----------------------------------------------------------------------------------------

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return self.take_bytes(nbytes)[:nbytes].view(dtype)

    def take_bytes(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 view of at least `nbytes` (a whole number of pages)."""
        size = page_round(nbytes)
        with self.lock:
            self._merge_returned()
            r = self._fit(size)
            if r is None:
                self.stats.overflows += 1
                self.stats.overflow_bytes += size
                first = self.stats.overflows == 1
            else:
                self.stats.takes += 1
                self.stats.used_bytes += size
                self.stats.max_used_bytes = max(self.stats.max_used_bytes, self.stats.used_bytes)
        if r is None:
            if first and self.warn is not None:
                self.warn(f"warning: the pinned transfer area ({self.size_bytes:,} bytes, the plan's peak) "
                          f"is full; {size:,} bytes pinned outside it (the run keeps more transfer buffers "
                          "alive than the plan's order)")
            return aligned_empty(size, self.backend.pins, self.backend)
        stream = self.backend.current_stream()
        pending = [ev for ev in r.events if not self.backend.query_event(ev)]
        if pending:
            with self.lock:
                self.stats.waits += 1
        for ev in pending:  # the previous owners' stream uses come first
            if stream is None:
                self.backend.synchronize_event(ev)
            else:
                self.backend.wait_event(stream, ev)
        r.events = []
        arr = self.base[r.off: r.off + r.size]
        weakref.finalize(arr, self.returned.append, r)
        view = torch.from_numpy(arr)
        with self.lock:
            self.live[view.data_ptr()] = r
        self.backend.poison_host(view, stream)
        return view

    def _fit(self, size: int) -> _Range | None:
        """(under the lock) Best fit, preferring memory no stream still uses; the rest stays free."""
        fits = [r for r in self.free if r.size >= size]
        if not fits:
            return None
        for r in fits:
            r.events = [ev for ev in r.events if not self.backend.query_event(ev)]
        r = min(fits, key=lambda r: (bool(r.events), r.size, r.off))
        self.free.remove(r)
        if r.size > size:
            self._insert(_Range(r.off + size, r.size - size, list(r.events)))
        return _Range(r.off, size, r.events)

    def _merge_returned(self) -> None:
        while self.returned:
            r = self.returned.popleft()
            self.live.pop(self.base_ptr + r.off, None)
            self.stats.used_bytes -= r.size
            self._insert(_Range(r.off, r.size, list(r.events)))

    def _insert(self, r: _Range) -> None:
        """(under the lock) A free range, coalesced with its free neighbours."""
        i = 0
        while i < len(self.free) and self.free[i].off < r.off:
            i += 1
        self.free.insert(i, r)
        if i + 1 < len(self.free) and r.off + r.size == self.free[i + 1].off:
            nxt = self.free.pop(i + 1)
            r.size += nxt.size
            r.events += nxt.events
        if i > 0 and self.free[i - 1].off + self.free[i - 1].size == r.off:
            prev = self.free[i - 1]
            prev.size += r.size
            prev.events += r.events
            self.free.pop(i)

    def used_bytes(self) -> int:
        with self.lock:
            self._merge_returned()
            return self.stats.used_bytes
