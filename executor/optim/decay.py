"""Weight-decay groups: which parameters AdamW decays. As Hugging Face's Trainer (get_decay_parameter_names)
and nanoGPT, biases and the weights of normalization layers (LayerNorm, RMSNorm) are not decayed; every other
parameter (matrices, embeddings, an untied head) is. `decay_pieces` cuts an element range of a block's flat
vector (this rank's shard of it) at the group boundaries.
"""

from __future__ import annotations

import functools
import re

from tierflow.executor.tiers.state import BlockLayout

# a parameter name that is not decayed: a bias, or a weight of a normalization layer
NO_DECAY = re.compile(r"(^|\.)bias$|(^|[._])(ln|norm|layernorm|rmsnorm)[^.]*\.weight$", re.IGNORECASE)


def decayed(name: str) -> bool:
    """Whether AdamW decays the parameter `name` (a block's parameter name, e.g. 'ln_1.weight')."""
    return NO_DECAY.search(name) is None


@functools.cache
def _block_runs(layout: BlockLayout, b: int) -> tuple[tuple[int, int, bool], ...]:
    """(lo, hi, decayed) runs of block b's flat vector, adjacent slots of one group merged."""
    runs: list[tuple[int, int, bool]] = []
    for s in layout.slots[b]:
        d = decayed(s.name)
        if runs and runs[-1][2] == d and runs[-1][1] == s.offset:
            runs[-1] = (runs[-1][0], s.offset + s.numel, d)
        else:
            runs.append((s.offset, s.offset + s.numel, d))
    return tuple(runs)


def decay_pieces(layout: BlockLayout, b: int, shard_lo: int, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """(a, z, decayed) pieces covering [lo, hi) of block b's shard starting at element `shard_lo` of the
    block (ranges relative to the shard, as the optimizer's)."""
    out = []
    for rlo, rhi, d in _block_runs(layout, b):
        a, z = max(rlo - shard_lo, lo), min(rhi - shard_lo, hi)
        if z > a:
            out.append((a, z, d))
    return out
