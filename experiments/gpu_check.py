"""The GPU check: one command that runs tierflow's CUDA paths end to end on a CUDA box within a time budget
and keeps everything it saw in one results folder, with a summary.

    python experiments/gpu_check.py [--quick] [--device cuda|cuda:N|cpu-adversarial] [--ssd-dir DIR]
                                    [--model NAME] [--hw PROFILE] [--budget-s S] [--out DIR]

Each step is a subprocess (a crash or an out-of-memory in one does not end the check); its command line, exit
code, wall time, stdout and stderr are kept under --out (`NN-step.out` / `NN-step.err`):

1. **env**: `tierflow env --ssd-dir DIR --json` (versions, CUDA and the GPUs, O_DIRECT, pinned-memory limits).
2. **calibrate**: `tierflow calibrate --device cuda --ssd-dir DIR -o box.yaml` (skipped with --hw PROFILE).
3. **plan_host, run_host, compare_host**: gpt3-1.3b (batch 8, seq 2048) with the GPU capped at 4.5 bytes per
   parameter (the bf16 weights and working memory, not the 12 bytes of fp32 master and Adam moments), so the
   optimizer states and gradients live in host memory and the host optimizer runs beside the GPU's work;
   `tierflow run` then `tierflow compare` (predicted against measured per op kind, in the summary).
4. **plan_ssd, run_ssd, compare_ssd**: the same model with the GPU capped at 1.5 bytes per parameter (below
   the bf16 weights alone) and host memory at 6 (room for the fp32 gradients and part of the weights, not for
   the states), so the plan streams weights and optimizer states from the SSD tier (--ssd-dir).
5. **bench_optimizer**: `experiments/bench_optimizer.py`, the executor's host AdamW against torch's fused one.
6. **bench_executor**: `experiments/bench_executor.py --device cuda`: the executor against plain PyTorch.
7. **bench_store**: `experiments/bench_store.py --device cuda`: the SSD store reading into and writing from
   page-locked buffers (the transfer area's allocation), against the raw device.
8. **bench_executor_graphs, bench_executor_eager**: bench_executor's on-device plans (4 x 256 and 6 x 384)
   against plain PyTorch with CUDA graphs on (`--cuda-graphs`) and off (`--no-cuda-graphs`), the run
   option. A tierflow without that option (RunConfig has no `cuda_graphs`) skips the graphs step with one
   line saying so, and runs the eager one without the flag (eager is all it has); neither fails the check.
9. **bench_dispatch**: `experiments/bench_dispatch.py`, the executor's host CPU per op against plain
   PyTorch's, on the CPU backends with one torch thread (OMP_NUM_THREADS=1).

The summary's first section states the three figures of the host-cost targets: bench_executor on the device
against plain PyTorch at 4 x 256 and 6 x 384 with CUDA graphs (target >= 0.97x) and without (>= 0.9x),
and the CPU the executor adds per op beyond plain PyTorch (target <= 40 us).

**The budget.** `--budget-s` (default 480: a lent GPU machine's 10-minute command with room to start and to
copy the results back) is shared among the steps still to run, in proportion to each step's share
(STEP_SHARE); a step that ends early leaves its time to the later ones. A run's `--steps` is sized from its
plan's predicted iteration time to fit its share (at least 2, at most 3), and a step still running at its
deadline gets SIGTERM (tierflow run stops its workers cleanly), then SIGKILL 15 s later: it is marked
"stopped at its budget" and whatever it wrote is kept. The summary is written after every step, so a check
killed from outside still leaves one.

summary.md puts the figures side by side (the plans' placements, predicted against measured per op kind, the
runs' device memory against the caps, the benchmarks' ratios). Exit code 0 when every step succeeded, 1 when
one failed or was stopped (the summary says which and where its stderr is), 2 for bad arguments or no CUDA.

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

from expcommon import RESULTS_DIR, arg_parser, script_main

from tierflow.errors import TierflowError

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = Path(__file__).resolve().parent
GIB = 2**30
STEP_TIMEOUT_S = 3600  # without a budget
TERM_GRACE_S = 15  # SIGTERM, then this long before SIGKILL
LOAD_AT_START = os.getloadavg()  # how busy the box was: other processes slow every timing of the check
DEFAULT_BUDGET_S = 480
STEPS = ("env", "calibrate", "plan_host", "run_host", "compare_host", "plan_ssd", "run_ssd", "compare_ssd",
         "bench_optimizer", "bench_executor", "bench_store", "bench_executor_graphs", "bench_executor_eager",
         "bench_dispatch")
# Each step's share of the budget left when it starts (divided by the shares of the steps still to run);
# env's is room for a loaded box (its imports took 8 s at a load of 13 on 2 cores): what it leaves goes on.
STEP_SHARE = {"env": 0.10, "calibrate": 0.08, "plan_host": 0.07, "run_host": 0.16, "compare_host": 0.03,
              "plan_ssd": 0.07, "run_ssd": 0.25, "compare_ssd": 0.03, "bench_optimizer": 0.07,
              "bench_executor": 0.14, "bench_store": 0.08, "bench_executor_graphs": 0.10,
              "bench_executor_eager": 0.10, "bench_dispatch": 0.05}
# Seconds a step gets at least, while the budget has them: calibrate's profile is what every later step plans
# and predicts on (without it they are skipped), and on the H200 (2026-11-29) it took 47 s where its share of
# the default budget gave it 27 s.
STEP_FLOOR_S = {"calibrate": 75.0}
RUN_OVERHEAD_S = 20.0  # a run's start and end besides its steps: imports, the SSD files' first write, export


@dataclass(frozen=True)
class Scenario:
    """Where a plan is made to put the states: the device and host caps in bytes per parameter."""

    name: str  # host | ssd
    gpu_bytes_per_param: float
    host_bytes_per_param: float | None  # None: the box's own host memory
    what: str


SCENARIOS = (
    Scenario("host", 4.5, None, "states and gradients in host memory (GPU capped at 4.5 B/param: bf16 "
             "weights and working memory)"),
    Scenario("ssd", 1.5, 6.0, "weights and states streamed from the SSD tier (GPU capped at 1.5 B/param, "
             "below the bf16 weights; host at 6 B/param)"),
)


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
    min_cuda_gpu_gib: float = 0.0  # on CUDA: cuBLAS workspaces (3 streams x 32 MiB) and the kernels' own


FULL = Shapes("gpt3-1.3b", batch=8, seq=2048, steps=3, plan_time_limit_s=40, min_gpu_gib=1.0,
              min_host_gib=4.0, quick=False, min_cuda_gpu_gib=1.0)
# tiny-gpt's floors: with memory counted to the KiB (not rounded up to MiB per 1/100 of a class) its
# 12.7 MiB of fp32 states fit beside 30 MiB of host working memory, so the ssd scenario's host floor is
# 10 MiB (states 99% on the SSDs) and its GPU floor 6 MiB; its 1.6 MiB of bf16 weights still fit on the GPU
QUICK = Shapes("tiny-gpt", batch=8, seq=64, steps=3, plan_time_limit_s=5, min_gpu_gib=0.006,
               min_host_gib=0.01, quick=True, min_cuda_gpu_gib=0.5)


@dataclass
class Step:
    """One command of the check and what came of it."""

    name: str
    argv: list[str]
    needs: list[Path] = field(default_factory=list)  # files an earlier step must have written
    rc: int | None = None  # None: not run
    wall_s: float = 0.0
    why_skipped: str = ""
    deadline_s: float | None = None  # the time it was given (None: STEP_TIMEOUT_S)
    stopped: bool = False  # still running at its deadline
    env: dict[str, str] = field(default_factory=dict)  # set for its process, besides the check's own
    unsupported: bool = False  # skipped because this tierflow lacks what it measures: not a failure

    @property
    def ok(self) -> bool:
        return self.rc == 0


class Budget:
    """The check's time: each step gets the remaining budget times its share over the shares still to come,
    or its floor (STEP_FLOOR_S) where that is more and the budget has it."""

    def __init__(self, total_s: float | None, names: list[str]) -> None:
        self.total_s, self.t0 = total_s, time.perf_counter()
        self.todo = list(names)

    def remaining_s(self) -> float:
        return (self.total_s or 0.0) - (time.perf_counter() - self.t0)

    def peek_s(self, name: str) -> float | None:
        """The seconds step `name` may take if it starts now (None: no budget)."""
        if self.total_s is None:
            return None
        shares = sum(STEP_SHARE[n] for n in self.todo if n != name) + STEP_SHARE[name]
        left = max(self.remaining_s(), 0.0)
        return min(max(left * STEP_SHARE[name] / shares, STEP_FLOOR_S.get(name, 0.0)), left)

    def take_s(self, name: str) -> float | None:
        """peek_s, and the step is no longer to come."""
        s = self.peek_s(name)
        self.drop(name)
        return s

    def drop(self, name: str) -> None:
        """Step `name` will not run: its share goes to the others."""
        if name in self.todo:
            self.todo.remove(name)


def tierflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "tierflow", *args]


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EXPERIMENTS / name), *args]


def stem(out: Path, name: str) -> Path:
    """Where a step's stdout and stderr go: NN-name.out / .err, NN its place in STEPS (also with --skip)."""
    return out / f"{STEPS.index(name) + 1:02d}-{name}"


def run_step(step: Step, out: Path, deadline_s: float | None = None) -> Step:
    """Run one step with its stdout and stderr in files under `out`; skip it when an input is missing; stop it
    (SIGTERM, then SIGKILL) at `deadline_s`."""
    missing = [p for p in step.needs if not p.exists()]
    if missing:
        step.why_skipped = f"{missing[0].name} was not written by an earlier step"
        print(f"gpu_check: {step.name}: skipped ({step.why_skipped})", file=sys.stderr)
        return step
    if deadline_s is not None and deadline_s < 1.0:
        step.why_skipped = "no time left in --budget-s"
        print(f"gpu_check: {step.name}: skipped ({step.why_skipped})", file=sys.stderr)
        return step
    path = stem(out, step.name)
    step.deadline_s = deadline_s
    limit = f" (at most {deadline_s:.0f} s)" if deadline_s is not None else ""
    print(f"gpu_check: {step.name}{limit}: {' '.join(step.argv[1:])}", file=sys.stderr)
    t0 = time.perf_counter()
    with open(f"{path}.out", "w") as so, open(f"{path}.err", "w") as se:
        proc = subprocess.Popen(step.argv, stdout=so, stderr=se, cwd=REPO, env={**os.environ, **step.env})
        try:
            step.rc = proc.wait(timeout=deadline_s if deadline_s is not None else STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            step.stopped = True
            proc.terminate()
            try:
                proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            step.rc = 124
            se.write(f"gpu_check: stopped at its budget after {time.perf_counter() - t0:.0f} s\n")
    step.wall_s = time.perf_counter() - t0
    print(f"gpu_check: {step.name}: exit {step.rc} ({step.wall_s:.1f} s)", file=sys.stderr)
    return step


def caps(shapes: Shapes, profile: Path | str, scenario: Scenario = SCENARIOS[1],
         device: str = "cuda") -> dict[str, float]:
    """The plan's `--set` caps (GiB, reserved parts included) for the shapes' model on `profile`: a floor the
    device can meet (on CUDA the cuBLAS workspaces of three streams come first), then the scenario's bytes
    per parameter."""
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
    from tierflow.planner.core.models import get_model

    hw = load_profile(profile)
    params = get_model(shapes.model).total_params()
    floor = max(shapes.min_gpu_gib, shapes.min_cuda_gpu_gib if device.startswith("cuda") else 0.0)
    # plus what the executor's CUDA runtime maps under the cap (cuBLAS workspaces, the allocator's pages) on a
    # GPU profile: the plan counts it among its static bytes (tierflow.planner.core.devicemem)
    gpu = (max(floor, scenario.gpu_bytes_per_param * params / GIB)
           + runtime_gpu_reserve_bytes("ideal", 1, hw) / GIB)
    out = {"gpu.memory_gib": round(hw.gpu.reserved_gib + gpu, 3)}
    if scenario.host_bytes_per_param is not None:
        host = max(shapes.min_host_gib, scenario.host_bytes_per_param * params / GIB)
        out["cpu.memory_gib"] = round(hw.cpu.reserved_gib + host, 3)
    return out


def plan_argv(shapes: Shapes, profile: Path | str, plan: Path, scenario: Scenario = SCENARIOS[1],
              device: str = "cuda", time_limit_s: float | None = None) -> list[str]:
    sets = [a for k, v in caps(shapes, profile, scenario, device).items() for a in ("--set", f"{k}={v}")]
    limit = shapes.plan_time_limit_s if time_limit_s is None else max(2, min(shapes.plan_time_limit_s,
                                                                            int(time_limit_s * 0.6)))
    return tierflow("plan", "--model", shapes.model, "--hw", str(profile), *sets,
                    "--batch", str(shapes.batch), "--seq", str(shapes.seq),
                    "--time-limit", str(limit), "--no-baselines", "-o", str(plan), "--json", "-q")


def steps_for(shapes: Shapes, plan: Path, share_s: float | None) -> int:
    """A run's --steps: the shapes' count, fewer (at least 2) when the plan's predicted iteration times
    RUN_OVERHEAD_S do not fit the run's share of the budget."""
    if share_s is None or shapes.quick:
        return shapes.steps
    pred = _json(plan).get("predicted", {}).get("iteration_s")
    if not pred or pred <= 0:
        return shapes.steps
    fits = int((share_s - RUN_OVERHEAD_S) / (2.0 * pred))  # measured up to 2x the prediction so far
    return max(2, min(shapes.steps, fits))


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
                      *(["--rounds", "2", "--models", "tiny"] if shapes.quick else ["--rounds", "2"]), *hw)
    return store, executor


def graphs_missing() -> str | None:
    """Why this tierflow cannot switch CUDA graphs (bench_executor.graphs_missing), or None."""
    sys.path.insert(0, str(EXPERIMENTS))
    from bench_executor import graphs_missing as missing

    return missing()


def graph_steps(shapes: Shapes, device: str, ssd: Path, out: Path,
                profile: Path | str | None = None) -> list[Step]:
    """bench_executor's on-device plans with CUDA graphs on, then off (the run option --[no-]cuda-graphs),
    predicted on `profile` where calibrate wrote it (as bench_argv): without the option, the first is skipped
    (one line says why) and the second runs without the flag."""
    try:
        missing = graphs_missing()
    except Exception as e:  # noqa: BLE001 - the executor does not import: the steps say so when they run
        missing = f"the executor's run options do not import ({type(e).__name__}: {e})"
    hw = ["--hw", str(profile)] if profile and not shapes.quick and Path(profile).exists() else []
    sizes = (["--models", "tiny", "--rounds", "2", "--quick"] if shapes.quick
             else ["--models", "small", "medium", "--rounds", "3", *hw])

    def argv(name: str, flag: list[str]) -> list[str]:
        return script("bench_executor.py", "--device", device, "--device-only", "--ssd-dir", str(ssd / name),
                      "--out", str(out / name), *sizes, *flag)

    on = Step("bench_executor_graphs", [] if missing else argv("bench_executor_graphs", ["--cuda-graphs"]))
    if missing:
        on.why_skipped, on.unsupported = missing, True
    off = Step("bench_executor_eager", argv("bench_executor_eager", [] if missing else ["--no-cuda-graphs"]))
    return [on, off]


def dispatch_argv(shapes: Shapes, out: Path) -> list[str]:
    return script("bench_dispatch.py", "--out", str(out / "bench_dispatch"),
                  *(["--quick"] if shapes.quick else ["--rounds", "4"]))


def optimizer_argv(shapes: Shapes, out: Path) -> list[str]:
    return script("bench_optimizer.py", "--out", str(out / "bench_optimizer"),
                  *(["--quick"] if shapes.quick else []))


def run_check(shapes: Shapes, device: str, ssd: Path, out: Path, hw: str | None,
              skip: tuple[str, ...] = (), budget_s: float | None = None) -> list[Step]:
    """Every step in order within the budget; a step whose inputs are missing is skipped, the others run
    whatever failed; the summary is rewritten after each step."""
    profile: Path | str = hw if hw else out / "box.yaml"
    for sub in ("run_host", "run_ssd", "bench_executor", "bench_executor_graphs", "bench_executor_eager"):
        (ssd / sub).mkdir(exist_ok=True)
    todo = [n for n in STEPS if n not in skip and not (n == "calibrate" and hw)]
    budget = Budget(budget_s, todo)
    done: list[Step] = []

    def go(step: Step) -> None:
        if step.name in skip:
            step.why_skipped = "--skip"
        elif step.argv:
            run_step(step, out, budget.take_s(step.name))
        budget.drop(step.name)
        done.append(step)
        write_summary(done, out, device, shapes)

    cal_device = "cpu" if device.startswith("cpu") else "cuda"
    go(Step("env", tierflow("env", "--ssd-dir", str(ssd), "--json")))
    if not hw and "calibrate" not in skip:
        quick = ["--quick", "--ssd-file-mib", "64"] if shapes.quick else []
        go(Step("calibrate", tierflow("calibrate", "--device", cal_device, "--ssd-dir", str(ssd),
                                      "-o", str(profile), "--json", "-q", *quick)))
    for sc in SCENARIOS:
        plan, run_dir = out / f"plan-{sc.name}.json", out / f"run-{sc.name}"
        plan_step = Step(f"plan_{sc.name}", [], why_skipped="no profile to plan on")
        if Path(profile).exists() or hw:
            try:
                plan_step.argv = plan_argv(shapes, profile, plan, sc, device, budget.peek_s(plan_step.name))
            except TierflowError as e:  # a profile or model that does not load: the plan step says why
                plan_step.why_skipped = str(e)
        go(plan_step)
        run_name = f"run_{sc.name}"
        n = steps_for(shapes, plan, budget.peek_s(run_name))
        go(Step(run_name, tierflow("run", str(plan), "--steps", str(n), "--device", device,
                                   "--ssd-dir", str(ssd / run_name), "--out", str(run_dir), "--json"),
                needs=[plan]))
        go(Step(f"compare_{sc.name}", tierflow("compare", str(plan), str(run_dir / "trace.json"),
                                               "--plot", str(out / f"compare-{sc.name}.png"), "--json"),
                needs=[plan, run_dir / "trace.json"]))
    go(Step("bench_optimizer", optimizer_argv(shapes, out), needs=[EXPERIMENTS / "bench_optimizer.py"]))
    store, executor = bench_argv(shapes, device, ssd, out, profile)
    go(Step("bench_executor", executor))
    go(Step("bench_store", store))
    for step in graph_steps(shapes, device, ssd, out, profile):
        if step.why_skipped and step.name not in skip:
            print(f"gpu_check: {step.name}: skipped ({step.why_skipped})", file=sys.stderr)
        go(step)
    go(Step("bench_dispatch", dispatch_argv(shapes, out), env={"OMP_NUM_THREADS": "1"}))
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
                                   f"**stopped at its budget** ({s.deadline_s:.0f} s)" if s.stopped else
                                   f"**failed** (exit {s.rc}; see `{stem(out, s.name).name}.err`)")
        given = f"{s.deadline_s:.0f}" if s.deadline_s is not None else "-"
        rows.append([s.name, state, f"{s.wall_s:.1f}", given,
                     f"`{' '.join(_short(a, out) for a in s.argv[1:])}`"])
    return ["## Steps", "", *table(["step", "result", "wall s", "budget s", "command"], rows), ""]


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
            f"{ssd.get('free_bytes', 0) / 1e9:.1f} GB free",
            f"- host AdamW: {env.get('host_optimizer') or '?'}", ""]


def plan_section(plan: dict, sc: Scenario = SCENARIOS[1]) -> list[str]:
    title = f"## Plan: {sc.name} ({sc.what})"
    if not plan:
        return [title, "", "No plan was written.", ""]
    d, cap = plan.get("decisions", {}), plan.get("capacity_bytes", {})
    place = d.get("placement", {})
    rows = [[k, *(f"{place[k].get(t, 0):.2f}" for t in ("gpu", "cpu", "ssd"))] for k in place]
    states = ("master", "adam_m", "adam_v")
    off_gpu = all(place.get(k, {}).get("gpu", 1) < 1 for k in ("weights", *states))
    on_ssd = all(place.get(k, {}).get("ssd", 0) > 0 for k in ("weights", *states))
    m = plan.get("model", {})
    pred = plan.get("predicted", {})
    return [title, "",
            f"{m.get('name')} ({m.get('num_layers')} x {m.get('hidden')}), {d.get('family')} schedule, "
            f"batch {d.get('batch')} in micro-batches of {d.get('micro_batch')}, seq {d.get('seq')}; usable "
            f"capacity GPU {cap.get('gpu', 0) / GIB:.2f} GiB, host {cap.get('cpu', 0) / GIB:.2f} GiB; "
            f"predicted {pred.get('iteration_s', float('nan')):.3f} s per iteration.", "",
            *table(["tensor class", "gpu", "cpu", "ssd"], rows), "",
            _placement_line(place, sc, off_gpu, on_ssd), ""]


def _placement_line(place: dict, sc: Scenario, off_gpu: bool, on_ssd: bool) -> str:
    """Whether the plan put the states where the scenario wants them."""
    if sc.name == "host":
        in_host = all(place.get(k, {}).get("cpu", 0) >= 0.999 for k in ("master", "adam_m", "adam_v"))
        return f"- optimizer states wholly in host memory: {'yes' if in_host else '**no**'}"
    states_ssd = all(place.get(k, {}).get("ssd", 0) > 0 for k in ("master", "adam_m", "adam_v"))
    return (f"- weights and optimizer states beyond the GPU cap: {'yes' if off_gpu else '**no**'}; "
            f"on the SSD tier: {'yes' if on_ssd else '**no**'}; optimizer states on the SSD tier: "
            f"{'yes' if states_ssd else '**no**'}")


def run_section(run: dict, cmp: dict, sc: Scenario = SCENARIOS[1]) -> list[str]:
    if not run:
        return [f"## Run: {sc.name}", "", "The run wrote no result.", ""]
    rows = [[s["step"], f"{s['loss']:.4f}", f"{s['step_s']:.3f}", f"{s['tokens_per_s']:,.0f}"]
            for s in run.get("steps", [])]
    meas = run.get("measured") or {}
    dev = meas.get("measured_device_memory") or {}
    lines = [f"## Run: {sc.name}", "", *table(["step", "loss", "s", "tokens/s"], rows), "",
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
        kinds = [[r["kind"], r["resource"], r["ops"], f"{r['predicted_s'] * 1e3:,.2f}",
                  f"{r['measured_s'] * 1e3:,.2f}", f"{r['ratio']:.2f}x", _gbps(r)]
                 for r in cmp.get("by_kind", [])]
        if kinds:
            lines += ["", "Per op kind (`tierflow compare`; ms over the run's iterations; a link's GB/s over "
                      "its ops' time):", "",
                      *table(["kind", "resource", "ops", "predicted ms", "measured ms",
                              "measured / predicted", "GB/s predicted / measured"], kinds)]
    return [*lines, ""]


def _gbps(row: dict) -> str:
    if row.get("bytes") is None or not row.get("measured_gbps"):
        return "-"
    return f"{row['predicted_gbps'] or 0:,.2f} / {row['measured_gbps']:,.2f}"


def bench_section(out: Path) -> list[str]:
    store = [r for r in _csv(out / "bench_store" / "bench_store.csv") if r["system"] == "store"]
    execu = _csv(out / "bench_executor" / "bench_executor.csv")
    opt = _csv(next(iter(sorted((out / "bench_optimizer").glob("*.csv"))), out / "none.csv"))
    lines = ["## Benchmarks", ""]
    if opt:
        lines += ["bench_optimizer (the executor's host AdamW against torch's fused AdamW):", "",
                  *table(list(opt[0]), [list(r.values()) for r in opt]), ""]
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


GRAPHS_TARGET, EAGER_TARGET = 0.97, 0.9  # bench_executor on the device over plain PyTorch
HOST_OP_US_TARGET = 40.0  # CPU the executor adds per op beyond plain PyTorch (bench_dispatch, one thread)
DECIDING_MODELS = {"small": "4 x 256", "medium": "6 x 384", "tiny": "2 x 128 (--quick)"}


def _not_measured(steps: list[Step], name: str, out: Path) -> str:
    step = next((s for s in steps if s.name == name), None)
    if step is None:
        return f"not measured ({name} has not run yet)"
    if step.rc is None:
        return f"not measured ({name} skipped: {step.why_skipped})"
    if not step.ok:
        what = "stopped at its budget" if step.stopped else f"failed, exit {step.rc}"
        return f"not measured ({name} {what}; see `{stem(out, name).name}.err`)"
    return f"not measured ({name} wrote no on-device row)"


def ratio_line(steps: list[Step], out: Path, name: str, label: str, target: float) -> str:
    """bench_executor's on-device ratios of step `name` against `target`."""
    rows = [r for r in _csv(out / name / "bench_executor.csv") if r.get("case") == "on device"]
    if not rows:
        return f"- {label}: {_not_measured(steps, name, out)}; target >= {target}x"
    got = [(DECIDING_MODELS.get(r["model"], r["model"]), float(r["ratio"])) for r in rows]
    cells = ", ".join(f"{m} **{x:.3f}x**" if x < target else f"{m} {x:.3f}x" for m, x in got)
    met = all(x >= target for _m, x in got)
    return f"- {label}: {cells} (target >= {target}x: {'met' if met else '**not met**'})"


def host_cost_line(steps: list[Step], out: Path) -> str:
    """bench_dispatch's CPU per op on the plain CPU backend, executor against plain PyTorch."""
    rows = [r for r in _csv(out / "bench_dispatch" / "bench_dispatch.csv")
            if r.get("backend") == "cpu" and r.get("variant") == "direct"]
    label = "host CPU per op, the executor beyond plain PyTorch (bench_dispatch, CPU backend, one thread)"
    if not rows:
        return f"- {label}: {_not_measured(steps, 'bench_dispatch', out)}; target <= {HOST_OP_US_TARGET:g} us"
    cells = []
    for r in rows:
        plain_us = float(r["plain_cpu_ms"]) * 1e3 / float(r["ops_per_step"])
        extra = float(r["executor_op_cpu_us"])
        txt = f"+{extra:.1f} us over plain's {plain_us:.1f} us ({(plain_us + extra) / plain_us:.2f}x)"
        cells.append(f"{r['plan']} {txt if extra <= HOST_OP_US_TARGET else f'**{txt}**'}")
    met = all(float(r["executor_op_cpu_us"]) <= HOST_OP_US_TARGET for r in rows)
    return (f"- {label}: {'; '.join(cells)} (target <= {HOST_OP_US_TARGET:g} us: "
            f"{'met' if met else '**not met**'})")


def decide_section(steps: list[Step], out: Path) -> list[str]:
    """The three figures of the host-cost targets, each against its target, or why it was not measured."""
    return ["## The host-cost targets: executor against plain PyTorch", "",
            ratio_line(steps, out, "bench_executor_graphs", "bench_executor on the device / plain PyTorch, "
                       "CUDA graphs on", GRAPHS_TARGET),
            ratio_line(steps, out, "bench_executor_eager", "bench_executor on the device / plain PyTorch, "
                       "CUDA graphs off", EAGER_TARGET),
            host_cost_line(steps, out), ""]


def scenario_sections(out: Path, sc: Scenario) -> list[str]:
    return [*plan_section(_json(out / f"plan-{sc.name}.json"), sc),
            *run_section(_json(Path(f"{stem(out, 'run_' + sc.name)}.out")),
                         _json(Path(f"{stem(out, 'compare_' + sc.name)}.out")), sc)]


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
    body = [*decide_section(steps, out), *steps_section(steps, out), *env_section(_json(out / "01-env.out")),
            *(line for sc in SCENARIOS for line in scenario_sections(out, sc)),
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
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"wall-clock seconds for the whole check (default {DEFAULT_BUDGET_S}), shared among "
                    "the steps; 0: no budget (each step up to an hour)")
    ap.set_defaults(out=None)
    args = ap.parse_args(argv)
    if args.budget_s < 0:
        ap.error(f"--budget-s {args.budget_s:g}: must be >= 0 (0: no budget)")
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
        steps = run_check(shapes, args.device, ssd, out, hw, tuple(args.skip), args.budget_s or None)
    finally:
        if args.ssd_dir is None:
            shutil.rmtree(ssd, ignore_errors=True)
    path = write_summary(steps, out, args.device, shapes)
    print(path.read_text())
    print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s.ok or s.why_skipped == "--skip" or s.unsupported for s in steps) else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
