"""Data-parallel training with the executor on torch.distributed: the full variant of
tests/executor/test_dist_executor.py, on the CPU with gloo.

    python experiments/dist_executor.py [--quick] [--out DIR]

1. Equivalence: tiny-gpt and tiny-llama x {horizontal, fuyou, vertical, block} x {device (GPU optimizer),
   weights_cpu, states_ssd, ckpt_ssd, mix} on 2 ranks (batch 4) and 3 ranks (batch 6: every block's shards of
   unequal size), each against 1 rank training the whole batch: the largest relative error of the losses, of
   the final fp32 weights and of Adam's m over the blocks (target <= 1e-5). One torchrun launch per world
   size.
2. kill -9: `tierflow run plan.json --nproc 2 --checkpoint-every 1` with optimizer states on the SSD; one rank
   is killed with SIGKILL once the checkpoint of step 3 exists (torchrun then stops the other rank); the same
   command resumes from the last complete checkpoint. Its losses after the resume must equal those of an
   uninterrupted run (bit for bit on the CPU).
Writes dist_executor.csv and dist_executor.md under --out (default experiments/results). --quick: tiny-gpt,
two families and two placements per world size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from expcommon import arg_parser, script_main, write_csv  # noqa: E402
from support.dist_worker import BATCH, OPTIMIZER, make_plan  # noqa: E402

from tierflow.executor.run import OutputOptions, RunConfig, run_plan  # noqa: E402
from tierflow.planner.io.planfile import write_plan  # noqa: E402

FAMILIES = ("horizontal", "fuyou", "vertical", "block")
PLACEMENTS = ("device", "weights_cpu", "states_ssd", "ckpt_ssd", "mix")
STEPS = 3


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent / "tests"))
    env.pop("WORLD_SIZE", None)
    return env


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def equivalence(ranks: int, cases: list[tuple[str, str, str]], tmp: Path) -> list[dict]:
    batch = BATCH if ranks == 2 else 2 * ranks
    out = tmp / f"out{ranks}"
    out.mkdir()
    spec = [{"name": f"{m}-{f}-{p}", "model": m, "family": f, "placement": p, "steps": STEPS, "batch": batch,
             "ssd_dir": str(tmp / "ssd")} for m, f, p in cases]
    (tmp / f"cases{ranks}.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(HERE.parent / "tests" / "support" / "dist_worker.py"),
                           str(tmp / f"cases{ranks}.json"), str(out)], capture_output=True, text=True,
                          env=_env())
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dist_executor: the {ranks}-rank launch failed:\n{proc.stderr[-3000:]}")
    rows = []
    (tmp / "ssd1").mkdir(exist_ok=True)
    for m, f, p in cases:
        got = torch.load(out / f"{m}-{f}-{p}.pt")
        want = run_plan(make_plan(m, f, p, gpus=1, batch=batch),
                        RunConfig(steps=STEPS, device="cpu", ssd_dir=str(tmp / "ssd1"), optimizer=OPTIMIZER,
                                  output=OutputOptions(quiet=True, collect_final=True)))
        rows.append({
            "ranks": ranks, "batch": batch, "model": m, "family": f, "placement": p,
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want.losses)),
            "weights_rel_err": max(rel_err(a, b) for a, b in zip(got["final"], want.final_master)),
            "adam_m_rel_err": max(rel_err(a, b) for a, b in zip(got["adam_m"], want.final_adam_m)),
            "launch_wall_s": wall_s,
        })
        print(f"  {ranks} ranks {m:9s} {f:10s} {p:11s} losses {rows[-1]['loss_rel_err']:.1e}  weights "
              f"{rows[-1]['weights_rel_err']:.1e}  adam m {rows[-1]['adam_m_rel_err']:.1e}", flush=True)
    return rows


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def kill9_resume(tmp: Path, steps: int = 6) -> dict:
    """One rank killed with SIGKILL after the checkpoint of step 3; the resumed run against an uninterrupted
    one."""
    plan = tmp / "plan.json"
    write_plan(make_plan("tiny-gpt", "vertical", "states_ssd", gpus=2), plan)
    (tmp / "ssdk").mkdir()

    def cmd(ck: Path) -> list[str]:
        return [sys.executable, "-m", "tierflow", "run", str(plan), "--nproc", "2", "--device", "cpu",
                "--steps", str(steps), "--ssd-dir", str(tmp / "ssdk"), "--checkpoint-dir", str(ck),
                "--checkpoint-every", "1", "--json"]

    straight = subprocess.run(cmd(tmp / "ck_straight"), capture_output=True, text=True, env=_env())
    assert straight.returncode == 0, straight.stderr[-2000:]
    want = [s["loss"] for s in json.loads(straight.stdout)["steps"]]
    ck = tmp / "ck"
    launcher = subprocess.Popen(cmd(ck), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env())
    while not (ck / "step00000003").is_dir() and launcher.poll() is None:
        time.sleep(0.02)
    workers = _children(launcher.pid)
    victim = workers[-1] if workers else None
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    _out, err = launcher.communicate(timeout=300)
    killed_rc = launcher.returncode
    resumed = subprocess.run(cmd(ck), capture_output=True, text=True, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rep = json.loads(resumed.stdout)
    got = [s["loss"] for s in rep["steps"]]
    first = rep["first_step"]
    return {"killed_pid": victim, "launcher_exit": killed_rc, "resumed_from_step": first,
            "losses_equal": got == want[first:], "steps_after_resume": len(got),
            "stderr_of_killed_run": " | ".join(x for x in err.splitlines()
                                               if x.startswith("tierflow run"))[:300]}


def run(quick: bool, out_dir: Path) -> list[dict]:
    models = ("tiny-gpt",) if quick else ("tiny-gpt", "tiny-llama")
    families = ("horizontal", "vertical") if quick else FAMILIES
    placements = ("states_ssd", "device") if quick else PLACEMENTS
    cases = [(m, f, p) for m in models for f in families for p in placements]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierflow-dist-") as d:
        for ranks in (2, 3):
            print(f"equivalence, {ranks} ranks ({len(cases)} cases)", flush=True)
            rows += equivalence(ranks, cases, Path(d))
        print("kill -9 of one rank, then resume", flush=True)
        k = kill9_resume(Path(d))
    print(f"  launcher exit {k['launcher_exit']} after SIGKILL of rank pid {k['killed_pid']}; resumed from "
          f"step {k['resumed_from_step']}, {k['steps_after_resume']} steps, losses equal to the "
          f"uninterrupted run's: {k['losses_equal']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "dist_executor.csv")
    worst = {key: max(r[key] for r in rows) for key in ("loss_rel_err", "weights_rel_err", "adam_m_rel_err")}
    lines = ["| ranks | model | family | placement | losses | fp32 weights | Adam m |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['model']} | {r['family']} | {r['placement']} | {r['loss_rel_err']:.1e} | "
              f"{r['weights_rel_err']:.1e} | {r['adam_m_rel_err']:.1e} |" for r in rows]
    lines += ["", f"Largest relative errors against 1 rank: losses {worst['loss_rel_err']:.1e}, weights "
              f"{worst['weights_rel_err']:.1e}, Adam m {worst['adam_m_rel_err']:.1e} (target 1e-5).", "",
              "kill -9 of one of 2 ranks after the checkpoint of step 3: the launcher exited "
              f"{k['launcher_exit']}; the same command resumed from step {k['resumed_from_step']} and its "
              f"{k['steps_after_resume']} losses {'equal' if k['losses_equal'] else 'DIFFER FROM'} the "
              "uninterrupted run's."]
    (out_dir / "dist_executor.md").write_text("\n".join(lines) + "\n")
    print(f"wrote dist_executor.csv, dist_executor.md under {out_dir}")
    return rows


if __name__ == "__main__":
    args = arg_parser(__doc__).parse_args()
    sys.exit(script_main(lambda: run(args.quick, Path(args.out))))
