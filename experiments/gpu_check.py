"""The GPU check: one command that runs tierflow's CUDA paths end to end on a CUDA box and keeps everything it
saw in one results folder, with a summary.

    python experiments/gpu_check.py [--quick] [--device cuda|cuda:N|cpu-adversarial] [--ssd-dir DIR]
                                    [--model NAME] [--hw PROFILE] [--out DIR]

Each step is a subprocess (a crash or an out-of-memory in one does not end the check); its command line, exit
code, wall time, stdout and stderr are kept under --out (`NN-step.out` / `NN-step.err`):

1. **env**: `tierflow env --ssd-dir DIR --json` (versions, CUDA and the GPUs, O_DIRECT, pinned-memory limits).
2. **calibrate**: `tierflow calibrate --device cuda --ssd-dir DIR -o box.yaml` (skipped with --hw PROFILE).
3. **plan**: `tierflow plan` of GPT-3 2.7B shapes (batch 8, seq 2048) on the calibrated profile with the GPU
   memory capped at 1.5 bytes per parameter (below the bf16 weights alone, so weights and optimizer states
   cannot stay on the device) and host memory at 6 bytes per parameter (room for the fp32 gradients and part
   of the weights, not for the 12 bytes per parameter of fp32 master weights and Adam moments), so that the
   plan must stream weights and optimizer states from the SSD tier (on the bundled h100-80g profile: 28% of
   the weights and all of the states, about 34 GB on --ssd-dir). The summary shows where the plan put them.
4. **run**: `tierflow run plan.json --device cuda --ssd-dir DIR --out run --json` (one round: 3 steps).
5. **compare**: `tierflow compare plan.json run/trace.json --plot compare.png --json`.
6. **bench_store**: `experiments/bench_store.py --device cuda`: the SSD store reading into and writing from
   page-locked buffers (the transfer area's allocation), against the raw device.
7. **bench_executor**: `experiments/bench_executor.py --device cuda`: the executor against plain PyTorch.

summary.md puts the figures side by side (the plan's placement, predicted against measured, the run's device
memory against the cap, the store's and the executor's ratios). Exit code 0 when every step succeeded, 1 when
one failed (the summary says which and where its stderr is).

--device cpu-adversarial runs the same steps on the adversarial CPU emulation of a CUDA device (streams as
threads with random delays, late copies, an allocator that poisons freed blocks; executor/device/emulated.py):
the check of the check, which CI runs with --quick (tiny-gpt shapes, short measurements). Calibrate then
measures the CPU (`--device cpu`), and its timings mean nothing for a GPU.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from expcommon import RESULTS_DIR, arg_parser

from tierflow.errors import TierflowError

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = Path(__file__).resolve().parent
GIB = 2**30
GPU_BYTES_PER_PARAM = 1.5  # the device cap: below the bf16 weights (2 B/param), so they cannot all stay there
HOST_BYTES_PER_PARAM = 6.0  # fp32 grads (4) + part of the weights: neither states nor all weights fit
STEP_TIMEOUT_S = 3600
LOAD_AT_START = os.getloadavg()  # how busy the box was: other processes slow every timing of the check
STEPS = ("env", "calibrate", "plan", "run", "compare", "bench_store", "bench_executor")


@dataclass(frozen=True)
class Shapes:
    """What the check plans and runs, and how long its measurements take."""

    model: str
    batch: int
    seq: int
    steps: int
    plan_time_limit_s: int
    min_gpu_gib: float  # floors of the caps: a tiny model's working memory exceeds its bytes per parameter
    min_host_gib: float
    quick: bool


FULL = Shapes("gpt3-2.7b", batch=8, seq=2048, steps=3, plan_time_limit_s=60, min_gpu_gib=1.0,
              min_host_gib=4.0, quick=False)
QUICK = Shapes("tiny-gpt", batch=8, seq=64, steps=3, plan_time_limit_s=5, min_gpu_gib=0.02,
               min_host_gib=0.03, quick=True)


@dataclass
class Step:
    """One command of the check and what came of it."""

    name: str
    argv: list[str]
    needs: list[Path] = field(default_factory=list)  # files an earlier step must have written
    rc: int | None = None  # None: not run
    wall_s: float = 0.0
    why_skipped: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0


def tierflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "tierflow", *args]


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXPERIMENTS / name), *args]


def stem(out: Path, name: str) -> Path:
    """Where a step's stdout and stderr go: NN-name.out / .err, NN its place in STEPS (also with --skip)."""
    return out / f"{STEPS.index(name) + 1:02d}-{name}"


def run_step(step: Step, out: Path) -> Step:
    """Run one step with its stdout and stderr in files under `out`; skip it when an input is missing."""
    missing = [p for p in step.needs if not p.exists()]
    if missing:
        step.why_skipped = f"{missing[0].name} was not written by an earlier step"
        print(f"gpu_check: {step.name}: skipped ({step.why_skipped})", file=sys.stderr)
        return step
    path = stem(out, step.name)
    print(f"gpu_check: {step.name}: {' '.join(step.argv[1:])}", file=sys.stderr)
    t0 = time.perf_counter()
    with open(f"{path}.out", "w") as so, open(f"{path}.err", "w") as se:
        try:
            done = subprocess.run(step.argv, stdout=so, stderr=se, cwd=REPO, timeout=STEP_TIMEOUT_S)
            step.rc = done.returncode
        except subprocess.TimeoutExpired:
            step.rc = 124
            se.write(f"gpu_check: killed after {STEP_TIMEOUT_S} s\n")
    step.wall_s = time.perf_counter() - t0
    print(f"gpu_check: {step.name}: exit {step.rc} ({step.wall_s:.1f} s)", file=sys.stderr)
    return step


def caps(shapes: Shapes, profile: Path | str) -> dict[str, float]:
    """The plan's `--set` caps (GiB, reserved parts included) for the shapes' model on `profile`."""
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
    from tierflow.planner.core.models import get_model

    hw = load_profile(profile)
    params = get_model(shapes.model).total_params()
    # plus what the executor's CUDA runtime maps under the cap (cuBLAS workspaces, the allocator's pages) on
    # a GPU: a cap below it cannot be met (the quick check at 0.02 GiB, out of memory in op 7)
    gpu = (max(shapes.min_gpu_gib, GPU_BYTES_PER_PARAM * params / GIB)
           + runtime_gpu_reserve_bytes("ideal", 1, hw) / GIB)
    host = max(shapes.min_host_gib, HOST_BYTES_PER_PARAM * params / GIB)
    return {"gpu.memory_gib": round(hw.gpu.reserved_gib + gpu, 3),
            "cpu.memory_gib": round(hw.cpu.reserved_gib + host, 3)}


def plan_argv(shapes: Shapes, profile: Path | str, plan: Path) -> list[str]:
    sets = [a for k, v in caps(shapes, profile).items() for a in ("--set", f"{k}={v}")]
    return tierflow("plan", "--model", shapes.model, "--hw", str(profile), *sets,
                    "--batch", str(shapes.batch), "--seq", str(shapes.seq),
                    "--time-limit", str(shapes.plan_time_limit_s), "--no-baselines", "-o", str(plan),
                    "--json", "-q")


def bench_argv(shapes: Shapes, device: str, ssd: Path, out: Path,
               profile: Path | str | None = None) -> tuple[list[str], list[str]]:
    """bench_store's and bench_executor's command lines; a full bench_executor predicts its plans on `profile`
    (the box calibrated a step before) instead of calibrating the box again."""
    quick = ["--quick"] if shapes.quick else []
    hw = ["--hw", str(profile)] if profile and not shapes.quick and Path(profile).exists() else []
    store = script("bench_store.py", "--device", device, "--dir", str(ssd), "--out", str(out / "bench_store"),
                   *quick, *(["--reps", "1"] if shapes.quick else []))
    executor = script("bench_executor.py", "--device", device, "--ssd-dir", str(ssd / "bench_executor"),
                      "--out", str(out / "bench_executor"), *quick,
                      *(["--rounds", "2", "--models", "tiny"] if shapes.quick else []), *hw)
    return store, executor


def run_check(shapes: Shapes, device: str, ssd: Path, out: Path, hw: str | None,
              skip: tuple[str, ...] = ()) -> list[Step]:
    """Every step in order; a step whose inputs are missing is skipped, the others run whatever failed."""
    profile: Path | str = hw if hw else out / "box.yaml"
    plan, run_dir = out / "plan.json", out / "run"
    for sub in ("run", "bench_executor"):
        (ssd / sub).mkdir(exist_ok=True)
    cal_device = "cpu" if device.startswith("cpu") else "cuda"
    steps = [Step("env", tierflow("env", "--ssd-dir", str(ssd), "--json"))]
    if not hw and "calibrate" not in skip:
        quick = ["--quick", "--ssd-file-mib", "64"] if shapes.quick else []
        steps.append(Step("calibrate", tierflow("calibrate", "--device", cal_device, "--ssd-dir", str(ssd),
                                                "-o", str(profile), "--json", "-q", *quick)))
    done = [run_step(s, out) for s in steps if s.name not in skip]
    plan_step = Step("plan", [], why_skipped="no profile to plan on")
    if Path(profile).exists() or hw:
        try:
            plan_step.argv = plan_argv(shapes, profile, plan)
        except TierflowError as e:  # a profile or model that does not load: the plan step says why
            plan_step.why_skipped = str(e)
    later = [plan_step,
             Step("run", tierflow("run", str(plan), "--steps", str(shapes.steps), "--device", device,
                                  "--ssd-dir", str(ssd / "run"), "--out", str(run_dir), "--json"),
                  needs=[plan]),
             Step("compare", tierflow("compare", str(plan), str(run_dir / "trace.json"),
                                      "--plot", str(out / "compare.png"), "--json"),
                  needs=[plan, run_dir / "trace.json"])]
    later += [Step(name, argv) for name, argv in zip(("bench_store", "bench_executor"),
                                                      bench_argv(shapes, device, ssd, out, profile))]
    for s in later:
        if s.name in skip:
            s.why_skipped = "--skip"
        done.append(run_step(s, out) if s.argv and s.name not in skip else s)
    return done


# -- the summary ---------------------------------------------------------------------------------------------


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def steps_section(steps: list[Step], out: Path) -> list[str]:
    rows = []
    for s in steps:
        state = "ok" if s.ok else (f"skipped ({s.why_skipped})" if s.rc is None else
                                   f"**failed** (exit {s.rc}; see `{stem(out, s.name).name}.err`)")
        rows.append([s.name, state, f"{s.wall_s:.1f}", f"`{' '.join(_short(a, out) for a in s.argv[1:])}`"])
    return ["## Steps", "", *table(["step", "result", "wall s", "command"], rows), ""]


def _short(arg: str, out: Path) -> str:
    """A path under the results folder or the repository, relative to it (the summary reads the same on any
    box)."""
    for root, label in ((out, "OUT"), (REPO, ".")):
        if arg.startswith(str(root)):
            return label + arg[len(str(root)):]
    return arg


def env_section(env: dict) -> list[str]:
    v = env.get("versions", {})
    gpus = env.get("gpus") or []
    gpu = "; ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in gpus) or "none"
    ssd = env.get("ssd_dir", {})
    return ["## Machine", "",
            f"- tierflow {v.get('tierflow', '?')}, torch {v.get('torch', '?')}, "
            f"python {v.get('python', '?')}, {v.get('os', platform.platform())}",
            f"- CUDA: {env.get('cuda', '?')}; GPUs: {gpu}",
            f"- CPU: {env.get('cpu', '?')}, {env.get('cores_usable', '?')} usable cores, "
            f"{env.get('memory_bytes', 0) / GIB:.1f} GiB",
            f"- SSD directory: O_DIRECT {ssd.get('o_direct', '?')}, device {ssd.get('device', '?')}, "
            f"{ssd.get('free_bytes', 0) / 1e9:.1f} GB free", ""]


def plan_section(plan: dict) -> list[str]:
    if not plan:
        return ["## Plan", "", "No plan was written.", ""]
    d, cap = plan.get("decisions", {}), plan.get("capacity_bytes", {})
    place = d.get("placement", {})
    rows = [[k, *(f"{place[k].get(t, 0):.2f}" for t in ("gpu", "cpu", "ssd"))] for k in place]
    states = ("master", "adam_m", "adam_v")
    off_gpu = all(place.get(k, {}).get("gpu", 1) < 1 for k in ("weights", *states))
    on_ssd = all(place.get(k, {}).get("ssd", 0) > 0 for k in ("weights", *states))
    m = plan.get("model", {})
    pred = plan.get("predicted", {})
    return ["## Plan", "",
            f"{m.get('name')} ({m.get('num_layers')} x {m.get('hidden')}), {d.get('family')} schedule, "
            f"batch {d.get('batch')} in micro-batches of {d.get('micro_batch')}, seq {d.get('seq')}; usable "
            f"capacity GPU {cap.get('gpu', 0) / GIB:.2f} GiB, host {cap.get('cpu', 0) / GIB:.2f} GiB; "
            f"predicted {pred.get('iteration_s', float('nan')):.3f} s per iteration.", "",
            *table(["tensor class", "gpu", "cpu", "ssd"], rows), "",
            f"- weights and optimizer states beyond the GPU cap: {'yes' if off_gpu else '**no**'}; "
            f"on the SSD tier: {'yes' if on_ssd else '**no**'}", ""]


def run_section(run: dict, cmp: dict) -> list[str]:
    if not run:
        return ["## Run", "", "The run wrote no result.", ""]
    rows = [[s["step"], f"{s['loss']:.4f}", f"{s['step_s']:.3f}", f"{s['tokens_per_s']:,.0f}"]
            for s in run.get("steps", [])]
    meas = run.get("measured") or {}
    dev = meas.get("measured_device_memory") or {}
    lines = ["## Run", "", *table(["step", "loss", "s", "tokens/s"], rows), "",
             f"- SSD tier: {run.get('ssd_bytes_read', 0) / 1e9:.2f} GB read, "
             f"{run.get('ssd_bytes_written', 0) / 1e9:.2f} GB written, O_DIRECT {run.get('o_direct')}",
             f"- device memory: {dev.get('max_allocated_bytes', 0) / GIB:.3f} GiB allocated at most, "
             f"{dev.get('max_reserved_bytes', 0) / GIB:.3f} GiB reserved, against the plan's "
             f"{meas.get('capacity_bytes', {}).get('gpu', 0) / GIB:.3f} GiB"]
    if cmp:
        lines.append(f"- predicted {cmp['predicted_iteration_s']:.3f} s per iteration, measured "
                     f"{cmp['measured_iteration_s']:.3f} s ({cmp['iteration_error']:+.1%}); busy time per "
                     "resource, measured / predicted: " + ", ".join(
                         f"{r['resource']} {r['measured_busy_s']:.3f} / {r['predicted_busy_s']:.3f}"
                         for r in cmp.get("by_resource", [])))
    return [*lines, ""]


def bench_section(out: Path) -> list[str]:
    store = [r for r in _csv(out / "bench_store" / "bench_store.csv") if r["system"] == "store"]
    execu = _csv(out / "bench_executor" / "bench_executor.csv")
    lines = ["## Benchmarks", ""]
    if store:
        lines += ["bench_store (the store with page-locked buffers; GB/s, x the raw reference, CPU s/GB):",
                  "",
                  *table(["MiB", "mode", "GB/s", "x reference", "cpu s/GB", "target met"],
                         [[r["size_mib"], r["mode"], r["gbps"], r["vs_reference"], r["cpu_s_per_gb"],
                           r["met"] or "-"] for r in store]), ""]
    if execu:
        lines += ["bench_executor (plain PyTorch against tierflow run, s per step):", "",
                  *table(["model", "case", "plain s", "tierflow s", "ratio", "vs bound"],
                         [[r["model"], r["case"], r["plain_step_s"], r["tierflow_step_s"], r["ratio"],
                           r.get("vs_bound") or "-"] for r in execu]), ""]
    return lines


def write_summary(steps: list[Step], out: Path, device: str, shapes: Shapes) -> Path:
    emulated = device.startswith("cpu")
    head = [f"# GPU check ({'emulated: ' if emulated else ''}--device {device})", "",
            f"`python experiments/gpu_check.py{' --quick' if shapes.quick else ''} --device {device}`, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {platform.node()}. "
            f"{sum(s.ok for s in steps)} of {len(steps)} steps succeeded; load average (1 min) "
            f"{LOAD_AT_START[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.", ""]
    if emulated:
        head += ["On the adversarial CPU emulation of a CUDA device: this checks the check (every step runs "
                 "and every figure is collected); its timings say nothing about a GPU.", ""]
    body = [*steps_section(steps, out), *env_section(_json(out / "01-env.out")),
            *plan_section(_json(out / "plan.json")),
            *run_section(_json(Path(f"{stem(out, 'run')}.out")), _json(Path(f"{stem(out, 'compare')}.out"))),
            *bench_section(out)]
    path = out / "summary.md"
    path.write_text("\n".join(head + body))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--device", default="cuda",
                    help="cuda (default), cuda:N, or cpu-adversarial (the emulation)")
    ap.add_argument("--ssd-dir", type=Path, default=None,
                    help="directory for the SSD tier and the store benchmark (default: a temporary folder in "
                    "the repository's folder, so on the disk that holds the checkout; removed at the end)")
    ap.add_argument("--model", default=None,
                    help="zoo model to plan and run (default gpt3-2.7b; --quick tiny-gpt)")
    ap.add_argument("--hw", default=None, help="plan on this profile instead of calibrating")
    ap.add_argument("--skip", nargs="+", default=[], choices=STEPS[1:], metavar="STEP",
                    help="steps to leave out: " + ", ".join(STEPS[1:]))
    ap.set_defaults(out=None)
    args = ap.parse_args(argv)
    hw = str(Path(args.hw).resolve()) if args.hw and Path(args.hw).is_file() else args.hw  # steps run in REPO
    shapes = QUICK if args.quick else FULL
    if args.model:
        shapes = Shapes(args.model, **{k: v for k, v in vars(shapes).items() if k != "model"})
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); to check the check, "
                  "use --device cpu-adversarial", file=sys.stderr)
            return 2
    out = (args.out or RESULTS_DIR / ("gpu_check" if args.device.startswith("cuda") else "gpu_check-emulated")
           ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ssd = (args.ssd_dir or Path(tempfile.mkdtemp(prefix=".gpu-check-ssd-", dir=REPO))).resolve()
    ssd.mkdir(parents=True, exist_ok=True)
    try:
        steps = run_check(shapes, args.device, ssd, out, hw, tuple(args.skip))
    finally:
        if args.ssd_dir is None:
            shutil.rmtree(ssd, ignore_errors=True)
    path = write_summary(steps, out, args.device, shapes)
    print(path.read_text())
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s.ok or s.why_skipped == "--skip" for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
