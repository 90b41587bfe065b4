"""Block-wise 8-bit optimizer states (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR
2022) on the executor's flat buffers, and the bf16 master with stochastic rounding
(tierflow.planner.core.optstates names the formats and their bytes).

A quantized stretch (`Q8`) is one flat uint8 buffer: an fp32 absmax per block of BLOCK elements, then one
code per element, each code an index into a 256-value map (the dynamic tree map of bitsandbytes'
create_dynamic_map: signed for Adam's m, unsigned for v). The buffer is what lies in host memory, on the
device and in the SSD tier's file: the SSD moves 1 + 4/256 bytes per element instead of 4.

The AdamW update itself is the fp32 one (host_adamw / torch's AdamW on the dequantized stretches): decode,
update, encode. The signed map differs from bitsandbytes' in one value: its most negative code is -1.0
instead of -0.9929, so that a block's absmax element decodes to exactly its absmax whatever its sign and
decode-then-encode returns the same bytes (a checkpoint stores decoded fp32 states and resumes bit for bit).

Why not a library: bitsandbytes' 8-bit AdamW (optimizer_update_8bit_blockwise) takes flat tensors with the
same layout (uint8 states, fp32 absmax per 256), but on this machine's CPU it ran 4M parameters in 460 ms
against 16 ms for torch's fused fp32 AdamW, and torchao's AdamW8bit in 423 ms
(docs/compressed-states.md); the executor's stretches need decode and encode on their own,
and neither library is a dependency of tierflow. tests/executor/optim/test_quant8.py compares this quantizer
and update with bitsandbytes' on the same inputs where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from tierflow.planner.core.optstates import QUANT_BLOCK_ELEMS, SCALE_BYTES

BLOCK = QUANT_BLOCK_ELEMS


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic tree map (bitsandbytes' create_dynamic_map(signed), 7 exponent bits),
    sorted; signed: its most negative value is -1.0 (module doc)."""
    return _dynamic_map(signed).clone()


@cache
def _dynamic_map(signed: bool) -> torch.Tensor:
    data: list[float] = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    out = torch.tensor(data, dtype=torch.float32)
    if signed:
        out[0] = -1.0
    assert out.numel() == 256
    return out


@cache
def _midpoints(signed: bool) -> torch.Tensor:
    m = _dynamic_map(signed)
    return (m[1:] + m[:-1]) / 2


LUT_BITS = 20  # sign, exponent and 11 mantissa bits of the quotient index the code table


@cache
def _code_table(signed: bool) -> torch.Tensor:
    """The code of every fp32 quotient by its top LUT_BITS bits: the map value nearest to the middle of the
    bin (NaN bins: code of 0)."""
    bins = torch.arange(1 << LUT_BITS, dtype=torch.int64)
    mid = ((bins << (32 - LUT_BITS)) | (1 << (31 - LUT_BITS))).to(torch.int64)
    mid = torch.where(mid >= 1 << 31, mid - (1 << 32), mid).to(torch.int32).view(torch.float32)
    mid = torch.nan_to_num(mid, nan=0.0).clamp(-1.0, 1.0)
    return torch.searchsorted(_midpoints(signed), mid).to(torch.uint8)


def _blocks(x: torch.Tensor, nb: int) -> torch.Tensor:
    """`x` as (nb, BLOCK), zero-padded at the end."""
    pad = nb * BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(nb, BLOCK) if pad else x.view(nb, BLOCK)


def n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def packed_bytes(n: int) -> int:
    """Bytes of a Q8 of n elements (optstates.quantized_bytes)."""
    return SCALE_BYTES * n_blocks(n) + n


@dataclass
class Q8:
    """n elements quantized block-wise: `buf` holds the blocks' fp32 absmax, then the codes."""

    n: int
    signed: bool
    buf: torch.Tensor  # uint8, packed_bytes(n)

    @classmethod
    def empty(cls, n: int, signed: bool, device: torch.device | str = "cpu") -> Q8:
        return cls(n, signed, torch.zeros(packed_bytes(n), dtype=torch.uint8, device=device))

    @classmethod
    def of(cls, x: torch.Tensor, signed: bool) -> Q8:
        q = cls.empty(x.numel(), signed, x.device)
        q.encode(x)
        return q

    @property
    def absmax(self) -> torch.Tensor:
        return self.buf[: SCALE_BYTES * n_blocks(self.n)].view(torch.float32)

    @property
    def codes(self) -> torch.Tensor:
        return self.buf[SCALE_BYTES * n_blocks(self.n):]

    def encode(self, x: torch.Tensor) -> None:
        """Quantize the n elements of `x` (fp32) into this buffer: each block's absmax, each element the code
        of the map value nearest to it divided by that absmax (found through a table indexed by the
        quotient's top LUT_BITS bits: exact but within 2^-12 of a midpoint between two map values, where the
        gap between map values is at least 1.4%)."""
        x = x.reshape(-1).float()
        assert x.numel() == self.n, (x.numel(), self.n)
        if self.n == 0:
            return
        nb = n_blocks(self.n)
        xb = _blocks(x, nb)
        am = xb.abs().amax(dim=1)
        self.absmax.copy_(am)
        inv = torch.where(am > 0, 1.0 / am, torch.zeros_like(am))  # an all-zero block: codes of 0
        normed = (xb * inv[:, None]).view(torch.int32).reshape(-1)[: self.n]
        normed.bitwise_right_shift_(32 - LUT_BITS).bitwise_and_((1 << LUT_BITS) - 1)  # in place: no copies
        self.codes.copy_(_code_table(self.signed).to(x.device)[normed])

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The n elements as fp32: each code's map value times its block's absmax."""
        if out is None:
            out = torch.empty(self.n, dtype=torch.float32, device=self.buf.device)
        if self.n == 0:
            return out
        nb = n_blocks(self.n)
        values = _dynamic_map(self.signed).to(self.buf.device)[self.codes.int()]
        if nb * BLOCK == self.n:  # whole blocks: straight into `out`
            torch.mul(values.view(nb, BLOCK), self.absmax[:, None], out=out.view(nb, BLOCK))
        else:
            out.copy_((_blocks(values, nb) * self.absmax[:, None]).reshape(-1)[: self.n])
        return out

    def copy_from(self, other: Q8) -> None:
        self.buf.copy_(other.buf)


def stochastic_round_bf16_(dst: torch.Tensor, x: torch.Tensor, generator: torch.Generator) -> None:
    """`dst` (bf16) = `x` (fp32) rounded to bf16 stochastically: up with a probability equal to the
    distance to the lower neighbour over the gap (random low 16 bits added before truncation), so the
    rounding is unbiased and small updates survive in expectation."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=generator, device="cpu")
    rounded = (bits + noise.to(bits.device)) & -65536  # 0xFFFF0000 as int32
    finite = torch.isfinite(x)
    out = torch.where(finite, rounded.view(torch.float32), x)
    dst.copy_(out)  # exact: the low 16 bits are zero


def round_generator(seed: int, step: int, block: int, lo: int) -> torch.Generator:
    """The noise of one stochastic rounding: a function of the run's seed, the step, the block and the
    range's start only, so that a resumed run rounds as the uninterrupted one."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + step) * 1_000_033 + block * 65_537 + lo)
    return g
