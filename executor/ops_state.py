"""The ops on the training state (state.py's tiered vectors): weights (read from SSD, fetch to the device, update
after a CPU optimizer step), gradients (to the host, to and from SSD) and the optimizer steps.

Numerics: weight gradients are accumulated in fp32 on the device (GradBuffers), sent to the host in the
compute dtype and accumulated there in fp32; AdamW runs in fp32 on the host with PyTorch's fused/foreach
kernel (or on the device for a GPU optimizer); the compute copy of the weights is the updated fp32 master cast
to the compute dtype.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.binding import OPTIMIZER_PART, ExecutionError
from tierflow.executor.context import OpContext, RoundState, Staged
from tierflow.executor.store import host_empty
from tierflow.planner.core.graph import Task

OPT_CLASSES = ("master", "adam_m", "adam_v")


class WeightOps:
    """Weights of the block a compute op runs: resident on the device, or fetched for it by a fetch_weights op."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx

    def read_weights(self, rs: RoundState, t: Task) -> None:
        out = {}
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            a = max(lo, W.ssd_lo)
            if hi <= a:
                continue
            buf = torch.empty(hi - a, dtype=W.dtype, pin_memory=self.cx.cuda)
            for name, _j, plo, phi in W.ssd_pieces():
                x, z = max(plo, a), min(phi, hi)
                if z > x:
                    buf[x - a: z - a].copy_(self.cx.ssd.read(name, W.dtype, phi - plo)[x - plo: z - plo])
            out[o] = buf
        rs.staged[Staged("weights_read", t.id)] = out

    def fetch_weights(self, rs: RoundState, t: Task) -> None:
        """The non-resident part of every owner's range to the device: host memory, then what read_weights read."""
        rid = self.cx.binding.dep_of_kind[t.id].get("read_weights")
        staged = rs.staged.pop(Staged("weights_read", rid)) if rid is not None else {}
        out = {}
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            parts = []
            a, z = max(lo, W.g), min(hi, W.ssd_lo)
            if z > a:
                parts.append(W.host[a - W.g: z - W.g].to(self.cx.device, non_blocking=self.cx.cuda))
            if o in staged:
                parts.append(staged[o].to(self.cx.device, non_blocking=self.cx.cuda))
            if parts:
                out[o] = torch.cat(parts) if len(parts) > 1 else parts[0]
        rs.weight_bufs[t.id] = out

    def weights(self, rs: RoundState, t: Task) -> list[torch.Tensor]:
        """One flat vector per owner of block t.block: the resident part and the fetched part, joined."""
        fid = self.cx.binding.wfetch[t.id]
        out = []
        for o, lo, hi in self.cx.layout.owners(t.block):
            W = self.cx.state.vec["weights"][o]
            if fid is None:
                if W.g < hi:
                    raise ExecutionError(f"op {t.id} ({t.label}): weights of block {o} are not all on the device and "
                                         "no fetch_weights precedes it (inconsistent plan)")
                out.append(W.dev[lo:hi])
                continue
            cache = rs.weight_full.setdefault(fid, {})
            if o not in cache:
                off = rs.weight_bufs[fid].get(o)
                rs.use_on(off, "gpu")
                res = W.dev[lo: min(hi, W.g)] if W.g > lo else None
                cache[o] = off if res is None else res if off is None else torch.cat([res, off])
            out.append(cache[o])
        return out

    def release(self, rs: RoundState, t: Task) -> None:
        """Compute op t is done with its fetched weights: the last reader frees the fetch's buffers."""
        fid = self.cx.binding.wfetch.get(t.id)
        if fid is None:
            return
        rs.weight_users[fid] -= 1
        if rs.weight_users[fid] == 0:
            rs.weight_bufs.pop(fid, None)
            rs.weight_full.pop(fid, None)

    def update_weights(self, rs: RoundState, t: Task) -> None:
        a, z, w = rs.staged.pop(Staged("weights_gpu", t.deps[0]))
        if z > a:
            self.cx.state.vec["weights"][t.block].dev[a:z].copy_(w, non_blocking=self.cx.cuda)


class GradBuffers:
    """fp32 weight-gradient accumulators on the device, one per (op that takes them, owner block)."""

    def __init__(self, cx: OpContext) -> None:
        self.cx = cx

    def accumulate(self, rs: RoundState, t: Task, o: int, pieces: list[tuple[int, int, torch.Tensor | None]]) -> None:
        """fp32 accumulation on the device of gradients `pieces` = [(lo, hi, grad)] into owner o's ranges, in the
        buffer of the op that will take these gradients (a buffer spans the owner's whole vector: a tied head adds
        the wte range of block 0). A None gradient (a parameter the step did not use) adds nothing."""
        key = (self.cx.binding.grad_group[(t.id, o)], o)
        with rs.lock:
            acc = rs.grad_acc.get(key)
        if acc is None:
            acc = torch.zeros(self.cx.layout.numel[o], dtype=torch.float32, device=self.cx.device)
            with rs.lock:
                rs.grad_acc[key] = acc
        for lo, hi, grad in pieces:
            if grad is not None:
                acc[lo:hi] += grad.reshape(-1)

    def take(self, rs: RoundState, group: int) -> list[tuple[int, torch.Tensor]]:
        """(owner, accumulator) of every buffer the op `group` takes."""
        with rs.lock:
            keys = [k for k in rs.grad_acc if k[0] == group]
            return [(k[1], rs.grad_acc.pop(k)) for k in keys]


class GradOps:
    """Weight gradients on the host: fp32 accumulators, the SSD range written out and read back."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers

    def offload_grads(self, rs: RoundState, t: Task) -> None:
        """Send a block's gradients to the host in the compute dtype and add them to the fp32 accumulators."""
        for o, g in self.buffers.take(rs, t.id):
            rs.use_on(g, "d2h")
            wire = g.to(self.cx.dtype)
            if self.cx.cuda:
                host = host_empty(wire.numel(), wire.dtype, True)
                host.copy_(wire, non_blocking=True)
                done = torch.cuda.Event()
                done.record(rs.streams["d2h"])
                done.synchronize()  # this op's own copy only: the host accumulation below needs its bytes
            else:
                host = wire
            self.cx.state.grads[o] += host.float()

    def _ssd_range(self, b: int) -> tuple[int, int]:
        _gpu_elems, _cpu_elems, ssd_elems = self.cx.state.grad_split[b]
        n = self.cx.layout.numel[b]
        return n - ssd_elems, n

    def write_grads(self, rs: RoundState, t: Task) -> None:
        a, z = self._ssd_range(t.block)
        if z > a:
            self.cx.ssd.write(f"grads_b{t.block}", self.cx.state.grads[t.block][a:z])
            self.cx.state.grads[t.block][a:z].zero_()

    def read_grads(self, rs: RoundState, t: Task) -> None:
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
        steps = [torch.tensor(float(step - 1), device=p.device) for p in params]
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
                    out[cls] = (lo, hi, self.cx.ssd.read(name, torch.float32, hi - lo))
        rs.staged[Staged("opt_states_read", t.id)] = out

    def adam(self, rs: RoundState, t: Task) -> None:
        """One optimizer part of block t.block on the host (adam and adam_deferred)."""
        b, state = t.block, self.cx.state
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
        rs.staged[Staged("weights_gpu", t.id)] = (a, z, new[: max(z - a, 0)].to(self.cx.device) if not self.cx.cuda
                                                  else new[: max(z - a, 0)].pin_memory())
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
        for _o, g in self.buffers.take(rs, t.id):
            grad = g if grad is None else grad + g
        vecs = [self.cx.state.vec[cls][b].dev for cls in OPT_CLASSES]
        self._adamw([vecs[0]], [grad], [vecs[1]], [vecs[2]], rs.step0 + t.iteration + 1, fused=self.cx.cuda)
        self.cx.state.vec["weights"][b].dev.copy_(vecs[0].to(self.cx.dtype))
