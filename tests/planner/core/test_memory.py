"""The one memory model (tierflow.planner.core.memory) against the simulator, on random configurations.

The simulator lets a transfer start as soon as its memory fits, so with more capacity than a schedule needs,
reads run ahead (optimizer states of deferred Adam parts) and offloads queue up behind a slow link: the peak
under a large box's capacity is not what the schedule needs. What the model promises:
1. capped at the model's estimate, every tier suffices: the schedule runs to the end (no tier overflows) and
   is not slowed by more than a few percent;
2. the estimate is not loose: at most (1 + MARGIN) times the peak simulated with the box's full capacity (on
   the CPU plus the staging of the blocks in flight, which the model sizes by the largest block).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierflow.api import make_schedule, simulate, simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.memory import MARGIN, schedule_memory
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.search.explain import min_requirements
from tierflow.planner.search.placement_model import placement_of
from tierflow.planner.search.problem import Problem

HALF = st.sampled_from([0.0, 0.5, 1.0])


@st.composite
def configs(draw):
    model = replace(get_model(draw(st.sampled_from(["gpt3-125m", "gpt3-350m", "llama2-7b"]))),
                    num_layers=draw(st.sampled_from([2, 3, 4, 6])))
    hw = load_profile(draw(st.sampled_from(["rtx3090-desktop", "rtx4090-lohan", "a100-80g-nvme"])))
    mb, M = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    family = draw(st.sampled_from(["horizontal", "fuyou", "vertical", "block"]))
    group = draw(st.sampled_from([d for d in (1, 2, 4) if M % d == 0])) if family == "block" else None
    x = {"w_ssd": draw(HALF), "s_ssd": draw(HALF), "c_ssd": draw(HALF)}
    x["w_gpu"] = draw(st.sampled_from([0.0, 0.5])) if x["w_ssd"] <= 0.5 else 0.0
    x["c_gpu"] = draw(st.sampled_from([0.0, 0.5])) if x["c_ssd"] <= 0.5 else 0.0
    alpha = None if family == "horizontal" else draw(st.sampled_from([0.0, 0.25, 0.5]))
    cfg = make_schedule(family, model, hw, batch=mb * M, micro_batch=mb,
                        seq=draw(st.sampled_from([128, 256])),
                        placement=placement_of(x), group=group, alpha=alpha,
                        swap_layers=draw(st.integers(0, model.num_layers)), iterations=2)
    return model, hw, cfg


def estimate(model, cfg, hw) -> dict[str, float]:
    mem = schedule_memory(model, micro_batch=cfg.micro_batch, seq=cfg.seq,
                          num_micro_batches=cfg.num_micro_batches, group=cfg.group, alpha=cfg.alpha,
                          optimizer_overlap=cfg.optimizer_overlap, prefetch_depth=cfg.prefetch_depth,
                          act_prefetch=cfg.act_prefetch, runtime=cfg.runtime, hw=hw)
    return mem.tier_bytes(cfg.placement, cfg.swap_layers), mem.staging_bytes(cfg.placement, cfg.swap_layers)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
          database=None)
@given(configs())
def test_estimate_suffices_and_is_not_loose(case):
    model, hw, cfg = case
    est, staging = estimate(model, cfg, hw)
    free = simulate_config(model, hw, cfg)
    g = build_graph(model, hw, cfg)
    g.capacity_bytes = {t: est[t] * (1 + 1e-9) + 1.0 for t in est}
    capped = simulate_config(model, hw, cfg, g)  # raises CapacityError if a tier does not suffice
    assert capped.iteration_s <= free.iteration_s * 1.05
    for tier in est:
        allowance = staging if tier == "cpu" else 0.0
        assert est[tier] <= (1 + MARGIN) * free.peak_bytes[tier] + allowance + 1.0, tier


def test_the_block_schedule_of_the_architecture_issue_runs():
    """Its default placement budgeted fewer gradient bytes than the builder holds ("cpu memory exceeded")."""
    res = simulate("gpt3-175b", "rtx4090-lohan", "block", batch=64, micro_batch=2, iterations=2)
    assert res.peak_bytes["cpu"] <= res.graph.capacity_bytes["cpu"]


def test_min_requirements_is_the_memory_model_of_the_frugal_plan():
    model, hw = get_model("gpt3-1.3b"), load_profile("rtx3090-desktop")
    for allow_ssd in (True, False):
        p = Problem(model, hw, 8, 1024, allow_ssd=allow_ssd)
        need = min_requirements(p)
        cfg = make_schedule("vertical", model, hw, batch=8, micro_batch=1, seq=1024, alpha=0.0,
                            placement=__import__("tierflow.planner.search.explain",
                                                 fromlist=["x"]).frugal_placement(p))
        est, _ = estimate(model, cfg, hw)
        assert need["ssd"] == pytest.approx(est["ssd"])
        assert need["gpu"] == pytest.approx(est["gpu"])
        assert need["cpu"] == pytest.approx(est["cpu"] + 0.02 * hw.cpu.capacity_bytes)
        if not allow_ssd:
            assert need["ssd"] == 0.0


@pytest.mark.xfail(strict=True, reason="known bug (docs/reproductions.md, caveats): with GPU memory capped "
                   "at the estimate, a vertical group with checkpoints on the SSDs gets stuck 1 MiB short at "
                   "the last layer's backward")
def test_vertical_group_with_checkpoints_on_ssd_fits_in_its_estimate():
    """Found by the property test above (random search, 2026-11-23); present since before the host memory
    model. Capping the GPU at the memory model's estimate leaves the head's backward of the third micro-batch
    1 MiB short and nothing can free it: a deadlock under memory pressure, not a missing byte (a larger
    estimate is taken up the same way). When it is fixed, this test passes and strict xfail fails: move it
    into the suite."""
    model = replace(get_model("llama2-7b"), num_layers=2)
    hw = load_profile("rtx3090-desktop")
    cpu, ssd = Split(), Split(cpu=0.0, ssd=1.0)
    placement = Placement(weights=cpu, master=cpu, adam_m=cpu, adam_v=cpu, grads=cpu, checkpoints=ssd)
    cfg = make_schedule("vertical", model, hw, batch=4, micro_batch=1, seq=128, placement=placement,
                        alpha=0.0, iterations=2)
    est, _ = estimate(model, cfg, hw)
    g = build_graph(model, hw, cfg)
    g.capacity_bytes = {t: est[t] * (1 + 1e-9) + 1.0 for t in est}
    simulate_config(model, hw, cfg, g)
