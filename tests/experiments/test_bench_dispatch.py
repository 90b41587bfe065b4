"""experiments/bench_dispatch.py --quick: the executor's cost per op and its parts on the plain CPU backend
and the emulation of CUDA, and the simulator's step with and without the per-op fields. Structure only: no
timing assertions (the figures live in the script's results)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("handoff", "events", "launch", "trace", "handler", "loop")


def test_bench_dispatch_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_dispatch.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "bench_dispatch.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["backend"], r["plan"], r["variant"]) for r in rows} == {
        (b, "on_device", v) for b in ("cpu", "cpu-adversarial") for v in ("direct", "per_op_leaves")} | {
        ("cpu-adversarial", "on_device", "graphs"), ("cpu", "on_device", "plain_blockwise")}
    graphs = [r for r in rows if r["variant"] == "graphs"]
    # the emulation's graphs: measured beside the same plan eager, and the model's step with graphs (the
    # replay's measured costs in place of the per-op ones)
    assert float(graphs[0]["executor_step_ms"]) > 0 and float(graphs[0]["eager_step_ms"]) > 0
    assert float(graphs[0]["predicted_ms"]) > 0 and graphs[0]["cal_graph_launch_us"] != ""
    # the model against the best round's CPU time too (what a shared box does not inflate)
    assert float(graphs[0]["executor_cpu_best_ms"]) > 0 and float(graphs[0]["cpu_vs_predicted"]) > 0
    # plain PyTorch block by block (no executor): its steps, and the decomposition's cost per op
    blockwise = [r for r in rows if r["variant"] == "plain_blockwise"][0]
    assert float(blockwise["plain_cpu_ms"]) > 0 and float(blockwise["executor_cpu_ms"]) > 0
    assert float(blockwise["executor_op_cpu_us"]) >= 0 and blockwise["handler_us"] == ""
    for r in rows:
        if r["variant"] in ("graphs", "plain_blockwise"):
            continue
        assert float(r["plain_step_ms"]) > 0 and float(r["executor_step_ms"]) > 0
        assert float(r["ops_per_step"]) > 0 and float(r["executor_op_us"]) >= 0
        assert all(float(r[f"{p}_us"]) >= 0 for p in PARTS)
        assert float(r["handler_us"]) > 0
        # only the emulation has streams: events and launches are the engine's there, none on a plain CPU
        assert (float(r["events_us"]) > 0) == (r["backend"] == "cpu-adversarial")
        modelled = r["variant"] == "direct"
        assert bool(r["predicted_ms"]) == modelled
        if modelled:  # the per-op fields add to the bare prediction
            assert float(r["predicted_ms"]) >= float(r["predicted_bare_ms"]) > 0
            assert float(r["cpu_vs_predicted"]) == pytest.approx(
                float(r["executor_cpu_best_ms"]) / float(r["predicted_ms"]), rel=0.01)
    assert "executor_op_us" in out.stdout
    # the paired estimate (the median of each round's difference): on every measured row, a number
    for r in rows:
        if r["variant"] != "graphs":
            float(r["paired_op_us"]), float(r["paired_op_cpu_us"])
    # each compute op's handler against the loop's same piece, and the optimizer ops against one AdamW step
    with open(tmp_path / "bench_dispatch_ops.csv", newline="") as f:
        ops = list(csv.DictReader(f))
    kinds = {(r["kind"], int(r["block"])) for r in ops}
    want = {("fwd", 0), ("fwd", 1), ("fwd", 2), ("head", 3), ("bwd", 0), ("bwd", 2), ("adam_gpu", -1)}
    assert want <= kinds
    for r in ops:
        assert float(r["executor_us"]) > 0
        if r["kind"] in ("fwd", "bwd", "head"):
            assert float(r["blockwise_us"]) > 0
            assert float(r["beyond_us"]) == pytest.approx(
                float(r["executor_us"]) - float(r["blockwise_us"]), abs=0.2)
    assert "us per op beyond the block-by-block loop" in out.stdout


def test_bench_dispatch_refuses_a_bad_rounds_count(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_dispatch.py"), "--rounds", "0",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
