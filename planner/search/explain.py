"""Explanations: the least each tier must hold (the memory model's most frugal plan), the message for a model
that does not fit, and what binds a chosen plan and which change to the box would help most."""

from __future__ import annotations

import math
from dataclasses import replace

from tierflow.planner.core.memory import schedule_memory
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.simulator import SimResult, bytes_text
from tierflow.planner.core.world import rank_capacity_bytes
from tierflow.planner.search.loads import IterationLoads
from tierflow.planner.search.placement_model import linear_loads, placement_memory, solve_placement
from tierflow.planner.search.problem import Problem
from tierflow.planner.search.results import SearchResult


def frugal_placement(problem: Problem) -> Placement:
    """Weights, optimizer states and checkpoints on the SSDs when the problem may use them, else in CPU
    memory. Under LoRA only the frozen weights go to the SSDs (LoRA writes nothing there)."""
    where = Split(gpu=0, cpu=0, ssd=1) if problem.uses_ssd else Split()
    if problem.model.lora is not None:
        return Placement(weights=where)
    return Placement(weights=where, master=where, adam_m=where, adam_v=where, grads=Split(),
                     checkpoints=where)


def min_requirements(problem: Problem) -> dict[str, float]:
    """The least each tier must hold for the most memory-frugal plan (vertical, micro-batch 1, alpha 0,
    everything that can live on the SSD there), by the one memory model (tierflow.planner.core.memory)."""
    mem = schedule_memory(problem.model, micro_batch=1, seq=problem.seq, num_micro_batches=problem.rank_batch,
                          group=problem.rank_batch, alpha=0.0, optimizer_overlap=True, prefetch_depth=1,
                          ranks=problem.world.ranks, hw=problem.hw)
    return mem.tier_bytes(frugal_placement(problem), 0, rank_capacity_bytes(problem.hw, problem.gpus)["cpu"])


def overflows(problem: Problem) -> dict[str, float]:
    """Bytes by which each tier that cannot hold the most frugal plan overflows."""
    need = min_requirements(problem)
    caps = problem.capacity_bytes
    return {t: need[t] - caps[t] for t in need if need[t] > caps[t]}


def infeasible_message(problem: Problem) -> str:
    """The one-line error for a problem no plan fits: which tier overflows by how much and what would make it
    fit (or, when every tier holds the most frugal plan, that verification refused every candidate)."""
    model, hw = problem.model, problem.hw
    need, caps = min_requirements(problem), problem.capacity_bytes
    over = overflows(problem)
    if not over:
        return (f"{model.name} on {hw.name}: no candidate plan survived verification "
                f"(try a smaller batch or --time-limit; the simulator refused every placement the solver "
                f"found)")
    parts = []
    ssd_gb = hw.ssd.capacity_gb * 1e9
    for tier, b in over.items():
        fix = {"gpu": "a smaller micro-batch or seq, or a GPU with more memory",
               "cpu": f"+{math.ceil(b / 2**30)} GiB CPU memory" + (
                   f", or {max(1, math.ceil(b / ssd_gb))} SSD(s) to hold states"
                   if hw.ssd.count == 0 else ""),
               "ssd": f"{math.ceil(b / (ssd_gb or 3.84e12))} more SSD(s) of {hw.ssd.capacity_gb:g} GB"}[tier]
        parts.append(f"{tier} overflows by {bytes_text(b)} (needs {bytes_text(need[tier])} of "
                     f"{bytes_text(caps[tier])}; fix: {fix})")
    return f"{model.name} does not fit on {hw.name}: " + "; ".join(parts)


WHAT_BINDS = {"gpu": "GPU compute: the plan is compute-bound; only a faster GPU or less recompute helps",
              "cpu": "CPU Adam", "h2d": "PCIe host-to-device", "d2h": "PCIe device-to-host",
              "pcie": "the PCIe link",
              "ssd_read": "SSD reads", "ssd_write": "SSD writes", "ssd": "the SSD array (reads + writes)",
              "dram": "host memory bandwidth (CPU Adam, PCIe and SSD DMA together)",
              "net": "the collectives among the GPUs (all-gather of weights, reduce-scatter of gradients, "
                     "LoRA: all-reduce of the adapters' gradients)",
              "pcie_h2d": "the PCIe link host-to-device, shared with the collectives through the host",
              "pcie_d2h": "the PCIe link device-to-host, shared with the collectives through the host"}


def explain(sr: SearchResult) -> list[str]:
    """What binds, and what change to the box would help most (each re-solved with the same CP-SAT model)."""
    best, problem = sr.best, sr.problem
    hw, cfg = problem.hw, best.config
    times = IterationLoads(work=_work_of(best.result), static_bytes={}, world=problem.world).times_s(hw)
    lines = []
    order = sorted(times.items(), key=lambda kv: -kv[1])
    it = best.verified_s
    lines.append("busiest resources (share of the iteration each would need alone): " +
                 ", ".join(f"{k} {100 * v / it:.0f}%" for k, v in order[:4]))
    lines.append(f"binds: {WHAT_BINDS[order[0][0]]}")
    peak = best.result.peak_bytes
    caps = best.result.graph.capacity_bytes
    lines.append("memory: " + ", ".join(f"{t} {peak[t] / 1e9:,.1f} of {caps[t] / 1e9:,.0f} GB"
                                        for t in ("gpu", "cpu", "ssd")))
    base_cfg = replace(cfg, iterations=1)
    lin, mem = linear_loads(problem, base_cfg), placement_memory(problem, base_cfg)
    what_ifs = [
        ("one more SSD", {"ssd.count": hw.ssd.count + 1} if hw.ssd.count else None),
        ("twice the SSDs", {"ssd.count": 2 * hw.ssd.count} if hw.ssd.count else None),
        ("+50% CPU memory", {"cpu.memory_gib": hw.cpu.memory_gib * 1.5}),
        ("next PCIe generation", {"pcie.h2d_gbps": hw.pcie.h2d_gbps * 2,
                                  "pcie.d2h_gbps": hw.pcie.d2h_gbps * 2,
                                  "pcie.duplex_h2d_gbps": hw.pcie.duplex_h2d_gbps * 2,
                                  "pcie.duplex_d2h_gbps": hw.pcie.duplex_d2h_gbps * 2,
                                  "pcie.generation": min(7, hw.pcie.generation + 1)}),
        ("2x CPU Adam rate", {"cpu.adam_gparams_per_s": hw.cpu.adam_gparams_per_s * 2}),
    ]
    base = solve_placement(problem, lin, mem, time_limit_s=2.0)
    gains = []
    for label, overrides in what_ifs:
        if overrides is None:
            continue
        # the same loads and memory; only the box's rates and capacities change
        s = solve_placement(problem.on(hw.with_overrides(overrides)), lin, mem, time_limit_s=2.0)
        if s and base:
            gains.append((base.report.objective_s / s.report.objective_s, label))
    gains.sort(reverse=True)
    if gains:
        lines.append("what would help most (solver bound, same candidate): " +
                     ", ".join(f"{label} {g:.2f}x" for g, label in gains))
    return lines


def _work_of(res: SimResult) -> dict[str, float]:
    N = res.graph.num_iterations
    w = dict.fromkeys(res.graph.resources(), 0.0)
    for t in res.graph.tasks:
        if t.iteration == N - 1:
            w[t.resource] += t.work
    return w
