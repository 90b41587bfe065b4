"""Optimizer states in a compressed format on the tiers (tierflow.planner.core.optstates: 8-bit moments, bf16
master): the tier vectors that hold them and the optimizer ops' decode / update / encode around the fp32
AdamW of host_adamw and adamw_update.

- Adam's m and v of an 8-bit format are `QTierVector`s: each stretch the optimizer steps at once (the device
  range; per optimizer part, its host range and its SSD file) is one quant8.Q8 of its own, quantized in
  blocks from its own start, so that a stretch is decoded and encoded whole. Its SSD files hold the packed
  bytes (1 + 4/256 per element).
- The bf16 master of 8bit-bf16master is a plain TierVector in bf16 (its SSD files hold 2 bytes per element);
  after each update it is rounded stochastically (quant8.stochastic_round_bf16_, noise a function of the
  step, block and range only), and the compute weights are copied from it.

The update runs on fp32 copies of one optimizer part's stretches (12 bytes per parameter of the part, freed
after the step).
"""

from __future__ import annotations

import torch

from tierflow.executor.host_adamw import host_adamw
from tierflow.executor.quant8 import Q8, packed_bytes, round_generator, stochastic_round_bf16_
from tierflow.executor.tiers.state import TierVector
from tierflow.planner.core.optstates import state_format

MOMENTS = ("adam_m", "adam_v")
OPT_CLASSES = ("master", "adam_m", "adam_v")


def compressed(fmt: str | None) -> bool:
    return fmt not in (None, "fp32")


def master_dtype(fmt: str | None) -> torch.dtype:
    return torch.bfloat16 if fmt == "8bit-bf16master" else torch.float32


class QTierVector(TierVector):
    """Adam's m or v of one block, 8-bit block-wise, split over device / host / SSD like a TierVector."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.signed = self.cls == "adam_m"
        self.dev_q: Q8 | None = None
        self.host_q: dict[tuple[int, int], Q8] = {}  # (a, z) of each part's host range -> its codes

    def host_ranges(self) -> list[tuple[int, int]]:
        out = []
        for lo, hi in self.parts:
            a, z = max(lo, self.g), min(hi, self.ssd_lo)
            if z > a:
                out.append((a, z))
        return out

    def set_full(self, full: torch.Tensor, ssd) -> None:
        full = full.detach().reshape(-1).float().cpu()
        self.dev_q = Q8.of(full[: self.g], self.signed) if self.g else None
        if self.dev_q is not None:
            self.dev_q.buf = self.dev_q.buf.to(self.device)
        self.host_q = {(a, z): Q8.of(full[a:z], self.signed) for a, z in self.host_ranges()}
        for name, _j, lo, hi in self.ssd_pieces():
            ssd.write(name, Q8.of(full[lo:hi], self.signed).buf)

    def get_full(self, ssd) -> torch.Tensor:
        out = torch.empty(self.n, dtype=torch.float32)
        if self.dev_q is not None:
            out[: self.g].copy_(Q8(self.g, self.signed, self.dev_q.buf.cpu()).decode())
        for (a, z), q in self.host_q.items():
            q.decode(out[a:z])
        for name, _j, lo, hi in self.ssd_pieces():
            self.read_q8(ssd, name, lo, hi).decode(out[lo:hi])
        return out

    def read_q8(self, ssd, name: str, lo: int, hi: int) -> Q8:
        return Q8(hi - lo, self.signed, ssd.read(name, torch.uint8, packed_bytes(hi - lo)))

    def ssd_bytes(self) -> int:
        return sum(packed_bytes(hi - lo) for _n, _j, lo, hi in self.ssd_pieces())


def make_vector(fmt: str | None, cls: str, *args) -> TierVector:
    """The tier vector of class `cls` for optimizer-state format `fmt` (TierVector's arguments after cls)."""
    if state_format(fmt).quantized and cls in MOMENTS:
        return QTierVector(cls, *args)
    return TierVector(cls, *args)


def vector_dtype(fmt: str | None, cls: str, compute_dtype: torch.dtype) -> torch.dtype:
    if cls == "weights":
        return compute_dtype
    return master_dtype(fmt) if cls == "master" else torch.float32


def read_piece(V: TierVector, ssd, name: str, lo: int, hi: int):
    """One SSD piece of a state vector as its optimizer step takes it: a Q8 of quantized moments, else the
    tensor in the vector's dtype."""
    if isinstance(V, QTierVector):
        return V.read_q8(ssd, name, lo, hi)
    return ssd.read(name, V.dtype, hi - lo)


def payload(x) -> torch.Tensor:
    """What an SSD file of a state piece holds: a Q8's packed bytes, else the tensor."""
    return x.buf if isinstance(x, Q8) else x


def host_stretch(V: TierVector, a: int, z: int):
    """The host range [a, z) of a part of V: a Q8 of quantized moments, else a view."""
    if isinstance(V, QTierVector):
        return V.host_q[(a, z)]
    return V.host[a - V.g: z - V.g]


def _decode(x) -> torch.Tensor:
    if isinstance(x, Q8):
        return x.decode()
    return x if x.dtype == torch.float32 else x.float()


def _encode(x, fp32: torch.Tensor, gen: torch.Generator | None) -> None:
    if isinstance(x, Q8):
        x.encode(fp32)
    elif x.dtype == torch.bfloat16:
        stochastic_round_bf16_(x, fp32, gen)
    elif x is not fp32:
        x.copy_(fp32)


def host_adamw_compressed(h, step: int, block: int, groups, states: dict, grads: torch.Tensor, dests: list,
                          coef=None) -> None:
    """host_adamw on fp32 copies of compressed stretches (states[cls]: (a, z, Q8 or tensor)), encoded back
    after the update; the compute copy of the weights from the stored (rounded) master."""
    fp32 = {cls: [(a, z, _decode(x)) for a, z, x in states[cls]] for cls in OPT_CLASSES}
    host_adamw(h, step, groups, fp32, grads, [], coef)
    lo, hi = groups[0][0], groups[-1][1]
    for cls in OPT_CLASSES:
        for (a, _z, x), (_a, _z2, f) in zip(states[cls], fp32[cls], strict=True):
            _encode(x, f, round_generator(0, step, block, a))
    for sa, sz, master in states["master"]:
        for a, z, buf in dests:
            x, y = max(a, sa, lo), min(z, sz, hi)
            if y > x:
                buf[x - a: y - a].copy_(master[x - sa: y - sa])


def adam_gpu_compressed(ops, rs, t) -> None:
    """OptimizerOps.adam_gpu with compressed states on the device: decode, the update, encode."""
    from tierflow.executor.decay import decay_pieces

    cx, b = ops.cx, t.block
    grad = None
    for _o, _lo, g in ops.buffers.take(rs, t.id):
        grad = g if grad is None else grad + g
    state = cx.state
    stored = []
    for cls in OPT_CLASSES:
        V = state.vec[cls][b]
        stored.append(V.dev_q if isinstance(V, QTierVector) else V.dev)
    fp32 = [_decode(x) for x in stored]
    groups = decay_pieces(state.layout, b, state.shards[b][0], 0, state.shard_numel[b])
    p, g, m, v = ([x[a:z] for a, z, _d in groups] for x in (fp32[0], grad, fp32[1], fp32[2]))
    step = rs.step0 + t.iteration + 1
    ops._adamw(rs, t, p, g, m, v, step, fused=cx.device.type == "cuda", decay=[d for _a, _z, d in groups])
    for x, f in zip(stored, fp32, strict=True):
        _encode(x, f, round_generator(0, step, b, 0))
    W = state.vec["weights"][b].dev
    if W is not stored[0]:
        W.copy_(stored[0])
