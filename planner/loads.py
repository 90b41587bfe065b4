"""Per-iteration load of every resource, and the roofline lower bound on iteration time.

The loads are exact and cannot drift from the schedule builder: they are *measured* on the builder's own task
graphs for 1- and 2-layer versions of the model and extrapolated linearly in the layer count (every decoder
layer of a model contributes the same tasks, so a load is c + (L - n) x r + n x s for L layers of which the last
n swap instead of recomputing). """

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hwprofiles import HardwareProfile
from planner.costmodel import CostModel
from planner.graph import RESOURCES
from planner.models import ModelSpec
from planner.schedules import ScheduleConfig, build_graph, static_bytes

LINK_RESOURCES = ("h2d", "d2h", "ssd_read", "ssd_write")


@dataclass(frozen=True)
class IterationLoads:
    """Work per iteration: seconds on the GPU and the CPU, bytes on each link; resident bytes per tier."""

    work: dict[str, float]  # resource -> seconds (gpu, cpu) or bytes (links)
    static_bytes: dict[str, float]

    def times_s(self, hw: HardwareProfile) -> dict[str, float]:
        """Each resource's busy time if it ran alone at full rate, plus the shared-link terms."""
        r = CostModel(hw).rates
        w = self.work
        out = {"gpu": w["gpu"], "cpu": w["cpu"]}
        out["h2d"] = _div(w["h2d"], r.h2d)
        out["d2h"] = _div(w["d2h"], r.d2h)
        out["pcie"] = _div(w["h2d"] + w["d2h"], max(r.h2d, r.d2h, r.h2d_duplex + r.d2h_duplex))
        out["ssd_read"] = _div(w["ssd_read"], r.ssd_read)
        out["ssd_write"] = _div(w["ssd_write"], r.ssd_write)
        if hw.ssd.rw_sharing == "shared":
            out["ssd"] = out["ssd_read"] + out["ssd_write"]
        return out

    def bound_s(self, hw: HardwareProfile) -> float:
        """Roofline lower bound: no iteration can be shorter than its busiest resource."""
        return max(self.times_s(hw).values())

    def binding(self, hw: HardwareProfile) -> str:
        t = self.times_s(hw)
        return max(t, key=t.get)


def _div(a: float, b: float) -> float:
    if a <= 0:
        return 0.0
    return a / b if b > 0 else math.inf


def _work(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, layers: int, swapped: int) -> dict[str, float]:
    g = build_graph(replace(model, num_layers=layers), hw, replace(cfg, iterations=1, swap_layers=swapped))
    work = dict.fromkeys(RESOURCES, 0.0)
    for t in g.tasks:
        work[t.resource] += t.work
    return work


def iteration_loads(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> IterationLoads:
    """Exact per-iteration work of `cfg` on the full model (see module doc)."""
    L = model.num_layers
    n = cfg.swap_layers if cfg.recompute else 0
    w1 = _work(model, hw, cfg, 1, 0)
    w2 = _work(model, hw, cfg, 2, 0)
    ws = _work(model, hw, cfg, 1, 1) if n else w1
    work = {}
    for k in w1:
        r = w2[k] - w1[k]  # one recomputed layer
        c = w1[k] - r  # embedding + head
        s = ws[k] - c  # one swapped layer
        work[k] = c + (L - n) * r + n * s
    return IterationLoads(work=work, static_bytes=static_bytes(model, cfg.placement))
