"""gantt.png: compute and transfers in distinct palettes (transfers hatched), and a zoomed panel of two
layers' worth of time inside the full iteration."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tierflow.api import simulate  # noqa: E402
from tierflow.planner.core.trace import KIND_COLORS, TENSOR_COLORS, plot_gantt, zoom_window  # noqa: E402


@pytest.fixture(scope="module")
def res():
    return simulate("tiny-llama", "rtx3090-desktop", "vertical", batch=4, micro_batch=1, seq=64)


def test_no_compute_kind_shares_a_colour_with_a_transfer():
    assert not set(KIND_COLORS.values()) & set(TENSOR_COLORS.values())
    assert len(set(TENSOR_COLORS.values())) == len(TENSOR_COLORS)


def test_gantt_has_a_zoomed_panel_of_two_layers(res, tmp_path):
    z0, z1 = zoom_window(res)
    w0, w1 = res.window_s
    mid = (res.graph.num_blocks - 1) // 2
    fwd = [t.id for t in res.graph.tasks if t.kind == "fwd" and t.block == mid
           and w0 <= res.start_s[t.id] < w1]
    assert z0 == pytest.approx(min(res.start_s[i] for i in fwd))
    assert z1 - z0 == pytest.approx(min(2 * sum(res.end_s[i] - res.start_s[i] for i in fwd), w1 - z0))
    assert w0 <= z0 < z1 <= w1 and z1 - z0 < (w1 - w0) / 2
    fig = plot_gantt(res, title="t")
    full, zoom, mem = fig.axes
    assert full.get_xlim() == pytest.approx((0, w1 - w0))
    assert zoom.get_xlim() == pytest.approx((z0 - w0, z1 - w0))
    # transfers are drawn hatched, compute solid
    hatched = {c.get_hatch() for c in zoom.collections if c.get_hatch()}
    assert hatched == {"////"}
    legend = {t.get_text() for t in full.get_legend().get_texts()}
    assert {"fwd", "bwd", "weights transfer", "grads transfer"} <= legend
    plt.close(fig)
    plot_gantt(res, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_gantt_into_an_axes_draws_only_the_window(res):
    fig, ax = plt.subplots()
    w0, _ = res.window_s
    assert plot_gantt(res, window=(w0, w0 + 0.01), ax=ax) is fig
    assert len(fig.axes) == 1 and ax.get_legend() is not None
    plt.close(fig)


def test_memory_panel_shows_a_small_run_on_a_big_box(res):
    """tiny-llama uses a sliver of the 3090 box: the memory panel is scaled to the fullest tier (not 0-100%,
    where every line lies on 0) and its legend gives each tier's peak and capacity."""
    fig = plot_gantt(res)
    mem = fig.axes[2]
    peak_pct = max(100 * res.peak_bytes[t] / res.graph.capacity_bytes[t] for t in ("gpu", "cpu", "ssd"))
    assert peak_pct < 1
    assert mem.get_ylim()[1] == pytest.approx(peak_pct * 1.15, rel=1e-6)
    labels = [t.get_text() for t in mem.get_legend().get_texts()]
    assert [s.split(":")[0] for s in labels] == ["gpu", "cpu", "ssd"] and all(" of " in s for s in labels)
    plt.close(fig)
