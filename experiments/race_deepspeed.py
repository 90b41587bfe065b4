"""Race DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer states on NVMe) against tierflow on this
machine.

    python experiments/race_deepspeed.py [--quick] [--reps N] [--steps N] [--ssd-dir DIR] [--out DIR]

Both train the same model (tierflow's own blocks, `executor.models.BlockModel`), on the same synthetic data,
batch = micro-batch, sequence, fp32 on the CPU as the device, torch intra-op threads, everything (weights,
fp32 master, Adam m and v, gradients) on the SSD directory, no recompute. DeepSpeed 0.19.8 runs on its CPU
accelerator (`DS_ACCELERATOR=cpu`, gloo, one rank, no launcher); tierflow runs its plans with `run_plan` (the
code of `tierflow run`). Every measurement is its own subprocess (DeepSpeed's global state does not leak; both
start cold), the variants of a point alternate, and each repetition reports the median step time over several
steps after warm-up, tokens/s, the process's peak resident memory and the bytes it read and wrote on the block
device per step (/proc/self/io: the SSD directory is the only file traffic during the steps).

The prediction: `tierflow calibrate --device cpu` measures this box (as experiments/closed_loop.py does, with
its device and host caps), then `simulate_config` predicts (a) DeepSpeed's step from the same DeepSpeed config
through the bridge (planner/io/deepspeed/config.py: `horizontal`, runtime deepspeed; recompute off, as the
model code does not checkpoint) and (b) each tierflow plan's step. Measured and predicted go in one table
(race.csv, race.md) and one figure (race.png) under --out.

DeepSpeed is optional: `pip install -e '.[baseline]'` and `apt-get install libaio-dev` (its async_io op builds
with ninja on first use). Without them the script prints one line and exits 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    Progress,
    arg_parser,
    headline,
    new_figure,
    print_table,
    save_figure,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.io.deepspeed.config import largest_param_elems

DS_VERSION = "0.19.8"
RESULT_TAG = "RACE-RESULT "
THREADS = 2  # torch intra-op threads in every worker (this machine has 2 cores)
ON_SSD = Split(gpu=0.0, cpu=0.0, ssd=1.0)
ON_DEVICE = Split(gpu=1.0, cpu=0.0, ssd=0.0)
ALL_ON_SSD = Placement(weights=ON_SSD, master=ON_SSD, adam_m=ON_SSD, adam_v=ON_SSD, grads=ON_SSD,
                       checkpoints=ON_DEVICE)
OPT_ON_SSD = replace(ALL_ON_SSD, weights=ON_DEVICE)  # DeepSpeed's optimizer-only NVMe offload
ON_HOST = Split(gpu=0.0, cpu=1.0, ssd=0.0)
# like-for-like with DeepSpeed's NVMe offload as it runs: its parameters stay in host memory (max_in_cpu) and
# its fp32 gradients are accumulated there; only the fp32 master and Adam m, v live on the SSD
HOST_WEIGHTS = replace(ALL_ON_SSD, weights=ON_HOST, grads=ON_HOST)
HYPER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}  # executor.context.Hyper


@dataclass(frozen=True)
class Point:
    """One point of the sweep: a GPT of tierflow's blocks and its batch (= micro-batch)."""

    layers: int
    hidden: int
    heads: int
    batch: int
    seq: int
    vocab: int = 8192

    @property
    def name(self) -> str:
        return f"gpt {self.layers}x{self.hidden} b{self.batch}x{self.seq}"

    def spec(self) -> ModelSpec:
        base = get_model("tiny-gpt")
        return replace(base, name=f"gpt-{self.layers}x{self.hidden}", num_layers=self.layers,
                       hidden=self.hidden, num_heads=self.heads, num_kv_heads=self.heads,
                       ffn_hidden=4 * self.hidden, vocab_size=self.vocab, seq_len=self.seq,
                       max_positions=self.seq, precision="fp32")


# From compute-bound (many tokens per weight byte) to offload-bound (few): model size x batch.
# The last point is where offload binds most: 261M parameters, 4.2 GB of fp32 weights and optimizer states.
SWEEP = [Point(6, 512, 8, 8, 256), Point(6, 512, 8, 1, 128), Point(12, 768, 12, 2, 128),
         Point(24, 1024, 16, 2, 256)]
QUICK_POINT = Point(2, 256, 4, 2, 64, vocab=2048)


# ---- DeepSpeed configs -------------------------------------------------------------------------------------


def ds_config(p: Point, nvme_dir: str, variant: str) -> dict:
    """The DeepSpeed config of one variant (see DS_VARIANTS)."""
    zero: dict = {"stage": 3,
                  "offload_param": {"device": "nvme", "nvme_path": nvme_dir},
                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    cfg: dict = {"train_batch_size": p.batch, "train_micro_batch_size_per_gpu": p.batch,
                 "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": dict(HYPER)},
                 "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if variant == "ds-default":  # as a new user writes it: DeepSpeed's defaults for everything else
        return cfg
    largest = largest_param_elems(p.spec())  # DeepSpeed stops on a swap buffer smaller than this
    total = p.spec().total_params()
    tuned_param = {"buffer_count": 4, "buffer_size": int(largest), "pin_memory": True}
    tuned_opt = {"buffer_count": 4, "pin_memory": True, "pipeline_read": True, "pipeline_write": True}
    # one optimizer sub-group for the whole model: with several, DeepSpeed 0.19.8's pipelined optimizer
    # swapper runs out of its 4 swap buffers at the first step (AssertionError in _swap_out_optimizer_state,
    # seen at 24 x 1024 with sub_group_size 1e8)
    zero.update({"sub_group_size": int(total) + 1, "stage3_prefetch_bucket_size": int(total),
                 "stage3_param_persistence_threshold": 0, "overlap_comm": True, "contiguous_gradients": True})
    cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": False,
                  "overlap_events": True}
    if variant == "ds-tuned":
        zero["offload_param"].update(tuned_param)
        zero["offload_optimizer"].update(tuned_opt)
        return cfg
    if variant == "ds-opt-nvme":  # optimizer-only NVMe offload: the parameters stay on the device
        zero["offload_param"] = {"device": "none"}
        zero["offload_optimizer"].update(tuned_opt)
        return cfg
    raise ValueError(f"unknown DeepSpeed variant {variant!r}")


DS_VARIANTS = ("ds-default", "ds-tuned", "ds-opt-nvme")
TF_VARIANTS = ("tf-horizontal", "tf-vertical", "tf-hostweights", "tf-plan")


# ---- workers (one subprocess per measurement) --------------------------------------------------------------


def _io_bytes() -> tuple[int, int]:
    """Bytes this process read from and wrote to the block layer so far (its threads included)."""
    vals = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            vals[k.strip()] = int(v)
    return vals["read_bytes"], vals["write_bytes"]


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM: ru_maxrss would carry the parent's peak across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def bare_worker(_job: dict) -> dict:
    """The peak resident memory of a process that has only imported torch, DeepSpeed and tierflow's executor:
    what every measured process holds before it allocates a single tensor of the model."""
    import deepspeed  # noqa: F401
    import torch  # noqa: F401

    import tierflow.executor.run  # noqa: F401

    return {"peak_rss_bytes": _peak_rss_bytes()}


@dataclass
class DsRun:
    """A DeepSpeed engine ready to train one point, with the point and its data (see ds_engine)."""
    engine: object
    data: object
    point: Point


def ds_engine(job: dict, before_init: Callable[[], None] | None = None) -> DsRun:
    """The DeepSpeed set-up every worker shares: torch's threads, tierflow's `BlockModel` of the job's point
    (seed 0) with its loss, one gloo rank, `deepspeed.initialize` with the job's config, synthetic tokens.
    `before_init` runs after deepspeed is imported and before the engine exists (race_profile.py instruments
    DeepSpeed's classes there)."""
    import torch

    torch.set_num_threads(job["threads"])
    import deepspeed

    from tierflow.executor.data import TokenData
    from tierflow.executor.models import BlockModel

    if before_init is not None:
        before_init()
    p = Point(**job["point"])
    spec = p.spec()

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = BlockModel(spec)

        def forward(self, x, y):
            return self.model.loss(x, y)

    deepspeed.init_distributed(dist_backend="gloo")
    model = WithLoss()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=job["ds_config"])
    return DsRun(engine=engine, data=TokenData.load(None, spec.vocab_size, seed=0), point=p)


def ds_worker(job: dict) -> dict:
    ds = ds_engine(job)
    engine, data, p = ds.engine, ds.data, ds.point
    times, losses, io0 = [], [], None
    for step in range(job["warmup"] + job["steps"]):
        if step == job["warmup"]:
            io0 = _io_bytes()
        x, y = data.batch(step, p.batch, p.seq)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    io1 = _io_bytes()
    return {"step_s": times[job["warmup"]:], "losses": losses, "peak_rss_bytes": _peak_rss_bytes(),
            "load_1min": os.getloadavg()[0],
            "ssd_read_bytes": (io1[0] - io0[0]) / job["steps"],
            "ssd_write_bytes": (io1[1] - io0[1]) / job["steps"]}


def tf_worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    from tierflow.executor.run import RunConfig, run_plan
    from tierflow.planner.io.planfile import load_plan

    warmup, io0 = job["warmup"], [None]

    def log(msg: str = "", **_kw) -> None:  # the reporter's step lines mark the end of each step
        if msg.startswith("step") and int(msg.split()[1].split("/")[0]) == warmup:
            io0[0] = _io_bytes()

    run = run_plan(load_plan(job["plan"]), RunConfig(steps=warmup + job["steps"], device="cpu",
                                                     ssd_dir=job["ssd_dir"]), log=log)
    io1 = _io_bytes()
    return {"step_s": [r.step_s for r in run.records[warmup:]], "losses": run.losses,
            "peak_rss_bytes": _peak_rss_bytes(), "load_1min": os.getloadavg()[0],
            "ssd_read_bytes": (io1[0] - io0[0][0]) / job["steps"],
            "ssd_write_bytes": (io1[1] - io0[0][1]) / job["steps"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(job: dict, work: Path, timeout_s: float = 600, script: Path | None = None) -> dict:
    """Run one measurement in a fresh Python process (`script --worker JOB`, this file by default); its result
    dict (or {"error": one line})."""
    path = work / f"job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "LOCAL_SIZE": "1", "OMP_NUM_THREADS": str(job["threads"])}
    # its own session, so that a timeout also ends what it started (DeepSpeed's JIT builds run ninja)
    proc = subprocess.Popen([sys.executable, str(script or Path(__file__).resolve()), "--worker", str(path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:300]}"}


def build_ops() -> dict:
    """Build (or load from torch's extension cache) the DeepSpeed ops the race needs: async_io and
    cpu_adam."""
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    for name in ("AsyncIOBuilder", "CPUAdamBuilder"):
        get_accelerator().create_op_builder(name).load(verbose=False)
    return {"build_s": time.perf_counter() - t0}


def worker_main(path: str) -> None:
    job = json.loads(Path(path).read_text())
    workers = {"ds": ds_worker, "tf": tf_worker, "bare": bare_worker, "build": lambda _job: build_ops()}
    res = workers[job["kind"]](job)
    print(RESULT_TAG + json.dumps(res), flush=True)


# ---- planning and prediction -------------------------------------------------------------------------------


def deepspeed_missing() -> str | None:
    """None when DeepSpeed and libaio are here, else the one line saying how to install them."""
    try:
        import importlib.metadata as md

        version = md.version("deepspeed")
    except Exception:
        return ("race_deepspeed: skipped: DeepSpeed is not installed (pip install -e '.[baseline]', and "
                "apt-get install libaio-dev for its NVMe offload)")
    if not any(Path(d).glob("libaio.so*") for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                                   "/usr/lib64", "/usr/lib", "/usr/local/lib")) or \
            not Path("/usr/include/libaio.h").exists():
        return (f"race_deepspeed: skipped: DeepSpeed {version} is installed but libaio is not "
                "(apt-get install libaio-dev; DeepSpeed's async_io op needs it for NVMe offload)")
    return None


def calibrate_box(ssd_dir: Path, quick: bool) -> dict:
    """This box as the executor uses it (experiments/closed_loop.py's calibration): the raw measurements
    (kept in race_runs.json, so that the profile can be rebuilt by a later tierflow: --predict-only)."""
    from tierflow.executor.calibration import FULL, QUICK, run_measurements

    prog = Progress(12, "calibrate")
    m = run_measurements(QUICK if quick else FULL, ssd_dir, prog, device="cpu")
    prog.finish()
    if m.get("ssd"):
        m["ssd"]["dir"] = "the race's SSD directory"
    return m


def box_profile(measurements: dict, out: Path):
    """The profile of the calibrated box (written as race_box.yaml): the device is this host's memory, given
    what DeepSpeed's and tierflow's fixed schedules hold there; rates in real bytes, the runs in fp32."""
    from tierflow.executor.calibration import build_profile, write_profile

    cal = build_profile(measurements, None, name="race-cpu", device_gib=DEVICE_GIB)
    write_profile(cal, out / "race_box.yaml")
    return cal.profile


def capped(hw, spec: ModelSpec):
    """The planner's box: the device (4 B/param) below weights + optimizer states, and the host holding fp32
    weights and gradients (8 B/param) and 50 MiB of buffers but not the 12 B/param of master and Adam states:
    only the SSD tier can hold those, as in DeepSpeed's NVMe offload (closed_loop.py's caps, tighter)."""
    P = spec.total_params()
    dev = hw.with_overrides({"gpu.memory_gib": max(0.02, round(4 * P / 2**30, 3))})
    return dev.with_overrides({"cpu.memory_gib": round(hw.cpu.reserved_gib + 8 * P / 2**30 + 0.05, 3)})


def ds_budget(hw, spec: ModelSpec, budget_bytes: float):
    """The planner's box with DeepSpeed's memory: device + host (above the host's reserve) hold `budget_bytes`
    (DeepSpeed's measured peak RSS less a bare process's). The host gets what DeepSpeed keeps there by design
    (fp32 parameters and gradients, 8 B/param, and 50 MiB of buffers), the device the rest; the optimizer
    states fit only on the SSD tier (12 B/param more than the host holds). Both reserves come on top, as in
    `capped`."""
    P = spec.total_params()
    host_bytes = 8 * P + 50 * 2**20
    dev_gib = hw.gpu.reserved_gib + max(0.02, (budget_bytes - host_bytes) / 2**30)
    dev = hw.with_overrides({"gpu.memory_gib": round(dev_gib, 3)})
    return dev.with_overrides({"cpu.memory_gib": round(hw.cpu.reserved_gib + host_bytes / 2**30, 3)})


def tf_plans(p: Point, hw, hw_capped, work: Path,
             variants: tuple[str, ...] = TF_VARIANTS) -> dict[str, tuple[Path, dict]]:
    """tierflow's plans for a point: {variant: (plan file, its decisions: ScheduleConfig.to_dict)}. The fixed
    schedules (no recompute: all activations stay on the device) on the calibrated box: everything on the SSD
    (horizontal, vertical), or like-for-like with DeepSpeed (hostweights: weights and gradients in host
    memory, the optimizer states on the SSD; the faster predicted of horizontal and vertical); the planner's
    plan on the capped box, where only the SSD tier holds the optimizer states."""
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.core.simulate import simulate_config
    from tierflow.planner.io.planfile import plan_from_graph, write_plan
    from tierflow.planner.io.planning import PlanOptions, make_plan

    spec = p.spec()
    out = {}
    for variant in variants:
        if variant == "tf-plan":
            try:
                opts = PlanOptions(time_limit_s=20, window=False)
                sr = make_plan(spec, hw_capped, p.batch, p.seq, opts).search
            except Exception as e:  # no plan fits the capped box: the race goes on without it
                print(f"race_deepspeed: {p.name}: no tierflow plan: {e}", file=sys.stderr)
                continue
            cfg, pred = sr.best.config, sr.best.result
        elif variant == "tf-hostweights":
            tried = [make_schedule(sched, spec, hw, batch=p.batch, micro_batch=p.batch, seq=p.seq,
                                   placement=HOST_WEIGHTS, recompute=False, iterations=3, runtime="ideal")
                     for sched in ("horizontal", "vertical")]
            cfg, pred = min(((c, simulate_config(spec, hw, c)) for c in tried),
                            key=lambda cp: cp[1].iteration_s)
        else:
            cfg = make_schedule(variant.removeprefix("tf-"), spec, hw, batch=p.batch, micro_batch=p.batch,
                                seq=p.seq, placement=ALL_ON_SSD, recompute=False, iterations=3,
                                runtime="ideal")
            pred = simulate_config(spec, hw, cfg)
        path = work / f"plan-{p.layers}x{p.hidden}-b{p.batch}-{variant}.json"
        write_plan(plan_from_graph(spec, hw, cfg, build_graph(spec, hw, cfg), predicted=pred), path)
        out[variant] = (path, cfg.to_dict())
    return out


def predict_tf(p: Point, hw, decisions: dict) -> tuple[float | None, str]:
    """A tierflow plan's step predicted on `hw` from the decisions it ran with (the plan as it ran: a
    re-plan on another profile could choose differently)."""
    from tierflow.planner.core.contract import ScheduleConfig
    from tierflow.planner.core.simulate import simulate_config
    from tierflow.planner.core.simulator import CapacityError

    cfg = ScheduleConfig.from_dict(decisions)
    try:
        return simulate_config(p.spec(), hw, cfg).iteration_s, cfg.describe()
    except CapacityError as e:
        return None, f"does not fit: {e}"


def predict_ds(p: Point, hw, cfg: dict, variant: str) -> tuple[float | None, str]:
    """DeepSpeed's step predicted through the bridge from the config it runs (recompute off: the model's code
    does not checkpoint activations)."""
    from tierflow.planner.core.simulate import simulate_config
    from tierflow.planner.core.simulator import CapacityError
    from tierflow.planner.io.deepspeed.config import parse_ds_config

    ds = parse_ds_config(cfg, f"{variant}.json", p.spec())
    spec = ds.trained(p.spec())  # no fp16 / bf16 section: fp32, as it runs
    sched = replace(ds.schedule(spec, hw, seq=p.seq), recompute=False)
    try:
        return simulate_config(spec, hw, sched).iteration_s, sched.describe()
    except CapacityError as e:
        return None, f"does not fit: {e}"


# ---- the race ----------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def race_point(p: Point, hw, reps: int, steps: int, warmup: int, ssd_dir: Path, work: Path,
               variants: tuple[str, ...], prog: Progress, bare_rss_bytes: float = 0.0) -> dict:
    """Every variant of one point, `reps` times, alternating: the point's record for race_runs.json (its
    runs and each tierflow plan's decisions). tf-plan is planned after DeepSpeed's first runs: its box gets
    DeepSpeed's memory (the smallest peak RSS of its variants less a bare process's, ds_budget); without a
    DeepSpeed run, closed_loop.py's caps (capped)."""
    spec = p.spec()
    fixed = tuple(v for v in variants if v.startswith("tf-") and v != "tf-plan")
    plans = tf_plans(p, hw, None, work, fixed) if fixed else {}
    budget: dict[str, float] = {}
    nvme = ssd_dir / "deepspeed"
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    ordered = (*[v for v in variants if v.startswith("ds-")],
               *[v for v in variants if not v.startswith("ds-")])
    for rep in range(reps):
        # alternate the order between repetitions; the first has DeepSpeed first (tf-plan needs its memory)
        for v in (ordered if rep % 2 == 0 else ordered[::-1]):
            if v == "tf-plan" and v not in plans:
                ds_rss = [r["peak_rss_bytes"] for d in variants if d.startswith("ds-") for r in runs[d]
                          if "error" not in r]
                if ds_rss:
                    budget["bytes"] = min(ds_rss) - bare_rss_bytes
                    hw_p = ds_budget(hw, spec, budget["bytes"])
                else:
                    hw_p = capped(hw, spec)
                plans.update(tf_plans(p, hw, hw_p, work, ("tf-plan",)))
            prog.step(f"{p.name} {v} rep {rep + 1}")
            job = {"point": asdict(p), "threads": THREADS, "steps": steps, "warmup": warmup}
            if v.startswith("ds-"):
                shutil.rmtree(nvme, ignore_errors=True)
                nvme.mkdir(parents=True)
                job.update(kind="ds", ds_config=ds_config(p, str(nvme), v))
            elif v in plans:
                job.update(kind="tf", plan=str(plans[v][0]), ssd_dir=str(ssd_dir))
            else:
                continue
            runs[v].append(run_worker(job, work, timeout_s=1800))
    shutil.rmtree(nvme, ignore_errors=True)
    return {"point": asdict(p), "runs": runs, "plans": {v: d for v, (_, d) in plans.items()},
            "budget_bytes": budget.get("bytes")}


def point_rows(record: dict, hw) -> list[dict]:
    """The table rows of one point's record: each variant's measured step (median over repetitions of each
    run's median step) and its prediction on `hw`, DeepSpeed's from its config through the bridge, tierflow's
    from the decisions its plan ran with."""
    p = Point(**record["point"])
    spec = p.spec()
    tokens = p.batch * p.seq
    rows = []
    for v, runs in record["runs"].items():
        ok = [r for r in runs if "error" not in r]
        errs = [r["error"] for r in runs if "error" in r]
        if v.startswith("ds-"):
            pred_s, decisions = predict_ds(p, hw, ds_config(p, "/nvme", v), v)
        elif v in record["plans"]:
            pred_s, decisions = predict_tf(p, hw, record["plans"][v])
            if v == "tf-plan" and record.get("budget_bytes"):
                decisions += (f"; planned with DeepSpeed's memory ({record['budget_bytes'] / 1e9:.2f} GB "
                              "above a bare process)")
        else:
            continue
        per_rep = [_median(r["step_s"]) for r in ok]
        med = _median(per_rep)
        rows.append({
            "point": p.name, "params_m": round(spec.total_params() / 1e6, 1), "variant": v,
            "step_s": round(med, 3), "min_s": round(min(per_rep), 3) if per_rep else float("nan"),
            "max_s": round(max(per_rep), 3) if per_rep else float("nan"), "runs": len(ok),
            "tokens_per_s": round(tokens / med, 1) if ok else float("nan"),
            "peak_rss_gb": round(max(r["peak_rss_bytes"] for r in ok) / 1e9, 2) if ok else float("nan"),
            "ssd_read_gb_per_step": round(_median([r["ssd_read_bytes"] for r in ok]) / 1e9, 3),
            "ssd_write_gb_per_step": round(_median([r["ssd_write_bytes"] for r in ok]) / 1e9, 3),
            "predicted_s": round(pred_s, 3) if pred_s else float("nan"),
            "error": round(med / pred_s - 1, 3) if (ok and pred_s) else float("nan"),
            "decisions": decisions, "failed": "; ".join(errs)[:300],
            # the machine's 1-minute load average as each run ended (2 cores: above 2, others ran beside it)
            "load": round(_median([r["load_1min"] for r in ok if "load_1min" in r]), 1),
        })
        rows[-1]["ssd_share"] = round(ssd_share(rows[-1], hw), 2)
    return rows


def ssd_share(row: dict, hw) -> float:
    """Share of the measured step the SSD traffic needs at the calibrated solo rates."""
    if hw.ssd.count == 0 or not row["step_s"] or row["step_s"] != row["step_s"]:
        return float("nan")
    from tierflow.planner.core.costmodel import link_rates

    r = link_rates(hw)
    need_s = row["ssd_read_gb_per_step"] * 1e9 / r.ssd_read + row["ssd_write_gb_per_step"] * 1e9 / r.ssd_write
    return need_s / row["step_s"]


def summarise(rows: list[dict]) -> list[dict]:
    """Per point: DeepSpeed's best variant against tierflow's best plan, and the SSD share of DeepSpeed's
    step (its row's ssd_share)."""
    out = []
    for point in dict.fromkeys(r["point"] for r in rows):
        mine = [r for r in rows if r["point"] == point and r["runs"]]
        ds = [r for r in mine if r["variant"].startswith("ds-")]
        tf = [r for r in mine if r["variant"].startswith("tf-")]
        if not ds or not tf:
            continue
        best_ds = max(ds, key=lambda r: r["tokens_per_s"])
        best_tf = max(tf, key=lambda r: r["tokens_per_s"])
        out.append({"point": point, "ds_best": best_ds["variant"], "ds_tokens_per_s": best_ds["tokens_per_s"],
                    "tf_best": best_tf["variant"], "tf_tokens_per_s": best_tf["tokens_per_s"],
                    "speedup": round(best_tf["tokens_per_s"] / best_ds["tokens_per_s"], 2),
                    "ds_ssd_share": best_ds["ssd_share"]})
    return out


def plot(rows: list[dict], summary: list[dict], path: Path) -> Path:
    fig, (ax1, ax2) = new_figure(2, width_in=6.5, height_in=4.2)
    points = list(dict.fromkeys(r["point"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs, ys, lo, hi = [], [], [], []
        for j, pt in enumerate(points):
            r = next((r for r in rows if r["point"] == pt and r["variant"] == v and r["runs"]), None)
            if r is None:
                continue
            tok = r["tokens_per_s"]
            xs.append(j + (i - (len(variants) - 1) / 2) * width)
            ys.append(tok)
            # one run: a spread of 0 (up to rounding)
            lo.append(max(0.0, tok - tok * r["step_s"] / r["max_s"]))
            hi.append(max(0.0, tok * r["step_s"] / r["min_s"] - tok))
        ax1.bar(xs, ys, width=width, yerr=[lo, hi], capsize=2, label=v,
                hatch="//" if v.startswith("ds-") else None)
    ax1.set_xticks(range(len(points)), [p.replace(" b", "\nb") for p in points], fontsize=7)
    ax1.set_ylabel("tokens/s (median, bars: spread)")
    ax1.set_title("DeepSpeed ZeRO-Infinity vs tierflow, optimizer states on the SSD")
    ax1.legend(fontsize=6, ncol=2)
    ax2.plot([s["ds_ssd_share"] for s in summary], [s["speedup"] for s in summary], "o")
    for s in summary:
        ax2.annotate(s["point"], (s["ds_ssd_share"], s["speedup"]), fontsize=6)
    ax2.axhline(1.0, color="black", lw=1)
    ax2.axhline(1.5, color="grey", lw=1, ls="--")
    ax2.set_xlabel("SSD share of DeepSpeed's step (calibrated rates)")
    ax2.set_ylabel("tierflow best / DeepSpeed best tokens/s")
    return save_figure(fig, path)


_NUMBERS = ("params_m", "step_s", "min_s", "max_s", "tokens_per_s", "peak_rss_gb", "ssd_read_gb_per_step",
            "ssd_write_gb_per_step", "predicted_s", "error", "ssd_share", "load")


def race_tables(rows: list[dict]) -> str:
    """The race's two tables (every run; best against best per point) from its rows, as point_rows gives them
    or as race.csv holds them (strings): the generated block of docs/deepspeed.md."""
    rows = [{**r, "runs": int(r["runs"]), **{k: float(r[k]) for k in _NUMBERS}} for r in rows]
    lines = ["| point | params | variant | step s (median) | spread s | tokens/s | peak RSS GB | "
             "SSD read GB/step | SSD write GB/step | SSD share | predicted s | error | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['error']:+.0%}" if r["error"] == r["error"] else "-"
        share = f"{r['ssd_share']:.0%}" if r["ssd_share"] == r["ssd_share"] else "-"
        lines.append(f"| {r['point']} | {r['params_m']}M | {r['variant']} | {r['step_s']} | "
                     f"{r['min_s']}-{r['max_s']} | {r['tokens_per_s']:,.0f} | {r['peak_rss_gb']} | "
                     f"{r['ssd_read_gb_per_step']} | {r['ssd_write_gb_per_step']} | {share} | "
                     f"{r['predicted_s']} | {err} | {'-' if r['load'] != r['load'] else r['load']} |")
    lines += ["", "| point | DeepSpeed best | tokens/s | tierflow best | tokens/s | speedup | "
              "SSD share of DS step |",
              "|---|---|---|---|---|---|---|"]
    for s in summarise(rows):
        lines.append(f"| {s['point']} | {s['ds_best']} | {s['ds_tokens_per_s']:,.0f} | {s['tf_best']} | "
                     f"{s['tf_tokens_per_s']:,.0f} | {s['speedup']}x | {s['ds_ssd_share']:.0%} |")
    return "\n".join(lines)


def markdown(rows: list[dict], commands: list[str], versions: str) -> str:
    return ("Measured by " + ", ".join(f"`{c}`" for c in commands) + "; predicted by `python "
            f"experiments/race_deepspeed.py --predict-only` ({versions}).\n\n" + race_tables(rows) + "\n")


def versions() -> str:
    import importlib.metadata as md
    import platform

    try:
        ds = f"deepspeed {md.version('deepspeed')}"
    except md.PackageNotFoundError:
        ds = "deepspeed not installed"
    return (f"{ds}, torch {md.version('torch')}, "
            f"tierflow {md.version('tierflow')}, Python {platform.python_version()}, {os.cpu_count()} cores")


# the CPU device's memory cap in the race's profile: DeepSpeed's ds-opt-nvme keeps the largest point's fp32
# weights and gradients (2.1 GB) and its activations there
DEVICE_GIB = 8.0
RUNS_FILE = "race_runs.json"  # the measurements behind race.csv: calibration, runs, plans' decisions
DOC = REPO_DIR / "docs" / "deepspeed.md"  # its race tables are generated (race_tables)
DOC_TABLE = "race (experiments/race_deepspeed.py from experiments/results/race.csv)"


def run(quick: bool, out_dir: Path, reps: int | None = None, steps: int | None = None,
        ssd_dir: Path | None = None, variants: tuple[str, ...] | None = None,
        points: list[Point] | None = None, merge: bool = False) -> list[dict]:
    """Measure `points` (default: the sweep, --quick: one small point) and write the results. `merge`: keep
    the other points (and the calibration) of the race_runs.json already under `out_dir`."""
    missing = deepspeed_missing()
    if missing:
        print(missing)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    points = points or ([QUICK_POINT] if quick else SWEEP)
    reps = reps or (1 if quick else 2)
    steps = steps or 2
    variants = variants or (("ds-default", "tf-horizontal", "tf-vertical") if quick
                            else (*DS_VARIANTS, *TF_VARIANTS))
    old = json.loads((out_dir / RUNS_FILE).read_text()) if merge and (out_dir / RUNS_FILE).exists() else None
    work = Path(tempfile.mkdtemp(prefix="tierflow-race-"))
    ssd_dir = ssd_dir or work / "ssd"
    ssd_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        # async_io and cpu_adam JIT-build on first use (minutes on 2 cores): once here, not inside a timed run
        built = run_worker({"kind": "build", "threads": THREADS}, work, timeout_s=1800)
        if "error" in built:
            print("race_deepspeed: skipped: DeepSpeed's async_io / cpu_adam ops do not build "
                  f"({built['error']})")
            return []
        data = {"calibration": old["calibration"] if old else calibrate_box(ssd_dir, quick),
                "commands": [*(old["commands"] if old else []),
                             _command(quick, reps, steps, points, variants)],
                "versions": versions(),
                "points": old["points"] if old else []}
        hw = box_profile(data["calibration"], out_dir)
        bare = run_worker({"kind": "bare", "threads": THREADS}, work)
        prog = Progress(len(points) * reps * len(variants), "race")
        for p in points:
            rec = race_point(p, hw, reps, steps, 1, ssd_dir, work, variants, prog,
                             bare_rss_bytes=bare.get("peak_rss_bytes", 0.0))
            _merge_point(data, rec)
            (out_dir / RUNS_FILE).write_text(json.dumps(data, indent=1) + "\n")  # each point as it ends
        prog.finish(f"done in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(data, out_dir)


def _command(quick: bool, reps: int, steps: int, points: list[Point], variants: tuple[str, ...]) -> str:
    """The command line that measures `points` and `variants` as this run does."""
    pick = "" if quick or points == SWEEP else " --points " + " ".join(str(SWEEP.index(p)) for p in points)
    if not quick and set(variants) != {*DS_VARIANTS, *TF_VARIANTS}:
        pick += " --variants " + " ".join(variants)
    quick_flag = " --quick" if quick else ""
    return f"python experiments/race_deepspeed.py{quick_flag} --reps {reps} --steps {steps}{pick}"


def _merge_point(data: dict, rec: dict) -> None:
    """Put one point's record into `data`, in sweep order: the variants it measured replace those of an
    earlier record of the same point, the others are kept (--variants measures some again)."""
    p = Point(**rec["point"])
    order = {q: i for i, q in enumerate(SWEEP)}
    kept = [r for r in data["points"] if Point(**r["point"]) != p]
    for old in (r for r in data["points"] if Point(**r["point"]) == p):
        rec = {**old, "runs": {**old["runs"], **rec["runs"]}, "plans": {**old["plans"], **rec["plans"]},
               "budget_bytes": rec["budget_bytes"] if "tf-plan" in rec["plans"] else old.get("budget_bytes")}
    data["points"] = sorted([*kept, rec], key=lambda r: order.get(Point(**r["point"]), len(SWEEP)))


def report(data: dict, out_dir: Path) -> list[dict]:
    """race.csv, race.md, race.png and race_box.yaml from the measurements in `data` (race_runs.json), the
    predictions made now: the profile rebuilt from the calibration's raw measurements by this tierflow."""
    hw = box_profile(data["calibration"], out_dir)
    rows = [row for rec in data["points"] for row in point_rows(rec, hw)]
    summary = summarise(rows)
    write_csv(rows, out_dir / "race.csv")
    (out_dir / "race.md").write_text(markdown(rows, data["commands"], data.get("versions") or versions()))
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, DOC_TABLE, race_tables(rows))
    plot(rows, summary, out_dir / "race.png")
    print_table([{**r, "error": f"{r['error']:+.1%}" if r["error"] == r["error"] else "-"} for r in rows],
                ["point", "variant", "step_s", "min_s", "max_s", "tokens_per_s", "peak_rss_gb",
                 "ssd_read_gb_per_step", "ssd_write_gb_per_step", "predicted_s", "error", "failed"])
    if summary:
        print_table(summary, list(summary[0]))
    return headlines(rows, summary)


def predict_only(out_dir: Path) -> list[dict]:
    """Re-predict the race from its measurements (race_runs.json under `out_dir`) without running anything:
    after a change to the planner or to the calibration's profile builder."""
    return report(json.loads((out_dir / RUNS_FILE).read_text()), out_dir)


def headlines(rows: list[dict], summary: list[dict]) -> list[dict]:
    """run_all's headline rows: the speedup per point and the prediction errors (no paper numbers: a race)."""
    out = [headline("race_deepspeed", f"{s['point']}: tierflow / DeepSpeed tokens/s", s["speedup"], None, "x",
                    note=f"SSD share of DeepSpeed's step {s['ds_ssd_share']:.0%}") for s in summary]
    for r in rows:
        if r["error"] == r["error"]:
            out.append(headline("race_deepspeed", f"{r['point']} {r['variant']}: predicted / measured step",
                                round(r["predicted_s"] / r["step_s"], 3), None, "x"))
    return out


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
        return
    ap = arg_parser(__doc__)
    ap.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 2, --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run after one warm-up step")
    ap.add_argument("--ssd-dir", type=Path, default=None,
                    help="directory for both SSD tiers (default: a temp dir)")
    ap.add_argument("--variants", nargs="+", choices=[*DS_VARIANTS, *TF_VARIANTS], default=None)
    ap.add_argument("--points", nargs="+", type=int, choices=range(len(SWEEP)), default=None,
                    help="only these points of the sweep (0-based), merged into race_runs.json under --out")
    ap.add_argument("--predict-only", action="store_true",
                    help="run nothing: re-predict the measured race (race_runs.json under --out) and rewrite "
                         "race.csv, race.md, race.png and race_box.yaml")
    args = ap.parse_args(argv)
    if args.predict_only:
        if not (args.out / RUNS_FILE).exists():  # nothing measured to re-predict: bad input, nothing written
            print(f"race_deepspeed: --predict-only: no {args.out / RUNS_FILE}; run the race first or pass "
                  "the --out folder that holds it", file=sys.stderr)
            sys.exit(2)
        rows = predict_only(args.out)
    else:
        rows = run(args.quick, args.out, args.reps, args.steps, args.ssd_dir,
                   tuple(args.variants) if args.variants else None,
                   [SWEEP[i] for i in args.points] if args.points else None, merge=args.points is not None)
    if rows:  # a skipped race (no DeepSpeed, no libaio) has said so in one line and wrote nothing
        print(f"wrote {args.out / 'race.csv'}, race.md and race.png", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
