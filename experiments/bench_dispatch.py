"""The executor's host cost per op, split into its parts, measured and modelled; no GPU needed.

    python experiments/bench_dispatch.py [--quick] [--rounds N] [--out DIR]

1. **Measured.** A plan of tiny ops (a 2 x 64 model at micro-batches of 1 x 8 tokens:
   executor/calibration/dispatch.py) is run by the real engine (executor/engine.py) on the plain CPU backend
   and on the adversarial CUDA emulation (its random delays off: executor/device/emulated.py), alternating
   round by round with plain PyTorch stepping the same model. Per op: the executor's cost
   (`executor_op_us` = (executor step - plain step) / ops per step) and its parts from the engine with clocks
   (hand-off between workers, event record / wait / synchronize, stream launch, trace recording, the
   handler, the rest of the worker's loop). Two plans: every tensor on the device, and the checkpoints in
   host memory (offload and fetch ops: hand-offs between the gpu, d2h and h2d workers).
2. **Cut.** `variant` per_op_leaves is the compute ops' way before the persistent parameters: an autograd
   leaf made per parameter per call and put into the block's module for the call, and every saved tensor of a
   kept layer through the pack's hooks; against `direct` (ops/params.py: resident weights' leaves made once,
   installed in the executor's copy of the module; a pack no op moves left to autograd): the same numerics,
   alternating in the same rounds.
3. **Modelled.** The simulator's step for the same plan on this box's profile
   (experiments/results/bench_executor_box.yaml, calibrated here) without per-op costs (`predicted_bare_ms`)
   and with the fixed costs calibrate measures now on this backend (`predicted_ms`: cpu.executor_op_us on
   every op, gpu.op_overhead_us and pcie.latency_us the rest of their ops' fixed cost, from calibrate's own
   tiny plan, a different plan from this one).

Writes bench_dispatch.csv under --out (with the default --out also the generated table of
docs/executor.md). --quick: two rounds, the on-device plan only (a CI test runs it for structure).
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
PARTS = ("handoff", "events", "launch", "trace", "handler", "loop")


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
           "executor_op_cpu_us": round(r.executor_op_cpu_us, 1)}
    row.update({f"{p}_us": round(r.parts_us[p], 1) for p in PARTS})
    return row


def modelled(backend: str, placement: str, measured_ms: float, rounds: int = 3) -> dict:
    """The simulator's step of the plan on this box's profile, bare and with the fixed costs calibrate
    measures on `backend` now (profile_builder's split: the executor's own cost on every op, the rest per
    resource)."""
    from tierflow.executor.calibration.dispatch import predicted_step_s
    from tierflow.executor.calibration.executor_costs import measure_executor_costs
    from tierflow.hwprofiles import load_profile

    bare = load_profile(str(BOX_PROFILE)).with_overrides(
        {"gpu.op_overhead_us": None, "pcie.latency_us": None, "ssd.latency_us": None,
         "cpu.executor_op_us": None})
    device = "cpu" if backend == "cpu" else "cpu-adversarial"
    ex = measure_executor_costs(bare, device, None, dispatch_rounds=rounds)
    own = ex["executor_op_us"]
    fields = {"cpu.executor_op_us": own,
              "gpu.op_overhead_us": max(0.0, (ex["op_overhead_us"] or 0.0) - own),
              "pcie.latency_us": max(0.0, (ex["pcie_latency_us"] or 0.0) - own)}
    bare_ms = predicted_step_s("cpu", placement, bare) * 1e3
    pred_ms = predicted_step_s("cpu", placement, bare.with_overrides(fields)) * 1e3
    return {"cal_executor_op_us": round(own, 1), "cal_op_overhead_us": round(fields["gpu.op_overhead_us"], 1),
            "predicted_bare_ms": round(bare_ms, 3), "predicted_ms": round(pred_ms, 3),
            "measured_vs_predicted": round(measured_ms / pred_ms, 3)}


def run(quick: bool, out_dir: Path, rounds: int | None = None) -> list[dict]:
    import torch
    from expcommon import headline

    rounds = rounds or (2 if quick else 10)
    placements = ("on_device",) if quick else ("on_device", "checkpoints_host")
    cases = [(b, p) for b in BACKENDS for p in placements]
    prog = Progress(len(cases) * (len(VARIANTS) + 1), "bench_dispatch")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = []
    for backend, placement in cases:
        for variant in VARIANTS:
            prog.step(f"{backend} {placement} {variant}")
            rows.append(measure(backend, placement, variant, rounds))
        prog.step(f"{backend} {placement}: the model")
        rows[-2].update(modelled(backend, placement, rows[-2]["executor_step_ms"], 1 if quick else 3))
    prog.finish()
    for r in rows:
        r.update(threads=torch.get_num_threads(), load=round(load, 2),
                 run_s=round(time.perf_counter() - t0, 1))
    write_csv(rows, out_dir / "bench_dispatch.csv")
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, DOC_TABLE, dispatch_table(rows))
    print_table(rows, ["backend", "plan", "variant", "plain_step_ms", "executor_step_ms", "executor_op_us",
                       *[f"{p}_us" for p in PARTS], "predicted_bare_ms", "predicted_ms"])
    best = [r for r in rows if r["variant"] == "direct"]
    return [headline("bench_dispatch", f"executor cost per op, {r['backend']} {r['plan']}",
                     r["executor_op_us"], None, "us") for r in best]


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
              "CPU ms/step plain / executor", "executor CPU us/op", "hand-off", "events", "launch", "trace",
              "handler", "loop", "predicted ms (bare / model)", "load"]
    body = []
    for r in rows:
        pred = (f"{_cell(r.get('predicted_bare_ms'))} / {_cell(r.get('predicted_ms'))}"
                if r.get("predicted_ms") not in (None, "") else "")
        cpu = f"{_cell(r['plain_cpu_ms'])} / {_cell(r['executor_cpu_ms'])}"
        body.append([r["backend"], r["plan"], r["variant"], _cell(r["ops_per_step"], "{:g}"),
                     _cell(r["plain_step_ms"]), _cell(r["executor_step_ms"]), _cell(r["executor_op_us"]), cpu,
                     _cell(r["executor_op_cpu_us"]), *[_cell(r[f"{p}_us"]) for p in PARTS], pred,
                     _cell(r["load"], "{:.2f}")])
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=None, help="rounds per variant (default 10; --quick 2)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        print(f"bench_dispatch: --rounds {args.rounds}: must be at least 1", file=sys.stderr)
        sys.exit(2)
    run(args.quick, args.out, args.rounds)


if __name__ == "__main__":
    sys.exit(script_main(main))
