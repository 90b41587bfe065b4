"""entries.scatter: flat sources copied into the destinations that tile their flat layout, through one
destination (its slices from one split_with_sizes) or several (each overlap its own slice): the bytes land
where a direct assembly of the layout puts them, the gaps between sources untouched."""

from __future__ import annotations

import pytest
import torch

from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.ops.entries import scatter


def _layout(seed: int) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """Sources at ascending offsets with gaps (some of zero bytes), and the layout's total size."""
    g = torch.Generator().manual_seed(seed)
    sources, pos = [], 0
    for _ in range(int(torch.randint(1, 9, (), generator=g))):
        pos += int(torch.randint(0, 5, (), generator=g))
        n = int(torch.randint(0, 12, (), generator=g))
        sources.append((pos, torch.randint(1, 255, (n,), dtype=torch.uint8, generator=g)))
        pos += n
    return sources, pos + int(torch.randint(0, 4, (), generator=g))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cuts", [(), (5,), (3, 17)])
def test_scatter_puts_every_source_where_the_layout_says(seed, cuts):
    sources, total = _layout(seed)
    want = torch.zeros(total, dtype=torch.uint8)
    for off, src in sources:
        want[off: off + src.numel()] = src
    bounds = [0, *[c for c in cuts if 0 < c < total], total]
    dests = [(a, torch.zeros(z - a, dtype=torch.uint8)) for a, z in zip(bounds, bounds[1:])]
    scatter(PlainCpuBackend(), sources, dests)
    got = torch.cat([d for _off, d in dests]) if dests else torch.zeros(0, dtype=torch.uint8)
    assert torch.equal(got, want)
