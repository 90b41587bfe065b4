"""Per-iteration loads extrapolated from 1- and 2-layer graphs equal the full graph's, and bound the
simulation."""

from __future__ import annotations

import pytest

from tierflow.api import simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement
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


def test_ssd_mixed_efficiency_spans_time_sharing_to_independent_directions():
    """ssd.mixed_efficiency: 0.5 = reads and writes time-share the drives (the time is the sum), 1 = they do
    not interfere (the longer direction), in between as for PCIe's duplex rates; the simulator agrees in
    order."""
    from tierflow.planner.search.loads import duplex_time_s

    R, W, rd, wr = 10.0, 5.0, 100.0, 40.0
    assert duplex_time_s(rd, wr, R, W, 0.5 * R, 0.5 * W) == pytest.approx(rd / R + wr / W)
    assert duplex_time_s(rd, wr, R, W, R, W) == pytest.approx(max(rd / R, wr / W))
    mid = duplex_time_s(rd, wr, R, W, 0.75 * R, 0.75 * W)
    assert max(rd / R, wr / W) < mid < rd / R + wr / W
    model = get_model("gpt3-125m")
    times = []
    for e in (0.5, 0.75, 1.0):
        hw = load_profile("rtx3090-desktop").with_overrides({"ssd.mixed_efficiency": e, "ssd.count": 1})
        cfg = make_schedule("fuyou", model, hw, batch=4, micro_batch=2, seq=256,
                            placement=Placement.uniform("ssd"))
        times.append(simulate_config(model, hw, cfg).iteration_s)
    assert times[0] >= times[1] >= times[2] and times[0] > times[2]
