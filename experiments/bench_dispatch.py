"""The executor's host cost per op, split into its parts, measured and modelled; no GPU needed.

    python experiments/bench_dispatch.py [--quick] [--rounds N] [--out DIR]

1. **Measured.** A plan of tiny ops (a 2 x 64 model at micro-batches of 1 x 8 tokens:
   executor/calibration/dispatch.py) is run by the real engine (executor/engine.py) on the plain CPU backend
   and on the adversarial CUDA emulation (its random delays off: executor/device/emulated.py), alternating
   round by round with plain PyTorch stepping the same model. Per op: the executor's cost
   (`executor_op_us` = (executor step - plain step) / ops per step, the medians of the rounds;
   `paired_op_us` / `paired_op_cpu_us`: the median of each round's difference, wall and CPU, which this box's
   drift of speed over seconds moves far less) and its parts from the engine with clocks
   (hand-off between workers, event record / wait / synchronize, stream launch, trace recording, the
   handler, the rest of the worker's loop). Two plans: every tensor on the device, and the checkpoints in
   host memory (offload and fetch ops: hand-offs between the gpu, d2h and h2d workers).
2. **Cut.** `variant` per_op_leaves is the compute ops' way before the persistent parameters: an autograd
   leaf made per parameter per call and put into the block's module for the call, and every saved tensor of a
   kept layer through the pack's hooks; against `direct` (ops/params.py: resident weights' leaves made once,
   installed in the executor's copy of the module; a pack no op moves left to autograd): the same numerics,
   alternating in the same rounds.
   `variant` plain_blockwise runs no executor: plain PyTorch steps the same model block by block as the
   plan's compute ops decompose a step (a graph per block on a detached input, the head's chunked loss, one
   backward call per block, flat weight gradients), alternating with the whole-model plain step; its
   `executor_*` columns are that loop's, so its `executor_op_us` is what the decomposition itself costs per
   op, the floor under the executor's (plain CPU only).
   `per_op` (plain CPU, bench_dispatch_ops.csv): each compute op's handler against the same block's piece of
   the block-by-block loop in thread CPU time, alternating in one process; what the handlers add per op of a
   step (a figure this box's drift moves far less than the step-level ones).
3. **Modelled.** The simulator's step for the same plan on this box's profile
   (experiments/results/bench_executor_box.yaml, calibrated here) without per-op costs (`predicted_bare_ms`)
   and with the fixed costs calibrate measures now on this backend (`predicted_ms`: cpu.executor_op_us on
   every op, gpu.op_overhead_us and pcie.latency_us the rest of their ops' fixed cost, from calibrate's own
   tiny plan, a different plan from this one).

Writes bench_dispatch.csv and bench_dispatch_ops.csv under --out (with the default --out also the generated
tables of docs/executor.md). --quick: two rounds, the on-device plan only (a CI test runs it for structure).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    Progress,
    arg_parser,
    markdown_table,
    print_table,
    script_main,
    write_csv,
    write_generated_block,
)

BACKENDS = ("cpu", "cpu-adversarial")
VARIANTS = ("direct", "per_op_leaves")
BOX_PROFILE = RESULTS_DIR / "bench_executor_box.yaml"
DOC = REPO_DIR / "docs" / "executor.md"
DOC_TABLE = "per-op overhead (experiments/bench_dispatch.py from experiments/results/bench_dispatch.csv)"
DOC_TABLE_OPS = ("per-op handlers against the block-by-block loop (experiments/bench_dispatch.py from "
                 "experiments/results/bench_dispatch_ops.csv)")
PARTS = ("handoff", "events", "launch", "trace", "handler", "loop")
ALL_BLOCKS = -1  # per_op's block of the optimizer row: every block's optimizer op against one AdamW step


def make_backend(name: str):
    from tierflow.executor.device.base import PlainCpuBackend
    from tierflow.executor.device.emulated import AdversarialCpuBackend

    return PlainCpuBackend() if name == "cpu" else AdversarialCpuBackend(max_delay_s=0.0)


def per_op_leaves(ex) -> None:
    """The compute ops make a leaf per parameter per call (before the cut): no block's weights are found
    resident, so no pack is left to autograd either."""
    for p in ex.ops.compute.params:
        p.leaves = p._over


def measure(backend: str, placement: str, variant: str, rounds: int) -> dict:
    from tierflow.executor.calibration.dispatch import measure_dispatch

    r = measure_dispatch(lambda: make_backend(backend), rounds=rounds, placement=placement,
                         setup=per_op_leaves if variant == "per_op_leaves" else None)
    row = {"backend": backend, "plan": placement, "variant": variant, "rounds": rounds,
           "ops_per_step": round(r.ops_per_step, 1), "plain_step_ms": round(r.plain_step_s * 1e3, 3),
           "executor_step_ms": round(r.executor_step_s * 1e3, 3),
           "ratio": round(r.plain_step_s / r.executor_step_s, 3),
           "plain_op_us": round(r.plain_step_s / r.ops_per_step * 1e6, 1),
           "executor_op_us": round(r.executor_op_us, 1),
           "plain_cpu_ms": round(r.plain_cpu_s * 1e3, 3), "executor_cpu_ms": round(r.executor_cpu_s * 1e3, 3),
           "executor_cpu_best_ms": round(r.executor_cpu_best_s * 1e3, 3),
           "executor_op_cpu_us": round(r.executor_op_cpu_us, 1),
           "paired_op_us": round(r.paired_op_us, 1), "paired_op_cpu_us": round(r.paired_op_cpu_us, 1)}
    row.update({f"{p}_us": round(r.parts_us[p], 1) for p in PARTS})
    return row


class BlockwiseSteps:
    """Plain PyTorch (no executor) stepping the same model block by block, as the plan's compute ops
    decompose a step: per micro-batch each block's forward on a detached input (an autograd graph of its
    own), the head's chunked loss (executor.models.chunked_lm_loss, the gradients computed in its forward),
    then one backward call per block from the gradient of its output (tiers/packs.grads_of), each block's
    weight gradients flattened into one fp32 vector and added across micro-batches; then torch.optim.AdamW
    on the same parameters. What this costs beyond PlainSteps' one backward per micro-batch is the
    decomposition's own cost, which the executor pays on top of its bookkeeping (the floor of
    `executor_op_us`)."""

    def __init__(self, plan, device) -> None:
        from tierflow.executor.calibration.dispatch import PlainSteps

        self.plain = PlainSteps(plan, device)
        blocks = list(self.plain.model.blocks)
        self.embedding, self.layers, self.head = blocks[0], blocks[1:-1], blocks[-1]
        self.tied = self.embedding.wte.weight if plan.model.tied_embeddings else None
        self.params = [list(b.parameters()) for b in blocks]
        self.op_s: dict[tuple[str, int], list[float]] | None = None  # (kind, block) -> thread CPU s, if timed

    def _micro_batch(self, x_tokens, targets, acc: list, num_mb: int) -> None:
        import torch

        from tierflow.executor.tiers.packs import grads_of

        params, clock = self.params, _OpClock(self.op_s)
        last = len(self.layers) + 1
        with clock("fwd", 0):
            emb = self.embedding(x_tokens)
        ins, outs, x = [], [], emb.detach()
        for k, block in enumerate(self.layers, 1):
            with clock("fwd", k):
                xin = x.detach().requires_grad_()
                out = block(xin)
            ins.append(xin)
            outs.append(out)
            x = out.detach()
        with clock("head", last):
            xin = x.detach().requires_grad_()
            loss = self.head(xin, targets=targets, tied_weight=self.tied) / num_mb
            extra = (self.tied,) if self.tied is not None else ()
            *g, dx = grads_of((loss,), (torch.ones_like(loss),), (*params[-1], *extra, xin))
            _add(acc, -1, g)
        for k in range(len(self.layers), 0, -1):
            with clock("bwd", k):
                *g, dx = grads_of((outs[k - 1],), (dx,), (*params[k], ins[k - 1]))
                _add(acc, k, g)
        with clock("bwd", 0):
            _add(acc, 0, grads_of((emb,), (dx,), tuple(params[0])))

    def step_s(self, steps: int) -> float:
        import torch

        from tierflow.executor.calibration.dispatch import MICRO_BATCH, NUM_MB

        pl = self.plain
        t0 = time.perf_counter()
        for _ in range(steps):
            acc = [None] * (len(self.layers) + 2)
            for i in range(NUM_MB):
                sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                self._micro_batch(pl.x[sl], pl.y[sl], acc, NUM_MB)
            with _OpClock(self.op_s)("adam_gpu", ALL_BLOCKS):
                for k, flat in enumerate(acc):  # the flat vectors as the parameters' gradients
                    ps = self.params[k] + ([self.tied] if k == len(acc) - 1 and self.tied is not None else [])
                    for p, g in zip(ps, torch._C._nn.unflatten_dense_tensors(flat, ps)):
                        p.grad = g if p.grad is None else p.grad + g
                pl.opt.step()
                pl.opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / steps


class _OpClock:
    """`with clock(kind, block):` adds the block's thread CPU seconds to times[(kind, block)] (nothing when
    times is None)."""

    def __init__(self, times: dict | None) -> None:
        self.times, self.key, self.t0 = times, None, 0.0

    def __call__(self, kind: str, block: int) -> _OpClock:
        self.key = (kind, block)
        return self

    def __enter__(self) -> None:
        if self.times is not None:
            self.t0 = time.thread_time()

    def __exit__(self, *exc) -> None:
        if self.times is not None:
            self.times.setdefault(self.key, []).append(time.thread_time() - self.t0)


def per_op(placement: str, rounds: int) -> list[dict]:
    """Each compute op's handler against the same block's piece of the block-by-block loop, in thread CPU
    time (what neither another thread of the process nor, mostly, another process moves), their rounds
    alternating in one process; per (kind, block) the median over the rounds after the first third. The
    executor's handler is the op's whole body (entries, parameters, packs, gradient buffers and the torch
    calls); the loop's piece is the same torch calls without the executor (BlockwiseSteps). Offload and
    fetch ops have no piece (the loop keeps every tensor where it is). Plain CPU backend."""
    import statistics

    from tierflow.executor.calibration.dispatch import ITERATIONS, _executor, tiny_plan
    from tierflow.executor.calibration.op_costs import clock_handlers

    plan = tiny_plan("cpu", placement)
    backend = make_backend("cpu")
    ex, blocks = _executor(plan, backend, None), BlockwiseSteps(plan, backend.device)
    handler_s = clock_handlers(ex)  # op id -> its handler's thread CPU seconds in the last round
    ex_s: dict[tuple[str, int], list[float]] = {}
    blocks.op_s = {}
    for r in range(rounds + 1):  # the first round a warm-up
        handler_s.clear()
        ex.run_round(ITERATIONS, r * ITERATIONS)
        blocks.step_s(ITERATIONS)
        if r == 0:
            blocks.op_s.clear()
            continue
        for tid, sec in handler_s.items():
            t = plan.graph.tasks[tid]
            ex_s.setdefault((t.kind, t.block), []).append(sec)
    ops = len([t for t in plan.graph.tasks if t.iteration < ITERATIONS]) / ITERATIONS

    def med_us(xs: list[float]) -> float:
        return statistics.median(xs[len(xs) // 3:]) * 1e6

    rows = []
    for key in sorted(ex_s):
        e, b = ex_s[key], blocks.op_s.get(key)
        e_us, b_us = med_us(e), med_us(b) if b else None
        rows.append({"plan": placement, "kind": key[0], "block": key[1],
                     "per_step": round(len(e) / rounds / ITERATIONS, 3), "executor_us": round(e_us, 1),
                     "blockwise_us": round(b_us, 1) if b_us is not None else "",
                     "beyond_us": round(e_us - (b_us or 0.0), 1), "ops_per_step": ops, "rounds": rounds})
    # the optimizer: the executor's op per block against the loop's one torch.optim.AdamW step of all blocks
    adam = [r for r in rows if r["kind"] == "adam_gpu"]
    total = sum(r["executor_us"] * r["per_step"] for r in adam)
    loop = med_us(blocks.op_s[("adam_gpu", ALL_BLOCKS)])
    for r in adam:
        r["beyond_us"] = ""
    rows.append({"plan": placement, "kind": "adam_gpu", "block": ALL_BLOCKS, "per_step": 1.0,
                 "executor_us": round(total, 1), "blockwise_us": round(loop, 1),
                 "beyond_us": round(total - loop, 1), "ops_per_step": ops, "rounds": rounds})
    return rows


def handlers_beyond_us(rows: list[dict]) -> float:
    """What the executor's handlers add per op of a step beyond the block-by-block loop's pieces (the
    offload and fetch ops whole; the optimizer ops of all blocks against the loop's one AdamW step): sum over
    the rows of (executor - loop) x times per step, / ops per step."""
    return sum(r["beyond_us"] * r["per_step"] for r in rows if r["beyond_us"] != "") / rows[0]["ops_per_step"]


def _add(acc: list, k: int, grads: list) -> None:
    """Block k's weight gradients as one flat vector, added into acc[k] (the first one becomes it)."""
    import torch

    flat = torch._C._nn.flatten_dense_tensors(list(grads))
    acc[k] = flat if acc[k] is None else acc[k].add_(flat)


def blockwise(backend: str, placement: str, rounds: int) -> dict:
    """Plain PyTorch step by step (PlainSteps) against the same run block by block (BlockwiseSteps),
    alternating round by round, one plan's ops per step: `executor_*` are the block-by-block run's (no
    executor), so `executor_op_us` is the decomposition's cost per op."""
    import statistics

    from tierflow.executor.calibration.dispatch import ITERATIONS, PlainSteps, paired_op_us, tiny_plan

    plan = tiny_plan("cpu", placement)
    dev = make_backend(backend).device
    plain, blocks = PlainSteps(plan, dev), BlockwiseSteps(plan, dev)
    plain.step_s(1)
    blocks.step_s(1)
    ops = len([t for t in plan.graph.tasks if t.iteration < ITERATIONS]) / ITERATIONS
    wall, cpu = {"p": [], "b": []}, {"p": [], "b": []}
    for _ in range(rounds):
        for k, runner in (("p", plain), ("b", blocks)):
            c0 = time.process_time()
            wall[k].append(runner.step_s(ITERATIONS))
            cpu[k].append((time.process_time() - c0) / ITERATIONS)
    p_s, b_s = statistics.median(wall["p"]), statistics.median(wall["b"])
    p_c, b_c = statistics.median(cpu["p"]), statistics.median(cpu["b"])
    return {"backend": backend, "plan": placement, "variant": "plain_blockwise", "rounds": rounds,
            "ops_per_step": round(ops, 1), "plain_step_ms": round(p_s * 1e3, 3),
            "executor_step_ms": round(b_s * 1e3, 3), "ratio": round(p_s / b_s, 3),
            "executor_op_us": round(max(0.0, (b_s - p_s) / ops * 1e6), 1),
            "plain_cpu_ms": round(p_c * 1e3, 3), "executor_cpu_ms": round(b_c * 1e3, 3),
            "executor_op_cpu_us": round(max(0.0, (b_c - p_c) / ops * 1e6), 1),
            "paired_op_us": round(paired_op_us(wall["b"], wall["p"], ops), 1),
            "paired_op_cpu_us": round(paired_op_us(cpu["b"], cpu["p"], ops), 1)}


def calibrated(backend: str, rounds: int = 3):
    """This box's profile (BOX_PROFILE) with the executor's fixed costs as `tierflow calibrate` measures them
    now on `backend` (executor_costs.measure_executor_costs: its own plans of tiny ops, not this benchmark's;
    profile_builder.executor_cost_fields), and the measurements."""
    from tierflow.executor.calibration.executor_costs import measure_executor_costs
    from tierflow.executor.calibration.profile_builder import executor_cost_fields
    from tierflow.hwprofiles import load_profile

    bare = load_profile(str(BOX_PROFILE)).with_overrides({k: None for k in FIXED_FIELDS})
    device = "cpu" if backend == "cpu" else "cpu-adversarial"
    ex = measure_executor_costs(bare, device, None, dispatch_rounds=rounds, op_rounds=max(2, rounds + 1))
    return bare, bare.with_overrides(executor_cost_fields(ex)), ex


FIXED_FIELDS = ("gpu.op_overhead_us", "gpu.moved_op_overhead_us", "gpu.graph_launch_us", "pcie.latency_us",
                "ssd.latency_us", "cpu.executor_op_us")


def modelled(bare, hw, placement: str, measured_ms: float, cpu_ms: float, graphs: bool = False) -> dict:
    """The simulator's step of the plan of tiny ops, bare and on the calibrated profile `hw` (with `graphs`:
    its capture segments one op each, planner/core/capture.py), against the measured step's wall time and
    its best round's CPU time (what a shared box does not inflate; calibrate's fields are CPU time on a CPU
    device: executor/calibration/op_costs.py)."""
    from tierflow.executor.calibration.dispatch import predicted_step_s

    bare_ms = predicted_step_s("cpu", placement, bare, graphs) * 1e3
    pred_ms = predicted_step_s("cpu", placement, hw, graphs) * 1e3
    g = hw.gpu
    return {"cal_executor_op_us": round(hw.cpu.executor_op_us or 0.0, 1),
            "cal_op_overhead_us": round(g.op_overhead_us or 0.0, 1),
            "cal_moved_op_us": round(g.moved_op_overhead_us or 0.0, 1),
            "cal_graph_launch_us": round(g.graph_launch_us, 1) if g.graph_launch_us is not None else "",
            "predicted_bare_ms": round(bare_ms, 3), "predicted_ms": round(pred_ms, 3),
            "measured_vs_predicted": round(measured_ms / pred_ms, 3),
            "cpu_vs_predicted": round(cpu_ms / pred_ms, 3)}


HELD_OUT = (4, 3, 16)  # layers, micro-batches, tokens each: a plan of tiny ops no fit has seen


def step_ms(backend: str, plan, rounds: int, graphs: bool = False) -> tuple[float, float]:
    """The executor's step on `plan`, with or without its capture segments as graphs: the median over
    `rounds` rounds of their wall time per step (as measure_dispatch times it) and the best round's CPU time
    per step (ms)."""
    import statistics

    from tierflow.executor.calibration.op_costs import ITERATIONS, CalRun

    run = CalRun(plan, make_backend(backend), cuda_graphs=graphs, clock=False)
    wall, cpu = [], []
    for r in range(rounds):
        c0 = time.process_time()
        wall.append(run.round_trace(r).wall_s / ITERATIONS)
        cpu.append((time.process_time() - c0) / ITERATIONS)
    return statistics.median(wall) * 1e3, min(cpu) * 1e3


def graph_row(backend: str, bare, hw, rounds: int) -> dict:
    """The plan of tiny ops on the device with its capture segments replayed as graphs (the emulation),
    beside the same plan eager, measured in the same call; the model's step with graphs."""
    from tierflow.executor.calibration.dispatch import tiny_plan

    plan = tiny_plan("cpu", "on_device")
    eager, graphed = [], []
    for _ in range(2):  # alternating, each half of the rounds
        eager.append(step_ms(backend, plan, max(1, rounds // 2)))
        graphed.append(step_ms(backend, plan, max(1, rounds // 2), graphs=True))
    ms, cpu_ms = min(m for m, _ in graphed), min(c for _, c in graphed)
    row = {"backend": backend, "plan": "on_device", "variant": "graphs", "rounds": rounds,
           "executor_step_ms": round(ms, 3), "executor_cpu_best_ms": round(cpu_ms, 3),
           "eager_step_ms": round(min(m for m, _ in eager), 3)}
    row.update(modelled(bare, hw, "on_device", ms, cpu_ms, graphs=True))
    return row


def held_out_row(backend: str, placement: str, bare, hw, rounds: int) -> dict:
    """A plan of tiny ops of another shape (HELD_OUT) than calibrate's and this benchmark's: measured, and
    the simulator's step on the calibrated profile."""
    from tierflow.executor.calibration.op_costs import cal_graph, load_cal_plan
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.core.simulator import simulate_graph

    layers, mbs, seq = HELD_OUT
    plan = load_cal_plan(*cal_graph(bare, placement, seq, mbs, layers))
    ms, cpu_ms = step_ms(backend, plan, rounds)

    def sim_ms(profile) -> float:
        model, prof, cfg = cal_graph(profile, placement, seq, mbs, layers)
        return simulate_graph(build_graph(model, prof, cfg), prof).iteration_s * 1e3

    pred = sim_ms(hw)
    return {"backend": backend, "plan": f"{placement} {layers}x64 {mbs}mb {seq}tok", "variant": "held_out",
            "rounds": rounds, "executor_step_ms": round(ms, 3), "executor_cpu_best_ms": round(cpu_ms, 3),
            "predicted_bare_ms": round(sim_ms(bare), 3), "predicted_ms": round(pred, 3),
            "measured_vs_predicted": round(ms / pred, 3), "cpu_vs_predicted": round(cpu_ms / pred, 3)}


def run(quick: bool, out_dir: Path, rounds: int | None = None) -> list[dict]:
    import torch
    from expcommon import headline

    rounds = rounds or (2 if quick else 20)
    placements = ("on_device",) if quick else ("on_device", "checkpoints_host")
    extra = 1 + (0 if quick else len(placements))  # per backend: calibrate, the held-out plans
    # + the emulation's graphs row, the plain CPU's block-by-block rows
    prog = Progress(len(BACKENDS) * (extra + len(placements) * len(VARIANTS)) + 1 + 2 * len(placements),
                    "bench_dispatch")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows, op_rows = [], []
    for backend in BACKENDS:
        prog.step(f"{backend}: calibrate")
        bare, hw, _ = calibrated(backend, 1 if quick else 3)
        for placement in placements:
            for variant in VARIANTS:
                prog.step(f"{backend} {placement} {variant}")
                rows.append(measure(backend, placement, variant, rounds))
            direct = rows[-len(VARIANTS)]
            direct.update(modelled(bare, hw, placement, direct["executor_step_ms"],
                                   direct["executor_cpu_best_ms"]))
        if backend == "cpu":
            for placement in placements:
                prog.step(f"{backend} {placement} plain_blockwise")
                rows.append(blockwise(backend, placement, rounds))
                prog.step(f"{backend} {placement} per-op handlers")
                op_rows += per_op(placement, rounds)
        if backend != "cpu":
            prog.step(f"{backend} on_device graphs")
            rows.append(graph_row(backend, bare, hw, rounds))
        for placement in () if quick else placements:
            prog.step(f"{backend} {placement} held-out plan")
            rows.append(held_out_row(backend, placement, bare, hw, max(2, rounds // 2)))
    prog.finish()
    for r in rows:
        r.update(threads=torch.get_num_threads(), load=round(load, 2),
                 load_end=round(os.getloadavg()[0], 2), run_s=round(time.perf_counter() - t0, 1))
    for r in op_rows:
        r.update(threads=torch.get_num_threads(), load=round(load, 2))
    write_csv(rows, out_dir / "bench_dispatch.csv")
    write_csv(op_rows, out_dir / "bench_dispatch_ops.csv")
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, DOC_TABLE, dispatch_table(rows))
        write_generated_block(DOC, DOC_TABLE_OPS, ops_table(op_rows))
    print_table(rows, ["backend", "plan", "variant", "plain_step_ms", "executor_step_ms", "executor_op_us",
                       "paired_op_cpu_us", *[f"{p}_us" for p in PARTS], "predicted_bare_ms", "predicted_ms",
                       "measured_vs_predicted", "cpu_vs_predicted"])
    if op_rows:
        print_table(op_rows, ["plan", "kind", "block", "per_step", "executor_us", "blockwise_us",
                              "beyond_us"])
        for placement in dict.fromkeys(r["plan"] for r in op_rows):
            mine = [r for r in op_rows if r["plan"] == placement]
            print(f"{placement}: the handlers add {handlers_beyond_us(mine):.1f} us per op beyond the "
                  "block-by-block loop (thread CPU time)")
    best = [r for r in rows if r["variant"] == "direct"]
    return [headline("bench_dispatch", f"executor cost per op, {r['backend']} {r['plan']}",
                     r["executor_op_us"], None, "us") for r in best]


def ops_table(rows: list[dict]) -> str:
    """docs/executor.md's table of bench_dispatch_ops.csv: per plan and op (kind, block) the handler's and the
    loop's thread CPU time, and per plan what the handlers add per op."""
    header = ["plan", "op (kind, block)", "per step", "executor us", "block-by-block loop us", "beyond us"]
    body = []
    for placement in dict.fromkeys(r["plan"] for r in rows):
        mine = [r for r in rows if r["plan"] == placement]
        for r in mine:
            block = "all" if int(r["block"]) == ALL_BLOCKS else r["block"]
            body.append([placement, f"{r['kind']} {block}", _cell(r["per_step"], "{:g}"),
                         _cell(r["executor_us"]), _cell(r["blockwise_us"]), _cell(r["beyond_us"])])
        body.append([placement, "**per op of a step**", "", "", "",
                     f"**{handlers_beyond_us(_numeric(mine)):.1f}**"])
    return markdown_table(header, body)


def _numeric(rows: list[dict]) -> list[dict]:
    """Rows as read back from the CSV (strings) with handlers_beyond_us's fields as numbers."""
    out = []
    for r in rows:
        beyond = r["beyond_us"]
        out.append({**r, "beyond_us": float(beyond) if beyond not in ("", None) else "",
                    "per_step": float(r["per_step"]), "ops_per_step": float(r["ops_per_step"])})
    return out


def _cell(x, fmt: str | None = None) -> str:
    """A number as the table shows it: 3 significant digits, whole numbers from 1000 on."""
    if x in (None, ""):
        return ""
    x = float(x)
    return (fmt or ("{:.0f}" if abs(x) >= 1000 else "{:.3g}")).format(x)


def dispatch_table(rows: list[dict]) -> str:
    """docs/executor.md's table of bench_dispatch.csv: per backend, plan and variant the steps (wall and CPU
    time), the cost per op and its parts, and the model's step beside the measured one."""
    header = ["backend", "plan", "variant", "ops/step", "plain ms/step", "executor ms/step", "executor us/op",
              "CPU ms/step plain / executor", "executor CPU us/op", "paired CPU us/op", "hand-off", "events",
              "launch", "trace",
              "handler", "loop", "predicted ms (bare / model)", "measured / predicted",
              "best CPU / predicted", "load"]
    body = []
    for r in rows:
        pred = (f"{_cell(r.get('predicted_bare_ms'))} / {_cell(r.get('predicted_ms'))}"
                if r.get("predicted_ms") not in (None, "") else "")
        cpu = (f"{_cell(r['plain_cpu_ms'])} / {_cell(r['executor_cpu_ms'])}"
               if r.get("plain_cpu_ms") not in (None, "") else "")
        body.append([r["backend"], r["plan"], r["variant"], _cell(r.get("ops_per_step"), "{:g}"),
                     _cell(r.get("plain_step_ms")), _cell(r["executor_step_ms"]),
                     _cell(r.get("executor_op_us")), cpu, _cell(r.get("executor_op_cpu_us")),
                     _cell(r.get("paired_op_cpu_us")), *[_cell(r.get(f"{p}_us")) for p in PARTS], pred,
                     _cell(r.get("measured_vs_predicted"), "{:.2f}"),
                     _cell(r.get("cpu_vs_predicted"), "{:.2f}"), _cell(r["load"], "{:.2f}")])
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per variant (default 20; --quick 2)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        print(f"bench_dispatch: --rounds {args.rounds}: must be at least 1", file=sys.stderr)
        sys.exit(2)
    run(args.quick, args.out, args.rounds)


if __name__ == "__main__":
    sys.exit(script_main(main))
