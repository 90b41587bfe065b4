"""Executor efficiency: `tierflow run` against plain PyTorch training of the same blocks, in one process,
alternating.

    python experiments/bench_executor.py [--quick] [--device cpu|cuda] [--ssd-dir DIR] [--hw PROFILE]
        [--ssd-schedule S] [--out DIR]

1. **On the device.** Plain PyTorch: the executor's own blocks (`executor.models.BlockModel`) trained with
   `torch.optim.AdamW` on the device, the batch in micro-batches with gradient accumulation, no offload, no
   recompute. tierflow: a plan of the same batch and micro-batches with every tensor class on the device and
   no recompute (`horizontal`, runtime ideal: the optimizer step is one `adam_gpu` op per block), run by the
   executor (`run_plan`, the code behind `tierflow run`). The two alternate round by round, so that a noisy
   machine slows both alike; each reports the median step time after its first (warm-up) round, and each
   run of tierflow's counts its STEPS_PER_ROUND steps after its lead steps (`lead_steps`: the run's setup
   and, with CUDA graphs, their warm-up and capture, which a long run pays once) (`ratio`:
   plain's over tierflow's; `ratio_paired`: the median over the rounds of each round's own ratio, with its
   min and max, which the box's drift of speed between rounds moves less). Target: tierflow's tokens/s at
   least 0.95x plain PyTorch's (0.98x for the large model, 8 x 768, where per-op costs matter less).
2. **Optimizer states on the SSD tier.** A plan of the same batch (vertical, --ssd-schedule for another) with
   fp32 master weights and Adam moments on the SSD tier (weights and gradients on the device and in host
   memory): the executor must overlap the SSD traffic
   with compute as the plan says, so its step time should be max(compute, SSD time), with compute = the plain
   PyTorch step above and SSD time = the bytes the run moved per step over the store's rates measured here
   (`measure_store`, the executor's own SsdStore: O_DIRECT, checksums). Target: within 15%. Beside it, what
   the SSD tier costs the compute on the same cores: the CPU seconds per step of the run's SSD I/O (requests
   and checksums, `SsdStore.cpu_s`), and plain PyTorch's step while another thread keeps the store busy
   writing and reading (`plain_beside_store_s`, with the GB/s the store moved meanwhile).

3. **The simulator's prediction.** Both plans are made on a profile of this box (`--hw`, or calibrated at the
   start of the run at calibrate's --quick sizes, with the run's threads: bench_executor_box.yaml), and the
   last round of each is compared with the prediction as `tierflow compare` does: the step against the
   predicted step, and each op kind's busy time (bench_executor_kinds.csv; `kinds_off` names the kinds off by
   more than 15% that take at least 5% of the ops' time).

Writes bench_executor.csv under --out (a run replaces the rows of its models and keeps the others; with the
default --out also the generated tables of docs/executor.md). --quick: one small model, fewer rounds, no
calibration and no prediction (a CI test runs it).
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
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

from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.compare import compare
from tierflow.planner.io.planfile import load_plan, plan_from_graph, write_plan

SEQ, BATCH, MICRO_BATCH = 256, 8, 2
STEPS_PER_ROUND = 3  # one round of the plan's three iterations
ON_GPU, ON_CPU, ON_SSD = Split(1.0, 0.0, 0.0), Split(0.0, 1.0, 0.0), Split(0.0, 0.0, 1.0)
ALL_ON_DEVICE = Placement(weights=ON_GPU, master=ON_GPU, adam_m=ON_GPU, adam_v=ON_GPU, grads=ON_GPU,
                          checkpoints=ON_GPU)
STATES_ON_SSD = Placement(weights=ON_GPU, master=ON_SSD, adam_m=ON_SSD, adam_v=ON_SSD, grads=ON_CPU,
                          checkpoints=ON_GPU)


def gpt(layers: int, hidden: int) -> ModelSpec:
    base = get_model("tiny-gpt")
    heads = hidden // 64
    return replace(base, name=f"gpt-{layers}x{hidden}", num_layers=layers, hidden=hidden, num_heads=heads,
                   num_kv_heads=heads, ffn_hidden=4 * hidden, vocab_size=2048, seq_len=SEQ, max_positions=SEQ)


MODELS = {"small": gpt(4, 256), "medium": gpt(6, 384), "large": gpt(8, 768), "tiny": gpt(2, 128)}
DEFAULT_MODELS = ("small", "medium")  # --quick: small; large (slow on 2 cores), tiny: --models
TARGET_RATIO = {"large": 0.98}  # tierflow over plain tokens/s, on the device; 0.95 for the others
# the plan with the states on the SSD tier: vertical (GreedySnake's order, with its deferred optimizer part),
# which the simulator predicts within 2% of the on-device plan on this box calibrated; horizontal's optimizer
# chain (each block's states read, updated and written back before its next forward) is predicted at +5-8%
SSD_SCHEDULE = "vertical"
TARGET_VS_BOUND = 0.15  # states on the SSD tier: step within 15% of max(compute, SSD time)
GRAPHS_FIELD = "cuda_graphs"  # RunConfig's CUDA graph switch (tierflow run --cuda-graphs / --no-cuda-graphs)
RUN_EXTRA: dict = {}  # RunConfig fields every tierflow run of this benchmark gets (--[no-]cuda-graphs)


def graphs_missing() -> str | None:
    """Why this tierflow cannot switch CUDA graphs (RunConfig has no `cuda_graphs`), or None."""
    from dataclasses import fields

    from tierflow.executor.run import RunConfig

    if GRAPHS_FIELD in {f.name for f in fields(RunConfig)}:
        return None
    return f"this tierflow's run options have no CUDA graph switch (RunConfig.{GRAPHS_FIELD})"


def make_plan(model: ModelSpec, placement: Placement, path: Path, hw: HardwareProfile | None = None,
              schedule: str = "horizontal") -> Plan:
    """A plan of `schedule` (default horizontal) with no recompute on `hw` (this box calibrated: its
    prediction is compared with the run; default a stock profile, for --quick, which predicts nothing), with
    room for every placement."""
    hw = (hw or load_profile("rtx3090-desktop")).with_overrides({"gpu.memory_gib": 64, "cpu.memory_gib": 64})
    cfg = make_schedule(schedule, model, hw, batch=BATCH, micro_batch=MICRO_BATCH, seq=SEQ,
                        placement=placement, iterations=STEPS_PER_ROUND, runtime="ideal", recompute=False)
    write_plan(plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg)), path)
    return load_plan(path)


def box_profile(device: str, ssd_dir: Path, out_dir: Path, hw_path: Path | None) -> HardwareProfile:
    """The profile the plans are predicted on: --hw, or this box calibrated now (`tierflow calibrate`'s
    measurements at its --quick sizes, on the device and with the torch threads of this run), written to
    out_dir/bench_executor_box.yaml so that a later run (--models large) can reuse it with --hw."""
    if hw_path is not None:
        return load_profile(str(hw_path))
    from tierflow.executor.calibration import QUICK, build_profile, run_measurements, write_profile

    prog = Progress(12, "calibrate")
    m = run_measurements(QUICK, ssd_dir, prog, device="cpu" if device.startswith("cpu") else "cuda")
    prog.finish()
    if m.get("ssd"):
        m["ssd"]["dir"] = "the benchmark's SSD directory"  # a temporary path: kept out of the results
    cal = build_profile(m, None, name="bench-executor-box", device_gib=64)
    write_profile(cal, out_dir / "bench_executor_box.yaml")
    return cal.profile


def plan_model(model: ModelSpec, device: str) -> ModelSpec:
    """The model as the run trains it: fp32 on a CPU device (calibrate reports the bytes it really moves)."""
    return model.with_precision("fp32") if device.startswith("cpu") else model


class PlainTrainer:
    """Plain PyTorch: BlockModel + AdamW (the executor's hyper-parameters), gradient accumulation over the
    micro-batches, on the device, in the main thread."""

    def __init__(self, model: ModelSpec, device: str) -> None:
        import torch

        from tierflow.executor.models import BlockModel
        from tierflow.executor.ops.context import Hyper

        # the emulation of a CUDA device (cpu-adversarial) is the CPU to plain PyTorch
        self.torch, self.device = torch, torch.device("cpu" if device.startswith("cpu") else device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        torch.manual_seed(0)
        self.model = BlockModel(model, dtype=dtype, device=self.device)
        h = Hyper()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                     weight_decay=h.weight_decay)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=g).to(self.device)
        self.y = torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=g).to(self.device)

    def steps(self, n: int) -> list[float]:
        from tierflow.executor.models import loss as lm_loss

        torch, out, num_mb = self.torch, [], BATCH // MICRO_BATCH
        for _ in range(n):
            t0 = time.perf_counter()
            for i in range(num_mb):
                sl = slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH)
                (lm_loss(self.model(self.x[sl]), self.y[sl]) / num_mb).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out


def lead_steps(device: str) -> int:
    """The steps a run of tierflow takes before its steady state, not counted: its first (the run's setup:
    threads, buffers, first launches) and, where the run uses CUDA graphs (--cuda-graphs, or CUDA's default),
    each segment's warm-up and capture (executor/graphs.py: WARMUP eager occurrences, then the capture), which
    a long run pays once."""
    from tierflow.executor.graphs import WARMUP

    return 1 + (WARMUP if graphs_on(device) else 0)


def graphs_on(device: str) -> bool:
    """Whether this benchmark's runs on `device` use CUDA graphs: --cuda-graphs / --no-cuda-graphs, else the
    run's default (on for CUDA, off elsewhere)."""
    graphs = RUN_EXTRA.get(GRAPHS_FIELD)
    return device.startswith("cuda") if graphs is None else bool(graphs)


def tierflow_steps(plan: Plan, device: str, ssd_dir: Path | None,
                   trace_dir: Path | None = None) -> tuple[list[float], float, float]:
    """A run of the plan through `run_plan`, its lead steps (lead_steps) then STEPS_PER_ROUND counted ones:
    the counted steps' times, and per step of the run the SSD bytes moved and the CPU seconds of the SSD
    tier's I/O (requests and checksums, all threads); with `trace_dir`, the measured trace written there
    (trace.json, for `compare`)."""
    from tierflow.executor.run import OutputOptions, RunConfig, run_plan

    lead = lead_steps(device)
    out = OutputOptions(out=str(trace_dir) if trace_dir else None, quiet=True)
    res = run_plan(plan, RunConfig(steps=lead + STEPS_PER_ROUND, device=device,
                                   ssd_dir=str(ssd_dir) if ssd_dir else None, output=out, **RUN_EXTRA))
    n = len(res.records)
    return ([r.step_s for r in res.records[lead:]], (res.ssd_bytes_read + res.ssd_bytes_written) / n,
            res.ssd_cpu_s / n)


KIND_MISS = 0.15  # an op kind "misses" when its measured busy time is off its prediction by more than this
KIND_SHARE = 0.05  # ... and its measured time is at least this share of all the ops' measured time


def prediction(plan: Plan, trace: Path, name: str, case: str, step_s: float,
               graphs: bool = False) -> tuple[dict, list[dict]]:
    """The simulator against the measured round (`tierflow compare`): the predicted step, the measured
    median step's error against it, and the op kinds that miss (busy time off by > KIND_MISS, at least
    KIND_SHARE of the ops' time), largest miss in seconds first; and one row per op kind. `graphs`: the run
    replayed the plan's capture segments as CUDA graphs, so the step is predicted as it ran them
    (planner/core/capture.py's graphed_graph) and no op kind is compared (a replay is timed as a whole)."""
    if graphs:
        from tierflow.planner.core.capture import capture_plan, graphed_graph
        from tierflow.planner.core.simulator import simulate_graph

        if capture_plan(plan.graph).segments:
            pred_s = simulate_graph(graphed_graph(plan.graph, plan.hardware), plan.hardware).iteration_s
            return ({"predicted_s": round(pred_s, 4), "vs_predicted": round(step_s / pred_s - 1, 4),
                     "kinds_off": "- (CUDA graphs: a replay is timed, not its ops)"}, [])
    d = compare(plan, trace).to_dict()
    pred_s = d["predicted_iteration_s"]
    total_s = sum(k["measured_s"] for k in d["by_kind"]) or 1.0
    misses = sorted((k for k in d["by_kind"] if k["predicted_s"] > 0 and abs(k["ratio"] - 1) > KIND_MISS
                     and k["measured_s"] >= KIND_SHARE * total_s),
                    key=lambda k: -abs(k["measured_s"] - k["predicted_s"]))
    row = {"predicted_s": round(pred_s, 4), "vs_predicted": round(step_s / pred_s - 1, 4),
           "kinds_off": "; ".join(f"{k['kind']} {k['ratio']:.2f}x" for k in misses)}
    its = d["iterations"]
    kinds = [{"model": name, "case": case, "kind": k["kind"], "resource": k["resource"],
              "ops_per_step": round(k["ops"] / its), "predicted_s_per_step": round(k["predicted_s"] / its, 4),
              "measured_s_per_step": round(k["measured_s"] / its, 4),
              "ratio": round(k["ratio"], 3) if k["predicted_s"] > 0 else ""} for k in d["by_kind"]]
    return row, kinds


def beside_store(plain: PlainTrainer, ssd_dir: Path, nbytes: int, steps: int) -> tuple[float, float]:
    """Plain PyTorch's median step time while another thread keeps the executor's SsdStore busy writing and
    reading back a tensor of `nbytes` (the interference of the SSD tier with compute on the same cores), and
    the GB/s the store moved meanwhile."""
    import threading

    import torch

    from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty

    root = ssd_dir / "beside"
    root.mkdir(exist_ok=True)
    store = SsdStore(root, warn=lambda m: None)
    data, out = aligned_empty(nbytes), aligned_empty(nbytes)  # whole pages
    nbytes = data.numel()
    stop, moved, errors = threading.Event(), [0], []

    def churn() -> None:
        try:
            while not stop.is_set():
                store.write("t", data)
                store.read("t", torch.uint8, nbytes, into=lambda n: out)
                moved[0] += 2 * nbytes
        except BaseException as e:  # raised in the main thread
            errors.append(e)

    th = threading.Thread(target=churn, daemon=True)
    t0 = time.perf_counter()
    th.start()
    try:
        times = plain.steps(steps)
    finally:
        stop.set()
        th.join()
        store.close()
    if errors:
        raise errors[0]
    return statistics.median(times), moved[0] / (time.perf_counter() - t0) / 1e9


def measure_store(ssd_dir: Path, nbytes: int, files: int = 3, repeats: int = 3) -> dict[str, float]:
    """GB/s of the executor's own SSD store, writing then reading `files` files of `nbytes` each, as a step's
    optimizer-state ops do: calibrate's measurement (executor.calibrate.measure_store), the best of
    `repeats`."""
    from tierflow.executor.calibration import measure_store as store_rates

    runs = [store_rates(ssd_dir, files * nbytes, mixed_s=0.0, files=files) for _ in range(repeats)]
    return {"write_gbps": max(r["write_gbps"] for r in runs), "read_gbps": max(r["read_gbps"] for r in runs)}


def run(quick: bool, out_dir: Path, device: str = "cpu", ssd_dir: Path | None = None,
        rounds: int | None = None, names: list[str] | None = None, hw_path: Path | None = None,
        ssd_schedule: str = SSD_SCHEDULE, device_only: bool = False) -> list[dict]:
    """The alternating rounds of every model; the rows replace those of the same models in
    bench_executor.csv (and bench_executor_kinds.csv), whose other models' rows are kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = names or (["small"] if quick else list(DEFAULT_MODELS))
    rounds = rounds or (3 if quick else 6)
    rows, kinds = [], []
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-executor-") as tmp:
        work = Path(tmp)
        ssd = ssd_dir or work / "ssd"
        ssd.mkdir(parents=True, exist_ok=True)
        hw = None if quick and hw_path is None else box_profile(device, ssd, out_dir, hw_path)
        prog = Progress(len(names) * rounds, "bench executor")
        for name in names:
            got, got_kinds = one_model(name, device, ssd, work, hw, rounds, prog, ssd_schedule, device_only)
            rows += got
            kinds += got_kinds
        prog.finish()
    rows = merged(out_dir / "bench_executor.csv", rows, names)
    write_csv(rows, out_dir / "bench_executor.csv")
    kinds_csv = out_dir / "bench_executor_kinds.csv"
    if kinds:
        write_csv(merged(kinds_csv, kinds, names), kinds_csv)
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, DOC_TABLE, executor_table(rows))
        if kinds:
            write_generated_block(DOC, KINDS_TABLE, kinds_table(read_rows(kinds_csv)))
    print_table(rows, ["model", "case", "plain_step_s", "tierflow_step_s", "ratio", "ratio_paired",
                       "ratio_paired_min", "ratio_paired_max", "bound_s", "vs_bound", "predicted_s",
                       "vs_predicted", "kinds_off"])
    return rows


def one_model(name: str, device: str, ssd: Path, work: Path, hw: HardwareProfile | None, rounds: int,
              prog: Progress, ssd_schedule: str = SSD_SCHEDULE,
              device_only: bool = False) -> tuple[list[dict], list[dict]]:
    """Plain PyTorch and the two plans of model `name` (the on-device one alone with `device_only`),
    alternating round by round; a row per plan, and the per-op-kind rows of the prediction (none without a
    profile of this box)."""
    model = plan_model(MODELS[name], device)
    plans = {"on device": make_plan(model, ALL_ON_DEVICE, work / f"{name}-dev.json", hw)}
    if not device_only:
        plans["states on SSD"] = make_plan(model, STATES_ON_SSD, work / f"{name}-ssd.json", hw, ssd_schedule)
    load_start = os.getloadavg()[0]
    plain = PlainTrainer(model, device)
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in plans}}
    paired: list[float] = []  # per counted round: plain's median step over the on-device plan's
    ssd_bytes_per_step = 0.0
    ssd_cpu_s: list[float] = []
    traces = {case: work / f"{name}-{i}-trace" for i, case in enumerate(plans)}
    for r in range(rounds):  # alternating; round 0 warms every path up and is not counted
        prog.step(f"{name} round {r + 1}")
        t = plain.steps(STEPS_PER_ROUND)
        plain_round = statistics.median(t)
        if r:
            times["plain"] += t
        for case, plan in plans.items():
            on_ssd = ssd if case == "states on SSD" else None
            last = r == rounds - 1 and hw is not None  # the last round's trace goes to compare
            t, moved, io_cpu_s = tierflow_steps(plan, device, on_ssd, traces[case] if last else None)
            if r:
                times[case] += t
                if case == "on device":
                    paired.append(plain_round / statistics.median(t))
            if case == "states on SSD":
                ssd_bytes_per_step = moved
                if r:
                    ssd_cpu_s.append(io_cpu_s)
    plain_s = statistics.median(times["plain"])
    tokens = BATCH * SEQ
    dev_s = statistics.median(times["on device"])
    rows = [{"model": name, "params_m": round(model.total_params() / 1e6, 2), "case": "on device",
             "plain_step_s": round(plain_s, 4), "tierflow_step_s": round(dev_s, 4),
             "plain_tokens_per_s": round(tokens / plain_s), "tierflow_tokens_per_s": round(tokens / dev_s),
             "ratio": round(plain_s / dev_s, 3), "ratio_paired": round(statistics.median(paired), 3),
             "ratio_paired_min": round(min(paired), 3), "ratio_paired_max": round(max(paired), 3),
             "target": f">= {TARGET_RATIO.get(name, 0.95)}x plain",
             "bound_s": "", "vs_bound": ""}]
    if not device_only:
        rows.append(ssd_row(name, plain, ssd, plain_s, times["states on SSD"], ssd_bytes_per_step, ssd_cpu_s))
    kinds = []
    for row, (case, plan) in zip(rows, plans.items()):
        if hw is not None:
            pred, k = prediction(plan, traces[case] / "trace.json", name, case, row["tierflow_step_s"],
                                 graphs=graphs_on(device))
            row.update(pred)
            kinds += k
        row.update({"schedule": plans[case].config.family,
                    "rounds": rounds - 1, "threads": _threads(), "load_1m_start": round(load_start, 2),
                    "load_1m_end": round(os.getloadavg()[0], 2),
                    "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    return rows, kinds


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def merged(path: Path, rows: list[dict], names: list[str]) -> list[dict]:
    """`rows` in place of the rows of the same models in the CSV at `path` (the others kept), in MODELS'
    order."""
    keep = [r for r in read_rows(path) if r["model"] not in names]
    order = list(MODELS)
    return sorted(keep + rows, key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))


def ssd_row(name: str, plain: PlainTrainer, ssd: Path, plain_s: float, times: list[float],
            ssd_bytes_per_step: float, ssd_cpu_s: list[float]) -> dict:
    """The states-on-SSD row: the step against max(compute, SSD time) at the store's rates measured now, the
    SSD I/O's CPU per step, and plain PyTorch's step beside a busy store."""
    per_file = max(1 << 20, int(ssd_bytes_per_step / 6))  # read + write of master, m, v: ~6 files a step
    rates = measure_store(ssd, per_file)
    ssd_s = ssd_bytes_per_step / 2 / (rates["read_gbps"] * 1e9) + ssd_bytes_per_step / 2 / (
        rates["write_gbps"] * 1e9)
    bound_s = max(plain_s, ssd_s)
    busy_s, busy_gbps = beside_store(plain, ssd, per_file, STEPS_PER_ROUND)
    st_s = statistics.median(times)
    tokens = BATCH * SEQ
    return {"model": name, "params_m": round(MODELS[name].total_params() / 1e6, 2),
            "case": "states on SSD", "plain_step_s": round(plain_s, 4),
            "tierflow_step_s": round(st_s, 4), "plain_tokens_per_s": round(tokens / plain_s),
            "tierflow_tokens_per_s": round(tokens / st_s), "ratio": round(plain_s / st_s, 3),
            "target": f"within {TARGET_VS_BOUND:.0%} of max(compute, SSD time)", "bound_s": round(bound_s, 4),
            "vs_bound": round(st_s / bound_s - 1, 4), "ssd_gb_per_step": round(ssd_bytes_per_step / 1e9, 4),
            "store_read_gbps": round(rates["read_gbps"], 2),
            "store_write_gbps": round(rates["write_gbps"], 2), "ssd_s": round(ssd_s, 4),
            "ssd_io_cpu_s": round(statistics.median(ssd_cpu_s), 4),
            "plain_beside_store_s": round(busy_s, 4), "store_beside_gbps": round(busy_gbps, 2)}


DOC = REPO_DIR / "docs" / "executor.md"
DOC_TABLE = "executor efficiency (experiments/bench_executor.py from experiments/results/bench_executor.csv)"
CPU_TABLE = ("the work per step (experiments/bench_executor.py --cpu-work from "
             "experiments/results/bench_executor_cpu.csv)")
KINDS_TABLE = ("states on the SSD tier by op kind (experiments/bench_executor.py from "
               "experiments/results/bench_executor_kinds.csv)")


def _f(x, fmt: str = ".3f") -> str:
    return "" if x in ("", None) else format(float(x), fmt)


def _result(r: dict) -> str:
    """The row's figure against its target, in bold when it misses."""
    if r["case"] == "on device":
        want = float(r["target"].split()[1].rstrip("x"))
        got = float(r["ratio"])
        return f"**{got:.2f}x**" if got < want else f"{got:.2f}x"
    got = float(r["vs_bound"])
    txt = f"{got:+.0%} over max(compute, SSD)"
    return f"**{txt}**" if got > TARGET_VS_BOUND else txt


def _predicted(r: dict) -> str:
    if r.get("predicted_s") in ("", None):
        return ""
    err = float(r["vs_predicted"])
    txt = f"{float(r['predicted_s']):.3f} ({err:+.0%})"
    return f"**{txt}**" if abs(err) > TARGET_VS_BOUND else txt


def executor_table(rows: list[dict]) -> str:
    """docs/executor.md's table of bench_executor.csv: per model and case the steps, the result against its
    target, the simulator's prediction on this box calibrated and the op kinds that miss theirs, the SSD
    figures, and the load and time of the run."""
    out = []
    for r in rows:
        m = MODELS[r["model"]]
        ssd = r["case"] == "states on SSD"
        beside = ""
        if ssd:
            slower = float(r["plain_beside_store_s"]) / float(r["plain_step_s"]) - 1
            beside = (f"{_f(r['plain_beside_store_s'])} s ({slower:+.0%}) at "
                      f"{_f(r['store_beside_gbps'], '.2f')} GB/s")
        load = f"{_f(r.get('load_1m_start'), '.1f')}-{_f(r.get('load_1m_end'), '.1f')}"
        case = "states on the SSD tier" if ssd else "on the device"
        if r.get("schedule"):
            case += f" ({r['schedule']})"
        out.append([f"{m.num_layers} x {m.hidden}", case,
                    _f(r["plain_step_s"]), _f(r["tierflow_step_s"]), _result(r),
                    r["target"].replace("max(compute, SSD time)", "max(compute, SSD)"), _predicted(r),
                    r.get("kinds_off", "") or "",
                    f"{_f(r['ssd_gb_per_step'])}, {_f(r['ssd_s'])} s" if ssd else "",
                    _f(r["ssd_io_cpu_s"]) if ssd else "", beside,
                    f"{r['utc']}, {load}" if r.get("utc") else ""])
    head = ["model", "case", "plain s/step", "tierflow s/step", "result", "target",
            "predicted s/step (error)", "op kinds off their prediction", "SSD GB/step, SSD s",
            "SSD I/O CPU s/step", "plain beside a busy store", "run (UTC), load"]
    return markdown_table(head, out)


def kinds_table(rows: list[dict]) -> str:
    """docs/executor.md's table of bench_executor_kinds.csv: the states-on-SSD plan's op kinds, predicted
    against measured busy time per step."""
    out = [[f"{MODELS[r['model']].num_layers} x {MODELS[r['model']].hidden}", r["kind"], r["resource"],
            r["ops_per_step"], _f(r["predicted_s_per_step"], ".4f"), _f(r["measured_s_per_step"], ".4f"),
            (f"**{float(r['ratio']):.2f}x**" if abs(float(r["ratio"]) - 1) > KIND_MISS else
             f"{float(r['ratio']):.2f}x") if r["ratio"] not in ("", None) else ""]
           for r in rows if r["case"] == "states on SSD"]
    return markdown_table(["model", "op kind", "resource", "ops/step", "predicted s/step", "measured s/step",
                           "measured / predicted"], out)


def cpu_work_table(rows: list[dict]) -> str:
    """docs/executor.md's table of bench_executor_cpu.csv: CPU seconds per step, median (min-max)."""
    def spread(r: dict, k: str) -> str:
        return f"{_f(r[k])} ({_f(r[k + '_min'])}-{_f(r[k + '_max'])})"

    out = [[f"{MODELS[r['model']].num_layers} x {MODELS[r['model']].hidden}", spread(r, "plain_cpu_s"),
            spread(r, "tierflow_cpu_s"), f"{_f(r['ratio'], '.2f')}x",
            f"{spread(r, 'states_on_ssd_cpu_s')}, {_f(r['ssd_gb_per_step'])} GB"] for r in rows]
    return markdown_table(["model", "plain PyTorch CPU s/step", "tierflow on device", "plain / tierflow",
                           "tierflow, states on SSD (SSD GB/step)"], out)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run_cpu_s(plan: Plan, ssd: Path | None) -> tuple[float, int]:
    """CPU seconds and SSD bytes of STEPS_PER_ROUND steps of `plan`: a run of two rounds minus a run of one,
    which cancels the run's setup (state init, files, threads)."""
    from tierflow.executor.run import OutputOptions, RunConfig, run_plan

    spent, moved = [], []
    for steps in (STEPS_PER_ROUND, 2 * STEPS_PER_ROUND):
        c0 = _cpu_s()
        opts = RunConfig(steps=steps, device="cpu", ssd_dir=str(ssd) if ssd else None,
                         output=OutputOptions(quiet=True))
        res = run_plan(plan, opts)
        spent.append(_cpu_s() - c0)
        moved.append(res.ssd_bytes_read + res.ssd_bytes_written)
    return spent[1] - spent[0], moved[1] - moved[0]


def _spread(name: str, xs: list[float]) -> dict:
    return {name: round(statistics.median(xs), 4), f"{name}_min": round(min(xs), 4),
            f"{name}_max": round(max(xs), 4)}


def cpu_work(out_dir: Path, names: list[str], rounds: int) -> list[dict]:
    """The work each side does per step, in CPU seconds of the whole process (all threads): plain PyTorch's
    over STEPS_PER_ROUND steps; tierflow's (the on-device plan, and the plan with the states on the SSD tier)
    from _run_cpu_s. Unlike wall time, this barely moves on a busy machine when torch computes on one thread
    (OMP_NUM_THREADS=1): it shows what the executor and its SSD tier add to the work, not how the box
    schedules it; on a 2-core box the SSD tier's CPU seconds come out of the compute's cores."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-executor-") as tmp:
        ssd = Path(tmp) / "ssd"
        ssd.mkdir()
        for name in names:
            model = MODELS[name]
            plans = {"device": make_plan(model, ALL_ON_DEVICE, Path(tmp) / f"{name}.json"),
                     "ssd": make_plan(model, STATES_ON_SSD, Path(tmp) / f"{name}-ssd.json")}
            plain = PlainTrainer(model, "cpu")
            plain.steps(1)
            for case, plan in plans.items():  # warm-up
                _run_cpu_s(plan, ssd if case == "ssd" else None)
            got: dict[str, list[float]] = {"plain": [], "device": [], "ssd": []}
            moved = 0
            for _ in range(rounds):  # alternating
                c0 = _cpu_s()
                plain.steps(STEPS_PER_ROUND)
                got["plain"].append((_cpu_s() - c0) / STEPS_PER_ROUND)
                for case, plan in plans.items():
                    cpu_s, moved = _run_cpu_s(plan, ssd if case == "ssd" else None)
                    got[case].append(cpu_s / STEPS_PER_ROUND)
            p, d = statistics.median(got["plain"]), statistics.median(got["device"])
            ssd_gb = moved / STEPS_PER_ROUND / 1e9
            rows.append({"model": name, "threads": _threads(), "rounds": rounds,
                         **_spread("plain_cpu_s", got["plain"]),
                         **_spread("tierflow_cpu_s", got["device"]), "ratio": round(p / d, 3),
                         **_spread("states_on_ssd_cpu_s", got["ssd"]), "ssd_gb_per_step": round(ssd_gb, 4)})
    write_csv(rows, out_dir / "bench_executor_cpu.csv")
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, CPU_TABLE, cpu_work_table(rows))
    print_table(rows, ["model", "threads", "plain_cpu_s", "tierflow_cpu_s", "ratio", "states_on_ssd_cpu_s",
                       "ssd_gb_per_step"])
    return rows


def _op_cpu_s(fn) -> tuple[dict[str, float], dict[str, int]]:
    """Self CPU seconds and calls of each torch op while `fn` runs, on every thread (torch.profiler with
    profile_all_threads: the executor computes in its workers, not in the main thread)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        fn()
    cpu: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in prof.key_averages():
        cpu[e.key] = cpu.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
        calls[e.key] = calls.get(e.key, 0) + e.count
    return cpu, calls


def op_work(out_dir: Path, names: list[str], top: int = 12) -> list[dict]:
    """Where each side's step goes, op by op: self CPU seconds per step of every torch op, plain PyTorch's
    STEPS_PER_ROUND steps against one round of the on-device plan (after a warm-up of each), the `top` ops
    whose time differs most, then the totals (bench_executor_ops.csv)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-executor-") as tmp:
        for name in names:
            rows += _op_rows(name, make_plan(MODELS[name], ALL_ON_DEVICE, Path(tmp) / f"{name}.json"), top)
    write_csv(rows, out_dir / "bench_executor_ops.csv")
    print_table(rows, ["model", "op", "plain_cpu_s_per_step", "tierflow_cpu_s_per_step",
                       "plain_calls_per_step", "tierflow_calls_per_step"])
    return rows


def _op_rows(name: str, plan: Plan, top: int) -> list[dict]:
    plain = PlainTrainer(MODELS[name], "cpu")
    plain.steps(1)
    tierflow_steps(plan, "cpu", None)
    walls: dict[str, list[float]] = {}

    def plain_round() -> None:
        walls["plain"] = plain.steps(STEPS_PER_ROUND)

    def tierflow_round() -> None:
        walls["tierflow"] = tierflow_steps(plan, "cpu", None)[0]

    (p_cpu, p_n), (t_cpu, t_n) = _op_cpu_s(plain_round), _op_cpu_s(tierflow_round)
    keys = sorted(set(p_cpu) | set(t_cpu), key=lambda k: -abs(t_cpu.get(k, 0) - p_cpu.get(k, 0)))
    p_cpu["total"], t_cpu["total"] = sum(p_cpu.values()), sum(t_cpu.values())
    p_n["total"], t_n["total"] = sum(p_n.values()), sum(t_n.values())
    per, run_per = float(STEPS_PER_ROUND), float(STEPS_PER_ROUND + lead_steps("cpu"))  # steps each side ran
    return [{"model": name, "threads": _threads(), "op": k,
             "plain_cpu_s_per_step": round(p_cpu.get(k, 0.0) / per, 4),
             "tierflow_cpu_s_per_step": round(t_cpu.get(k, 0.0) / run_per, 4),
             "plain_calls_per_step": round(p_n.get(k, 0) / per),
             "tierflow_calls_per_step": round(t_n.get(k, 0) / run_per),
             "plain_step_s": round(statistics.median(walls["plain"]), 4),
             "tierflow_step_s": round(statistics.median(walls["tierflow"]), 4)}
            for k in [*keys[:top], "total"]]


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--device", default="cpu",
                    help="cpu (default), cuda, or cpu-adversarial (the emulation of a CUDA device: plain "
                    "PyTorch then runs on the CPU)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternating rounds, the first a warm-up (default 6; --quick 3); at least 2")
    ap.add_argument("--ssd-dir", type=Path, default=None,
                    help="directory for the SSD tier (default: a temp dir)")
    ap.add_argument("--ssd-schedule", default=SSD_SCHEDULE,
                    choices=["horizontal", "fuyou", "vertical", "block"],
                    help=f"the schedule of the plan with the states on the SSD tier (default {SSD_SCHEDULE})")
    ap.add_argument("--hw", type=Path, default=None,
                    help="the profile of this box to predict with (default: calibrate it now, at calibrate's "
                    "--quick sizes, and write bench_executor_box.yaml under --out; --quick: no prediction)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                    help="model sizes (default small medium; --quick small): " + ", ".join(
                        f"{k} = {m.num_layers} x {m.hidden}" for k, m in MODELS.items()))
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="tierflow's runs with CUDA graphs on / off (the run option; default: the run's own "
                    "default)")
    ap.add_argument("--device-only", action="store_true",
                    help="only the plan with every tensor on the device (not the states on the SSD tier)")
    ap.add_argument("--cpu-work", action="store_true",
                    help="instead: CPU seconds per step of each side on the CPU (bench_executor_cpu.csv); "
                    "run with OMP_NUM_THREADS=1 on a shared machine")
    ap.add_argument("--ops", action="store_true",
                    help="instead: self CPU seconds per step of every torch op, plain PyTorch against the "
                    "on-device plan, under torch.profiler on all threads (bench_executor_ops.csv)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.rounds is not None and args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first is a warm-up)")
    if args.cuda_graphs is not None:
        why = graphs_missing()
        if why:
            ap.error(f"--{'' if args.cuda_graphs else 'no-'}cuda-graphs: {why}; run without it")
        RUN_EXTRA[GRAPHS_FIELD] = args.cuda_graphs
    if args.cpu_work:
        cpu_work(args.out, args.models or list(DEFAULT_MODELS), args.rounds or 3)
        return
    if args.ops:
        op_work(args.out, args.models or list(DEFAULT_MODELS))
        return
    run(args.quick, args.out, args.device, args.ssd_dir, args.rounds, args.models, args.hw, args.ssd_schedule,
        args.device_only)
    print(f"wrote {args.out / 'bench_executor.csv'} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
