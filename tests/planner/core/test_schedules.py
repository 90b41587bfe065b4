"""Tests for tierflow.planner.core.schedules (and the task graph it builds): family defaults, bad requests,
the order of the GPU steps, the task graph's structure, and the bytes every link moves per iteration, checked
against closed forms derived from tierflow.planner.core.workload (never against recorded simulator
outputs)."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import CPU, GPU, SSD, placement, profile, small_models, splits

from tierflow.api import simulate, simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.devicemem import cuda_runtime_memory
from tierflow.planner.core.families import FAMILIES, family_of
from tierflow.planner.core.graph import LINKS, RESOURCES, TIER_INDEX
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import ScheduleError, build_graph, make_schedule, step_sequence
from tierflow.planner.core.workload import (
    ADAM_STATE_BYTES,
    COMPUTE_BYTES,
    GRAD_ACCUM_BYTES,
    GRAD_WIRE_BYTES,
    MASTER_BYTES,
    embed_cost,
    head_cost,
    layer_cost,
)

GPU_KINDS = {"fwd", "recompute", "bwd", "head", "adam_gpu"}






def work_of(graph, kind: str, iteration: int) -> float:
    return sum(t.work for t in graph.tasks if t.kind == kind and t.iteration == iteration)


def param_sums(model, micro_batch: int, seq: int):
    """(E, Lp, Hf, sum of fetch_params over all blocks, sum over blocks that own parameters), from
    workload."""
    e = embed_cost(model, micro_batch, seq)
    lay = layer_cost(model, micro_batch, seq)
    h = head_cost(model, micro_batch, seq)
    blocks = [e] + [lay] * model.num_layers + [h]
    return (e.fetch_params, lay.fetch_params, h.fetch_params, sum(b.fetch_params for b in blocks),
            sum(b.fetch_params for b in blocks if b.owned_params > 0))


def weight_fetch_params(model, micro_batch: int, seq: int) -> int:
    """Parameters fetched per group of micro-batches: embedding and layers once forward and once backward, the
    head once (its forward and backward are one step)."""
    E, Lp, Hf, _, _ = param_sums(model, micro_batch, seq)
    return 2 * (E + model.num_layers * Lp) + Hf


def expected_link_bytes(model, cfg: ScheduleConfig) -> dict[str, float]:
    """Bytes each link moves in one iteration, derived from the schedule's definition:

    - a group of g micro-batches visits F(embed), F(1..L), H(head), B(L..1), B(embed); each visit is one
      weight use that fetches the block's off-GPU weights once (its SSD part is read first);
    - a recomputed layer's input is a checkpoint offloaded once and fetched in backward; in a snake order only
      the micro-batch that turns at a visit hands its activation over on the GPU, so g - 1 of g layer inputs
      (forward), head inputs and activation gradients cross PCIe (and the SSD part of them the SSD);
    - a layer that is not recomputed (recompute off, or one of the last `swap_layers`) offloads and fetches
      its full activations once per micro-batch; its input crosses for g - 1 of g micro-batches;
    - gradients: bf16 over PCIe once per backward use (once per iteration when they accumulate on the GPU);
      fp32 spill to SSD written and read once per block per iteration;
    - optimizer states: their SSD part read and written once per iteration, plus the SSD part of the weights
      written back; the GPU part of the weights is refreshed over H2D after the CPU optimizer.
    """
    p = cfg.placement
    L, M, g = model.num_layers, cfg.num_micro_batches, cfg.group
    groups = M // g
    _, _, _, sum_fetch, sum_fetch_owned = param_sums(model, cfg.micro_batch, cfg.seq)
    lay = layer_cost(model, cfg.micro_batch, cfg.seq)
    P = model.total_params()
    ckpt = lay.checkpoint_bytes
    weights = groups * COMPUTE_BYTES * weight_fetch_params(model, cfg.micro_batch, cfg.seq)
    R = L - cfg.swap_layers if cfg.recompute else 0  # layers recomputed in backward
    S = L - R  # layers that keep (swap out) their full activations
    # per group: checkpoints of recomputed layers (out once per micro-batch; in for the g - 1 forward
    # hand-overs that are not on the GPU and once in backward), inputs of swapped layers and of the head
    # (g - 1 hand-overs), activation gradients of the head and every layer (g - 1 hand-overs), full
    # activations of swapped layers
    act_out = groups * (ckpt * (R * g + S * (g - 1) + (g - 1) + (L + 1) * (g - 1))
                        + lay.full_activation_bytes * S * g)
    act_in = groups * (ckpt * (R * (g - 1) + R * g + S * (g - 1) + (g - 1) + (L + 1) * (g - 1))
                       + lay.full_activation_bytes * S * g)
    if p.gpu_optimizer:
        grads_d2h = states = grads_ssd = update = weights_back = 0.0
    else:
        grads_d2h = GRAD_WIRE_BYTES * sum_fetch * (1 if p.grads.gpu == 1.0 else groups)
        if cfg.runtime == "deepspeed":  # its final gradient also goes to the optimizer's fp32 one
            grads_d2h += GRAD_ACCUM_BYTES * sum_fetch
        states = P * (MASTER_BYTES * p.master.ssd + ADAM_STATE_BYTES * (p.adam_m.ssd + p.adam_v.ssd))
        grads_ssd = GRAD_ACCUM_BYTES * sum_fetch_owned * p.grads.ssd
        update = COMPUTE_BYTES * P * p.weights.gpu
        weights_back = COMPUTE_BYTES * P * p.weights.ssd
    ck = p.checkpoints
    return {
        "cpu->gpu": weights * p.weights.off_gpu + act_in * ck.off_gpu + update,
        "gpu->cpu": grads_d2h + act_out * ck.off_gpu,
        "ssd->cpu": weights * p.weights.ssd + act_in * ck.ssd + states + grads_ssd,
        "cpu->ssd": act_out * ck.ssd + states + grads_ssd + weights_back,
    }


# ---- strategies --------------------------------------------------------------------------------------------







@st.composite
def placements(draw):
    if draw(st.integers(0, 9)) == 0:
        return Placement.uniform("gpu")
    grads = GPU if draw(st.integers(0, 4)) == 0 else draw(splits(gpu=False))
    # master, m and v may differ off the GPU
    return Placement(weights=draw(splits()), master=draw(splits(gpu=False)), adam_m=draw(splits(gpu=False)),
                     adam_v=draw(splits(gpu=False)), grads=grads, checkpoints=draw(splits()))


@st.composite
def schedules(draw):
    model = draw(small_models())
    family = draw(st.sampled_from(FAMILIES))
    M = draw(st.sampled_from([1, 2, 3, 4, 6]))
    if family == "block" and M == 1:
        M = 2
    mb = draw(st.sampled_from([1, 2]))
    kw = dict(batch=M * mb, micro_batch=mb, seq=draw(st.sampled_from([16, 32, 64])),
              placement=draw(placements()),
              recompute=draw(st.booleans()), swap_layers=draw(st.integers(0, model.num_layers)),
              prefetch_depth=draw(st.integers(1, 3)), act_prefetch=draw(st.integers(1, 3)), iterations=3)
    if family == "block":
        kw["group"] = draw(st.sampled_from([d for d in range(1, M + 1) if M % d == 0]))
    if family in ("vertical", "block"):
        kw["alpha"] = draw(st.sampled_from([None, 0.0, 0.5]))
    return model, make_schedule(family, model, profile(), **kw)


# ---- family defaults and bad requests ----------------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_family_defaults(M):
    m, hw = get_model("tiny-gpt"), profile()
    h = make_schedule("horizontal", m, hw, batch=2 * M, micro_batch=2)
    f = make_schedule("fuyou", m, hw, batch=2 * M, micro_batch=2)
    v = make_schedule("vertical", m, hw, batch=2 * M, micro_batch=2)
    assert (h.group, h.alpha, h.optimizer_overlap) == (1, 0.0, False)
    assert (f.group, f.alpha, f.optimizer_overlap) == (1, 0.0, True)
    assert (v.group, v.optimizer_overlap) == (M, True) and 0 < v.alpha < 1
    assert all(c.num_micro_batches == M for c in (h, f, v))
    assert h.seq == m.seq_len
    if M > 1:
        b = make_schedule("block", m, hw, batch=2 * M, micro_batch=2)
        assert 1 <= b.group <= M and M % b.group == 0 and b.optimizer_overlap


def test_schedule_config_round_trips_through_dict():
    cfg = make_schedule("block", get_model("tiny-llama"), profile(), batch=8, micro_batch=1, group=4,
                        alpha=0.5, prefetch_depth=2, recompute=True, swap_layers=2, act_prefetch=3,
                        placement=placement(weights=Split(0.25, 0.5, 0.25)))
    assert ScheduleConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(family="horizontal", batch=6, micro_batch=4), ["6", "4", "divisible"]),
        (dict(family="vertical", batch=7, micro_batch=2), ["7", "2", "divisible"]),
        (dict(family="zigzag", batch=8, micro_batch=2), ["zigzag", "horizontal", "vertical"]),
        (dict(family="horizontal", batch=0, micro_batch=2), ["positive"]),
        (dict(family="horizontal", batch=8, micro_batch=-1), ["positive"]),
        (dict(family="block", batch=8, micro_batch=1, group=3), ["group 3"]),
        (dict(family="block", batch=8, micro_batch=1, group=16), ["group 16"]),
        (dict(family="vertical", batch=8, micro_batch=1, alpha=1.0), ["alpha"]),
        (dict(family="vertical", batch=8, micro_batch=1, alpha=-0.1), ["alpha"]),
        (dict(family="horizontal", batch=8, micro_batch=1, prefetch_depth=0), ["prefetch"]),
        (dict(family="horizontal", batch=8, micro_batch=1, swap_layers=5), ["swap_layers 5", "4"]),
        (dict(family="horizontal", batch=8, micro_batch=1, swap_layers=-1), ["swap_layers -1"]),
        # tiny-gpt has 64 positions
        (dict(family="horizontal", batch=8, micro_batch=1, seq=65), ["65", "64"]),
    ],
)
def test_bad_requests_raise_schedule_error(kwargs, words):
    kwargs = dict(kwargs)
    family = kwargs.pop("family")
    with pytest.raises(ScheduleError) as err:
        make_schedule(family, get_model("tiny-gpt"), profile(), **kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_public_entry_point_raises_schedule_errors():
    # the public entry point raises the same error (a ValueError) before simulating anything
    with pytest.raises(ValueError, match="divisible"):
        simulate("tiny-gpt", "rtx4090-lohan", "horizontal", batch=6, micro_batch=4)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        simulate("tiny-gpt", "rtx4090-lohan", "zigzag", batch=8, micro_batch=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hw_name, overrides", [("rtx4090-lohan", {}), ("rtx2060-laptop", {}),
                                                ("rtx3090-desktop", {"ssd.count": 0})])
def test_default_placement_is_valid_and_off_gpu(family, hw_name, overrides):
    hw = profile(hw_name).with_overrides(overrides)
    for model in ("gpt3-1.3b", "gpt3-13b"):
        m = get_model(model)
        p = make_schedule(family, m, hw, batch=32, micro_batch=4, seq=2048).placement
        for name in ("weights", "master", "adam_m", "adam_v", "grads", "checkpoints"):
            s = getattr(p, name)
            assert s.gpu == 0.0
            assert abs(s.gpu + s.cpu + s.ssd - 1) < 1e-6
            if hw.ssd.count == 0:
                assert s.ssd == 0.0, f"{name} placed on a missing SSD"


# ---- the order of GPU steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks, M, g",
                         [(3, 1, 1), (4, 4, 1), (4, 4, 4), (6, 6, 2), (6, 6, 3), (5, 8, 4)])
def test_step_sequence_visits_every_step_once_in_snake_order(num_blocks, M, g):
    steps = step_sequence(num_blocks, M, g)
    head = num_blocks - 1
    visits = 2 * num_blocks - 1  # F(0..head-1), H(head), B(head-1..0)
    assert len(steps) == M * visits
    assert len({(s.phase, s.block, s.mb) for s in steps}) == len(steps)
    for g0 in range(0, M, g):
        chunk = steps[g0 * visits:(g0 + g) * visits]
        runs = [chunk[i:i + g] for i in range(0, len(chunk), g)]
        expected = ([("F", b) for b in range(head)] + [("H", head)]
                    + [("B", b) for b in range(head - 1, -1, -1)])
        assert [(r[0].phase, r[0].block) for r in runs] == expected
        for r in runs:
            assert all((s.phase, s.block) == (r[0].phase, r[0].block) for s in r)
            assert sorted(s.mb for s in r) == list(range(g0, g0 + g))
        for a, b in zip(runs, runs[1:]):
            assert a[-1].mb == b[0].mb  # snake: the micro-batch that ends one visit starts the next
            assert [s.mb for s in b] == [s.mb for s in reversed(a)]


def _gpu_runs(res, iteration=0):
    """Runs of consecutive GPU compute steps of one block and phase, in the order the simulator ran them."""
    steps = [t for t in res.graph.tasks if t.resource == "gpu" and t.iteration == iteration
             and t.kind in ("fwd", "head", "bwd")]
    steps.sort(key=lambda t: (res.start_s[t.id], t.id))
    runs: list[list] = []
    for t in steps:
        phase = {"fwd": "F", "head": "H", "bwd": "B"}[t.kind]
        if runs and (runs[-1][0][0], runs[-1][0][1]) == (phase, t.block):
            runs[-1].append((phase, t.block, t.mb))
        else:
            runs.append([(phase, t.block, t.mb)])
    return runs


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
@pytest.mark.parametrize("M", [2, 3, 4])
def test_vertical_runs_gpu_steps_in_snake_order(model, M):
    res = simulate(model, "rtx4090-lohan", "vertical", batch=M, micro_batch=1, seq=32)
    L = get_model(model).num_layers
    runs = _gpu_runs(res)
    assert [(r[0][0], r[0][1]) for r in runs] == (
        [("F", b) for b in range(L + 1)] + [("H", L + 1)] + [("B", b) for b in range(L, -1, -1)])
    for r in runs:
        assert sorted(x[2] for x in r) == list(range(M))
    forward = [r for r in runs if r[0][0] == "F"]
    for a, b in zip(forward, forward[1:]):
        assert a[-1][2] == b[0][2], "the last micro-batch of block b must be the first of block b+1"
    for a, b in zip(runs, runs[1:]):
        assert a[-1][2] == b[0][2]
        assert [x[2] for x in b] == [x[2] for x in reversed(a)]


@pytest.mark.parametrize("family", ["horizontal", "fuyou"])
def test_horizontal_runs_each_micro_batch_through_all_blocks(family):
    res = simulate("tiny-gpt", "rtx4090-lohan", family, batch=3, micro_batch=1, seq=32)
    runs = _gpu_runs(res)
    L = get_model("tiny-gpt").num_layers
    visits = 2 * (L + 2) - 1
    assert len(runs) == 3 * visits and all(len(r) == 1 for r in runs)
    assert [r[0][2] for r in runs] == [m for m in range(3) for _ in range(visits)]


# ---- the task graph ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("place", ["default", "cpu", "ssd", "gpu"])
@pytest.mark.parametrize("swap", [0, 1, 4])
def test_task_graph_structure(family, place, swap):
    model, hw = get_model("tiny-llama"), profile()
    p = {"default": None, "cpu": Placement.uniform("cpu"), "ssd": placement(SSD, SSD, SSD, SSD),
         "gpu": Placement.uniform("gpu")}[place]
    cfg = make_schedule(family, model, hw, batch=8, micro_batch=2, seq=32, placement=p, swap_layers=swap,
                        iterations=2)
    graph = build_graph(model, hw, cfg)
    tasks = graph.tasks
    G = graph.to_networkx()
    assert G.number_of_nodes() == len(tasks)
    assert nx.is_directed_acyclic_graph(G)
    assert G.number_of_edges() == sum(len(set(t.deps)) for t in tasks)
    assert [t.id for t in tasks] == list(range(len(tasks)))
    for t in tasks:
        assert t.resource in RESOURCES
        assert t.work >= 0 and t.work == t.work
        assert 0 <= t.block <= model.num_layers + 1 and t.iteration in (0, 1)
        for d in t.deps:
            assert d < t.id, "dependencies are built before their consumers"
            assert tasks[d].key <= t.key, "a task's queue position is never ahead of its dependencies'"
        for tier, delta in t.mem_start:
            assert tier in TIER_INDEX.values() and delta > 0, "only allocations happen at a task's start"
        for tier, _ in t.mem_end:
            assert tier in TIER_INDEX.values()
        assert G.nodes[t.id]["kind"] == t.kind and set(G.predecessors(t.id)) == set(t.deps)
    assert {t.kind for t in tasks if t.resource == "gpu"} <= GPU_KINDS
    if place == "gpu":
        assert not [t for t in tasks if t.resource in LINKS]
        assert {t.kind for t in tasks if t.resource == "gpu"} >= {"adam_gpu"}
        assert not [t for t in tasks if t.resource == "cpu"]
    else:
        assert "adam_gpu" not in {t.kind for t in tasks}
    # every block runs forward (or head) and backward for every micro-batch of every iteration
    for it in range(2):
        for m in range(cfg.num_micro_batches):
            got = {(t.kind, t.block) for t in tasks if t.iteration == it and t.mb == m
                   and t.resource == "gpu"}
            want = {("fwd", b) for b in range(model.num_layers + 1)} | {("head", model.num_layers + 1)}
            want |= {("bwd", b) for b in range(model.num_layers + 1)}
            # the last `swap` keep theirs
            want |= {("recompute", b) for b in range(1, model.num_layers - swap + 1)}
            assert got == want


def test_graph_static_bytes_and_capacity_are_closed_form():
    model, hw = get_model("tiny-gpt"), profile()
    P = model.total_params()
    w, s, gr = Split(0.25, 0.5, 0.25), Split(0.0, 0.75, 0.25), Split(0.0, 0.5, 0.5)
    cfg = make_schedule("vertical", model, hw, batch=4, micro_batch=1, placement=placement(w, s, gr))
    graph = build_graph(model, hw, cfg)
    per = {t: COMPUTE_BYTES * getattr(w, t) + (MASTER_BYTES + 2 * ADAM_STATE_BYTES) * getattr(s, t)
           for t in ("gpu", "cpu", "ssd")}
    per["ssd"] += GRAD_ACCUM_BYTES * gr.ssd
    # on a GPU the plan also holds what the executor's CUDA runtime maps under the cap (devicemem)
    runtime = {"gpu": cuda_runtime_memory().total_bytes, "cpu": 0.0, "ssd": 0.0}
    for tier in ("gpu", "cpu", "ssd"):
        assert graph.static_bytes[tier] == pytest.approx(P * per[tier] + runtime[tier], rel=1e-12)
    assert graph.capacity_bytes == {"gpu": hw.gpu.capacity_bytes, "cpu": hw.cpu.capacity_bytes,
                                    "ssd": hw.ssd.capacity_bytes}


# ---- bytes per link: closed forms --------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama", "gpt3-1.3b", "llama2-7b"])
@pytest.mark.parametrize("family, M, group", [("horizontal", 4, 1), ("fuyou", 4, 1), ("vertical", 4, 4),
                                               ("vertical", 1, 1), ("block", 6, 2), ("block", 6, 3)])
def test_weight_and_gradient_bytes_weights_on_cpu(model, family, M, group):
    m, hw = get_model(model), profile()
    mb, seq = 1, 64
    cfg = make_schedule(family, m, hw, batch=M * mb, micro_batch=mb, seq=seq,
                        placement=Placement.uniform("cpu"), group=group if family == "block" else None)
    graph = build_graph(m, hw, cfg)
    E, Lp, Hf, sum_fetch, _ = param_sums(m, mb, seq)
    per_group = COMPUTE_BYTES * (2 * (E + m.num_layers * Lp) + Hf)
    n_groups = M // group
    for it in range(cfg.iterations):
        # horizontal: weights cross for every micro-batch (F and B; the head once); vertical: once per pass
        assert work_of(graph, "fetch_weights", it) == n_groups * per_group
        # DeepSpeed (horizontal's runtime) also copies the final gradient to the optimizer's fp32 one
        boundary = GRAD_ACCUM_BYTES * sum_fetch if cfg.runtime == "deepspeed" else 0
        assert work_of(graph, "offload_grads", it) == n_groups * GRAD_WIRE_BYTES * sum_fetch + boundary
        assert work_of(graph, "update_weights", it) == 0
        assert graph.bytes_per_link(iteration=it)["ssd->cpu"] == 0
        assert graph.bytes_per_link(iteration=it)["cpu->ssd"] == 0
    if family in ("horizontal", "fuyou"):
        assert work_of(graph, "fetch_weights", 0) == M * per_group
    if family == "vertical":
        assert work_of(graph, "fetch_weights", 0) == per_group  # independent of M


@pytest.mark.parametrize("family", ["horizontal", "vertical", "block"])
@pytest.mark.parametrize("w_ssd", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("alpha", [None, 0.5])
def test_optimizer_state_bytes_on_ssd(family, w_ssd, alpha):
    m, hw = get_model("tiny-llama"), profile()
    P = m.total_params()
    w = Split(0.0, 1.0 - w_ssd, w_ssd)
    cfg = make_schedule(family, m, hw, batch=4, micro_batch=1, placement=placement(weights=w, states=SSD),
                        alpha=alpha)
    graph = build_graph(m, hw, cfg)
    for it in range(cfg.iterations):
        assert work_of(graph, "read_opt_states", it) == pytest.approx(12 * P, rel=1e-12)
        assert work_of(graph, "write_opt_states", it) == pytest.approx(12 * P + COMPUTE_BYTES * P * w_ssd,
                                                                       rel=1e-12)


def _zero_infinity_expectation(model):
    """Horizontal, one micro-batch, weights + optimizer states + fp32 grads on SSD, checkpoints on CPU.

    REFERENCE: weights read 2P forward + 2P backward, grads written 4P and read 4P, states read 12P and
    written 12P, weights written 2P: 38P. Exact for this schedule: the head is one step (its weights are read
    once, not twice) and a tied head reads the embedding matrix too and keeps its own fp32 gradient of it."""
    P = model.total_params()
    tied = model.vocab_size * model.embed_dim if model.tied_embeddings else 0
    head_owned = model.final_norm_params() + model.head_params()
    read = 4 * P - 2 * head_owned + 2 * tied + 4 * (P + tied) + 12 * P
    write = 4 * (P + tied) + 12 * P + 2 * P
    return read, write


@pytest.mark.parametrize("model, within_1pct", [("llama2-7b", True), ("gpt3-13b", True), ("gpt3-175b", True),
                                                ("gpt3-1.3b", False), ("tiny-gpt", False)])
def test_zero_infinity_ssd_traffic_is_38P(model, within_1pct):
    m, hw = get_model(model), profile()
    P = m.total_params()
    cfg = make_schedule("horizontal", m, hw, batch=1, micro_batch=1, seq=min(m.seq_len, 2048),
                        placement=placement(weights=SSD, states=SSD, grads=SSD, checkpoints=CPU))
    graph = build_graph(m, hw, cfg)
    read, write = _zero_infinity_expectation(m)
    for it in range(cfg.iterations):
        b = graph.bytes_per_link(iteration=it)
        assert b["ssd->cpu"] == pytest.approx(read, rel=1e-12)
        assert b["cpu->ssd"] == pytest.approx(write, rel=1e-12)
        total = b["ssd->cpu"] + b["cpu->ssd"]
        if within_1pct:
            assert total == pytest.approx(38 * P, rel=0.01)
        else:  # a large tied embedding (gpt3-1.3b: 7.8% of P) puts it above 38P
            assert total > 38 * P


@pytest.mark.parametrize("model, within_1pct",
                         [("llama2-7b", True), ("gpt3-175b", True), ("gpt3-1.3b", False)])
@pytest.mark.parametrize("family", ["horizontal", "fuyou"])
def test_fuyou_style_ssd_traffic_is_16P_read_14P_write(model, within_1pct, family):
    m, hw = get_model(model), profile()
    P = m.total_params()
    tied = m.vocab_size * m.embed_dim if m.tied_embeddings else 0
    head_owned = m.final_norm_params() + m.head_params()
    cfg = make_schedule(family, m, hw, batch=1, micro_batch=1, seq=min(m.seq_len, 2048),
                        placement=placement(weights=SSD, states=SSD, grads=CPU, checkpoints=CPU))
    b = build_graph(m, hw, cfg).bytes_per_link(iteration=1)
    assert b["ssd->cpu"] == pytest.approx(16 * P - 2 * head_owned + 2 * tied, rel=1e-12)
    assert b["cpu->ssd"] == pytest.approx(14 * P, rel=1e-12)
    if within_1pct:
        assert b["ssd->cpu"] == pytest.approx(16 * P, rel=0.01)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedules())
def test_link_bytes_per_iteration_match_closed_form(case):
    model, cfg = case
    graph = build_graph(model, profile(), cfg)
    expected = expected_link_bytes(model, cfg)
    for it in range(cfg.iterations):
        got = graph.bytes_per_link(iteration=it)
        assert set(got) == set(expected)
        for link, want in expected.items():
            assert got[link] == pytest.approx(want, rel=1e-9, abs=1e-6), (link, it, cfg.describe())
    total = graph.bytes_per_link()
    for link, want in expected.items():
        assert total[link] == pytest.approx(cfg.iterations * want, rel=1e-9, abs=1e-6)


# ---- the family contract -----------------------------------------------------------------------------------


@pytest.mark.parametrize("M", [2, 4])
def test_family_names_say_what_was_built(M):
    m, hw = get_model("tiny-gpt"), profile()
    one = make_schedule("block", m, hw, batch=2 * M, micro_batch=2, group=1)
    assert (one.family, one.group, one.optimizer_overlap) == ("fuyou", 1, True)  # never "horizontal"
    allmb = make_schedule("block", m, hw, batch=2 * M, micro_batch=2, group=M)
    assert allmb.family == "vertical"
    assert family_of(1, M, optimizer_overlap=False) == "horizontal"
    if M > 2:
        assert make_schedule("block", m, hw, batch=2 * M, micro_batch=2, group=2).family == "block"


@pytest.mark.parametrize("family", ["horizontal", "fuyou", "vertical"])
def test_group_is_refused_where_the_family_fixes_it(family):
    with pytest.raises(ScheduleError, match="--group applies to the block schedule only"):
        make_schedule(family, get_model("tiny-gpt"), profile(), batch=8, micro_batch=2, group=2)


def test_recomputes_counts_swapped_layers_from_the_end():
    m = get_model("tiny-gpt")  # 4 layers
    cfg = make_schedule("vertical", m, profile(), batch=4, micro_batch=2, swap_layers=1)
    assert [cfg.recomputes(b, m.num_layers) for b in range(m.num_layers + 2)] == [False, True, True, True,
                                                                                  False, False]
    assert cfg.recomputed_fraction(m.num_layers) == 0.75
    off = make_schedule("vertical", m, profile(), batch=4, micro_batch=2, recompute=False)
    assert not any(off.recomputes(b, m.num_layers) for b in range(6)) and off.recomputed_fraction(4) == 0.0


# ---- ZeRO-Infinity as DeepSpeed runs it --------------------------------------------------------------------


def test_horizontal_runs_as_deepspeed_runs_it_unless_asked_for_the_ideal():
    m, hw = get_model("tiny-gpt"), profile()
    assert make_schedule("horizontal", m, hw, batch=4, micro_batch=2).runtime == "deepspeed"
    assert make_schedule("horizontal", m, hw, batch=4, micro_batch=2, runtime="ideal").runtime == "ideal"
    assert make_schedule("fuyou", m, hw, batch=4, micro_batch=2).runtime == "lohan"
    assert make_schedule("fuyou", m, hw, batch=4, micro_batch=2, runtime="ideal").runtime == "ideal"
    assert make_schedule("vertical", m, hw, batch=4, micro_batch=2).runtime == "ideal"
    with pytest.raises(ScheduleError, match="applies to the horizontal schedule"):
        make_schedule("vertical", m, hw, batch=4, micro_batch=2, runtime="deepspeed")
    with pytest.raises(ScheduleError, match="applies to the fuyou schedule"):
        make_schedule("horizontal", m, hw, batch=4, micro_batch=2, runtime="lohan")
    with pytest.raises(ScheduleError, match="unknown runtime"):
        make_schedule("horizontal", m, hw, batch=4, micro_batch=2, runtime="megatron")


def test_deepspeed_fetches_nvme_weights_on_demand_and_swaps_sub_groups_serially():
    m, hw = get_model("gpt3-125m"), profile()
    on_ssd = Placement.uniform("ssd")
    kw = dict(batch=8, micro_batch=2, seq=256, placement=on_ssd, iterations=2)
    ds = make_schedule("horizontal", m, hw, **kw)
    ideal = make_schedule("horizontal", m, hw, runtime="ideal", **kw)

    def fetched_just_in_time(cfg) -> list[bool]:
        """For each weight copy to the GPU: is the next GPU step in queue order the one that consumes it?"""
        tasks = build_graph(m, hw, cfg).tasks
        gpu_steps = sorted((t for t in tasks if t.resource == "gpu"), key=lambda t: (t.key, t.id))
        out = []
        for f in (t for t in tasks if t.kind == "fetch_weights"):
            nxt = next(s for s in gpu_steps if s.key > f.key)
            out.append(f.id in nxt.deps)
        return out

    assert all(fetched_just_in_time(ds))  # DeepSpeed: no prefetch of NVMe-resident parameters
    assert not all(fetched_just_in_time(ideal))  # the ideal runtime fetches one use ahead
    tasks = build_graph(m, hw, ds).tasks
    reads = [t for t in tasks if t.kind == "read_opt_states" and t.iteration == 0]
    writes = {t.id for t in tasks if t.kind == "write_opt_states" and t.iteration == 0}
    # all but the first wait for a write
    assert sum(1 for r in reads if writes & set(r.deps)) == len(reads) - 1
    slow, fast = simulate_config(m, hw, ds), simulate_config(m, hw, ideal)
    assert slow.iteration_s > fast.iteration_s


# ---- Fuyou as LoHan's code runs it -------------------------------------------------------------------------


def _lohan_case(runtime: str):
    m, hw = get_model("gpt3-125m"), profile()
    cfg = make_schedule("fuyou", m, hw, batch=2, micro_batch=2, seq=256, placement=Placement.uniform("ssd"),
                        iterations=3, runtime=runtime)
    return m, hw, cfg


def test_lohan_thread_serialises_the_optimizer_io_and_the_backward_weight_reads():
    """LoHan's training thread reads a block's states and waits, writes back the block stepped before and
    waits, then reads the next module's weights: in the simulated steady iteration none of these SSD ops
    overlap."""
    m, hw, cfg = _lohan_case("lohan")
    res = simulate_config(m, hw, cfg)
    tasks = res.graph.tasks
    assert all(d < t.id for t in tasks for d in t.deps)  # renumbered: dependencies before consumers
    it = 1
    thread = [t for t in tasks if t.iteration == it and t.kind in ("read_opt_states", "write_opt_states")]
    thread += [t for t in tasks if t.iteration == it and t.kind == "read_weights"
               and any(u.kind in ("write_opt_states", "read_opt_states") for u in (tasks[d] for d in t.deps))]
    assert len(thread) > 2 * m.num_layers
    spans = sorted((res.start_s[t.id], res.end_s[t.id], t.label) for t in thread)
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        assert s1 >= e0 - 1e-9, f"{a} [{s0:.4f}, {e0:.4f}] overlaps {b} [{s1:.4f}, {e1:.4f}]"
    # each block's states are read only once the thread has fetched the next block's weights for the backward
    for r in (t for t in tasks if t.kind == "read_opt_states" and t.iteration == it
              and 1 <= t.block < m.num_layers):
        assert any(tasks[d].kind == "fetch_weights" and tasks[d].block == r.block - 1 for d in r.deps)


def test_lohan_waits_for_its_optimizer_io_where_the_ideal_fuyou_overlaps_it():
    """LoHan's 13B at batch 8 on its box (12 SSDs): the thread's optimizer reads and writes, one after the
    other, take longer than the GPU's work, so the iteration is at least their sum; the ideal fuyou overlaps
    them."""
    m, hw = get_model("gpt3-13b-lohan").with_seq(1024), load_profile("rtx4090-lohan")
    on_ssd = {"gpu": 0, "cpu": 0, "ssd": 1}
    pl = Placement.from_dict({"weights": on_ssd, "master": on_ssd, "adam_m": on_ssd, "adam_v": on_ssd})
    out = {}
    for rt in ("lohan", "ideal"):
        res = simulate_config(m, hw, make_schedule("fuyou", m, hw, batch=8, micro_batch=8, placement=pl,
                                                   runtime=rt))
        io_s = sum(res.end_s[t.id] - res.start_s[t.id] for t in res.graph.tasks
                   if t.iteration == 1 and t.kind in ("read_opt_states", "write_opt_states"))
        out[rt] = (res.iteration_s, io_s, res.link_bytes)
    assert out["lohan"][2] == pytest.approx(out["ideal"][2], rel=1e-9)  # the same bytes
    assert out["lohan"][0] >= out["lohan"][1]
    assert out["ideal"][0] < 0.95 * out["ideal"][1]
