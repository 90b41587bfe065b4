"""The memory contract between a plan and the executor: run a plan in bf16 on a CPU "device" whose every
allocation is counted, one op at a time in the plan's order, and compare the live device bytes after each op
with the plan's GPU bytes at that point (its static bytes plus every op's memory effects, Task.mem_start and
Task.mem_end, replayed in the same order). Host buffers that cross PCIe are counted as the pinned caching
allocator would give them (rounded up to a power of two) unless they come from the executor's pinned arena.

How device bytes are counted (TrackingCpuBackend): every tensor an op on gpu, h2d or d2h creates is seen by a
TorchDispatchMode, and its storage is device memory until it is freed (a weak reference to the storage); host
buffers (the backend's host_buffer) are not device memory. The state's device vectors are counted from the
start. Transient memory inside an op (a kernel's workspace, temporaries freed before the op returns) is not
compared: the contract is the memory each op leaves behind."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tierflow.executor.data import TokenData
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.engine import Executor, Hyper
from tierflow.executor.tiers.ssd_store import SsdStore
from tierflow.executor.tiers.state import TrainState
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.graph import TIER_INDEX
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.workload import layer_cost
from tierflow.planner.io.planfile import plan_from_graph

HW = load_profile("rtx3090-desktop")
MICRO, SEQ = 1, 64
DEVICE_RESOURCES = ("gpu", "h2d", "d2h")
_tls = threading.local()


def pinned_rounding(nbytes: int) -> int:
    """What PyTorch's pinned caching allocator reserves for a request: the next power of two."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


class _Allocs(TorchDispatchMode):
    """Notes the storage of every tensor an aten op returns as device memory (unless allocated as host
    memory)."""

    def __init__(self, backend: TrackingCpuBackend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a return with alias information (a view, an in-place or out= result) is memory that existed before
        if not getattr(_tls, "host", False) and not any(r.alias_info for r in func._schema.returns):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.backend.note(t)
        return out


class TrackingCpuBackend(PlainCpuBackend):
    """The plain CPU backend, with device and pinned host memory counted."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.device_storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.pinned: dict[int, tuple[StorageWeakRef, int]] = {}
        self.arena_ptrs: set[int] = set()  # storages of the executor's pinned arena: counted at their size

    def note(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if not n or t.device.type != "cpu":
            return
        with self.lock:
            old = self.device_storages.get(ptr)
            if old is None or old[0].expired():
                self.device_storages[ptr] = (StorageWeakRef(st), n)

    def pinned_area(self, nbytes: int) -> torch.Tensor:
        _tls.host = True
        try:
            t = super().pinned_area(nbytes)
        finally:
            _tls.host = False
        st = t.untyped_storage()
        with self.lock:  # one allocation of its size (cudaHostRegister on CUDA: no rounding)
            self.arena_ptrs.add(st.data_ptr())
            self.pinned[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return t

    def host_buffer(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        _tls.host = True
        try:
            t = super().host_buffer(numel, dtype, pinned)
        finally:
            _tls.host = False
        if pinned:
            st = t.untyped_storage()
            with self.lock:
                self.pinned[st.data_ptr()] = (StorageWeakRef(st), pinned_rounding(st.nbytes()))
        return t

    @staticmethod
    def _live(table: dict) -> int:
        for k in [k for k, (ref, _n) in table.items() if ref.expired()]:
            del table[k]
        return sum(n for _ref, n in table.values())

    def device_bytes(self) -> int:
        with self.lock:
            return self._live(self.device_storages)

    def pinned_bytes(self) -> int:
        with self.lock:
            return self._live(self.pinned)


@dataclass
class Sample:
    op: str
    resource: str
    measured_bytes: int
    plan_bytes: float
    pinned_bytes: int = 0
    plan_cpu_bytes: float = 0.0
    area_used_bytes: int = 0  # of the transfer area, after the op


@dataclass
class Contract:
    samples: list[Sample] = field(default_factory=list)
    static_device_bytes: int = 0
    losses: list[float] = field(default_factory=list)
    straddle_bytes: int = 0  # see slack_bytes
    static_pinned_bytes: int = 0  # pinned before the first op: the state's host weights and the transfer area
    area_bytes: int = 0
    area_max_used_bytes: int = 0
    area_overflows: int = 0


def run_contract(model_name: str, family: str, placement: Placement, swap_layers: int, tmp_path,
                 batch: int = 2, iterations: int = 1) -> Contract:
    """One round of the plan in bf16 on the tracking backend, its ops one at a time in the plan's (key, id)
    order (a topological order that keeps every resource's queue order), each op measured after it returns."""
    model = get_model(model_name)
    cfg = make_schedule(family, model, HW, batch=batch, micro_batch=MICRO, seq=SEQ, placement=placement,
                        swap_layers=swap_layers, iterations=iterations, runtime="ideal")
    plan = plan_from_graph(model, HW, cfg, build_graph(model, HW, cfg))
    be = TrackingCpuBackend()
    (tmp_path / "ssd").mkdir(exist_ok=True)
    ssd = SsdStore(tmp_path / "ssd", backend=be)
    state = TrainState(model, cfg.placement, cfg.alpha, be, torch.bfloat16, ssd)
    state.init_random(0)
    ex = Executor(plan, state, TokenData.load(None, model.vocab_size, seed=0), be, Hyper(), ssd)
    g = plan.graph
    order = sorted(range(len(g.tasks)), key=lambda i: (g.tasks[i].key, i))
    pos = {tid: i for i, tid in enumerate(order)}
    static = sum(v.dev.untyped_storage().nbytes()
                 for vs in state.vec.values() for v in vs if v.dev is not None)
    out = Contract(static_device_bytes=static, straddle_bytes=_straddle_bytes(state),
                   static_pinned_bytes=be.pinned_bytes(), area_bytes=ex.arena.size_bytes)
    gpu, cpu = TIER_INDEX["gpu"], TIER_INDEX["cpu"]
    level = {"gpu": float(g.static_bytes["gpu"]), "cpu": float(g.static_bytes["cpu"])}
    turn = [0]
    cv = threading.Condition()
    run = ex.ops.run

    def serial(rs, t) -> None:
        with cv:
            while turn[0] != pos[t.id]:
                if rs.abort.is_set():
                    return
                cv.wait(0.05)
        try:
            if t.resource in DEVICE_RESOURCES:
                with _Allocs(be):
                    run(rs, t)
            else:
                run(rs, t)
            for tier, idx in (("gpu", gpu), ("cpu", cpu)):
                level[tier] += sum(d for i, d in t.mem_start + t.mem_end if i == idx)
            out.samples.append(Sample(f"{t.id} {t.label}", t.resource, static + be.device_bytes(),
                                      level["gpu"], be.pinned_bytes(), level["cpu"],
                                      ex.arena.used_bytes()))
        finally:
            with cv:
                turn[0] += 1
                cv.notify_all()

    ex.ops.run = serial
    rr = ex.run_round(iterations, 0)
    ssd.close()
    out.losses = rr.losses
    out.area_max_used_bytes, out.area_overflows = ex.arena.stats.max_used_bytes, ex.arena.stats.overflows
    assert len(out.samples) == len(order)
    return out


def _straddle_bytes(state: TrainState) -> int:
    """Device bytes a weight use holds beyond the plan's fetch: the resident head of a parameter that the
    placement's device/host split cuts, copied into the fetched buffer so that the parameter is one tensor
    (executor.ops.weights.WeightOps.fetch_start), summed over the owners of a block; the two largest blocks'
    (the weight use in progress and the one fetched ahead)."""
    per_block = []
    for b in range(len(state.layout.numel)):
        n = 0
        for o, lo, hi in state.layout.owners(b):
            W = state.vec["weights"][o]
            cut = [s for s in state.layout.slots[o] if lo <= s.offset < W.g < s.offset + s.numel <= hi]
            if cut:
                n += (W.g - cut[0].offset) * W.dev.element_size()
        per_block.append(n)
    return sum(sorted(per_block)[-2:])


def slack_bytes(model_name: str, c: Contract) -> float:
    """What the plan's memory effects leave out by design: an activation handed from one compute op straight
    to the next (the plan counts it in the consumer's working memory, not between the two ops) and the
    activation gradient handed on the same way, one layer checkpoint each; the split parameters' resident
    heads (_straddle_bytes); 4 KiB for the round's token batches."""
    return 2 * layer_cost(get_model(model_name), MICRO, SEQ).checkpoint_bytes + c.straddle_bytes + 4096


CPU_ALL = Split(0.0, 1.0, 0.0)
CASES = {
    # weights and checkpoints on the host, the last layer swapped (its saved activations offloaded)
    "weights_cpu_swap": Placement(weights=CPU_ALL, checkpoints=CPU_ALL),
    # a third of each weight vector resident on the device, checkpoints kept on the device, one layer swapped
    "weights_split_swap": Placement(weights=Split(0.3, 0.7, 0.0), checkpoints=Split(1.0, 0.0, 0.0)),
    # checkpoints half kept on the device, half on the host; weights on the host
    "ckpt_split_swap": Placement(weights=CPU_ALL, checkpoints=Split(0.5, 0.5, 0.0)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["horizontal", "vertical"])
@pytest.mark.parametrize("model_name", ["tiny-gpt", "tiny-llama"])
def test_live_device_bytes_stay_within_the_plan_per_op(model_name, family, case, tmp_path):
    c = run_contract(model_name, family, CASES[case], 1, tmp_path)
    assert all(x == x for x in c.losses)
    slack = slack_bytes(model_name, c)
    over = [(s.op, s.measured_bytes - s.plan_bytes)
            for s in c.samples if s.measured_bytes > s.plan_bytes + slack]
    worst = max(c.samples, key=lambda s: s.measured_bytes - s.plan_bytes)
    assert not over, (f"{len(over)} of {len(c.samples)} ops leave more device memory than the plan "
                      f"+ {slack:,.0f}; "
                      f"worst {worst.op}: {worst.measured_bytes:,} vs {worst.plan_bytes:,.0f}", over[:8])
    # pinned host memory: the state's and the transfer area, allocated before the first op;
    # nothing pinned after
    assert c.area_bytes > 0 and c.area_overflows == 0
    assert max(s.pinned_bytes for s in c.samples) <= c.static_pinned_bytes
    assert max(s.area_used_bytes for s in c.samples) <= c.area_max_used_bytes <= c.area_bytes
    assert c.area_max_used_bytes == c.area_bytes, (c.area_max_used_bytes, c.area_bytes)


def test_the_hidden_compute_dtype_option_trains_in_bf16_on_a_cpu(tmp_path, capsys):
    from tierflow.cli import main
    from tierflow.planner.io.planfile import write_plan

    model = get_model("tiny-gpt")
    cfg = make_schedule("vertical", model, HW, batch=2, micro_batch=MICRO, seq=SEQ,
                        placement=CASES["weights_cpu_swap"], swap_layers=1, iterations=1)
    path = tmp_path / "plan.json"
    write_plan(plan_from_graph(model, HW, cfg, build_graph(model, HW, cfg)), path)
    assert main(["run", str(path), "--steps", "1", "--device", "cpu", "--compute-dtype", "bf16"]) == 0
    assert "compute bfloat16" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["horizontal", "vertical"])
def test_gradients_leave_the_compute_stream_in_the_compute_dtype(family, tmp_path, monkeypatch):
    """offload_grads only copies: the cast of fp32 accumulators happens on the compute stream after the last
    contribution (vertical: several micro-batches), or a single contribution is written in bf16
    (horizontal)."""
    from tierflow.executor.ops.grad_buffers import GradBuffers

    seen = []
    real = GradBuffers.take

    def take(self, rs, group):
        out = real(self, rs, group)
        seen.extend(g.dtype for _o, _lo, g in out)
        return out

    monkeypatch.setattr(GradBuffers, "take", take)
    c = run_contract("tiny-llama", family, CASES["weights_cpu_swap"], 1, tmp_path)
    assert all(x == x for x in c.losses) and seen and set(seen) == {torch.bfloat16}
