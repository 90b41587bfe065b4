"""CUDA graphs on the CPU: the planner's capture segments (planner/core/capture.py) on real plans, and the
executor's capture and replay (executor/graphs.py) on the adversarial emulation, whose graphs refuse what CUDA
refuses during a capture (executor/device/emugraph.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from support.runs import PLACEMENTS, make_plan, reference, rel_err, run

from tierflow.cli import main
from tierflow.executor import graphs as graphs_mod
from tierflow.executor.calibration.dispatch import ITERATIONS, tiny_config, tiny_plan
from tierflow.executor.data import TokenData
from tierflow.executor.device.base import CaptureError, GraphReplayError, HiddenSyncError
from tierflow.executor.device.emulated import AdversarialCpuBackend
from tierflow.executor.engine import ExecutionError, Executor
from tierflow.executor.ops.context import Hyper
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.core.capture import CapturePlan, Segment, capture_plan, peak_with_pool_bytes
from tierflow.planner.core.opkinds import COMPUTE_KINDS
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.io.planfile import plan_from_graph, write_plan

# -- the planner's segments ---------------------------------------------------------------------------------

FAMILIES = ("horizontal", "fuyou", "vertical", "block")


def _compute_edges(tasks):
    return [(d, t.id) for t in tasks if t.kind in COMPUTE_KINDS for d in t.deps
            if tasks[d].kind in COMPUTE_KINDS]


def _components(tasks):
    """Connected components of the compute ops over their dependencies on each other."""
    parent = {t.id: t.id for t in tasks if t.kind in COMPUTE_KINDS}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in _compute_edges(tasks):
        parent[find(a)] = find(b)
    comps: dict[int, list[int]] = {}
    for x in parent:
        comps.setdefault(find(x), []).append(x)
    return list(comps.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_segments_hold_only_device_compute_and_cover_every_closed_run(family, placement):
    plan = make_plan("tiny-gpt", family, placement)
    g = plan.graph
    tasks = g.tasks
    cp = capture_plan(g)
    queue = g.resource_order()["gpu"]
    pos = {op: i for i, op in enumerate(queue)}
    crossing = {x for t in tasks for d in t.deps if tasks[d].resource != t.resource for x in (d, t.id)}
    seg_of = cp.segment_of
    for i, s in enumerate(cp.segments):
        # compute ops of the gpu queue, no transfer / host op / cross-resource wait inside, one iteration
        assert all(tasks[op].kind in COMPUTE_KINDS and tasks[op].resource == "gpu" for op in s.ops)
        assert not crossing & set(s.ops)
        assert {tasks[op].iteration for op in s.ops} == {s.iteration}
        # consecutive in the gpu queue: nothing else runs between its ops
        assert [pos[op] for op in s.ops] == list(range(pos[s.ops[0]], pos[s.ops[0]] + len(s.ops)))
        assert all(seg_of[op] == i for op in s.ops)
        assert s.pool_bytes <= cp.pool_bytes
    # closed: what one compute op hands another never crosses a segment's boundary
    for a, b in _compute_edges(tasks):
        assert seg_of.get(a) == seg_of.get(b)
    # maximal: a compute op left eager is connected to a crossing op, spans iterations, or has an eager op of
    # the gpu queue between its component's ops
    for comp in _components(tasks):
        if any(op in seg_of for op in comp):
            assert all(op in seg_of for op in comp)
            continue
        lo, hi = min(pos[op] for op in comp), max(pos[op] for op in comp)
        between = [op for op in queue[lo:hi + 1] if op not in comp and op not in seg_of]
        assert (set(comp) & crossing or len({tasks[op].iteration for op in comp}) > 1 or between
                or any(tasks[op].resource != "gpu" for op in comp)), comp
    assert peak_with_pool_bytes(g, cp) >= cp.pool_bytes


def test_a_plan_on_the_device_is_one_segment_per_iteration_and_host_checkpoints_none():
    on = tiny_plan("cpu", "on_device").graph
    cp = capture_plan(on)
    compute = [t for t in on.tasks if t.kind in COMPUTE_KINDS]
    assert len(cp.segments) == on.num_iterations
    assert cp.captured_ops == len(compute)
    assert len({s.key for s in cp.segments}) == 1  # one graph, replayed every iteration
    # the pool: the segment's own peak of the plan's memory effects, above what it started with
    held, peak = 0.0, 0.0
    for op in cp.segments[0].ops:
        for eff in (on.tasks[op].mem_start, on.tasks[op].mem_end):
            held += sum(b for tier, b in eff if tier == 0)
            peak = max(peak, held)
    assert cp.pool_bytes == peak > 0
    # every checkpoint offloaded: each micro-batch's chain crosses a transfer, nothing is closed
    host = tiny_plan("cpu", "checkpoints_host").graph
    assert capture_plan(host).segments == ()


def test_twin_maps_an_op_to_its_place_in_another_iteration():
    g = tiny_plan("cpu", "on_device").graph
    cp = capture_plan(g)
    s0, s1 = cp.segments[:2]
    assert [cp.twin(op, 1, g.tasks) for op in s0.ops] == list(s1.ops)
    assert cp.twin(s0.ops[0], g.num_iterations, g.tasks) is None


# -- the executor: capture and replay on the emulation ------------------------------------------------------


def _executor(plan, graphs, seed=1, **kw):
    be = AdversarialCpuBackend(seed=seed, max_delay_s=0.0005)
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, be, torch.float32, None)
    state.init_random(0)
    data = TokenData.load(None, plan.model.vocab_size, seed=0)
    return Executor(plan, state, data, be, Hyper(), None, cuda_graphs=graphs, **kw)


def _losses(ex, rounds=2):
    out = []
    for r in range(rounds):
        out += ex.run_round(ITERATIONS, r * ITERATIONS).losses
    return out


def test_replayed_graphs_train_bit_for_bit_as_eager_launches(capsys):
    plan = tiny_plan("cpu", "on_device")
    eager = _losses(_executor(plan, False))
    ex = _executor(plan, True)
    graphed = _losses(ex)
    assert graphed == eager
    runner = ex.graph_runner
    (g,) = runner.graphs.values()
    # 6 iterations: a warm-up, a capture, 4 replays (which no Python of the ops ran for)
    assert g.graph.replays == 4 and not runner.eager
    assert "cuda-graphs" not in capsys.readouterr().err


def test_llama_blocks_replay_bit_for_bit_too():
    """Rotary positions, RMSNorm, gated MLP: every tensor they make per call is the graph's own."""
    plan = make_plan("tiny-llama", "block", "device", iterations=ITERATIONS)
    eager = _losses(_executor(plan, False))
    ex = _executor(plan, True)
    assert _losses(ex) == eager
    assert [g.graph.replays for g in ex.graph_runner.graphs.values()] == [2 * ITERATIONS - 2]


@pytest.mark.parametrize("family", ["horizontal", "fuyou"])
def test_a_run_with_graphs_matches_plain_pytorch_adamw(family, tmp_path, monkeypatch):
    """`run_plan` with RunConfig.cuda_graphs (what --cuda-graphs sets) on the emulation: the same
    equivalence with plain PyTorch as every run (tests/executor/test_executor.py), over 5 steps (3 + 2: a
    warm-up, a capture and replays, and a second round replaying the first round's graph)."""
    plan = make_plan("tiny-gpt", family, "device", iterations=3)
    replays = []
    real = graphs_mod.GraphRunner._replay
    monkeypatch.setattr(graphs_mod.GraphRunner, "_replay",
                        lambda self, *a: (replays.append(1), real(self, *a)))
    res = run(plan, tmp_path, device="cpu-adversarial", cuda_graphs=True)
    assert len(replays) >= 2  # segments per iteration x iterations after the capture
    ref_losses, ref_weights = reference("tiny-gpt")
    assert max(abs(a - b) / b for a, b in zip(res.losses, ref_losses)) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(res.final_master, ref_weights)) <= 1e-5


def test_partly_captured_plan_mixes_replays_and_eager_ops_exactly():
    plan = make_plan("tiny-gpt", "fuyou", "device", iterations=ITERATIONS)
    cp = capture_plan(plan.graph)
    assert 0 < cp.captured_ops < sum(t.kind in COMPUTE_KINDS for t in plan.graph.tasks)
    eager = _losses(_executor(plan, False))
    ex = _executor(plan, True)
    assert _losses(ex) == eager
    assert all(g.graph.replays > 0 for g in ex.graph_runner.graphs.values())


def test_an_illegal_capture_falls_back_to_eager_launches_with_one_line(monkeypatch, capsys):
    plan = tiny_plan("cpu", "on_device")
    eager = _losses(_executor(plan, False))
    ex = _executor(plan, True)
    head = ex.ops.handlers["head"]

    def head_with_a_host_sync(rs, t):
        head(rs, t)
        float(rs.loss_sum[t.iteration])  # .item(): the host waits for the device

    monkeypatch.setitem(ex.ops.handlers, "head", head_with_a_host_sync)
    assert _losses(ex) == eager
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert ("--cuda-graphs: ops 18-31 (14 compute ops) run eagerly: capture failed: a host synchronization"
            in err[0])
    assert ex.graph_runner.graphs == {}


def test_a_segment_that_is_not_closed_runs_eagerly(monkeypatch, capsys):
    """The executor's own check of the planner's closure: a segment cut inside a micro-batch's chain (the
    forward only) hands its activations to eager ops, so it is refused at its warm-up."""
    plan = tiny_plan("cpu", "on_device")
    g = plan.graph
    real = capture_plan(g)
    fwd = [Segment(s.ops[:3], s.iteration, s.key[:3], s.pool_bytes) for s in real.segments]
    cut = CapturePlan(tuple(fwd), {op: i for i, s in enumerate(fwd) for op in s.ops}, real.pool_bytes,
                      real.iteration_start)
    monkeypatch.setattr(graphs_mod, "capture_plan", lambda graph: cut)
    eager = _losses(_executor(plan, False), rounds=1)
    ex = _executor(plan, True)
    assert _losses(ex, rounds=1) == eager
    err = capsys.readouterr().err
    assert "ops 0-2 (3 compute ops) run eagerly: entry (0, 'pack', 1, 0) crosses the segment's boundary" \
        in err


def test_a_replay_refuses_to_overwrite_a_gradient_buffer_not_yet_taken(monkeypatch):
    plan = tiny_plan("cpu", "on_device")
    ex = _executor(plan, True)
    _losses(ex, rounds=1)  # warm-up, capture, a replay
    monkeypatch.setitem(ex.ops.handlers, "adam_gpu", lambda rs, t: None)  # nothing takes the gradients
    with pytest.raises(ExecutionError, match="would overwrite the gradient buffer"):
        ex.run_round(ITERATIONS, ITERATIONS)


def test_graphs_are_off_by_default_on_the_emulation_and_refused_on_a_plain_cpu(tmp_path, capsys):
    plan = tiny_plan("cpu", "on_device")
    assert _executor(plan, None).graph_runner is None
    model, hw, cfg = tiny_config("cpu", "on_device")
    path = tmp_path / "p.json"
    write_plan(plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg)), path)
    assert main(["run", str(path), "--device", "cpu", "--steps", "1", "--cuda-graphs", "-q"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tierflow: --cuda-graphs: cpu has no CUDA graphs; every op runs eagerly"]
    assert main(["run", str(path), "--device", "cpu", "--steps", "1", "--no-cuda-graphs", "-q"]) == 0
    assert "cuda-graphs" not in capsys.readouterr().err


# -- the emulated graph refuses what CUDA refuses ------------------------------------------------------------


@pytest.fixture
def gpu():
    be = AdversarialCpuBackend(max_delay_s=0.0)
    errors: list = []
    be.start_round(threading.Event(), lambda label, e: errors.append(e))
    stream = be.new_stream("gpu")
    yield be, stream, errors
    be.close_streams([stream])


def _on(be, stream, errors, fn):
    """fn() run as an op on the emulated gpu stream; what it raised."""
    be.launch(stream, fn, "op")
    be.synchronize()
    return errors[-1] if errors else None


def test_an_emulated_replay_reruns_the_recorded_ops_on_the_captured_memory(gpu):
    be, stream, errors = gpu
    w = be.empty(4, torch.float32)
    w.copy_(torch.arange(4.0))
    box = {}
    pool = be.graph_pool()
    g = be.new_graph(pool, lambda: {w.untyped_storage().data_ptr(): w})

    def capture():
        def body():
            y = be.empty(4, torch.float32)
            torch.mul(w, 2.0, out=y)
            box["y"] = y + 1.0  # a new result: replays write it into the same memory
        g.capture(body)

    assert _on(be, stream, errors, capture) is None
    y = box["y"]
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]
    w.copy_(torch.full((4,), 10.0))  # a persistent input changed in place: the replay reads it
    assert _on(be, stream, errors, g.replay) is None
    assert y.tolist() == [21.0] * 4 and box["y"] is y


@pytest.mark.parametrize("what", ["item", "copy_async", "host_buffer", "unowned", "sync"])
def test_an_emulated_capture_refuses_what_cuda_refuses(gpu, what):
    be, stream, errors = gpu
    w = be.empty(4, torch.float32)
    w.fill_(1.0)
    stray = be.empty(4, torch.float32)  # made outside the capture, not declared persistent
    stray.fill_(2.0)
    pinned = be.host_buffer(4, torch.float32, pinned=True)
    g = be.new_graph(be.graph_pool(), lambda: {w.untyped_storage().data_ptr(): w})
    body = {
        "item": lambda: (w * 2).sum().item(),
        "copy_async": lambda: be.copy_async(pinned, w),
        "host_buffer": lambda: be.host_buffer(4, torch.float32, pinned=True),
        "unowned": lambda: w + stray,
        "sync": lambda: be.synchronize(),
    }[what]
    err = _on(be, stream, errors, lambda: g.capture(body))
    expected = HiddenSyncError if what == "sync" else CaptureError
    assert isinstance(err, expected), err


def test_an_emulated_replay_refuses_a_persistent_tensor_that_moved(gpu):
    be, stream, errors = gpu
    state = {"w": be.empty(4, torch.float32)}
    state["w"].fill_(1.0)
    g = be.new_graph(be.graph_pool(), lambda: {state["w"].untyped_storage().data_ptr(): state["w"]})
    assert _on(be, stream, errors, lambda: g.capture(lambda: state["w"] * 3)) is None
    state["w"] = be.empty(4, torch.float32)  # the owner now keeps its tensor elsewhere: a new address
    err = _on(be, stream, errors, g.replay)
    assert isinstance(err, GraphReplayError) and "new tensor address" in str(err)


# -- the model: one launch per captured segment ------------------------------------------------------------


def test_the_simulator_charges_one_launch_per_segment_instead_of_per_op_host_costs():
    from tierflow.planner.core.capture import graphed_graph
    from tierflow.planner.core.simulator import simulate_graph

    model, hw, cfg = tiny_config("cpu", "on_device")
    hw = hw.with_overrides({"gpu.op_overhead_us": 300, "cpu.executor_op_us": 100, "gpu.graph_launch_us": 20,
                            "gpu.graph_op_us": 5})
    g = build_graph(model, hw, cfg)
    cp = capture_plan(g)
    gg = graphed_graph(g, hw, cp)
    per_iteration = len(g.tasks) // g.num_iterations
    assert len(gg.tasks) == len(g.tasks) - g.num_iterations * (len(cp.segments[0].ops) - 1)
    eager, graphed = simulate_graph(g, hw).iteration_s, simulate_graph(gg, hw).iteration_s
    # the gpu queue is serial on this plan: each iteration's 14 compute ops lose their 300 + 100 us and the
    # segment gains one launch (20 us), 5 us per captured op and one engine cost (100 us)
    n = len(cp.segments[0].ops)
    assert eager - graphed == pytest.approx((n * 400 - 120 - n * 5) * 1e-6, rel=1e-6)
    assert per_iteration == 18
    # without a launch cost or per-op costs in the profile, graphs change nothing of the device's time
    bare = tiny_config("cpu", "on_device")[1]
    g0 = build_graph(model, bare, cfg)
    assert simulate_graph(graphed_graph(g0, bare), bare).iteration_s == pytest.approx(
        simulate_graph(g0, bare).iteration_s, rel=1e-9)
    # and a plan with nothing captured is left as it is
    hmodel, _hw, hcfg = tiny_config("cpu", "checkpoints_host")
    host = build_graph(hmodel, hw, hcfg)
    assert graphed_graph(host, hw) is host


def test_micro_batches_of_another_shape_run_eagerly_with_one_line(capsys):
    plan = tiny_plan("cpu", "on_device")
    ex = _executor(plan, True)
    ex.run_round(ITERATIONS, 0)  # warm-up, capture, a replay
    real = ex.data.batch

    def shorter(step, batch, seq):  # dynamic shapes: one token less per sequence
        return real(step, batch, seq - 1)

    ex.data.batch = shorter
    losses = ex.run_round(ITERATIONS, ITERATIONS).losses
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run eagerly: dynamic shapes" in err[0]
    ref = _executor(plan, False)
    ref.run_round(ITERATIONS, 0)
    ref.data.batch = shorter
    assert losses == ref.run_round(ITERATIONS, ITERATIONS).losses


def test_the_trace_shares_a_replayed_segments_span_among_its_ops_by_modelled_work():
    """CUDA times a replay, not its ops: each segment's ops get consecutive spans that tile the segment's
    measured span, in proportion to their modelled work, instead of each carrying the whole span (which
    counted a segment once per op in compare's per-kind busy times)."""
    plan = tiny_plan("cpu", "on_device")
    ex = _executor(plan, True)
    res = ex.run_round(ITERATIONS, 0)
    tasks = plan.graph.tasks
    segs = ex.graph_runner.capture.segments
    assert segs
    for seg in segs:
        starts = [res.start_s[op] for op in seg.ops]
        ends = [res.end_s[op] for op in seg.ops]
        assert all(a <= b for a, b in zip(starts, ends))
        assert all(abs(e - s) < 1e-12 for e, s in zip(ends[:-1], starts[1:]))  # consecutive
        span = ends[-1] - starts[0]
        assert span > 0
        total = sum(tasks[op].work for op in seg.ops)
        for op, a, b in zip(seg.ops, starts, ends):
            assert (b - a) == pytest.approx(span * tasks[op].work / total, rel=1e-9, abs=1e-12)
    # the ops outside the segments keep their own events' spans
    inside = {op for seg in segs for op in seg.ops}
    outside = [t.id for t in tasks if t.id < len(res.start_s) and t.id not in inside and t.resource == "gpu"]
    assert outside and all(res.end_s[op] >= res.start_s[op] for op in outside)
