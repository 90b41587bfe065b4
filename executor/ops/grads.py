"""The ops on the training state (state.py's tiered vectors): weights (read from SSD, fetch to the device, update
after a CPU optimizer step), gradients (to the host, to and from SSD) and the optimizer steps.

Numerics: weight gradients are accumulated in fp32 on the device (GradBuffers), sent to the host in the
compute dtype and accumulated there in fp32; AdamW runs in fp32 on the host with PyTorch's fused/foreach
kernel (or on the device for a GPU optimizer); the compute copy of the weights is the updated fp32 master cast
to the compute dtype.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.binding import OPTIMIZER_PART, ExecutionError
from tierflow.executor.context import OpContext, RoundState, Staged
from tierflow.executor.device import RoundAborted
from tierflow.planner.core.graph import Task

OPT_CLASSES = ("master", "adam_m", "adam_v")


@dataclass
class OwnerWeights:
    """The compute weights of one owner's range [lo, hi) on the device: elements before `start` in the resident
    vector (its element 0 is the owner's element 0), from `start` on in the buffer a fetch_weights op filled."""

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
    """Weights of the block a compute op runs: resident on the device, or fetched for it by a fetch_weights op."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx

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
            if len(pieces) == 1 and pieces[0][1:] == (a, hi, a, hi):  # one file, exactly the range: read into pinned
                out[o] = self.cx.ssd.read(pieces[0][0], W.dtype, hi - a, into=self.cx.transfer_bytes)
                continue
            buf = self.cx.transfer_buffer(hi - a, W.dtype)
            for name, x, z, plo, phi in pieces:
                buf[x - a: z - a].copy_(self.cx.ssd.read(name, W.dtype, phi - plo)[x - plo: z - plo])
            out[o] = buf
        rs.staged[Staged("weights_read", t.id)] = out

    def fetch_start(self, o: int, lo: int, hi: int) -> int:
        """Where the fetched buffer of owner o's range [lo, hi) starts: the first element not on the device, or
        the start of the parameter that element belongs to, so that every parameter is one tensor (of the
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
        """The non-resident part of every owner's range to the device, straight into one buffer per owner (from
        fetch_start): device memory of a parameter split by the placement, host memory, then what read_weights
        read. With several ranks: this rank's whole shard into its slot of a full-size buffer per owner, which
        all_gather_weights completes (ops_net.py)."""
        be = self.cx.backend
        rid = self.cx.binding.dep_of_kind[t.id].get("read_weights")
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
        compute weights in slot [r*S, r*S + shard)}: the device part copied on the device, the host part and what
        read_weights read (`staged`) copied from pinned host memory. The other slots are filled by the gather."""
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
        """The weights of every owner of block t.block: resident, fetched, or both (never joined); with several
        ranks the owner's range of the gathered full-size buffer (all of it "fetched", from element 0)."""
        fid = self.cx.binding.wfetch[t.id]
        if not self.cx.state.world.single:
            if fid is None:
                raise ExecutionError(f"op {t.id} ({t.label}): no all_gather_weights precedes it on a plan for "
                                     f"{self.cx.state.world.ranks} ranks (inconsistent plan)")
            bufs = rs.weight_bufs[fid]
            out = []
            for o, lo, hi in self.cx.layout.owners(t.block):
                rs.use_on(bufs[o], "gpu")
                out.append(OwnerWeights(lo, hi, None, 0, bufs[o]))
            return out
        out = []
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            if fid is None:
                if W.g < hi:
                    raise ExecutionError(f"op {t.id} ({t.label}): weights of block {o} are not all on the device and "
                                         "no fetch_weights precedes it (inconsistent plan)")
                out.append(OwnerWeights(lo, hi, W.dev, hi, None))
                continue
            base, buf = rs.weight_bufs[fid].get(o, (hi, None))
            rs.use_on(buf, "gpu")
            out.append(OwnerWeights(lo, hi, W.dev, base, buf))
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


class GradBuffers:
    """Weight-gradient buffers on the device, one per (op that takes them, owner block), covering the owner's
    range the taking op gets (binding.grad_range: a tied head's buffer for block 0 is the wte range only).

    The plan counts a buffer that several compute ops add into (a weight use of several micro-batches, or
    gradients kept on the device) as fp32 and one written by a single compute op as the compute dtype
    (GRAD_ACCUM_BYTES vs GRAD_WIRE_BYTES): a single contribution is written straight into a compute-dtype
    buffer (the same values an fp32 buffer would round to on the wire), several are added in fp32 and, after
    the last, cast into a compute-dtype buffer on the compute stream, the fp32 one freed. Either way the
    offload_grads op only copies what it takes (no cast on the D2H queue). A GPU optimizer keeps fp32.

    With several ranks every buffer is fp32 (whatever the number of contributions) and spans the owner's whole
    vector padded to W*S elements: the reduce-scatter sums in fp32, and reduce_scatter_grads casts this rank's
    shard to the compute dtype on the net stream for an offload_grads taker (ops_net.py), so that offload_grads
    still only copies."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx
        # main's dtype rule (compute dtype for a single contribution, cast after the last): one rank, host optimizer
        self.wire_cast = not cx.state.placement.gpu_optimizer and cx.state.world.single

    def accumulate(self, rs: RoundState, t: Task, o: int, pieces: list[tuple[int, int, torch.Tensor | None]]) -> None:
        """Gradients `pieces` = [(lo, hi, grad)] of owner o's ranges into the buffer of the op that will take
        them. A None gradient (a parameter the step did not use) adds nothing."""
        bind = self.cx.binding
        key = (bind.grad_group[(t.id, o)], o)
        base, end = bind.grad_range[key]
        cast = self.wire_cast
        single = bind.grad_contributors[key] == 1 and cast
        with rs.lock:
            acc = rs.grad_acc.get(key)
            left = rs.grad_left.setdefault(key, bind.grad_contributors[key]) - 1
            rs.grad_left[key] = left
        if acc is None:
            # with several ranks [base, end) is the owner's whole vector padded to W*S elements (binding)
            acc = self.cx.backend.empty(end - base, self.cx.dtype if single else torch.float32).zero_()
            with rs.lock:
                rs.grad_acc[key] = acc
        for lo, hi, grad in pieces:
            if grad is None:
                continue
            if single:
                acc[lo - base: hi - base].copy_(grad.reshape(-1))
            else:
                acc[lo - base: hi - base] += grad.reshape(-1)
        if left == 0 and acc.dtype != self.cx.dtype and cast:
            wire = self.cx.backend.empty(end - base, self.cx.dtype)
            wire.copy_(acc)  # the cast, on the compute stream where the gradient is produced
            with rs.lock:
                rs.grad_acc[key] = wire

    def take(self, rs: RoundState, group: int) -> list[tuple[int, int, torch.Tensor]]:
        """(owner, first element, buffer) of every buffer the op `group` takes."""
        with rs.lock:
            keys = [k for k in rs.grad_acc if k[0] == group]
            for k in keys:
                rs.grad_left.pop(k, None)
            return [(k[1], self.cx.binding.grad_range[k][0], rs.grad_acc.pop(k)) for k in keys]


class GradOps:
    """Weight gradients on the host: fp32 accumulators, the SSD range written out and read back."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers

    def offload_grads(self, rs: RoundState, t: Task) -> None:
        """Send a block's gradients (already in the compute dtype: GradBuffers) to the host; they are added to the
        fp32 accumulators on the host, not in the D2H queue: with streams by HostGradAdds (after this copy's
        event), on a plain CPU at once."""
        be = self.cx.backend
        for o, lo, g in self.buffers.take(rs, t.id):
            rs.use_on(g, "d2h")
            if not self.cx.asynchronous:
                self.cx.state.grads[o][lo: lo + g.numel()] += g.float()
                continue
            host = self.cx.transfer_buffer(g.numel(), g.dtype)
            be.copy_async(host, g)
            rs.grad_adds.submit(t, o, lo, be.record(rs.streams["d2h"]), host)

    def _ssd_range(self, b: int) -> tuple[int, int]:
        _gpu_elems, _cpu_elems, ssd_elems = self.cx.state.grad_split[b]
        n = self.cx.state.shard_numel[b]
        return n - ssd_elems, n

    def write_grads(self, rs: RoundState, t: Task) -> None:
        HostGradAdds.wait_for(rs, t.block)
        a, z = self._ssd_range(t.block)
        if z > a:
            self.cx.ssd.write(f"grads_b{t.block}", self.cx.state.grads[t.block][a:z])
            self.cx.state.grads[t.block][a:z].zero_()

    def read_grads(self, rs: RoundState, t: Task) -> None:
        HostGradAdds.wait_for(rs, t.block)
        a, z = self._ssd_range(t.block)
        if z > a:
            self.cx.state.grads[t.block][a:z].copy_(self.cx.ssd.read(f"grads_b{t.block}", torch.float32, z - a))


class OptimizerOps:
    """AdamW steps: per optimizer part on the host (adam, adam_deferred, with their SSD reads and writes), or
    per block on the device (adam_gpu)."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers

    def _adamw(self, params, grads, ms, vs, step: int, fused: bool) -> None:
        h = self.cx.hyper
        # a fill kernel, not torch.tensor(..., device=cuda): that is a synchronizing copy from pageable memory
        steps = [torch.full((), float(step - 1), dtype=torch.float32, device=p.device) for p in params]
        adamw_step(params, grads, ms, vs, [], steps, foreach=False if fused else None, fused=fused,
                   amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay,
                   eps=h.eps, maximize=False)

    def read_opt_states(self, rs: RoundState, t: Task) -> None:
        j = self.cx.binding.part_of[t.id]
        out = {}
        for cls in OPT_CLASSES:
            V = self.cx.state.vec[cls][t.block]
            for name, pj, lo, hi in V.ssd_pieces():
                if pj == j:
                    out[cls] = (lo, hi, self.cx.ssd.read(name, torch.float32, hi - lo))  # host-only: pageable
        rs.staged[Staged("opt_states_read", t.id)] = out

    def adam(self, rs: RoundState, t: Task) -> None:
        """One optimizer part of block t.block on the host (adam and adam_deferred)."""
        b, state = t.block, self.cx.state
        HostGradAdds.wait_for(rs, b)
        j = OPTIMIZER_PART[t.kind]
        lo, hi = state.parts[b][j]
        rid = self.cx.binding.dep_of_kind[t.id].get("read_opt_states")
        ssd_parts = rs.staged.pop(Staged("opt_states_read", rid)) if rid is not None else {}
        vecs = {cls: state.vec[cls][b] for cls in OPT_CLASSES}
        cuts = sorted({lo, hi, *(min(max(v.ssd_lo, lo), hi) for v in vecs.values())})

        def view(cls: str, a: int, z: int) -> torch.Tensor:
            V = vecs[cls]
            if a >= V.ssd_lo:
                plo, _phi, data = ssd_parts[cls]
                return data[a - plo: z - plo]
            return V.host[a - V.g: z - V.g]

        params, grads, ms, vs = [], [], [], []
        for a, z in zip(cuts, cuts[1:]):
            if z <= a:
                continue
            params.append(view("master", a, z))
            ms.append(view("adam_m", a, z))
            vs.append(view("adam_v", a, z))
            grads.append(state.grads[b][a:z])
        self._adamw(params, grads, ms, vs, rs.step0 + t.iteration + 1, fused=True)
        master = torch.cat(params) if len(params) > 1 else params[0]
        state.grads[b][lo:hi].zero_()
        self._stage_weights(rs, t, j, lo, hi, master.to(state.vec["weights"][b].dtype))
        rs.staged[Staged("opt_states_out", t.id)] = ssd_parts

    def _stage_weights(self, rs: RoundState, t: Task, j: int, lo: int, hi: int, new: torch.Tensor) -> None:
        """The compute copy of the updated range [lo, hi), to wherever the weights live: host memory now, the
        device range for update_weights, the SSD files for write_opt_states."""
        W = self.cx.state.vec["weights"][t.block]
        a, z = max(lo, W.g), min(hi, W.ssd_lo)
        if z > a:
            W.host[a - W.g: z - W.g].copy_(new[a - lo: z - lo])
        a, z = lo, min(hi, W.g)
        wire = self.cx.transfer_buffer(max(z - a, 0), new.dtype)  # update_weights copies it
        wire.copy_(new[: max(z - a, 0)])
        rs.staged[Staged("weights_gpu", t.id)] = (a, z, wire)
        w_ssd = [(name, new[plo - lo: phi - lo]) for name, pj, plo, phi in W.ssd_pieces() if pj == j]
        rs.staged[Staged("weights_ssd", t.id)] = w_ssd

    def write_opt_states(self, rs: RoundState, t: Task) -> None:
        a = t.deps[0]
        for cls, (_lo, _hi, data) in rs.staged.pop(Staged("opt_states_out", a)).items():
            j = self.cx.binding.part_of[t.id]
            name = next(n for n, pj, _l, _h in self.cx.state.vec[cls][t.block].ssd_pieces() if pj == j)
            self.cx.ssd.write(name, data)
        for name, data in rs.staged.pop(Staged("weights_ssd", a)):
            self.cx.ssd.write(name, data)

    def adam_gpu(self, rs: RoundState, t: Task) -> None:
        b = t.block
        grad = None
        for _o, _lo, g in self.buffers.take(rs, t.id):
            grad = g if grad is None else grad + g
        vecs = [self.cx.state.vec[cls][b].dev for cls in OPT_CLASSES]
        self._adamw([vecs[0]], [grad], [vecs[1]], [vecs[2]], rs.step0 + t.iteration + 1,
                    fused=self.cx.device.type == "cuda")
        self.cx.state.vec["weights"][b].dev.copy_(vecs[0].to(self.cx.dtype))


class HostGradAdds:
    """Adds offloaded gradients to the host fp32 accumulators off the D2H queue: a thread per round that waits
    (blocking) for each offload_grads copy's event and adds its bytes, in the D2H queue's order, so that the
    D2H worker never synchronizes and the fp32 add runs on a host thread. Host ops that read a block's
    accumulators (adam, write_grads, read_grads) first wait for the block's adds queued before them."""

    def __init__(self, backend, state, rs: RoundState, fail) -> None:
        self.backend, self.state, self.rs, self.fail = backend, state, rs, fail
        self.cv = threading.Condition()
        self.items: list[tuple[Task, int, int, object, torch.Tensor] | None] = []
        self.pending: dict[int, int] = {}
        self.thread = threading.Thread(target=self._loop, name="tierflow-gradadd", daemon=True)
        self.thread.start()

    def submit(self, t: Task, o: int, lo: int, event, host: torch.Tensor) -> None:
        with self.cv:
            self.pending[o] = self.pending.get(o, 0) + 1
            self.items.append((t, o, lo, event, host))
            self.cv.notify_all()

    @staticmethod
    def wait_for(rs: RoundState, b: int) -> None:
        """Until every add of block b queued so far is done (no-op without streams)."""
        self = rs.grad_adds
        if self is None:
            return
        with self.cv:
            while self.pending.get(b, 0):
                if rs.abort.is_set():
                    raise RoundAborted()
                self.cv.wait(0.05)

    def close(self) -> None:
        with self.cv:
            self.items.append(None)
            self.cv.notify_all()
        self.thread.join()

    def _loop(self) -> None:
        self.backend.thread_init()
        while True:
            with self.cv:
                while not self.items:
                    self.cv.wait()
                item = self.items.pop(0)
            if item is None:
                return
            t, o, lo, event, host = item
            try:
                if not self.rs.abort.is_set():
                    self.backend.synchronize_event(event)
                    self.state.grads[o][lo: lo + host.numel()] += host.float()
            except RoundAborted:
                pass
            except BaseException as e:  # noqa: BLE001 - the op whose gradients these are
                self.fail(t, e)
            with self.cv:
                self.pending[o] -= 1
                self.cv.notify_all()
