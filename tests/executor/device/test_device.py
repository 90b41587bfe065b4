"""The CUDA logic on a CPU: the adversarial emulation of a CUDA device (executor/device/emulated.py)
turns each kind of missing synchronization into a failure, and the executor's CUDA paths run on it: every
record_stream and stream wait the executor makes is needed (removing one fails the run), errors are passed up
with the op named, out-of-memory errors of every tier exit 3, and no op on a stream synchronizes the host."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from support.runs import make_plan, reference, rel_err, run

from tierflow.cli import main
from tierflow.executor import engine as engine_mod
from tierflow.executor.device.base import HiddenSyncError, PageableCopyError, RoundAborted
from tierflow.executor.device.cuda import CudaBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend
from tierflow.executor.device.factory import make_backend
from tierflow.executor.engine import ExecutionError, Executor
from tierflow.executor.ops.context import RoundState
from tierflow.executor.ops.grads import GradOps
from tierflow.executor.ops.weights import WeightOps
from tierflow.executor.options import OutputOptions
from tierflow.executor.tiers.arena import arena_bytes_for
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.io.planfile import write_plan

ADV = "cpu-adversarial"


@pytest.fixture
def be():
    b = AdversarialCpuBackend(max_delay_s=0.001)
    errors: list[tuple[str, BaseException]] = []
    b.start_round(threading.Event(), lambda label, e: errors.append((label, e)))
    b.errors = errors
    yield b
    b.close_streams(list(b.streams))


def _gate() -> threading.Event:
    return threading.Event()


# -- the adversary itself ------------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False])
def test_a_missing_stream_wait_reads_what_is_not_written_yet(be, wait):
    gpu, d2h = be.new_stream("gpu"), be.new_stream("d2h")
    box: dict = {}

    def produce():
        time.sleep(0.05)
        x = be.empty(256, torch.float32)
        x.fill_(3.0)
        box["x"] = x

    be.launch(gpu, produce, "produce")
    done = be.record(gpu)
    if wait:
        be.wait_event(d2h, done)
    host = be.host_buffer(256, torch.float32, pinned=True)
    be.launch(d2h, lambda: be.copy_async(host, box["x"]), "consume")
    be.synchronize()
    if wait:
        assert not be.errors and torch.equal(host, torch.full((256,), 3.0))
    else:
        assert be.errors and isinstance(be.errors[0][1], KeyError)


@pytest.mark.parametrize("record", [True, False])
def test_a_block_freed_without_record_stream_is_reused_and_reported(be, record):
    """The d2h copy of a gpu-stream block lands after the gpu stream reused the block: NaN, and the free is
    reported; with record_stream the block waits for the d2h stream and the copy reads the data."""
    gpu, d2h = be.new_stream("gpu"), be.new_stream("d2h")
    box: dict = {}
    dropped, reused = _gate(), _gate()
    host = be.host_buffer(1024, torch.float32, pinned=True)

    def produce():
        x = be.empty(1024, torch.float32)
        x.fill_(7.0)
        box["x"] = x

    def offload():
        x = box.pop("x")
        if record:
            be.record_stream(x, d2h)
        be.copy_async(host, x)  # lands after this handler returns
        del x
        dropped.set()
        assert reused.wait(5)

    def next_alloc():
        assert dropped.wait(5)
        box["y"] = be.empty(1024, torch.float32)  # the freed block, unless d2h recorded a use
        reused.set()

    be.launch(gpu, produce, "produce")
    be.wait_event(d2h, be.record(gpu))
    be.launch(d2h, offload, "offload")
    be.launch(gpu, next_alloc, "next")
    be.synchronize()
    if record:
        assert not be.errors and torch.equal(host, torch.full((1024,), 7.0))
        assert be.reuses == 0
    else:
        assert torch.isnan(host).all() and be.reuses == 1
        assert be.errors and "freed without record_stream(d2h)" in str(be.errors[0][1])


def test_pageable_copies_and_hidden_syncs_are_errors(be):
    gpu = be.new_stream("gpu")
    pageable = be.host_buffer(16, torch.float32, pinned=False)
    ev = be.record(gpu)
    be.launch(gpu, lambda: be.copy_async(be.empty(16, torch.float32), pageable), "copy")
    be.launch(gpu, lambda: be.synchronize_event(ev), "sync")
    be.synchronize()
    kinds = [type(e) for _label, e in be.errors]
    assert kinds == [PageableCopyError, HiddenSyncError]
    assert [label for label, _e in be.errors] == ["copy", "sync"]


def test_devices_and_threads():
    """Emulated device 1: a thread that did not call thread_init (set_device) may not enqueue on its streams,
    and events of two devices cannot be timed against each other."""
    from tierflow.executor.device.emulated import EmuEvent

    b = AdversarialCpuBackend(1, max_delay_s=0)
    b.start_round(threading.Event(), lambda label, e: None)
    s = b.new_stream("gpu")
    seen = {}

    def worker(init: bool) -> None:
        if init:
            b.thread_init()
        try:
            b.launch(s, lambda: None, "x")
            seen[init] = b.record(None).device
        except RuntimeError as e:
            seen[init] = str(e)

    for init in (False, True):
        th = threading.Thread(target=worker, args=(init,))
        th.start()
        th.join()
    assert "did not call thread_init" in seen[False]
    assert seen[True] == 1  # the current device after thread_init is the run's
    b.thread_init()
    start = b.record(s)
    end = b.record(s)
    b.synchronize_event(end)
    assert b.elapsed_s(start, end) >= 0
    other = EmuEvent(0, enqueued=True)
    other.fire()
    with pytest.raises(RuntimeError, match="device 1 and device 0"):
        b.elapsed_s(start, other)
    b.close_streams([s])
    AdversarialCpuBackend(0).thread_init()  # this (main) thread back on device 0


def test_waiting_on_an_event_never_recorded_does_not_wait(be):
    """As cudaStreamWaitEvent: an event not yet recorded is no dependency (why the engine waits for
    `done`)."""
    from tierflow.executor.device.emulated import EmuEvent

    gpu = be.new_stream("gpu")
    ev = EmuEvent(0)
    ran = []
    be.wait_event(gpu, ev)
    be.launch(gpu, lambda: ran.append(1), "after")
    be.synchronize()
    assert ran == [1]


# -- the executor on the adversary: every wait and record_stream it makes is needed --------------------------


def _adv_fails(plan, tmp_path, **kw) -> str | None:
    """None if the adversarial run equals plain PyTorch, else what went wrong."""
    try:
        res = run(plan, tmp_path, device=ADV, steps=3, **kw)
    except ExecutionError as e:
        return str(e)
    want_losses, want_weights = reference("tiny-llama", steps=3)
    worst = max(max(abs(a - b) / b for a, b in zip(res.losses, want_losses)),
                max(rel_err(a, b) for a, b in zip(res.final_master, want_weights)))
    return None if worst <= 1e-5 else f"differs from plain PyTorch by {worst:.1e}"


USE_SITES = [("offload", "d2h"), ("fetch", "h2d"), ("take", "gpu"), ("weights", "gpu"),
             ("offload_grads", "d2h")]


@pytest.mark.parametrize(("site", "resource"), USE_SITES)
def test_each_record_stream_is_needed(site, resource, tmp_path, monkeypatch):
    plan = make_plan("tiny-llama", "vertical", "mix", 0.25)  # packs, activations, weights and grads all cross
    real = RoundState.use_on

    def use_on(self, x, r):
        if r == resource and sys._getframe(1).f_code.co_name == site:
            return
        real(self, x, r)

    monkeypatch.setattr(RoundState, "use_on", use_on)
    why = _adv_fails(plan, tmp_path)
    assert why is not None and f"record_stream({resource})" in why


def test_every_cross_stream_wait_is_needed(tmp_path, monkeypatch):
    plan = make_plan("tiny-llama", "vertical", "mix", 0.25)
    monkeypatch.setattr(AdversarialCpuBackend, "wait_event", lambda self, stream, ev: None)
    assert _adv_fails(plan, tmp_path) is not None


def test_the_adversarial_run_is_the_plain_one(tmp_path):
    """The control of the two tests above: nothing removed, the adversary finds nothing."""
    assert _adv_fails(make_plan("tiny-llama", "vertical", "mix", 0.25), tmp_path) is None


# -- defect 4: another device index; errors of workers and the reporter name the op --------------------------


def test_a_run_on_device_index_1(tmp_path):
    res = run(make_plan("tiny-gpt", "vertical", "ckpt_ssd", 0.25), tmp_path, device=f"{ADV}:1", steps=2)
    want, _ = reference("tiny-gpt", steps=2)
    assert max(abs(a - b) / b for a, b in zip(res.losses, want)) <= 1e-5
    assert res.measured is not None and (res.measured.end_s >= res.measured.start_s).all()


def test_a_start_event_on_the_wrong_device_is_reported_with_the_op(tmp_path, monkeypatch):
    """The old start event (recorded on the current device, 0, not on the run's) cannot be timed against the
    ops' events of device 1: the reporter's error reaches the caller naming the op, not an assert in
    run.py."""
    real = Executor.new_round

    def new_round(self, *a):
        from tierflow.executor.device.emulated import EmuEvent

        rs = real(self, *a)
        rs.ev0 = EmuEvent(0, enqueued=True)  # as torch.cuda.Event().record() on the current device, 0
        rs.ev0.fire()
        return rs

    monkeypatch.setattr(Executor, "new_round", new_round)
    with pytest.raises(ExecutionError, match=r"reporting the loss after op \d+ .*device 0 and device 1"):
        run(make_plan("tiny-gpt", "vertical", "weights_cpu"), tmp_path, device=f"{ADV}:1", steps=1)


def test_workers_set_their_device(tmp_path, monkeypatch):
    monkeypatch.setattr(AdversarialCpuBackend, "thread_init", lambda self: None)
    with pytest.raises(RuntimeError, match="did not call thread_init"):
        run(make_plan("tiny-gpt", "vertical", "weights_cpu"), tmp_path, device=f"{ADV}:1", steps=1)


# -- defect 5: out of memory on every tier exits 3 naming it; CUDA errors say they are asynchronous ----------


def _plan_file(tmp_path, placement="weights_cpu"):
    f = tmp_path / "plan.json"
    write_plan(make_plan("tiny-gpt", "vertical", placement, iterations=1), f)
    return f


def test_host_out_of_memory_exits_3(tmp_path, monkeypatch, capsys):
    def huge(self, rs, t):
        torch.empty(1 << 62, dtype=torch.uint8)  # torch raises RuntimeError here, not MemoryError

    monkeypatch.setattr(WeightOps, "fetch_weights", huge)
    assert main(["run", str(_plan_file(tmp_path)), "--steps", "1", "--device", "cpu"]) == 3
    err = capsys.readouterr().err.strip()
    assert "cpu out of memory in op" in err and "fetch_weights" in err and "\n" not in err


def test_pinned_out_of_memory_exits_3_naming_the_tier(tmp_path, monkeypatch, capsys):
    f = _plan_file(tmp_path, "ckpt_ssd")
    base = ["run", str(f), "--steps", "1", "--device", ADV, "--ssd-dir", str(tmp_path)]
    monkeypatch.setattr(AdversarialCpuBackend, "pinned_limit_bytes", 4096)  # not even the state fits
    assert main(base) == 3
    err = capsys.readouterr().err.strip()
    assert "cpu (pinned) out of memory for the training state" in err and "\n" not in err
    real = TrainState.init_random

    def init(self, seed):  # the state fits, the plan's transfer area does not
        real(self, seed)
        self.backend.pinned_limit_bytes = self.backend.pinned_bytes + 4096

    monkeypatch.setattr(TrainState, "init_random", init)
    monkeypatch.setattr(AdversarialCpuBackend, "pinned_limit_bytes", None)
    sized = []
    monkeypatch.setattr(engine_mod, "arena_bytes_for",
                        lambda *a: sized.append(arena_bytes_for(*a)) or sized[-1])
    assert main(base) == 3
    err = capsys.readouterr().err.strip()
    need = sized[0]
    assert err.startswith("tierflow run: cpu (pinned) out of memory: the plan's pinned transfer area needs "
                          f"{need / 2**30:.3f} GiB ({need:,} bytes)") and "\n" not in err
    # an area too small for the run (here: empty) serves its buffers outside it; a failure there names the op
    monkeypatch.setattr(engine_mod, "arena_bytes_for", lambda *a: 0)
    assert main(base) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the warning that the area is full
    assert "cpu (pinned) out of memory in op" in last and "offload_checkpoint" in last
    assert "placement.checkpoints" in last


@pytest.mark.parametrize(("message", "code", "want"), [
    ("CUDA error: an illegal memory access was encountered", 1, "CUDA error surfaced in op"),
    ("CUDA error: out of memory", 3, "gpu out of memory in op"),
])
def test_cuda_errors(tmp_path, monkeypatch, capsys, message, code, want):
    def fail(self, rs, t):
        raise torch.AcceleratorError(message)

    monkeypatch.setattr(WeightOps, "fetch_weights", fail)
    assert main(["run", str(_plan_file(tmp_path)), "--steps", "1", "--device", ADV]) == code
    err = capsys.readouterr().err.strip()
    assert want in err and "\n" not in err
    if code == 1:
        assert "CUDA_LAUNCH_BLOCKING=1" in err


# -- defect 6: no op on a stream synchronizes the host -------------------------------------------------------


def test_a_synchronizing_d2h_op_is_refused(tmp_path, monkeypatch):
    """The old offload_grads waited for its own copy inside the D2H queue (and added in fp32 there)."""

    def old_offload_grads(self, rs, t):
        for o, lo, g in self.buffers.take(rs, t.id):
            host = self.cx.backend.host_buffer(g.numel(), g.dtype, pinned=True)
            self.cx.backend.copy_async(host, g)
            self.cx.backend.synchronize_event(self.cx.backend.record(rs.streams["d2h"]))
            self.cx.state.grads[o][lo: lo + g.numel()] += host

    monkeypatch.setattr(GradOps, "offload_grads", old_offload_grads)
    with pytest.raises(ExecutionError, match="offload_grads .*HiddenSyncError"):
        run(make_plan("tiny-gpt", "vertical", "weights_cpu"), tmp_path, device=ADV, steps=1)


def test_the_gpu_optimizer_step_makes_no_host_tensor(tmp_path, monkeypatch):
    """torch.tensor(step, device=cuda) is a synchronizing copy from pageable memory; the step is a fill."""
    real = torch.tensor
    calls = []

    def spy(*a, **kw):
        if kw.get("device") is not None:
            calls.append(kw["device"])
        return real(*a, **kw)

    monkeypatch.setattr(torch, "tensor", spy)
    plan = make_plan("tiny-gpt", "vertical", "device")
    assert "adam_gpu" in {t.kind for t in plan.graph.tasks}
    run(plan, tmp_path, device=ADV, steps=1)
    assert calls == []


def test_cuda_backend_events_block_and_copy_streams_come_first(monkeypatch):
    made = {}

    class FakeEvent:
        def __init__(self, **kw):
            made["event"] = kw

        def record(self, stream=None):
            pass

    class FakeStream:
        def __init__(self, device, priority=0):
            made.setdefault("priority", {})[priority] = device

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    b = CudaBackend.__new__(CudaBackend)
    b.device = torch.device("cuda", 1)
    b.record(object())
    assert made["event"] == {"enable_timing": True, "blocking": True}
    for r in ("gpu", "h2d", "d2h"):
        b.new_stream(r)
    assert set(made["priority"]) == {0, -1}  # h2d and d2h ahead of the compute stream


def test_device_names():
    assert make_backend("cpu").name == "cpu"
    assert make_backend("cpu-adversarial:3").index == 3
    for bad in ("tpu", "cuda:x", "cpu-adversarial:x"):
        with pytest.raises(ValueError, match="--device"):
            make_backend(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_backend("cuda:1")


def test_round_aborted_is_quiet(be):
    abort = threading.Event()
    be.start_round(abort, lambda label, e: None)
    s = be.new_stream("gpu")
    from tierflow.executor.device.emulated import EmuEvent

    ev = EmuEvent(0, enqueued=True)  # never fires
    abort.set()
    with pytest.raises(RoundAborted):
        be.synchronize_event(ev)
    be.close_streams([s])


# -- defect 3: device memory measured per round, in the trace and in compare; the plan's capacity enforced ---


def test_measured_device_memory_reaches_the_trace_and_compare(tmp_path):
    from tierflow.planner.io.compare import compare, format_comparison
    from tierflow.planner.io.planfile import load_plan

    plan = make_plan("tiny-gpt", "vertical", "mix", 0.25)
    f = tmp_path / "plan.json"
    write_plan(plan, f)
    for device, measured in ((ADV, True), ("cpu", False)):
        out = tmp_path / device
        run(load_plan(f), tmp_path, device=device, steps=2,
            output=OutputOptions(out=str(out), quiet=True, collect_final=True))
        c = compare(load_plan(f), out / "trace.json")
        text = format_comparison(c)
        if measured:  # the emulated allocator's own peak, not the plan's numbers replayed
            m = c.measured_device_memory
            assert m["max_reserved_bytes"] >= m["max_allocated_bytes"] > 0
            assert m["max_allocated_bytes"] != c.predicted.peak_bytes["gpu"]
            assert "measured max allocated" in text and c.to_dict()["measured_device_memory"] == m
        else:
            assert c.measured_device_memory is None and "not measured" in text


def test_the_plans_gpu_capacity_is_enforced(tmp_path):
    plan = make_plan("tiny-gpt", "vertical", "weights_cpu")
    plan.graph.capacity_bytes["gpu"] = 256 << 10  # what the executor allocates on the device exceeds it
    with pytest.raises(ExecutionError, match="gpu out of memory in op"):
        run(plan, tmp_path, device=ADV, steps=1)


def test_expandable_segments(monkeypatch):
    from tierflow.executor.device.cuda import enable_expandable_segments

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert enable_expandable_segments() and calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's choice is kept
    assert not enable_expandable_segments() and len(calls) == 1


# -- defect 1: only what crosses PCIe is pinned, at its size -------------------------------------------------


def test_only_what_crosses_pcie_is_pinned():
    from support.runs import PLACEMENTS

    from tierflow.planner.core.models import get_model

    b = AdversarialCpuBackend(max_delay_s=0)
    p = PLACEMENTS["mix"]  # weights, master, Adam moments and gradients all partly in host memory
    st = TrainState(get_model("tiny-gpt"), p, 0.25, b, torch.float32, None)
    st.ssd = None
    # no SSD store here: keep every host range in memory
    for cls in ("master", "adam_m", "adam_v", "weights"):
        for v in st.vec[cls]:
            v.c, v.s = v.c + v.s, 0
    st.init_random(0)

    def pinned(t):
        return b.host[t.untyped_storage().data_ptr()]

    for blk in range(len(st.layout.numel)):
        assert pinned(st.vec["weights"][blk].host)  # fetch_weights copies it to the device
        for cls in ("master", "adam_m", "adam_v"):
            assert not pinned(st.vec[cls][blk].host)  # CPU Adam only
        assert not pinned(st.grads[blk])  # fp32 accumulators: offload_grads stages the compute dtype
    weights_host = sum(v.host.numel() * v.host.element_size() for v in st.vec["weights"])
    assert b.pinned_bytes == weights_host


def test_a_pinned_read_asks_for_its_size_only(tmp_path):
    """The pinned caching allocator rounds a request up to a power of two: 1 MiB + 4 KiB would pin 2 MiB."""
    from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty

    asked = []

    class PageAligned:
        pins = True

        def host_buffer(self, numel, dtype, pinned):
            asked.append((numel, pinned))
            return aligned_empty(numel)  # page-aligned, as pinned memory is

    store = SsdStore(tmp_path, backend=PageAligned(), warn=lambda m: None)
    data = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    store.write("w", data)
    assert torch.equal(store.read("w", torch.float32, 1 << 18, pinned=True), data)
    assert asked == [(1 << 20, True)]
    assert torch.equal(store.read("w", torch.float32, 1 << 18), data)  # pageable: aligned by one extra page
    assert asked[-1] == ((1 << 20) + 4096, False)
    store.close()


# -- defect 8: bf16 support is checked before training -------------------------------------------------------


def test_a_device_without_bf16_is_refused_before_training(tmp_path, monkeypatch, capsys):
    def no_bf16(self, dtype):
        raise ValueError(f"--device {self.name}: emulated GPU without bf16 support; "
                         "use an Ampere or newer GPU")

    monkeypatch.setattr(AdversarialCpuBackend, "check_compute_dtype", no_bf16)
    started = []
    monkeypatch.setattr(Executor, "run_round", lambda self, *a, **kw: started.append(1))
    assert main(["run", str(_plan_file(tmp_path)), "--steps", "1", "--device", ADV]) == 2
    err = capsys.readouterr().err.strip()
    assert "without bf16 support" in err and "\n" not in err and not started


# -- defect 2: a kept layer does not hold its output until its backward --------------------------------------


@pytest.mark.parametrize("model_name", ["tiny-gpt", "tiny-llama"])
def test_a_pack_releases_the_layer_output_and_backward_still_matches(model_name):
    from tierflow.executor.models import build_blocks
    from tierflow.executor.tiers.packs import Pack
    from tierflow.planner.core.models import get_model

    torch.manual_seed(0)
    layer = build_blocks(get_model(model_name))[1]
    x = torch.randn(2, 16, get_model(model_name).hidden)
    g = torch.randn_like(x)
    xa = x.clone().requires_grad_()
    layer(xa).backward(g)
    want = [xa.grad, *(p.grad.clone() for p in layer.parameters())]
    layer.zero_grad()
    leaves = list(layer.parameters())
    pack = Pack(leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook):
        pack.out = layer(pack.input(x.clone()))
    next_input = pack.out.detach()
    pack.release_output()
    # the next layer's input keeps the values
    assert pack.out.numel() == 0 and next_input.numel() == x.numel()
    grads, dx = pack.grads(g)
    got = [dx, *grads]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
