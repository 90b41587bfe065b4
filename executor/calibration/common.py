"""What every calibration measurement shares: the sizes of its work (``--quick`` or full), the units, the
guarded torch import (torch is imported inside the functions, so that building the `tierflow` parser never
imports it) and the error of a calibration that cannot run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierflow.errors import TierflowError
from tierflow.extras import install_command

MIB = 2**20
GIB = 2**30


class CalibrationError(TierflowError):
    """A calibration that cannot run or a result that cannot be used (one line, exit code 2)."""


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does; ``--quick`` keeps the whole run under ~20 s on a small machine."""

    dram_bytes: int
    adam_params: int
    adam_steps: int
    ssd_file_bytes: int
    ssd_block_bytes: int
    ssd_min_s: float  # each solo SSD phase runs at least this long (re-reading / re-writing the file)
    ssd_mixed_s: float
    gpu_target_s: float  # timed span per GEMM shape
    hbm_bytes: int
    pcie_bytes: int


FULL = Sizes(
    dram_bytes=1 * GIB, adam_params=50_000_000, adam_steps=5, ssd_file_bytes=2 * GIB, ssd_block_bytes=4 * MIB,
    ssd_min_s=1.0, ssd_mixed_s=3.0, gpu_target_s=0.3, hbm_bytes=2 * GIB, pcie_bytes=1 * GIB,
)
QUICK = Sizes(
    dram_bytes=256 * MIB, adam_params=5_000_000, adam_steps=3, ssd_file_bytes=256 * MIB,
    ssd_block_bytes=1 * MIB, ssd_min_s=0.3, ssd_mixed_s=1.0, gpu_target_s=0.05, hbm_bytes=512 * MIB,
    pcie_bytes=256 * MIB,
)


def import_torch() -> Any:
    """torch, or a one-line CalibrationError saying how to install it."""
    try:
        import torch
    except ImportError as e:
        raise CalibrationError(f"tierflow calibrate needs PyTorch ({e}): {install_command('run')}") from None
    return torch
