"""The weight ops: read a block's SSD range into the transfer area (read_weights), bring the non-resident part
to the device (fetch_weights; with several ranks this rank's shard, which ops/net.py's all-gather completes),
and copy a CPU optimizer step's new compute weights back to their device range (update_weights).
`WeightOps.weights` gives a compute op the weights of its block, resident or fetched (`OwnerWeights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierflow.executor.binding import ExecutionError
from tierflow.executor.ops.context import OpContext, RoundState, Staged
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import READ_WEIGHTS


@dataclass
class OwnerWeights:
    """The compute weights of one owner's range [lo, hi) on the device: elements before `start` in the
    resident vector (its element 0 is the owner's element 0), from `start` on in the buffer a fetch_weights op
    filled."""

    lo: int
    hi: int
    resident: torch.Tensor | None
    start: int
    fetched: torch.Tensor | None

    def view(self, a: int, z: int) -> torch.Tensor:
        """Elements [a, z) of the owner's vector; a parameter lies wholly in one of the two parts."""
        if a >= self.start:
            return self.fetched[a - self.start: z - self.start]
        assert z <= self.start, (a, z, self.start)
        return self.resident[a:z]


class WeightOps:
    """Weights of the block a compute op runs:
    resident on the device, or fetched for it by a fetch_weights op."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx
        # block -> (its owners, their resident weights): _resident's lists
        self._resident_of: dict[int, tuple[list[int], list[OwnerWeights]]] = {}

    def owners(self, b: int) -> list[tuple[int, int, int]]:
        """(owner, lo, hi) of each owner's weights this rank fetches for block b (TrainState.owner_ranges)."""
        return self.cx.state.owner_ranges(b)

    def read_weights(self, rs: RoundState, t: Task) -> None:
        """The SSD range of every owner's weights into a transfer-area buffer (fetch_weights copies it)."""
        out = {}
        for o, lo, hi in self.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            a = max(lo, W.ssd_lo)
            if hi <= a:
                continue
            pieces = [(name, max(plo, a), min(phi, hi), plo, phi) for name, _j, plo, phi in W.ssd_pieces()
                      if min(phi, hi) > max(plo, a)]
            # one file, exactly the range: read into pinned
            if len(pieces) == 1 and pieces[0][1:] == (a, hi, a, hi):
                out[o] = self.cx.ssd.read(pieces[0][0], W.dtype, hi - a, into=self.cx.transfer_bytes)
                continue
            buf = self.cx.transfer_buffer(hi - a, W.dtype)
            for name, x, z, plo, phi in pieces:
                buf[x - a: z - a].copy_(self.cx.ssd.read(name, W.dtype, phi - plo)[x - plo: z - plo])
            out[o] = buf
        rs.staged[Staged("weights_read", t.id)] = out

    def fetch_start(self, o: int, lo: int, hi: int) -> int:
        """Where the fetched buffer of owner o's range [lo, hi) starts: the first element not on the device,
        or the start of the parameter that element belongs to, so that every parameter is one tensor (of the
        resident vector or of the fetched buffer) and nothing is concatenated per use. The resident part of
        that one parameter is copied into the buffer too: the only device bytes beyond the plan's fetch."""
        g = self.cx.state.vec["weights"][o].g
        if g <= lo:
            return lo
        for s in self.cx.layout.slots[o]:
            if s.offset < g < s.offset + s.numel:
                return max(lo, s.offset)
        return g

    def fetch_weights(self, rs: RoundState, t: Task) -> None:
        """The non-resident part of every owner's range to the device, straight into one buffer per owner
        (from fetch_start): device memory of a parameter split by the placement, host memory, then what
        read_weights read. With several ranks: this rank's whole shard into its slot of a full-size buffer per
        owner, which all_gather_weights completes (net.py)."""
        be = self.cx.backend
        rid = self.cx.binding.dep_of_kind[t.id].get(READ_WEIGHTS)
        staged = rs.staged.pop(Staged("weights_read", rid)) if rid is not None else {}
        if not self.cx.state.world.single:
            rs.weight_bufs[t.id] = self.shard_buffers(rs, t, staged)
            return
        out = {}
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            if hi <= W.g:
                continue
            base = self.fetch_start(o, lo, hi)
            dst = be.empty(hi - base, W.dtype)
            if W.g > base:  # the resident head of the parameter the split cuts
                be.copy_async(dst[: W.g - base], W.dev[base: W.g])
            a, z = max(base, W.g), min(hi, W.ssd_lo)
            if z > a:
                be.copy_async(dst[a - base: z - base], W.host[a - W.g: z - W.g])
            if o in staged:
                s = max(lo, W.ssd_lo)
                be.copy_async(dst[s - base:], staged[o])
            out[o] = (base, dst)
        rs.weight_bufs[t.id] = out

    def shard_buffers(self, rs: RoundState, t: Task, staged: dict) -> dict[int, torch.Tensor]:
        """{owner: a device buffer of W*S elements (S = ceil(n/W)) holding this rank's shard of the owner's
        compute weights in slot [r*S, r*S + shard)}: the device part copied on the device, the host part and
        what read_weights read (`staged`) copied from pinned host memory. The other slots are filled by the
        gather."""
        be, world = self.cx.backend, self.cx.state.world
        out = {}
        for o, _lo, hi in self.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            s = world.shard_size(self.cx.layout.numel[o])
            full = be.empty(s * world.ranks, W.dtype)
            slot = full[world.rank * s: world.rank * s + hi]
            if W.g:
                slot[: W.g].copy_(W.dev)  # device to device, on this op's stream
            if W.ssd_lo > W.g:
                be.copy_async(slot[W.g: W.ssd_lo], W.host)
            if o in staged:
                be.copy_async(slot[W.ssd_lo:], staged[o])
            out[o] = full
        return out

    def weights(self, rs: RoundState, t: Task) -> list[OwnerWeights]:
        """The weights of every owner of block t.block: resident, fetched, or both (never joined); with
        several ranks the owner's range of the gathered full-size buffer (all of it "fetched", from element
        0)."""
        fid = self.cx.binding.wfetch[t.id]
        if not self.cx.state.world.single:
            if fid is None:
                raise ExecutionError(f"op {t.id} ({t.label}): no all_gather_weights precedes it on a plan "
                                     f"for {self.cx.state.world.ranks} ranks (inconsistent plan)")
            bufs = rs.weight_bufs[fid]
            out = []
            for o, lo, hi in self.cx.layout.owners(t.block):
                rs.use_on(bufs[o], "gpu")
                out.append(OwnerWeights(lo, hi, None, 0, bufs[o]))
            return out
        if fid is None:
            return self._resident(t)
        out = []
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            base, buf = rs.weight_bufs[fid].get(o, (hi, None))
            rs.use_on(buf, "gpu")
            out.append(OwnerWeights(lo, hi, W.dev, base, buf))
        return out

    def _resident(self, t: Task) -> list[OwnerWeights]:
        """The resident weights of block t.block (no fetch): one list per block, made again only when a
        vector is not the one it was made of (a state loaded anew), so that a compute op on resident weights
        builds nothing and BlockParams knows its leaves by the list's identity."""
        vecs = self.cx.state.vec["weights"]
        owners, cached = self._resident_of.get(t.block, ((), None))
        if cached is not None:
            for o, ow in zip(owners, cached):  # (a loop: no generator made per op)
                if ow.resident is not vecs[o].dev:
                    break
            else:
                return cached
        out = []
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = vecs[o]
            if W.g < hi:
                raise ExecutionError(f"op {t.id} ({t.label}): weights of block {o} are not all on the "
                                     "device and no fetch_weights precedes it (inconsistent plan)")
            out.append(OwnerWeights(lo, hi, W.dev, hi, None))
        self._resident_of[t.block] = ([o for o, _lo, _hi in self.cx.layout.owners(t.block)], out)
        return out

    def release(self, rs: RoundState, t: Task) -> None:
        """Compute op t is done with its fetched weights: the last reader frees the fetch's buffers."""
        fid = self.cx.binding.wfetch.get(t.id)
        if fid is None:
            return
        rs.weight_users[fid] -= 1
        if rs.weight_users[fid] == 0:
            rs.weight_bufs.pop(fid, None)

    def update_weights(self, rs: RoundState, t: Task) -> None:
        a, z, w = rs.staged.pop(Staged("weights_gpu", t.deps[0]))
        if z > a:
            self.cx.backend.copy_async(self.cx.state.vec["weights"][t.block].dev[a:z], w)
