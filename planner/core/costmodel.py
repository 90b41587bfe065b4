"""Roofline cost model: how long a piece of work takes on a hardware profile.

- A GEMM takes max(FLOPs / (peak x eff(FLOPs)), bytes / (HBM x hbm_eff)); eff(f) = gemm_efficiency x f / (f +
  f_half) so that small GEMMs do not reach peak (f_half = the profile's gemm_half_gflop).
- The peak is the one of the block's precision (workload.Precision.gemm_peak: gpu.peak_tflops for 16-bit,
  gpu.fp32_tflops, gpu.tf32_tflops); a GEMM's fixed cost in seconds stays the same, so f_half scales with that
  peak.
- Attention (flash-style, causal) does half of the convention's FLOPs and runs at the same size-dependent
  efficiency as one GEMM of that size.
- Elementwise kernels are bound by HBM bandwidth; the MLP's activation function by gpu.activation_gbps where
  the profile measured it (a CPU computes GELU / SiLU far below its memory bandwidth), and attention runs at
  gpu.attention_efficiency of a GEMM of its size where measured.
- Transfers: bytes / link bandwidth; H2D and D2H share the PCIe link and SSD reads and writes share the array
  as the profile says (the simulator applies the shared rates while both directions are active).
- CPU Adam: parameters / the CPU's Adam rate.
- Software costs (optional profile fields, 0 when absent): every compute op adds gpu.op_overhead_us (host work
  its kernels do not hide: dispatch, autograd, launches, the executor's hand-off); every transfer op adds
  pcie.latency_us and every SSD op ssd.latency_us before its bytes move (`Rates.latency_s`; the simulator runs
  that fixed part first, outside the shared link, then the bytes); every op on every resource adds
  cpu.executor_op_us, the executor's engine's own cost per op (hand-off between its workers, events and
  stream waits, launch, trace), paid by the worker of the op's resource the same way (gpu.op_overhead_us is
  then the rest of a compute op's: its handler's Python, the framework's dispatch and the kernel launches).
- Host memory: every host-side transfer (PCIe DMA either way, SSD DMA either way) moves its bytes through DRAM
  once, and CPU Adam moves CPU_ADAM_DRAM_BYTES_PER_PARAM per parameter; when together they ask for more than
  the box sustains (cpu.memory_gbps x cpu.memory_efficiency), the simulator slows all of them in proportion (a
  fluid shared resource, like the PCIe duplex).
- Host cores: when the device is the host CPU (gpu.host_cores set, as `tierflow calibrate --device cpu`
  writes), its compute, CPU Adam, the device<->host copies and the SSD ops (buffer copies and CRC32 checksums
  in the executor's store) share cpu.cores the same way. Where calibrate measured how the threads interfere
  (cpu.compute_slowdown_per_io_op, cpu.copy_slowdown_beside_compute, cpu.ssd_slowdown_beside_compute), those
  factors replace the proportional share for the copies and SSD ops: on 2 cores one SSD read beside a GEMM
  slowed the GEMM 1.9x (an I/O thread takes time slices from one of compute's two threads, and the parallel
  region runs at its slowest thread's pace) but the read only 1.16x (it sleeps on the device between
  requests).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tierflow.hwprofiles import HardwareProfile, ProfileError
from tierflow.planner.core.compute import DeliveredCompute, delivered_compute, kernels, unfused_extra_bytes
from tierflow.planner.core.workload import BlockCost, Gemm, Precision
from tierflow.planner.core.world import SINGLE, World

CAUSAL_ATTENTION_WORK = 0.5  # a causal flash-attention kernel skips the masked half of the score matrix
# CPU Adam (DeepSpeed's cpu_adam, fp32 gradients): reads gradient, master, m, v (16 B), writes master, m, v
# (12 B) and the fp16 copy of the weight (2 B): 30 B per parameter (REF 2: "~28-32 bytes moved per parameter")
CPU_ADAM_DRAM_BYTES_PER_PARAM = 30
# GPU Adam reads grad, master, m, v (16 B) and writes master, m, v, bf16 weight (14 B) + grad zeroing
GPU_ADAM_BYTES_PER_PARAM = 36


@dataclass(frozen=True)
class Rates:
    """Bandwidths in bytes/s of every link, solo and while the opposite direction is busy."""

    h2d: float
    d2h: float
    h2d_duplex: float
    d2h_duplex: float
    ssd_read: float
    ssd_write: float
    ssd_read_mixed: float
    ssd_write_mixed: float
    adam_params_per_s: float
    dram_bps: float = math.inf  # DRAM bytes/s the host sustains for all of them together
    adam_dram_bps: float = 0.0  # DRAM bytes/s CPU Adam moves while it runs at its solo rate
    # host cores, when the device is the host CPU (gpu.host_cores): compute, CPU Adam and the device<->host
    # copies (memcpy on a core each) share cpu.cores; inf: not modelled
    cores: float = math.inf
    gpu_cores: float = 0.0  # cores device compute uses at its solo speed
    adam_cores: float = 0.0  # cores CPU Adam uses at its solo speed
    copy_cores: float = 0.0  # cores one copy or SSD op (memcpy, checksum) uses at its solo rate
    # measured thread interference on a host device (cpu.compute_slowdown_per_io_op and the two beside-compute
    # slowdowns): when set, the copies and SSD ops leave the proportional share of the cores; instead compute
    # runs 1 + compute_io_extra x k times slower beside k of them, and each of them its own factor slower
    # beside compute (`io_contention`)
    compute_io_extra: float = 0.0
    copy_beside_compute: float = 1.0
    ssd_beside_compute: float = 1.0
    # on a GPU box: GPU ops x this while a host optimizer op runs (cpu.gpu_slowdown_beside_host_optimizer)
    gpu_beside_host_optimizer: float = 1.0
    # fixed software cost of one op on each link (pcie.latency_us, ssd.latency_us), before its bytes move
    pcie_latency_s: float = 0.0
    ssd_latency_s: float = 0.0
    # the executor's own host cost per op on every resource (cpu.executor_op_us): its worker pays it
    executor_op_s: float = 0.0
    # several ranks (tierflow.planner.core.world): the collectives' rate in bytes one rank receives per
    # second, their fixed cost (the ring's steps x each step's latency), and what each of those bytes also
    # uses of this rank's PCIe link (each direction) and of the host memory pool (through-host and PCIe
    # peer-to-peer paths)
    net: float = 0.0
    net_latency_s: float = 0.0
    net_pcie_use: float = 0.0
    net_dram_use: float = 0.0

    def latency_s(self, resource: str) -> float:
        """The fixed cost of one op on `resource` before its work starts flowing: the executor's own cost per
        op (cpu.executor_op_us, every resource) and the link's (gpu and cpu ops have theirs in their work)."""
        if resource in ("h2d", "d2h"):
            return self.executor_op_s + self.pcie_latency_s
        if resource in ("ssd_read", "ssd_write"):
            return self.executor_op_s + self.ssd_latency_s
        if resource == "net":
            return self.executor_op_s + self.net_latency_s
        return self.executor_op_s

    @property
    def core_bound(self) -> bool:
        """Whether host cores are a shared resource (the device is the host CPU)."""
        return math.isfinite(self.cores)

    @property
    def io_contention(self) -> bool:
        """Whether compute and the host's I/O threads slow each other by measured factors (a host device whose
        profile has cpu.compute_slowdown_per_io_op) rather than by a proportional share of the cores."""
        return self.core_bound and self.compute_io_extra > 0

    def beside_compute(self, resource: str) -> float:
        """The factor an op on a link takes longer while device compute runs (io_contention; else 1)."""
        if resource in ("h2d", "d2h"):
            return self.copy_beside_compute
        if resource in ("ssd_read", "ssd_write"):
            return self.ssd_beside_compute
        return 1.0

    def pools(self) -> list[tuple[str, float, dict[str, float]]]:
        """The shared host resources: (name, capacity per second, {resource: capacity used per unit of its
        work at its solo rate}) for host memory ("dram", bytes) and, on a host device, the cores ("cores").
        Every unit of a link's work is a byte, of gpu's and cpu's a second of work at solo speed."""
        out = []
        if self.dram_bound:
            use = {"h2d": 1.0, "d2h": 1.0, "ssd_read": 1.0, "ssd_write": 1.0, "cpu": self.adam_dram_bps}
            if self.net_dram_use > 0:
                use["net"] = self.net_dram_use
            out.append(("dram", self.dram_bps, use))
        if self.net_pcie_use > 0:
            # collectives through the PCIe fabric share this rank's x16 link with its own copies, each
            # direction
            out.append(("pcie_h2d", self.h2d, {"h2d": 1.0, "net": self.net_pcie_use}))
            out.append(("pcie_d2h", self.d2h, {"d2h": 1.0, "net": self.net_pcie_use}))
        if self.core_bound:
            # a device<->host copy is a memcpy on one core; an SSD op of the executor copies through aligned
            # buffers and checksums (CRC32) every byte on the host, one core as well
            # (with measured interference, io_contention, the copies and SSD ops are slowed by it instead)
            use = {"gpu": self.gpu_cores, "cpu": self.adam_cores}
            for link in ("h2d", "d2h", "ssd_read", "ssd_write"):
                rate = getattr(self, link)
                if rate > 0 and not self.io_contention:
                    use[link] = self.copy_cores / rate
            out.append(("cores", self.cores, {k: v for k, v in use.items() if v > 0}))
        return out

    @property
    def dram_bound(self) -> bool:
        """Whether host memory bandwidth is modelled (a finite sustained rate)."""
        return math.isfinite(self.dram_bps)


def link_rates(hw: HardwareProfile, world: World | None = None) -> Rates:
    """The link rates one rank sees on a box (cheap: no cost model is built). With several ranks per box
    (`world.gpus` > 1) the box's shared resources are divided among them (tierflow.planner.core.world): the
    SSD array, host memory bandwidth, CPU Adam, and a PCIe switch's uplink among the GPUs behind it."""
    p, s = hw.pcie, hw.ssd
    world = world or SINGLE
    g = world.gpus
    mixed = s.mixed_fraction
    read = s.total_read_gbps * 1e9 / g
    write = s.total_write_gbps * 1e9 / g
    pcie = {"h2d": p.h2d_gbps * 1e9, "d2h": p.d2h_gbps * 1e9, "h2d_duplex": p.duplex_h2d_gbps * 1e9,
            "d2h_duplex": p.duplex_d2h_gbps * 1e9}
    topo = hw.topology
    if g > 1 and topo is not None and topo.switch_uplink_gbps is not None:
        # the GPUs behind one switch share its uplink to the host (each direction)
        share = topo.switch_uplink_gbps * 1e9 / min(topo.gpus_per_switch, g)
        pcie = {k: min(v, share) for k, v in pcie.items()}
    adam = hw.cpu.adam_gparams_per_s * 1e9 / g
    dram = hw.cpu.sustained_memory_bps / g
    return Rates(
        **pcie,
        ssd_read=read,
        ssd_write=write,
        ssd_read_mixed=read * mixed,
        ssd_write_mixed=write * mixed,
        adam_params_per_s=adam,
        dram_bps=dram,
        # a solo rate already includes its own memory limit: alone, CPU Adam never waits for DRAM
        adam_dram_bps=min(adam * CPU_ADAM_DRAM_BYTES_PER_PARAM, dram),
        pcie_latency_s=p.latency_s,
        ssd_latency_s=s.latency_s,
        executor_op_s=hw.cpu.executor_op_s,
        **_core_rates(hw, g),
        **_net_rates(hw, world),
    )


def _net_rates(hw: HardwareProfile, world: World) -> dict:
    """The collectives of `world` on `hw` (empty for one rank): a hierarchical ring, first among the boxes
    (the ranks with the same local index exchange over the network, each box's `network.gbps` shared by its
    `gpus` ranks), then inside each box over the GPU <-> GPU links. For a vector of S bytes a rank receives
    (W-1)/W x S in all (the op's work) in time (n-1)/n x S / network + (g-1)/g x S / p2p, so the op's rate is
    the quotient; each of the (g-1) + (n-1) ring steps costs its link's latency. Through host memory (p2p:
    host) every byte a rank receives was written to DRAM by its sender's DMA and is read by its own, and
    crosses its PCIe link in both directions (it sends as much as it receives): 2 bytes of DRAM traffic and 1
    of each PCIe direction per byte; peer-to-peer over PCIe loads the links but not DRAM; NVLink neither."""
    if world.single:
        return {}
    g, n = world.gpus, world.nodes
    topo, netw = hw.topology, hw.network
    seconds_per_byte = 0.0  # per byte of the vector
    latency = 0.0
    pcie_use = dram_use = 0.0
    if g > 1:
        if topo is None:
            raise ValueError(f"{g} GPUs per box, but profile {hw.name} has no topology section "
                             "(add one, or --set topology.gpu_count=N)")
        seconds_per_byte += (g - 1) / g / (topo.p2p_gbps * 1e9)
        latency += (g - 1) * topo.p2p_latency_s
        if topo.p2p in ("host", "pcie"):
            pcie_use = 1.0
        if topo.p2p == "host":
            dram_use = 2.0
    if n > 1:
        if netw is None:
            raise ValueError(f"{n} boxes, but profile {hw.name} has no network section "
                             "(add one, or --set network.gbps=N)")
        seconds_per_byte += (n - 1) / n / (netw.gbps * 1e9)
        latency += (n - 1) * netw.latency_s
    W = world.ranks
    # only the intra-box part of the bytes crosses the GPU's links to the host for the p2p paths; the
    # inter-box part crosses them too (NIC <-> GPU over PCIe): every byte received is counted once per
    # direction
    return {"net": (W - 1) / W / seconds_per_byte, "net_latency_s": latency, "net_pcie_use": pcie_use,
            "net_dram_use": dram_use}


def _core_rates(hw: HardwareProfile, gpus: int = 1) -> dict:
    """Core sharing on a host device: compute takes gpu.host_cores, CPU Adam all the cores (torch's intra-op
    threads), each copy or SSD op one core (a memcpy, a checksum); each alone at its solo speed never waits
    for cores. With several ranks per box, each rank gets 1/gpus of the cores."""
    cores, device = hw.cpu.cores, hw.gpu.host_cores
    if device is None:  # a GPU box: its launching thread beside the host optimizer, where measured
        f = hw.cpu.gpu_slowdown_beside_host_optimizer
        return {"gpu_beside_host_optimizer": f} if f is not None and f > 1 else {}
    if cores is None:
        return {}
    cores = float(cores) / gpus
    out = {"cores": cores, "gpu_cores": min(float(device), cores), "adam_cores": cores,
           "copy_cores": min(1.0, cores)}
    c = hw.cpu
    if c.compute_slowdown_per_io_op is not None and c.compute_slowdown_per_io_op > 1:
        out.update(compute_io_extra=c.compute_slowdown_per_io_op - 1.0,
                   copy_beside_compute=c.copy_slowdown_beside_compute or 1.0,
                   ssd_beside_compute=c.ssd_slowdown_beside_compute or 1.0)
    return out


class CostModel:
    """Turns work (FLOPs, bytes, parameters) into seconds on one hardware profile."""

    def __init__(self, hw: HardwareProfile, world: World | None = None):
        self.hw = hw
        g = hw.gpu
        self.peak_flops = g.peak_tflops * 1e12
        self.gemm_eff = g.gemm_efficiency
        self.half_flops = g.gemm_half_gflop * 1e9
        self.hbm_bps = g.hbm_gbps * 1e9 * g.hbm_efficiency
        self.op_overhead_s = g.op_overhead_s  # per compute op (gpu.op_overhead_us)
        # attention's rate relative to a GEMM of its size (gpu.attention_efficiency), the activation
        # function's bytes/s (gpu.activation_gbps): as measured where the profile has them, else like any GEMM
        # / elementwise
        self.attention_eff = g.attention_efficiency if g.attention_efficiency is not None else 1.0
        self.activation_bps = g.activation_gbps * 1e9 if g.activation_gbps is not None else self.hbm_bps
        self.rates = link_rates(hw, world)
        # the GPU kernel by kernel where the profile has a compute section (tierflow.planner.core.compute)
        self.delivered = delivered_compute(hw.compute, self.peak_flops, self.gemm_eff, self.hbm_bps)
        self._delivered_by_peak: dict[float, DeliveredCompute] = {}

    # ---- GPU compute ---------------------------------------------------------------------------------------

    def peak_flops_for(self, precision: Precision) -> float:
        """FLOP/s of the GEMM peak that `precision` runs at (its profile field)."""
        tflops = getattr(self.hw.gpu, precision.gemm_peak)
        if tflops is None:
            field = f"gpu.{precision.gemm_peak}"
            raise ProfileError(f"profile {self.hw.name}: {field} is not set, so {precision.name} training "
                               f"cannot be simulated on it (add it from the GPU's datasheet, e.g. --set "
                               f"{field}=N, or use another --precision)")
        return tflops * 1e12

    def efficiency(self, flops: float, peak_flops: float | None = None) -> float:
        """Achieved fraction of peak for one GEMM of `flops` FLOPs (at `peak_flops`, default the 16-bit
        peak: the GEMM's fixed cost in seconds is the same at every peak)."""
        half = self.half_flops * (peak_flops or self.peak_flops) / self.peak_flops
        return self.gemm_eff * flops / (flops + half)

    def _delivered_at(self, peak_flops: float) -> DeliveredCompute | None:
        """The kernel-by-kernel model at the peak a precision runs at (the profile's compute section)."""
        if self.delivered is None or peak_flops == self.peak_flops:
            return self.delivered
        d = self._delivered_by_peak.get(peak_flops)
        if d is None:
            d = dataclasses.replace(self.delivered, peak_flops=peak_flops,
                                    gemm_rate_flops=peak_flops * self.gemm_eff)
            self._delivered_by_peak[peak_flops] = d
        return d

    def gemm_s(self, g: Gemm, peak_flops: float | None = None) -> float:
        peak = peak_flops or self.peak_flops
        delivered = self._delivered_at(peak)
        if delivered is not None:
            return delivered.gemm_s(g)
        one = Gemm(g.m, g.n, g.k, elem_bytes=g.elem_bytes)
        t = max(one.flops / (peak * self.efficiency(one.flops, peak)), one.bytes / self.hbm_bps)
        return t * g.count

    def attention_s(self, flops: float, backward: bool = False, peak_flops: float | None = None) -> float:
        """Causal attention of `flops` (the convention's forward FLOPs; the backward does twice the work)."""
        peak = peak_flops or self.peak_flops
        work = flops * CAUSAL_ATTENTION_WORK
        passes = 2 if backward else 1
        d = self._delivered_at(peak)
        delivered = None if d is None else d.attention_s(passes * work, backward)
        if delivered is not None:
            return delivered
        if work <= 0:
            return 0.0
        return passes * work / (peak * self.efficiency(work, peak) * self.attention_eff)

    def elementwise_s(self, nbytes: float, activation_bytes: float = 0.0) -> float:
        """Non-GEMM kernels moving `nbytes`, of which `activation_bytes` through the activation function."""
        return (nbytes - activation_bytes) / self.hbm_bps + activation_bytes / self.activation_bps

    def unfused_s(self, block: BlockCost) -> float:
        """One forward pass's extra elementwise time where the profile's framework runs a layer's norms,
        rotary positions, gated activation and GQA repeat as separate ops (compute.layer_ops unfused)."""
        if self.hw.compute is None or self.hw.compute.layer_ops != "unfused" or "norm" not in block.extras:
            return 0.0
        x = block.extras
        per_token = unfused_extra_bytes(x["norm"], x["rmsnorm_elems"], x["rotary_elems"],
                                        x["kv_repeat_elems"], x["gated_ffn_elems"],
                                        block.precision.compute_bytes)
        return per_token * block.tokens / self.hbm_bps

    def forward_s(self, block: BlockCost) -> float:
        peak = self.peak_flops_for(block.precision)
        device = (
            sum(self.gemm_s(g, peak) for g in block.fwd_gemms)
            + self.attention_s(block.attn_fwd_flops, peak_flops=peak)
            + self.elementwise_s(block.fwd_elementwise_bytes, block.fwd_activation_bytes)
            + self.unfused_s(block)
        )
        return self._launched(device, block, False) + self.op_overhead_s

    def backward_s(self, block: BlockCost) -> float:
        """Backward = two GEMMs per forward GEMM (data and weight gradient; a frozen weight's, LoRA's base,
        only the data gradient), 2x the attention, 2x elementwise."""
        peak = self.peak_flops_for(block.precision)
        device = (
            2 * sum(self.gemm_s(g, peak) for g in block.fwd_gemms)
            - sum(self.gemm_s(g, peak) for g in block.fwd_gemms[:block.frozen_gemms])
            + self.attention_s(block.attn_fwd_flops, backward=True, peak_flops=peak)
            + 2 * self.elementwise_s(block.fwd_elementwise_bytes, block.fwd_activation_bytes)
            + 2 * self.unfused_s(block)
        )
        return self._launched(device, block, True) + self.op_overhead_s

    def _launched(self, device_s: float, block: BlockCost, backward: bool) -> float:
        """A pass's device time, or its kernels' launches where modelled and longer."""
        if self.delivered is None:
            return device_s
        return self.delivered.launch_bound_s(device_s, kernels(block, backward))

    def gpu_adam_s(self, params: float, weight_copy_bytes: int = 0) -> float:
        """GPU Adam over `params`; `weight_copy_bytes`: per parameter, less the write of the compute weights
        that an in-place precision's step does not make (Precision.in_place: its compute bytes; 36 - 4 = 32 B,
        reads grad, weight, m, v and writes weight, m, v and the zeroed grad)."""
        return params * (GPU_ADAM_BYTES_PER_PARAM - weight_copy_bytes) / self.hbm_bps + self.op_overhead_s

    # ---- CPU and links -------------------------------------------------------------------------------------

    def cpu_adam_s(self, params: float) -> float:
        return params / self.rates.adam_params_per_s

    def transfer_s(self, link: str, nbytes: float) -> float:
        """Solo time of one transfer op on link 'h2d' | 'd2h' | 'ssd_read' | 'ssd_write': its fixed cost, then
        its bytes at the link rate."""
        rate = getattr(self.rates, link)
        if rate <= 0:
            return float("inf") if nbytes > 0 else 0.0
        return self.rates.latency_s(link) + nbytes / rate
