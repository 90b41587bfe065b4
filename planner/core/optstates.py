"""The optimizer-state formats: how many bytes AdamW's master copy and moments take per parameter.

- ``fp32`` (the default): fp32 master copy and fp32 moments m and v, 4 + 4 + 4 bytes per parameter.
- ``8bit``: fp32 master, m and v quantized block-wise to 8 bits (Dettmers et al., "8-bit Optimizers via
  Block-wise Quantization", ICLR 2022): one byte per element and one fp32 absmax per block of
  QUANT_BLOCK_ELEMS elements, 1 + 4/256 bytes per moment (tierflow.executor.optim.quant8 implements it).
- ``8bit-bf16master``: the same moments and a bf16 master copy rounded stochastically after each step
  (unbiased, so small updates survive in expectation, the compensation that needs no stored term: a Kahan
  term would take another 2 bytes and make the master as large as an fp32 one); only for 16-bit precisions,
  whose compute weights are bf16 anyway.

Block size: 256 elements, as bitsandbytes' blockwise 8-bit optimizers (their update kernels quantize
blocks of 256) and torchao's OptimState8bit (block_size=256) do; fp32 scales add 1.6% to a moment.
Only the standard library here (never torch).
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_FORMATS = ("fp32", "8bit", "8bit-bf16master")
DEFAULT_STATE_FORMAT = "fp32"
QUANT_BLOCK_ELEMS = 256  # elements per quantization block (one absmax each)
SCALE_BYTES = 4  # an fp32 absmax per block
FP32_BYTES = 4
BF16_BYTES = 2
QUANT_BYTES = 1  # one 8-bit code per element


@dataclass(frozen=True)
class StateFormat:
    """Bytes per parameter of each optimizer tensor class in one format."""

    name: str
    master_bytes: float  # the master copy (a bf16 master: 2)
    moment_bytes: float  # each of m and v, block scales included
    quantized: bool  # m and v stored as 8-bit codes + per-block absmax

    @property
    def state_bytes(self) -> float:
        return self.master_bytes + 2 * self.moment_bytes


def quantized_moment_bytes(block_elems: int = QUANT_BLOCK_ELEMS) -> float:
    """Bytes per element of a block-wise 8-bit tensor: its code and its share of the block's absmax."""
    return QUANT_BYTES + SCALE_BYTES / block_elems


def state_format(name: str | None, master_bytes: int = FP32_BYTES) -> StateFormat:
    """The format called `name` (None: the default) for a precision whose fp32 master takes
    `master_bytes`."""
    name = name or DEFAULT_STATE_FORMAT
    if name == "fp32":
        return StateFormat(name, master_bytes, FP32_BYTES, False)
    if name == "8bit":
        return StateFormat(name, master_bytes, quantized_moment_bytes(), True)
    if name == "8bit-bf16master":
        return StateFormat(name, BF16_BYTES, quantized_moment_bytes(), True)
    raise ValueError(f"unknown optimizer-state format {name!r} (use one of {', '.join(STATE_FORMATS)})")


def quantized_bytes(elems: int, block_elems: int = QUANT_BLOCK_ELEMS) -> int:
    """Exact bytes of `elems` elements quantized block-wise: the codes and one absmax per (partial) block."""
    return QUANT_BYTES * elems + SCALE_BYTES * -(-elems // block_elems)
