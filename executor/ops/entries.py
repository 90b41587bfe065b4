"""Entries: the activations, their gradients and the saved-tensor packs that wait between ops (see
binding.py), and the plan's ops that move them: offload (device -> kept / host / SSD staging), write and read
(the SSD part), fetch (back together on the device, for the consumer that depends on the fetch)."""

from __future__ import annotations

import numpy as np
import torch

from tierflow.executor.binding import Entry, EntryKey, EntryState, ExecutionError
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.tiers.packs import Pack
from tierflow.executor.tiers.ssd_store import split_counts
from tierflow.planner.core.graph import Task


class EntryOps:
    def __init__(self, cx: OpContext) -> None:
        self.cx = cx
        self.binding = cx.binding

    # -- producers and consumers (called by the compute ops) -------------------------------------------------

    def put(self, rs: RoundState, key: EntryKey, dev: torch.Tensor | None = None,
            pack: Pack | None = None) -> None:
        """A compute op produced `key` on the device: keep it for its consumers (if it has any)."""
        users = self.binding.consumers[key]
        if users == 0:
            return
        if dev is not None:
            dev = self.cx.backend.own(dev)
        e = Entry(shape=tuple(dev.shape) if dev is not None else None,
                  dtype=dev.dtype if dev is not None else torch.uint8, users=users,
                  dev_users=self.binding.direct_users[key], dev=dev, pack=pack)
        with rs.lock:
            rs.entries[key] = e

    def take(self, rs: RoundState, t: Task, key: EntryKey):
        """What consumer t reads for `key`: the copy made by its fetch, else the device tensor (or pack)."""
        fid = self.binding.fetch_for[t.id].get(key)
        e = rs.entries[key]
        if fid is not None:
            data = rs.fetched.pop(fid)
            rs.use_on(data, "gpu")
        elif e.is_pack:
            return e.pack
        elif e.holds_device_copy:
            return e.dev
        elif e.state is not EntryState.ON_DEVICE and 0 < e.gpu_elems == int(np.prod(e.shape)):
            data = e.kept  # offloaded with every element kept on the device (by the d2h stream)
            rs.use_on(data, "gpu")
        else:
            raise ExecutionError(f"op {t.id} ({t.label}): {tuple(key)} is neither on the device nor fetched "
                                 "by one of its dependencies (inconsistent plan)")
        if e.is_pack:
            e.pack.restore(data)
            return e.pack
        return data.view(e.shape)

    def done_with(self, rs: RoundState, t: Task, key: EntryKey) -> None:
        """Consumer t has read `key`: release the device copy (for a direct reader) and, after the last
        consumer, the entry and its SSD file."""
        with rs.lock:
            e = rs.entries[key]
            if key not in self.binding.fetch_for[t.id]:
                self._dev_release(e)
            e.users -= 1
            if e.users == 0:
                del rs.entries[key]
                e.move(EntryState.RELEASED)
                name = e.ssd_name
            else:
                name = None
        if name and self.cx.ssd:
            self.cx.ssd.delete(name)

    def _dev_release(self, e: Entry) -> None:
        """One reader of the produced device tensor is done (called under the round's lock)."""
        e.dev_users -= 1
        if e.dev_users <= 0:  # (not e.holds_device_copy)
            e.dev = None
            if e.pack is not None:
                e.pack.saved = None

    # -- the plan's ops --------------------------------------------------------------------------------------

    def offload(self, rs: RoundState, t: Task) -> None:
        """Split the entry's flat elements over the tiers: [0, gpu) kept on the device, then the transfer area
        (host part), then a transfer-area buffer staging the SSD part for the write. Each source (the tensor,
        or each tensor of a pack, as bytes) is copied straight into its slices of those buffers: nothing is
        joined first."""
        be = self.cx.backend
        e = rs.entries[self.binding.entry_key(t)]
        if e.is_pack:
            if rs.streams is not None:
                for x in e.pack.saved:
                    rs.use_on(x, "d2h")
            sources, n = e.pack.segments()
            e.dtype, e.shape = torch.uint8, (n,)
        else:
            rs.use_on(e.dev, "d2h")
            sources, n = [(0, e.dev.reshape(-1))], e.dev.numel()
        ck = self.cx.cfg.placement.checkpoints
        e.gpu_elems, e.cpu_elems, e.ssd_elems = split_counts(n, ck.gpu, ck.ssd)
        g, c = e.gpu_elems, e.cpu_elems
        dests = []
        if g:
            e.kept = be.empty(g, e.dtype)
            dests.append((0, e.kept))
        if c:
            e.host_cpu = self.cx.transfer_buffer(c, e.dtype)
            dests.append((g, e.host_cpu))
        if e.ssd_elems:
            e.host_ssd = self.cx.transfer_buffer(e.ssd_elems, e.dtype)
            dests.append((g + c, e.host_ssd))
        lay = e.pack.layout if e.is_pack else None
        scatter(be, sources, dests, lay.cuts if lay is not None else None)
        with rs.lock:
            e.move(EntryState.OFFLOADED)
            if e.is_pack:
                e.pack.saved = None  # its bytes now live in kept / host
            self._dev_release(e)

    @staticmethod
    def _ssd_name(key: EntryKey) -> str:
        return f"{key.name}_it{key.iteration}_b{key.block}_m{key.mb}"

    def write(self, rs: RoundState, t: Task) -> None:
        key = self.binding.entry_key(t)
        e = rs.entries[key]
        name = self._ssd_name(key)
        self.cx.ssd.write(name, e.host_ssd)
        e.ssd_name, e.host_ssd = name, None
        e.move(EntryState.ON_SSD)

    def read(self, rs: RoundState, t: Task) -> None:
        e = rs.entries[self.binding.entry_key(t)]
        # the fetch copies it
        e.host_ssd = self.cx.ssd.read(e.ssd_name, e.dtype, e.ssd_elems, into=self.cx.transfer_bytes)
        e.move(EntryState.READ_BACK)

    def fetch(self, rs: RoundState, t: Task) -> None:
        """Copy the kept, host and SSD parts into one device buffer for the consumer that depends on this op.
        The SSD part read back is dropped at once; the last fetch of the entry also drops the kept and the
        host parts (the plan frees them there: its consumer reads only the fetched copy). A dropped buffer
        that a queued copy still reads is kept by record_stream (device) and by the transfer area's events
        (host)."""
        be = self.cx.backend
        e = rs.entries[self.binding.entry_key(t)]
        assert not e.ssd_elems or e.state in (EntryState.OFFLOADED, EntryState.READ_BACK), e.state
        g, c = e.gpu_elems, e.cpu_elems
        dst = be.empty(g + c + e.ssd_elems, e.dtype)
        if g:
            rs.use_on(e.kept, "h2d")
            be.copy_async(dst[:g], e.kept)
        if c:
            be.copy_async(dst[g:g + c], e.host_cpu)
        if e.ssd_elems:
            be.copy_async(dst[g + c:], e.host_ssd)
            e.host_ssd = None
        if t.id in self.binding.last_fetch:
            e.kept = e.host_cpu = None
        e.move(EntryState.FETCHED)
        rs.fetched[t.id] = dst


def scatter(be, sources: list[tuple[int, torch.Tensor]], dests: list[tuple[int, torch.Tensor]],
            cuts: dict | None = None) -> None:
    """Copy flat sources [(offset, tensor)] of one flat layout into the flat destinations [(offset, buffer)]
    that tile it: each overlap is one copy_async (backend.copy_many), straight into the destination's slice;
    a source inside one destination is copied whole (no slice of it). Into one destination that holds the
    whole layout (an entry offloaded to one tier) the slices are one split_with_sizes call, its sizes kept in
    `cuts` (a pack layout's: the same sources' sizes and offsets every time) per destination size."""
    if len(dests) == 1 and dests[0][0] == 0:
        dst = dests[0][1]
        cut = cuts.get(dst.numel()) if cuts is not None else None
        if cut is None:
            cut = _cut(sources, dst.numel())
            if cuts is not None:
                cuts[dst.numel()] = cut
        sizes, picks = cut
        pieces = dst.split_with_sizes(sizes)
        be.copy_many([(pieces[i], sources[k][1]) for k, i in picks])
        return
    spans = [(do, do + dst.numel(), dst) for do, dst in dests]
    pairs = []
    for so, src in sources:
        se = so + src.numel()
        for do, de, dst in spans:
            a, z = max(so, do), min(se, de)
            if z > a:
                pairs.append((dst[a - do: z - do], src if (a, z) == (so, se) else src[a - so: z - so]))
    be.copy_many(pairs)


def _cut(sources: list[tuple[int, torch.Tensor]], n: int) -> tuple[list[int], list[tuple[int, int]]]:
    """How one flat buffer of `n` elements holds the flat sources [(offset, tensor)] (ascending, disjoint):
    the split_with_sizes sizes that cut it into the sources' slices, the gaps between them and the tail, and
    (source index, piece index) of each non-empty source."""
    sizes, pos, picks = [], 0, []
    for k, (so, src) in enumerate(sources):
        m = src.numel()
        if so > pos:
            sizes.append(so - pos)
        if m:
            picks.append((k, len(sizes)))
        sizes.append(m)
        pos = so + m
    sizes.append(n - pos)
    return sizes, picks
