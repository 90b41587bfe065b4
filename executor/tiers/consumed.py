"""Which element ranges of the host fp32 gradient accumulators hold gradients an optimizer step has already
consumed (`ConsumedGrads`): such a range counts as zero, so the optimizer op need not zero it (a whole pass
over the accumulator), and the next step's first contribution writes it instead of adding to zeros.

Every access of `TrainState.grads` goes through it: an add (`add`) copies its gradient into the consumed
parts of its range and adds it to the others; a reader (the optimizer op, the gradient norm, write_grads)
first zeroes what is still consumed in its range (`settle`: a range that no op of the step added to, as an
accumulator zeroed at once would have it), and the optimizer op and write_grads mark their range consumed
after use (`consume`) where they zeroed it before. Numerics: a copy into a consumed range equals the add to
zeros it replaces (0 + x == x; only a gradient's -0.0 keeps its sign, which AdamW's update cannot see).
"""

from __future__ import annotations

import threading

import torch

Range = tuple[int, int]


class ConsumedGrads:
    """Per block, the sorted disjoint ranges [a, z) of its accumulator that hold consumed gradients."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[Range]] = {}
        self.lock = threading.Lock()

    def consume(self, b: int, a: int, z: int) -> None:
        """Block b's elements [a, z) were used (stepped, or written out): they count as zero from now on."""
        if z <= a:
            return
        with self.lock:
            keep = [(x, y) for x, y in self.ranges.get(b, []) if y < a or x > z]
            touch = [(x, y) for x, y in self.ranges.get(b, []) if not (y < a or x > z)]
            lo, hi = min([a, *[x for x, _ in touch]]), max([z, *[y for _, y in touch]])
            self.ranges[b] = sorted([*keep, (lo, hi)])

    def take(self, b: int, a: int, z: int) -> list[Range]:
        """The consumed parts of block b's [a, z), no longer consumed (the caller writes them)."""
        with self.lock:
            old = self.ranges.get(b, [])
            if not old:
                return []
            hit = [(max(a, x), min(z, y)) for x, y in old if min(z, y) > max(a, x)]
            rest = []
            for x, y in old:
                rest += [r for r in ((x, min(y, a)), (max(x, z), y)) if r[1] > r[0]]
            self.ranges[b] = rest
            return hit

    def clear(self, b: int) -> None:
        with self.lock:
            self.ranges.pop(b, None)

    def settle(self, acc: torch.Tensor, b: int, a: int, z: int) -> None:
        """Zero the consumed parts of block b's accumulator `acc` in [a, z) (normally none: every range gets
        an add each step), so that a reader sees the step's gradients."""
        for x, y in self.take(b, a, z):
            acc[x:y].zero_()

    def add(self, acc: torch.Tensor, b: int, lo: int, g: torch.Tensor) -> None:
        """Add gradient `g` (any float dtype) to block b's accumulator `acc` at [lo, lo + numel): written into
        the consumed parts (one cast, no temporary), added in fp32 to the others."""
        z = lo + g.numel()
        parts = self.take(b, lo, z)
        at = lo
        for x, y in [*parts, (z, z)]:
            if x > at:
                acc[at:x] += g[at - lo: x - lo].float()
            if y > x:
                acc[x:y].copy_(g[x - lo: y - lo])
            at = max(at, y)
