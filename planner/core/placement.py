"""Where each tensor class lives: fractions over GPU, CPU and SSD, and the defaults each schedule starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierflow.errors import TierflowError
from tierflow.planner.core.graph import TIERS

TENSOR_CLASSES = ("weights", "master", "adam_m", "adam_v", "grads", "checkpoints")


class PlacementError(TierflowError, ValueError):
    """A placement that cannot be used (fractions, or a combination the executor cannot run)."""


@dataclass(frozen=True)
class Split:
    gpu: float = 0.0
    cpu: float = 1.0
    ssd: float = 0.0

    def __post_init__(self) -> None:
        for tier in TIERS:
            v = getattr(self, tier)
            if not 0.0 <= v <= 1.0:
                raise PlacementError(f"placement fraction {tier}={v} must be within [0, 1]")
        if abs(self.gpu + self.cpu + self.ssd - 1.0) > 1e-6:
            raise PlacementError(f"placement fractions gpu={self.gpu} cpu={self.cpu} ssd={self.ssd} must sum to 1")

    @property
    def off_gpu(self) -> float:
        return self.cpu + self.ssd

    def as_dict(self) -> dict[str, float]:
        return {"gpu": self.gpu, "cpu": self.cpu, "ssd": self.ssd}


def _split(**kw: float) -> Split:
    return Split(**kw)


@dataclass(frozen=True)
class Placement:
    """Fractions of every tensor class per tier. `grads` is where gradients accumulate between micro-batches
    (gpu: on the GPU across all micro-batches; cpu: fp32 in host memory; ssd: spilled until the optimizer step).
    `checkpoints` is where activation checkpoints (and, in vertical schedules, the activations and activation
    gradients that wait between layers) are kept."""

    weights: Split = field(default_factory=Split)
    master: Split = field(default_factory=Split)
    adam_m: Split = field(default_factory=Split)
    adam_v: Split = field(default_factory=Split)
    grads: Split = field(default_factory=Split)
    checkpoints: Split = field(default_factory=Split)

    def __post_init__(self) -> None:
        g = self.master.gpu
        if self.adam_m.gpu != g or self.adam_v.gpu != g:
            raise PlacementError("master, adam_m and adam_v must have the same GPU fraction (the optimizer runs where they are)")
        if g not in (0.0, 1.0):
            raise PlacementError(f"optimizer states on the GPU must be all or nothing, got gpu={g}")
        if g == 1.0 and (self.weights.gpu != 1.0 or self.grads.gpu != 1.0):
            raise PlacementError("a GPU optimizer needs the weights and gradients on the GPU too (weights.gpu = grads.gpu = 1)")
        if self.grads.ssd > 0 and self.grads.gpu > 0:
            raise PlacementError("gradients accumulate either on the GPU or on the host side, not both with an SSD spill")

    @property
    def gpu_optimizer(self) -> bool:
        return self.master.gpu == 1.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: getattr(self, name).as_dict() for name in TENSOR_CLASSES}

    @classmethod
    def from_dict(cls, data: dict) -> Placement:
        unknown = set(data) - set(TENSOR_CLASSES)
        if unknown:
            raise PlacementError(f"unknown tensor class {sorted(unknown)[0]!r} (known: {', '.join(TENSOR_CLASSES)})")
        return cls(**{k: Split(**v) for k, v in data.items()})

    @classmethod
    def uniform(cls, tier: str) -> Placement:
        s = Split(**{t: 1.0 if t == tier else 0.0 for t in TIERS})
        return cls(weights=s, master=s, adam_m=s, adam_v=s, grads=s, checkpoints=s)

    def describe(self) -> str:
        parts = []
        for name in TENSOR_CLASSES:
            s = getattr(self, name)
            tiers = [f"{t} {getattr(s, t):.0%}" for t in TIERS if getattr(s, t) > 0]
            parts.append(f"{name}: {' '.join(tiers)}")
        return "; ".join(parts)


def fill_split(nbytes: float, budget_bytes: float) -> tuple[Split, float]:
    """Put as much of `nbytes` on the CPU as `budget_bytes` allows, the rest on SSD. Returns (split, budget left)."""
    if nbytes <= 0:
        return Split(), budget_bytes
    cpu = max(0.0, min(1.0, budget_bytes / nbytes))
    cpu = round(cpu, 6)
    return Split(gpu=0.0, cpu=cpu, ssd=round(1.0 - cpu, 6)), budget_bytes - cpu * nbytes
