"""Per-iteration load of every resource, and the roofline lower bound on iteration time.

The loads are exact and cannot drift from the schedule builder: they are *measured* on the builder's own task
graphs for 1- and 2-layer versions of the model and extrapolated linearly in the layer count (every decoder
layer of a model contributes the same tasks, so a load is c + (L - n) x r + n x s for L layers of which the
last n swap instead of recomputing). """

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.clock import Clock
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.dsruntime import as_runtime_steps
from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.core.memory import static_bytes
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.schedules import build_graph, step_sequence
from tierflow.planner.core.world import SINGLE, World


@dataclass(frozen=True)
class IterationLoads:
    """Work per iteration: seconds on the GPU and the CPU, bytes on each link; resident bytes per tier."""

    work: dict[str, float]  # resource -> seconds (gpu, cpu) or bytes (links)
    static_bytes: dict[str, float]
    world: World = SINGLE  # several ranks: one rank's work, on its share of the box
    runtime: str | None = None  # whose CPU Adam steps (its rate sets the DRAM bytes a CPU second moves)

    def times_s(self, hw: HardwareProfile) -> dict[str, float]:
        """Each resource's busy time if it ran alone at full rate, the shared-link terms, and "phases": the
        forward phase's busiest resource plus the backward phase's (transfers that serve one phase cannot hide
        behind the other phase's compute, except for the prefetch at the boundary)."""
        out = self._times(hw, "")
        if any(k.endswith("@F") for k in self.work):
            out["phases"] = max(self._times(hw, "@F").values()) + max(self._times(hw, "@B").values())
        return out

    def _times(self, hw: HardwareProfile, suffix: str) -> dict[str, float]:
        r = link_rates(as_runtime_steps(hw, self.runtime), self.world)
        w = {k: self.work.get(k + suffix, 0.0) for k in RESOURCES}
        out = {"gpu": w["gpu"], "cpu": w["cpu"]}
        out["h2d"] = _div(w["h2d"], r.h2d)
        out["d2h"] = _div(w["d2h"], r.d2h)
        out["pcie"] = pcie_time_s(w["h2d"], w["d2h"], r)
        out["ssd_read"] = _div(w["ssd_read"], r.ssd_read)
        out["ssd_write"] = _div(w["ssd_write"], r.ssd_write)
        if hw.ssd.count > 0:  # both directions of the array, as for PCIe (ssd.mixed_efficiency)
            out["ssd"] = duplex_time_s(w["ssd_read"], w["ssd_write"], r.ssd_read, r.ssd_write,
                                       r.ssd_read_mixed, r.ssd_write_mixed)
        if w["net"] > 0:  # the collectives of several ranks
            out["net"] = _div(w["net"], r.net)
        out.update(pool_times_s(w, r))  # host memory (cpu.memory_efficiency) and, on a host device, its cores
        return out

    def bound_s(self, hw: HardwareProfile) -> float:
        """Roofline lower bound: no iteration can be shorter than its busiest resource (phases not
        counted)."""
        return max(v for k, v in self.times_s(hw).items() if k != "phases")

    def predict_s(self, hw: HardwareProfile) -> float:
        """The planner's prediction: the roofline bound, or the sum of the two phases' bounds when larger."""
        return max(self.times_s(hw).values())

    def binding(self, hw: HardwareProfile) -> str:
        t = self.times_s(hw)
        return max(t, key=t.get)


def pool_times_s(work: dict[str, float], r) -> dict[str, float]:
    """Least time each shared host pool needs for `work` (bytes on the links, seconds on gpu and cpu): host
    memory ("dram": each byte a link moves crosses DRAM once, CPU Adam moves r.adam_dram_bps while it runs)
    and, on a host device, its cores ("cores")."""
    return {name: sum(work.get(k, 0.0) * u for k, u in use.items()) / cap_s for name, cap_s, use in r.pools()}


def pcie_time_s(h2d_bytes: float, d2h_bytes: float, r) -> float:
    """Least time to move both directions over one PCIe link (duplex_time_s at the PCIe rates)."""
    return duplex_time_s(h2d_bytes, d2h_bytes, r.h2d, r.d2h, r.h2d_duplex, r.d2h_duplex)


def duplex_time_s(a_bytes: float, b_bytes: float, a_rate: float, b_rate: float, a_mixed: float,
                  b_mixed: float) -> float:
    """Least time to move both directions of one link (PCIe, or the SSD array's reads and writes): run them
    together for t (at the mixed rates) as long as both have bytes left, the rest alone at the solo rates.
    With c = 1 - Am/A - Bm/B < 0 (running both at once moves more than one alone), t = min(a/Am, b/Bm) and the
    time is a/A + b/B + c t."""
    if a_bytes <= 0 or b_bytes <= 0:
        return _div(a_bytes, a_rate) + _div(b_bytes, b_rate)
    base = a_bytes / a_rate + b_bytes / b_rate
    c = duplex_coefficient(a_rate, b_rate, a_mixed, b_mixed)
    if c >= 0:
        return base
    return base + c * min(a_bytes / a_mixed, b_bytes / b_mixed)


def duplex_coefficient(a_rate: float, b_rate: float, a_mixed: float, b_mixed: float) -> float:
    return 1.0 - a_mixed / a_rate - b_mixed / b_rate


def _div(a: float, b: float) -> float:
    if a <= 0:
        return 0.0
    return a / b if b > 0 else math.inf


def _work(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, layers: int, swapped: int,
          cache: dict | None) -> dict[str, float]:
    if cache is None:
        return _measure_work(model, hw, cfg, layers, swapped)
    key = (cfg.micro_batch, cfg.group, cfg.placement, cfg.alpha, cfg.optimizer_overlap, cfg.prefetch_depth,
           cfg.act_prefetch, cfg.recompute, layers, swapped, cfg.gpus, cfg.nodes, cfg.runtime)
    if key not in cache:
        cache[key] = _measure_work(model, hw, cfg, layers, swapped)
    return cache[key]


def _measure_work(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, layers: int,
                  swapped: int) -> dict[str, float]:
    """Work per resource, and per resource and phase ("gpu@F", "h2d@B", ...): a task belongs to the phase of
    the GPU step its queue position serves (forward steps -> F; head and backward steps -> B; the optimizer
    tail after the last step to neither)."""
    m = replace(model, num_layers=layers)
    g = build_graph(m, hw, replace(cfg, iterations=1, swap_layers=swapped))
    steps = step_sequence(layers + 2, cfg.num_micro_batches, cfg.group)
    phases = ["F" if st.phase == "F" else "B" for st in steps]
    clock = Clock(len(phases))
    work = dict.fromkeys(RESOURCES, 0.0)
    for r in RESOURCES:
        work[r + "@F"] = work[r + "@B"] = 0.0
    for t in g.tasks:
        work[t.resource] += t.work
        i = clock.first_iteration_step(t.key)
        if i is not None:
            work[t.resource + "@" + phases[i]] += t.work
    return work


def iteration_loads(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig,
                    cache: dict | None = None) -> IterationLoads:
    """Exact per-iteration work of `cfg` on the full model (see module doc). `cache`, a dict the caller keeps
    for one model and box (a Problem's), holds the measured 1- and 2-layer loads across calls."""
    L = model.num_layers
    n = cfg.swap_layers if cfg.recompute else 0
    w1 = _work(model, hw, cfg, 1, 0, cache)
    w2 = _work(model, hw, cfg, 2, 0, cache)
    ws = _work(model, hw, cfg, 1, 1, cache) if n else w1
    work = {}
    for k in w1:
        r = w2[k] - w1[k]  # one recomputed layer
        c = w1[k] - r  # embedding + head
        s = ws[k] - c  # one swapped layer
        work[k] = c + (L - n) * r + n * s
    return IterationLoads(work=work,
                          static_bytes=static_bytes(model, cfg.placement, cfg.runtime, cfg.world.ranks,
                                                    cfg.ds_knobs, hw=hw),
                          world=cfg.world, runtime=cfg.runtime)
