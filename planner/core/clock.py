"""Queue keys: the schedule contract between the builder (tierflow.planner.core.schedules) and the modules
that read a graph's order back (loads, slots, window). Keys are made and read only through this module.

Every task carries a key; each resource runs its tasks in the order (key, id). The GPU step i (0 <= i < S) of
iteration `it` has the key ``it * period + i`` with ``period = S + TAIL_KEYS``: the TAIL_KEYS keys after the
last step of an iteration hold its optimizer tail (the CPU Adam steps that run after the whole backward when
the optimizer is not overlapped). Every other task sits at a named offset (``Offset``) from the key of the GPU
step it serves, so that it is queued just before the step that needs it or just after the step that produced
it. The builder never gives a task a key below a dependency's key (tierflow.planner.core.graph.GraphBuilder),
so the order (key, id) is a topological order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TAIL_KEYS = 10  # keys reserved after the last GPU step of an iteration (the optimizer tail)


class Offset:
    """Named offsets from the key of the GPU step a task serves (in steps)."""

    RECOMPUTE = -0.01  # a recompute runs just before the backward step it feeds
    OFFLOAD = 0.5  # device -> host copy of what a step produced
    WRITE_OFFLOADED = 0.6  # host -> SSD write of that copy
    WEIGHT_FETCH = -0.25  # weight fetch of a use, before the use's first step
    WEIGHT_FETCH_AHEAD = -1.0  # fetches of uses of the previous iteration: one step per use further ahead
    OPTIMIZER_FLOOR = -0.5  # a fetch that waits for the previous iteration's optimizer:
                            # not ahead of its start
    ADAM_GPU = 0.3  # the GPU optimizer after the block's last backward step
    WRITE_GRADS = 0.6  # fp32 gradients spilled to the SSD
    READ_GRADS = 0.7  # ... and read back for the optimizer
    ADAM = 0.8  # the CPU Adam step of a block
    READ_STATES = -0.1  # optimizer states read from the SSD just before their Adam part
    AFTER_ADAM = 0.1  # states written back, resident weights updated, after their Adam part
    DEFERRED_ADAM = -2.0  # the deferred Adam part: two steps before the block's first forward step
    TAIL_RANK = 0.001  # the optimizer tail: one block after the other


@dataclass(frozen=True)
class Clock:
    """Makes and reads the keys of a schedule with `steps_per_iteration` GPU steps per iteration."""

    steps_per_iteration: int

    @property
    def period(self) -> int:
        return self.steps_per_iteration + TAIL_KEYS

    def step(self, iteration: int, index: int) -> float:
        """The key of GPU step `index` of `iteration`."""
        return float(iteration * self.period + index)

    def steps(self, iteration: int) -> list[float]:
        return [self.step(iteration, i) for i in range(self.steps_per_iteration)]

    def deferred_adam(self, iteration: int, first_forward_index: int) -> float:
        """The key of a block's deferred Adam part:
        in the next iteration, before the block's first forward."""
        return self.step(iteration + 1, first_forward_index) + Offset.DEFERRED_ADAM

    def nearest_step(self, key: float) -> tuple[int, int]:
        """(iteration, step index) of the GPU step a task at `key` belongs to: the step itself for a GPU step,
        the nearest one for a task at an offset smaller than half a step. An index >= steps_per_iteration is
        the iteration's optimizer tail."""
        return divmod(round(key), self.period)

    def next_step(self, key: float) -> tuple[int, int]:
        """(iteration, index) of the first GPU step at or after `key`
        (a task queued before it runs for it)."""
        return divmod(math.ceil(key - 1e-9), self.period)

    def is_tail(self, index: int) -> bool:
        return index >= self.steps_per_iteration

    def first_iteration_step(self, key: float) -> int | None:
        """For a one-iteration graph: the step index whose phase a task at `key` counts in (keys below 0 are
        prefetches for the first step: index 0), None for the optimizer tail."""
        if key < 0:
            return 0
        if key < self.steps_per_iteration:
            return int(key)
        return None
