"""Per-iteration loads extrapolated from 1- and 2-layer graphs equal the full graph's, and bound the simulation."""

from __future__ import annotations

import pytest

from tierflow.api import simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.search.loads import iteration_loads


@pytest.mark.parametrize(
    "family, micro_batch, swap",
    [("horizontal", 2, 0), ("fuyou", 2, 3), ("vertical", 1, 0), ("vertical", 2, 5), ("block", 1, 2)],
)
def test_extrapolated_loads_equal_the_full_graph(family, micro_batch, swap):
    model, hw = get_model("gpt3-1.3b"), load_profile("rtx3090-desktop").with_overrides({"cpu.memory_gib": 48})
    cfg = make_schedule(family, model, hw, batch=8, micro_batch=micro_batch, seq=512, swap_layers=swap)
    loads = iteration_loads(model, hw, cfg)
    g = build_graph(model, hw, cfg)
    for resource in RESOURCES:
        exact = sum(t.work for t in g.tasks if t.resource == resource and t.iteration == 1)
        assert loads.work[resource] == pytest.approx(exact, rel=1e-9, abs=1e-6), resource
        # the two phases split the work, and only the optimizer tail falls in neither
        phased = loads.work[resource + "@F"] + loads.work[resource + "@B"]
        assert phased <= loads.work[resource] * (1 + 1e-9) + 1e-6
        if resource == "gpu" and family != "horizontal":
            assert phased == pytest.approx(loads.work[resource], rel=1e-9)
    res = simulate_config(model, hw, cfg, g)
    assert loads.bound_s(hw) <= res.iteration_s * (1 + 1e-9)
    assert loads.static_bytes == pytest.approx(g.static_bytes)
