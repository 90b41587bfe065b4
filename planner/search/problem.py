"""The planning problem: a model on a box at a batch and sequence length, and everything that depends only on
them (cost model, link rates, tier capacities, per-micro-batch blocks), built once. With several data-parallel
ranks (`gpus` per box x `nodes` boxes) the problem is one rank's: its share of the global batch
(`rank_batch`), its share of the box's host resources and capacities (tierflow.planner.core.world);
candidates, placement and loads are per rank. Every search function takes a
Problem instead of the (model, hw, batch, seq) tuple; its caches live on the instance, so two problems never
share (or hash) each other's state.

    >>> from tierflow.api import Candidate, Problem
    >>> p = Problem.of("gpt3-13b", "rtx4090-lohan", batch=64, seq=1024)
    >>> p.config(Candidate(micro_batch=8, group=8, alpha=0.25)).family
    'vertical'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.costmodel import CostModel, Rates
from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
from tierflow.planner.core.families import family_of
from tierflow.planner.core.memory import ScheduleMemory, blocks_of, schedule_memory
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import ScheduleError, check_world, make_schedule
from tierflow.planner.core.workload import BlockCost
from tierflow.planner.core.world import World, rank_capacity_bytes


@dataclass(frozen=True)
class Candidate:
    """The discrete decisions the search enumerates; placement and swap count are solved per candidate."""

    micro_batch: int
    group: int  # micro-batches a block runs before the next block (1 = one per sweep, M = all)
    alpha: float  # fraction of each block's CPU Adam deferred into the next iteration's forward
    prefetch_depth: int = 1
    # the search's own candidates overlap; a fixed horizontal baseline does not
    optimizer_overlap: bool = True

    def family(self, batch: int) -> str:
        """What the builder builds for this candidate (`batch`: one rank's sequences per iteration)."""
        return family_of(self.group, batch // self.micro_batch, self.optimizer_overlap)

    def describe(self, batch: int) -> str:
        M = batch // self.micro_batch
        fam = self.family(batch)
        if fam == "block":
            fam = f"block k={self.group}"
        return f"{fam}, {M} x {self.micro_batch}, alpha {self.alpha:g}, prefetch {self.prefetch_depth}"


@dataclass(frozen=True, eq=False)
class Problem:
    model: ModelSpec
    hw: HardwareProfile
    batch: int  # global batch, in sequences
    seq: int
    allow_ssd: bool = True  # may the plan use the SSD tier at all
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    gpus: int = 1  # data-parallel ranks per box
    nodes: int = 1  # boxes

    def __post_init__(self) -> None:
        check_world(self.hw, self.gpus, self.nodes)
        W = self.world.ranks
        if self.batch % W:
            raise ScheduleError(f"batch {self.batch} is not divisible by {W} ranks (use a multiple of {W})")

    @classmethod
    def of(cls, model: ModelSpec | str, hw: HardwareProfile | str, *, batch: int, seq: int | None = None,
           allow_ssd: bool = True, gpus: int = 1, nodes: int = 1) -> Problem:
        m = model if isinstance(model, ModelSpec) else get_model(model)
        h = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
        return cls(m, h, batch, seq or m.seq_len, allow_ssd, gpus=gpus, nodes=nodes)

    def on(self, hw: HardwareProfile) -> Problem:
        """The same problem on another box (its own caches)."""
        return Problem(self.model, hw, self.batch, self.seq, self.allow_ssd, gpus=self.gpus, nodes=self.nodes)

    @property
    def world(self) -> World:
        return World(self.gpus, self.nodes)

    @property
    def rank_batch(self) -> int:
        """Sequences one rank runs per iteration (the global batch split over the ranks)."""
        return self.world.rank_batch(self.batch)

    # ---- built once ----------------------------------------------------------------------------------------

    @cached_property
    def cost(self) -> CostModel:
        return CostModel(self.hw, self.world)

    @cached_property
    def rates(self) -> Rates:
        return self.cost.rates

    @cached_property
    def capacity_bytes(self) -> dict[str, float]:
        """Usable bytes of each tier for one rank (the SSD tier is empty when the problem forbids it)."""
        return {**rank_capacity_bytes(self.hw, self.gpus), **({} if self.uses_ssd else {"ssd": 0.0})}

    @property
    def uses_ssd(self) -> bool:
        return self.allow_ssd and self.hw.ssd.count > 0

    def blocks(self, micro_batch: int) -> list[BlockCost]:
        return self.memoized(("blocks", micro_batch), lambda: blocks_of(self.model, micro_batch, self.seq))

    def memoized(self, key: tuple, make):
        """A value cached on this problem (search layers keep their per-config results here)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ---- candidates ----------------------------------------------------------------------------------------

    def config(self, c: Candidate, placement: Placement | None = None, swap_layers: int = 0,
               iterations: int = 3) -> ScheduleConfig:
        """The schedule of a candidate with these decisions (the public way to build a candidate's config)."""
        fam = c.family(self.rank_batch)
        return make_schedule(fam, self.model, self.hw, batch=self.batch,
                             micro_batch=c.micro_batch, seq=self.seq, placement=placement or Placement(),
                             group=c.group if fam == "block" else None, alpha=c.alpha,
                             prefetch_depth=c.prefetch_depth, swap_layers=swap_layers, iterations=iterations,
                             gpus=self.gpus, nodes=self.nodes,
                             # a candidate is tierflow's own plan: with the optimizer overlapped and one
                             # micro-batch per sweep it is built as Fuyou's schedule, but runs on tierflow's
                             # executor
                             runtime="ideal" if fam == "fuyou" else None)

    def schedule_memory(self, cfg: ScheduleConfig) -> ScheduleMemory:
        return self.memoized(("schedule_memory", cfg.micro_batch, cfg.group, cfg.alpha, cfg.optimizer_overlap,
                              cfg.prefetch_depth, cfg.act_prefetch, cfg.runtime), lambda: schedule_memory(
            self.model, micro_batch=cfg.micro_batch, seq=self.seq, num_micro_batches=cfg.num_micro_batches,
            group=cfg.group, alpha=cfg.alpha, optimizer_overlap=cfg.optimizer_overlap,
            prefetch_depth=cfg.prefetch_depth, act_prefetch=cfg.act_prefetch, runtime=cfg.runtime,
            ranks=self.world.ranks, hw=self.hw))

    def gpu_floor_s(self, micro_batch: int) -> float:
        """GPU compute of one iteration without any recompute: no plan with this micro-batch can beat it."""
        def floor() -> float:
            per_mb = sum(self.cost.forward_s(b) + self.cost.backward_s(b) for b in self.blocks(micro_batch))
            return per_mb * self.rank_batch // micro_batch
        return self.memoized(("gpu_floor_s", micro_batch), floor)

    def fits_gpu(self, micro_batch: int) -> bool:
        """Can one layer's backward at this micro-batch (plus a few weight buffers) fit on the GPU at all?"""
        blocks = self.blocks(micro_batch)
        need = max(b.bwd_working_bytes for b in blocks) + 3 * max(b.weight_bytes for b in blocks)
        # and what the executor's CUDA runtime maps under the cap (tierflow.planner.core.devicemem)
        need += runtime_gpu_reserve_bytes("ideal", self.world.ranks, self.hw)
        return need <= self.capacity_bytes["gpu"]

    def describe(self) -> str:
        ranks = self.world.ranks
        world = "" if ranks == 1 else f" over {ranks} ranks ({self.gpus} GPUs x {self.nodes} boxes)"
        return f"{self.model.name} on {self.hw.name}, batch {self.batch} x {self.seq}{world}"
