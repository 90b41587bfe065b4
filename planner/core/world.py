"""Several GPUs and boxes: the data-parallel world, each rank's shard, and what one rank gets of its box.

A run has `gpus` data-parallel ranks per box (node) and `nodes` boxes: W = gpus x nodes ranks. Every rank owns
a 1/W shard of each block's flat parameter vector (ZeRO-3 / ZeRO-Infinity partitioning): elements
[r*ceil(n/W), min(n, (r+1)*ceil(n/W))) of a block's n. Its bf16 weights, fp32 master, Adam m/v and fp32
gradient accumulators of that shard live on its tiers, split by the plan's placement fractions; its CPU Adam
updates that shard only. Weights are all-gathered for compute, gradients reduce-scattered (ops on the resource
`net`).

Symmetry. All ranks run the same ops on the same amounts of data at the same time (lockstep data parallelism:
every collective is a barrier among them), so the simulator plays ONE rank's graph (rank 0, whose shard
ceil(n/W) is the largest) and models what the ranks of a box share as divided among them:

- divided by the `gpus` ranks of a box: the CPU cores that run Adam (its parameter rate), the host memory
  bandwidth pool, host memory capacity, the SSD array's read and write rates and its capacity, and the
  upstream PCIe link of a switch among the GPUs behind it (topology.gpus_per_switch,
  topology.switch_uplink_gbps);
- not divided: the GPU's compute and memory, and its own x16 link up to the switch (pcie.*).

Why this is exact for lockstep symmetric ranks: when g identical ranks ask a shared resource for the same work
at the same moments, a fair share gives each 1/g of it for as long as they all ask, which is what one rank
with 1/g of the resource sees. Where it is not: ranks drift apart (a straggler, uneven shards: rank 0 is the
largest by at most one element per block), and then a rank that asks while the others are idle would get more
than 1/g, so the model is pessimistic for bursts that do not coincide (e.g. the SSD reads of one rank while
another computes); and a resource shared unfairly (one rank's DMA starving another's) is not modelled.

Collectives run over `net`, whose rate comes from the box's GPU <-> GPU links and, with several boxes, the
network: a hierarchical ring (costmodel.net_rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core import hostadam


@dataclass(frozen=True)
class World:
    """The data-parallel world of a run."""

    gpus: int = 1  # ranks per box
    nodes: int = 1  # boxes

    @property
    def ranks(self) -> int:
        return self.gpus * self.nodes

    @property
    def single(self) -> bool:
        return self.ranks == 1

    def rank_batch(self, batch: int) -> int:
        """Sequences one rank runs per iteration: the global batch split over the ranks (the one place it is
        computed)."""
        return batch // self.ranks

    def to_dict(self) -> dict[str, int]:
        return {"gpus": self.gpus, "nodes": self.nodes, "ranks": self.ranks}


SINGLE = World()


def shard_elems(n: int, ranks: int) -> int:
    """Elements of an n-element flat vector that rank 0 (the largest shard) owns: ceil(n / ranks)."""
    return n if ranks <= 1 else math.ceil(n / ranks)


def shard_range(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s shard of an n-element flat vector."""
    size = math.ceil(n / ranks) if ranks > 1 else n
    return min(n, rank * size), min(n, (rank + 1) * size)


def rank_capacity_bytes(hw: HardwareProfile, gpus: int = 1) -> dict[str, float]:
    """Each memory tier's usable bytes for one rank of a box with `gpus` ranks: its whole GPU; 1/gpus of the
    box's host memory and SSD array."""
    cap = hw.tier_capacity_bytes
    if gpus <= 1:
        return cap
    return {"gpu": cap["gpu"], "cpu": cap["cpu"] / gpus, "ssd": cap["ssd"] / gpus}


@dataclass(frozen=True)
class HostShare:
    """What one of `processes` equal processes (or ranks) of a box gets of its host, from the profile's
    fields, each with its mechanism:

    - cores: each process's optimizer threads (OpenMP / at::parallel_for over every core, as DeepSpeedCPUAdam
      and torch run by default) time-share the box's cpu.physical_cores: 1/g of them each;
    - memory: the cpu.memory_channels behind cpu.memory_gbps serve every process's streams: 1/g of the
      sustained rate each (and 1/g of the capacity);
    - SSD array: the ssd.count drives of one array (md RAID0 stripes every file over all of them), its
      ceilings and the host path its bytes cross: 1/g each;
    - PCIe: a GPU's own x16 link is its own; the GPUs behind one switch or root port
      (topology.gpus_per_switch) share its uplink (topology.switch_uplink_gbps): 1/min(g, behind it) each.
    """

    processes: int
    cores: float | None  # physical cores per process (None: the profile does not say)
    memory_gbps: float  # DRAM wire rate per process
    ssd_drives: float  # drives' worth of the array per process
    uplink_gbps: float | None  # a switch's uplink per GPU behind it (None: no switch bottleneck)


def host_share(hw: HardwareProfile, processes: int) -> HostShare:
    g = max(1, processes)
    c, topo = hw.cpu, hw.topology
    uplink = None
    if topo is not None and topo.switch_uplink_gbps is not None:
        uplink = topo.switch_uplink_gbps / min(topo.gpus_per_switch, g)
    return HostShare(g, None if c.physical_cores is None else c.physical_cores / g, c.memory_gbps / g,
                     hw.ssd.count / g, uplink)


def process_adam_rates(hw: HardwareProfile, processes: int) -> dict[str, float]:
    """Each process's CPU Adam rates (torch's / the executor's, and DeepSpeed's where the profile has one):
    the host model of each implementation (planner/core/hostadam.py) on the process's share of the cores and
    of the memory bandwidth where the profile describes its CPU; else 1/g of the profile's rate (the rate of
    a memory-bound loop on 1/g of the bandwidth)."""
    g = max(1, processes)
    share = host_share(hw, g)
    out = {"cpu.adam_gparams_per_s": hw.cpu.adam_gparams_per_s / g}
    if hw.cpu.deepspeed_adam_gparams_per_s is not None:
        out["cpu.deepspeed_adam_gparams_per_s"] = hw.cpu.deepspeed_adam_gparams_per_s / g
    for key, impl in (("cpu.adam_gparams_per_s", "tierflow"),
                      ("cpu.deepspeed_adam_gparams_per_s", "deepspeed")):
        if key not in out:
            continue
        alone = hostadam.profile_rate(hw, impl)
        shared = hostadam.profile_rate(hw, impl, share.cores, 1.0 / g)
        if alone is not None and shared is not None:  # the profile's rate scaled as the model scales
            out[key] = out[key] * g * shared.gparams_per_s / alone.gparams_per_s
    return out


def independent_process_profile(hw: HardwareProfile, gpus: int) -> HardwareProfile:
    """The box as one of `gpus` independent single-GPU training processes on it sees it: each runs its own
    whole model (no shards, no collectives: replicated states, e.g. one program launched per GPU with no
    communication between them), and they share the host (HostShare): CPU Adam at the rate its
    implementation reaches on 1/gpus of the cores and memory bandwidth (process_adam_rates), 1/gpus of the
    host memory bandwidth and capacity, of the SSD array's rates (per drive, the array's ceilings and the
    host path its bytes cross) and capacity, and a PCIe switch's uplink per GPU behind it; each GPU and its
    own x16 link stay whole. The lockstep caveat of the module's docstring applies: processes that drift
    apart get more than 1/gpus while the others are idle."""
    if gpus <= 1:
        return hw
    c, s, p = hw.cpu, hw.ssd, hw.pcie
    share = host_share(hw, gpus)
    out: dict = {
        **process_adam_rates(hw, gpus),
        "cpu.memory_gbps": share.memory_gbps,
        "cpu.memory_gib": c.memory_gib / gpus,
        "cpu.reserved_gib": c.reserved_gib / gpus,
        "ssd.read_gbps": s.read_gbps / gpus,
        "ssd.write_gbps": s.write_gbps / gpus,
        "ssd.capacity_gb": s.capacity_gb / gpus,
    }
    if share.cores is not None:
        out["cpu.physical_cores"] = share.cores
    optional = {"ssd.array_read_gbps": s.array_read_gbps, "ssd.array_write_gbps": s.array_write_gbps,
                "ssd.host_path_gbps": s.host_path_gbps}
    out.update({k: v / gpus for k, v in optional.items() if v is not None})
    if share.uplink_gbps is not None:
        for k in ("h2d_gbps", "d2h_gbps", "duplex_h2d_gbps", "duplex_d2h_gbps"):
            out[f"pcie.{k}"] = min(getattr(p, k), share.uplink_gbps)
    return hw.with_overrides(out)
