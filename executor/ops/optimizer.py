"""The optimizer ops (`OptimizerOps`): AdamW per optimizer part on the host (adam, adam_deferred, with the
reads and writes of their SSD ranges: read_opt_states, write_opt_states), or per block on the device
(adam_gpu).

Numerics: AdamW runs in fp32 on the host with PyTorch's fused/foreach kernel (or on the device for a GPU
optimizer) on the fp32 gradient accumulators; the compute copy of the weights is the updated fp32 master cast
to the compute dtype. The host op does not zero the accumulators: the next step's first gradient write
overwrites them (ops/grads.py `host_grad_writes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierflow.executor.binding import OPTIMIZER_PART
from tierflow.executor.ops.context import OpContext, RoundState, Staged
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.grads import HostGradAdds, host_grad_writes
from tierflow.executor.optim import fused_host_adamw
from tierflow.executor.optim.adamw import adamw_update
from tierflow.executor.optim.clipping import GradNorms, sum_of_squares
from tierflow.executor.optim.decay import decay_pieces
from tierflow.executor.optim.host_adamw import MIN_KERNEL_ELEMENTS, RangeStep
from tierflow.executor.optim.qstate import (
    adam_gpu_compressed,
    compressed,
    host_adamw_compressed,
    host_stretch,
    payload,
    read_piece,
)
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import READ_OPT_STATES

OPT_CLASSES = ("master", "adam_m", "adam_v")


@dataclass
class HostPart:
    """What the host adam op of one optimizer part of a block reuses from step to step (the plan's ranges
    and the tiers' splits fix it): its range and decay groups, the fp32 states' host pieces (each vector's
    whole host range: no view made per op), the compute copy's host piece, the device range of the weights
    (a transfer buffer per op), their SSD files' ranges of this part, and the update (RangeStep, made at the
    first step: how the range lies in its pieces)."""

    lo: int
    hi: int
    groups: list[tuple[int, int, bool]]
    compressed: bool  # 8-bit states (their own path, qstate.py)
    pieces: dict[str, list[tuple[int, int, torch.Tensor]]]  # master, adam_m, adam_v: the host piece or none
    host_dest: list[tuple[int, int, torch.Tensor]]  # the weights' host piece or none
    wire: tuple[int, int]  # [a, z) of the part in the weights' device range (empty if z <= a)
    wdtype: torch.dtype
    w_ssd: list[tuple[str, int, int]]  # (file, lo, hi) of the part's weights on the SSD tier
    hosts: list[tuple[object, torch.Tensor | None]]  # (vector, its host tensor then): see `current`
    update: RangeStep | None = None

    @classmethod
    def of(cls, state, b: int, j: int) -> HostPart:
        lo, hi = state.parts[b][j]
        W = state.vec["weights"][b]
        fp32 = not compressed(state.spec.optimizer_states)
        vecs = [state.vec[c][b] for c in (*OPT_CLASSES, "weights")]
        return cls(lo, hi, decay_pieces(state.layout, b, state.shards[b][0], lo, hi),
                   not fp32, {c: _pieces(state.vec[c][b], lo, hi) for c in OPT_CLASSES} if fp32 else {},
                   _pieces(W, lo, hi), (lo, min(hi, W.g)), W.dtype,
                   [(name, plo, phi) for name, pj, plo, phi in W.ssd_pieces() if pj == j] if W.s else [],
                   [(V, V.host) for V in vecs])

    def current(self) -> bool:
        """Whether the vectors' host tensors are those it holds (a block set anew, TrainState.set_shard,
        allocates new ones: then it is made again)."""
        for V, h in self.hosts:
            if V.host is not h:
                return False
        return True


class OptimizerOps:
    """AdamW steps: per optimizer part on the host (adam, adam_deferred, with their SSD reads and writes), or
    per block on the device (adam_gpu)."""

    def __init__(self, cx: OpContext, buffers: GradBuffers) -> None:
        self.cx, self.buffers = cx, buffers
        self.unwritten = host_grad_writes(cx.binding).unwritten  # (iteration, block): no gradient write
        self.parts: dict[tuple[int, int], HostPart] = {}  # (block, part) -> what its host adam op reuses
        host = not cx.state.placement.gpu_optimizer
        if host and any(hi - lo >= MIN_KERNEL_ELEMENTS for parts in cx.state.parts for lo, hi in parts):
            fused_host_adamw.warm_up()  # the host op's kernel loaded now, not in its first op

    def _adamw(self, rs, t, params, grads, ms, vs, step: int, fused: bool, decay=None) -> None:
        # schedule and weight-decay groups: executor/optim/adamw.py; the clipping factor: clip_prelude
        coef = clip_prelude(self.cx, rs, t, step, grads)
        adamw_update(self.cx.hyper, [params, grads, ms, vs], step, fused, decay, coef)

    def read_opt_states(self, rs: RoundState, t: Task) -> None:
        j = self.cx.binding.part_of[t.id]
        out = {}
        for cls in OPT_CLASSES:
            V = self.cx.state.vec[cls][t.block]
            for name, pj, lo, hi in V.ssd_pieces():
                if pj == j:
                    out[cls] = (lo, hi, read_piece(V, self.cx.ssd, name, lo, hi))  # host-only: pageable
        rs.staged[Staged("opt_states_read", t.id)] = out

    def adam(self, rs: RoundState, t: Task) -> None:
        """One optimizer part of block t.block on the host (adam and adam_deferred): the AdamW update and the
        compute copy of the updated range staged (`host_adamw`); the gradient range is left as it is, for
        the next step's first write to overwrite (ops/grads.py), unless no write of this iteration reached
        it (zeroed first, then: the update of a zero gradient)."""
        b, cx = t.block, self.cx
        HostGradAdds.wait_for(rs, b)
        part = self._part(b, OPTIMIZER_PART[t.kind])
        lo, hi = part.lo, part.hi
        rid = cx.binding.dep_of_kind[t.id].get(READ_OPT_STATES)
        ssd_parts = rs.staged.pop(Staged("opt_states_read", rid)) if rid is not None else {}
        step = rs.step0 + t.iteration + 1
        grads = cx.state.grads[b]
        if (t.iteration, b) in self.unwritten:
            grads[lo:hi].zero_()
        dests = self._weight_dests(rs, t, part)
        if part.compressed:  # decoded, updated, encoded (executor/optim/qstate.py)
            stretches = {cls: _stretches(cx.state.vec[cls][b], lo, hi, ssd_parts.get(cls))
                         for cls in OPT_CLASSES}
            coef = clip_prelude(cx, rs, t, step, [grads[ga:gz] for ga, gz, _d in part.groups])
            host_adamw_compressed(cx.hyper, step, b, part.groups, stretches, grads, dests, coef,
                                  zero_grads=False)
        else:  # the squares for the step's norm summed in the update's pass
            pieces = part.pieces if not ssd_parts else {
                cls: [*part.pieces[cls], ssd_parts[cls]] if cls in ssd_parts else part.pieces[cls]
                for cls in OPT_CLASSES}
            if part.update is None:  # its first step: how the range lies in these pieces, worked out once
                part.update = RangeStep(part.groups, pieces, grads, dests)
            norms = cx.norms
            coef = clip_factor(cx, rs, t, step, [])  # (a host op's global factor needs no gradients passed)
            sumsq = part.update(cx.hyper, step, pieces, grads, dests, coef,
                                squares=norms is not None and norms.wants_squares(), zero_grads=False)
            if norms is not None:
                norms.add_squares(step, sumsq)
        rs.staged[Staged("opt_states_out", t.id)] = ssd_parts

    def _part(self, b: int, j: int) -> HostPart:
        """Block b's optimizer part j (HostPart), made at its first op: the layout, the shards, the parts'
        ranges and the tiers' splits are fixed for the ops' life."""
        part = self.parts.get((b, j))
        if part is None or not part.current():
            part = self.parts[(b, j)] = HostPart.of(self.cx.state, b, j)
        return part

    def _weight_dests(self, rs: RoundState, t: Task, part: HostPart) -> list[tuple[int, int, torch.Tensor]]:
        """(a, z, buffer) for every place the compute copy of the updated range goes: host memory now (the
        whole host range: the writers take the part's range of it, no view made per op), a transfer buffer
        of the device range for update_weights, one of the SSD range for write_opt_states (both staged here,
        written by host_adamw)."""
        dests = list(part.host_dest)
        a, z = part.wire
        wire = self.cx.transfer_buffer(z - a, part.wdtype) if z > a else None  # update_weights copies it
        rs.staged[Staged("weights_gpu", t.id)] = (a, z, wire)
        if z > a:
            dests.append((a, z, wire))
        w_ssd = []
        for name, plo, phi in part.w_ssd:  # (the SSD tier holds some of the weights)
            buf = torch.empty(phi - plo, dtype=part.wdtype)
            dests.append((plo, phi, buf))
            w_ssd.append((name, buf))
        rs.staged[Staged("weights_ssd", t.id)] = w_ssd
        return dests

    def write_opt_states(self, rs: RoundState, t: Task) -> None:
        a = t.deps[0]
        for cls, (_lo, _hi, data) in rs.staged.pop(Staged("opt_states_out", a)).items():
            j = self.cx.binding.part_of[t.id]
            name = next(n for n, pj, _l, _h in self.cx.state.vec[cls][t.block].ssd_pieces() if pj == j)
            self.cx.ssd.write(name, payload(data))
        for name, data in rs.staged.pop(Staged("weights_ssd", a)):
            self.cx.ssd.write(name, data)

    def _adam_adapters(self, rs: RoundState, t: Task, grad: torch.Tensor | None) -> None:
        """LoRA: AdamW on a decoder layer's adapters (fp32 master and moments on the device, every adapter
        matrix decayed, as the decay rule decays matrices)."""
        lora, b = self.cx.state.lora, t.block
        if grad is None:  # a layer whose backward the plan did not run (cannot happen in a valid plan)
            grad = torch.zeros_like(lora.master[b])
        step = rs.step0 + t.iteration + 1
        self._adamw(rs, t, [lora.master[b]], [grad], [lora.adam_m[b]], [lora.adam_v[b]], step,
                    fused=self.cx.device.type == "cuda")

    def adam_gpu(self, rs: RoundState, t: Task) -> None:
        b = t.block
        grad = None
        for _o, _lo, g in self.buffers.take(rs, t.id):
            grad = g if grad is None else grad + g
        if self.cx.state.lora is not None:
            return self._adam_adapters(rs, t, grad)
        if compressed(self.cx.state.spec.optimizer_states):
            step = rs.step0 + t.iteration + 1

            def update(p, g, m, v, decay) -> None:
                self._adamw(rs, t, p, g, m, v, step, fused=self.cx.device.type == "cuda", decay=decay)

            return adam_gpu_compressed(self.cx.state, b, grad, step, update)
        vecs = [self.cx.state.vec[cls][b].dev for cls in OPT_CLASSES]
        state = self.cx.state
        groups = decay_pieces(state.layout, b, state.shards[b][0], 0, state.shard_numel[b])  # decay or not
        p, g, m, v = ([x[a:z] for a, z, _d in groups] for x in (vecs[0], grad, vecs[1], vecs[2]))
        self._adamw(rs, t, p, g, m, v, rs.step0 + t.iteration + 1, fused=self.cx.device.type == "cuda",
                    decay=[d for _a, _z, d in groups])
        W = self.cx.state.vec["weights"][b].dev
        if W is not vecs[0]:  # aliased when both are fp32 on the device (TrainState.weights_alias_master)
            W.copy_(vecs[0])  # the cast to the compute dtype, in one pass (no temporary)


def _pieces(V, lo: int, hi: int) -> list[tuple[int, int, torch.Tensor]]:
    """The host piece (a, z, tensor) of the state vector V if [lo, hi) reaches its host range: the whole host
    range (no view made per op: host_adamw takes [lo, hi) of it); the op adds the SSD range read_opt_states
    read per step."""
    return [(V.g, V.ssd_lo, V.host)] if min(hi, V.ssd_lo) > max(lo, V.g) else []


def _stretches(V, lo: int, hi: int, ssd) -> list[tuple[int, int, torch.Tensor]]:
    """(a, z, view) of the stretches of [lo, hi) of the state vector V: its host range, and `ssd` (lo, hi,
    data) where read_opt_states read its SSD range."""
    a, z = max(lo, V.g), min(hi, V.ssd_lo)
    out = [(a, z, host_stretch(V, a, z))] if z > a else []
    if ssd is not None:
        out.append(ssd)
    return out


def clip_prelude(cx: OpContext, rs: RoundState, t: Task, step: int,
                 grads: list[torch.Tensor]) -> torch.Tensor | float | None:
    """What an optimizer op of `step` does before its update: adds the squares of its (unclipped) gradients
    to the step's norm, and returns the factor its gradients are to be multiplied by (None: no clipping)."""
    coef = clip_factor(cx, rs, t, step, grads)
    norms = cx.norms
    if norms is not None:
        norms.observe(step, grads)
    return coef


def clip_factor(cx: OpContext, rs: RoundState, t: Task, step: int,
                grads: list[torch.Tensor]) -> torch.Tensor | float | None:
    """The factor the gradients of an optimizer op of `step` are to be multiplied by (None: no clipping)."""
    norms = cx.norms
    if norms is None or norms.max_norm <= 0:
        return None
    if norms.mode == "global":
        return _global_coef(cx, rs, t, step, norms, grads)
    return norms.delayed_coef(step)


def _global_coef(cx: OpContext, rs: RoundState, t: Task, step: int, norms: GradNorms,
                 grads: list[torch.Tensor]) -> torch.Tensor:
    """The clipping factor of `step`: at the step's first optimizer op, after every gradient op of the step
    (the plan's dependencies, planner/core/clipwait.py), from the norm of all of the step's gradients (the
    optimizer ops run on one worker, in order). A GPU optimizer op has taken its own gradients (`grads`) out
    of the buffers already."""
    with norms.lock:
        if step in norms.coefs:
            return norms.coefs[step]
    state = cx.state
    if state.placement.gpu_optimizer or state.lora is not None:
        taken: dict[int, torch.Tensor] = {}
        with rs.lock:
            for (group, _owner), buf in rs.grad_acc.items():
                if group != t.id and cx.binding.plan.graph.tasks[group].iteration == t.iteration:
                    taken[group] = buf.float() if group not in taken else taken[group] + buf.float()
        sumsq = sum_of_squares([*taken.values(), *grads])
    else:
        sumsq = torch.stack([_host_sq(cx, rs, b) for b in range(len(state.grads))]).sum()
    return norms.set_global(step, sumsq.sqrt())


def _host_sq(cx: OpContext, rs: RoundState, b: int) -> torch.Tensor:
    """Squares of block b's fp32 gradient accumulator: its host range, and its SSD range from the SSD tier's
    file (where the step's last write_grads left it; read back once more here)."""
    HostGradAdds.wait_for(rs, b)
    state = cx.state
    _g, _c, ssd_elems = state.grad_split[b]
    n = state.shard_numel[b]
    host = sum_of_squares([state.grads[b][: n - ssd_elems]])
    if ssd_elems == 0:
        return host
    return host + sum_of_squares([cx.ssd.read(f"grads_b{b}", torch.float32, ssd_elems)])
