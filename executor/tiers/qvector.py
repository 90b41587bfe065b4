"""Adam's moments of an 8-bit optimizer-state format on the tiers (tierflow.planner.core.optstates): a vector
of one block split over device / host / SSD by element ranges as a TierVector (tiers/state.py) is, each
stretch the optimizer steps whole (the device range; per optimizer part, its host range and its SSD file) one
quant8.Q8 of its own, quantized in blocks from its own start, so that a stretch is decoded and encoded whole.
Its SSD files hold the packed bytes (1 + 4/256 per element). executor/optim/qstate.py steps them."""

from __future__ import annotations

import torch

from tierflow.executor.optim.quant8 import Q8, packed_bytes
from tierflow.executor.tiers.ssd_store import SsdPieces, split_counts
from tierflow.planner.core.optstates import state_format

MOMENTS = ("adam_m", "adam_v")


def quantized_class(fmt: str | None, cls: str) -> bool:
    """Is tensor class `cls` stored as 8-bit codes in optimizer-state format `fmt`?"""
    return cls in MOMENTS and state_format(fmt).quantized


def vector_dtype(fmt: str | None, cls: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a state vector of class `cls` (a quantized one: the dtype it decodes to)."""
    if cls == "weights":
        return compute_dtype
    return torch.bfloat16 if cls == "master" and fmt == "8bit-bf16master" else torch.float32


class QTierVector(SsdPieces):
    """Adam's m or v of one block, 8-bit block-wise; the interface of TierVector that the tiers, the
    checkpoints and the optimizer use (set_full, get_full, ssd_pieces, ssd_bytes), plus its codes."""

    def __init__(self, cls: str, block: int, n: int, split, dtype: torch.dtype, backend,
                 parts: list[tuple[int, int]], pin: bool) -> None:
        self.cls, self.block, self.n, self.dtype = cls, block, n, dtype
        self.backend, self.device = backend, backend.device
        self.g, self.c, self.s = split_counts(n, split.gpu, split.ssd)
        self.parts, self.pin = parts, pin
        self.signed = cls == "adam_m"
        self.dev = self.host = None  # the codes live in dev_q / host_q
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
