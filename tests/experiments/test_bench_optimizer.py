"""experiments/bench_optimizer.py --quick: the executor's adam op against fused AdamW at two small sizes, into
a temporary folder; checks the CSV's rows and columns and the docs table it renders. No timing assertions:
the target lives in the script."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_optimizer  # noqa: E402

COLUMNS = {"params", "threads", "variant", "reps", "median_s", "min_s", "max_s", "gparams_per_s", "vs_fused",
           "vs_fused_min", "vs_fused_max", "target", "met"}


def test_bench_optimizer_quick(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_optimizer.py"), "--quick",
                          "--threads", "1", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "bench_optimizer.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert COLUMNS <= set(rows[0])
    points = {(int(r["params"]), int(r["threads"]), r["variant"]) for r in rows}
    assert points == {(n, t, v) for n in bench_optimizer.QUICK_SIZES for t in (1, 2)
                      for v in ("executor", "fused", "fused_cast")}
    for r in rows:
        assert int(r["reps"]) == bench_optimizer.QUICK_REPS
        assert 0 < float(r["min_s"]) <= float(r["median_s"]) <= float(r["max_s"])
        assert float(r["gparams_per_s"]) > 0
        if r["variant"] == "executor":
            assert float(r["vs_fused_min"]) <= float(r["vs_fused"]) <= float(r["vs_fused_max"])
            assert r["met"] == ("yes" if float(r["vs_fused"]) >= float(r["target"]) else "no")
            assert float(r["vs_same_job_min"]) <= float(r["vs_same_job"]) <= float(r["vs_same_job_max"])
        elif r["variant"] == "fused":
            assert float(r["vs_fused"]) == 1.0 and r["met"] == ""
        else:
            assert float(r["vs_fused_min"]) <= float(r["vs_fused"]) <= float(r["vs_fused_max"])
    table = bench_optimizer.optimizer_table(rows)
    assert table.count("\n") == 2 + 2 * len(bench_optimizer.QUICK_SIZES) - 1  # header, rule, a row per point
    assert "fused AdamW + cast" in table and table.splitlines()[2].split("|")[5].strip() != "-"


def test_the_executor_variant_is_the_executors_own_op():
    """HostAdamOp steps the executor's `adam` op: its master, moments and compute weights move as fused
    AdamW's would from the same state, its gradients are left as they were (the next step's first gradient
    write overwrites them: executor/ops/grads.py)."""
    import torch

    from tierflow.executor.calibration.optimizer_op import HostAdamOp

    op = HostAdamOp(5000)
    ref = {k: getattr(op, k).clone() for k in ("master", "grads", "m", "v")}
    op.step()
    p = torch.nn.Parameter(ref["master"])
    p.grad = ref["grads"]
    h = op.hyper
    opt = torch.optim.AdamW([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                            fused=True)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": ref["m"], "exp_avg_sq": ref["v"]}
    opt.step()
    assert torch.equal(op.master, p.detach()) and torch.equal(op.m, ref["m"]) and torch.equal(op.v, ref["v"])
    assert torch.equal(op.weights, p.detach().to(op.weights.dtype))
    assert torch.equal(op.grads, ref["grads"]) and op.grads.any()
    assert op.norms.value(1) is not None  # the step's gradient norm, as a run logs it
