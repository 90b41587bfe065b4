"""LoRA over the tiers, in simulation: full fine-tuning against LoRA adapters (rank 8-64) per schedule, the
plans of LLaMA-2 70B on the Fuyou box, and the largest model per box.

    python experiments/lora_tiers.py [--quick] [--out DIR]

For LLaMA-2 70B and GPT-3 175B on the Fuyou box (rtx4090-lohan: 768 GB, 12 SSDs) and on a 4090 box with 256 GB
and 4 SSDs (rtx4090-lohan with --set cpu.memory_gib=256, cpu.reserved_gib=19 (the profile's rule: 6 GiB +
5%), ssd.count=4): each schedule's default plan (horizontal, fuyou, vertical, runtime ideal, batch 16,
micro-batch 1) simulated for full fine-tuning and LoRA of rank 8, 16, 32, 64 (all seven projections):
tokens/s, hardware TFLOPS, the GPU's busy share and the SSD bytes written per iteration (a default placement
that overflows a tier: does not fit). Then `tierflow plan`'s search
(plan_search, 60 s, no window check) for LLaMA-2 70B on the Fuyou box at batch 2 and 16, full and LoRA rank
16: the issue's targets (GPU busy >= 85%, LoRA >= 1.25x full at batch 16, zero SSD writes). Then the largest
LLaMA- and GPT-family model `tierflow capacity` trains (batch 16 x 2048, verified by simulation) per box, full
and LoRA rank 16, with a third box: the 4090 with 256 GiB and no SSD. Writes lora_tiers.csv and the tables of
docs/lora.md. --quick: LLaMA-2 7B on the 4-SSD box, one rank, no search, no capacity (a CI test, structure
only).

    python experiments/lora_tiers.py --cpu [--quick] [--out DIR]

Part (b), on this CPU (one torch thread): a tiny LLaMA fine-tuned with LoRA on Python's stdlib sources in
tierflow (the plan `tierflow plan --lora` makes on this box's calibrated profile, experiments/results/
closed_loop_cpu.yaml; the base in host memory, and on the SSD tier), in plain PyTorch + PEFT (everything in
memory, the plan's micro-batch) and in DeepSpeed ZeRO-3 + PEFT (parameters and optimizer states offloaded to
host memory, and to NVMe; needs `pip install deepspeed==0.19.8`, its own process per run, as
race_deepspeed.py runs it; where it cannot run, one line says why). Validation losses of the full runs; step
times from rounds alternating tierflow and PEFT. Writes lora_cpu.csv and lora_cpu_rounds.csv.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from expcommon import (
    BOX_4090_256GB_4SSDS,
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    markdown_table,
    print_table,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.api import simulate_config
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.lora import LoraConfig
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import make_schedule
from tierflow.planner.core.simulator import CapacityError
from tierflow.planner.io.planning import PlanOptions, make_plan
from tierflow.planner.search.capacity import largest

BATCH = 16
RANKS = (8, 16, 32, 64)
SCHEDULES = ("horizontal", "fuyou", "vertical")
BOXES = {"rtx4090-lohan": {},
         "4090 256 GB 4 SSDs": BOX_4090_256GB_4SSDS,
         "4090 256 GB no SSD": {"cpu.memory_gib": 256, "ssd.count": 0}}
DOC = REPO_DIR / "docs" / "lora.md"
DOC_TABLE = "lora schedules (experiments/lora_tiers.py from experiments/results/lora_tiers.csv)"
COLUMNS = ("kind", "model", "box", "batch", "variant", "schedule", "tokens_per_s", "hw_tflops", "gpu_busy",
           "ssd_write_gb", "ssd_read_gb", "largest_params_b", "largest_model")


def box(name: str):
    return load_profile("rtx4090-lohan").with_overrides(BOXES[name])


def variant_model(model_name: str, rank: int | None):
    m = get_model(model_name)
    return m if rank is None else m.with_lora(LoraConfig(rank))


def _row(kind: str, model: str, box_name: str, batch: int, rank: int | None, schedule: str, r=None,
         largest_params: float | str = "", largest_model: str = "") -> dict:
    row = dict.fromkeys(COLUMNS, "")
    row.update(kind=kind, model=model, box=box_name, batch=batch, variant=f"lora r{rank}" if rank else "full",
               schedule=schedule, largest_params_b=largest_params, largest_model=largest_model)
    if r is not None:
        row.update(tokens_per_s=round(r.tokens_per_s, 1), hw_tflops=round(r.hw_tflops, 1),
                   gpu_busy=round(r.busy["gpu"], 3),
                   ssd_write_gb=round(r.link_bytes.get("cpu->ssd", 0.0) / 1e9, 1),
                   ssd_read_gb=round(r.link_bytes.get("ssd->cpu", 0.0) / 1e9, 1))
    return row


def schedule_row(model_name: str, box_name: str, rank: int | None, schedule: str,
                 batch: int = BATCH) -> dict:
    model, hw = variant_model(model_name, rank), box(box_name)
    cfg = make_schedule(schedule, model, hw, batch=batch, micro_batch=1, runtime="ideal", iterations=2)
    try:
        r = simulate_config(model, hw, cfg)
    except CapacityError:
        return _row("schedule", model_name, box_name, batch, rank, schedule, largest_model="does not fit")
    return _row("schedule", model_name, box_name, batch, rank, schedule, r)


def plan_row(model_name: str, box_name: str, rank: int | None, batch: int, time_limit_s: float) -> dict:
    model, hw = variant_model(model_name, rank), box(box_name)
    opts = PlanOptions(time_limit_s=time_limit_s, window=False)
    sr = make_plan(model, hw, batch, model.seq_len, opts).search
    return _row("plan", model_name, box_name, batch, rank, sr.best.config.family, sr.best.result)


def capacity_row(box_name: str, family: str, rank: int | None) -> dict:
    a = largest(family, box(box_name), 16, 2048, BOXES[box_name].get("ssd.count", 1) != 0,
                lora=LoraConfig(rank) if rank else None)
    if a.model is None:  # none of the largest candidates passed the simulation: its reason
        return _row("capacity", family, box_name, 16, rank, "vertical", None, "",
                    f"verification refused: {a.note.split(' at t=')[0]}")
    name = f"{a.model.num_layers} layers x {a.model.hidden}"
    return _row("capacity", family, box_name, 16, rank, "vertical", a.verified,
                round(a.params / 1e9, 1), name)


def run(quick: bool, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if quick:
        rows = [schedule_row("llama2-7b", "4090 256 GB 4 SSDs", rank, s, batch=4)
                for rank in (None, 16) for s in SCHEDULES]
    else:
        rows = [schedule_row(m, b, rank, s) for m in ("llama2-70b", "gpt3-175b")
                for b in ("rtx4090-lohan", "4090 256 GB 4 SSDs") for rank in (None, *RANKS)
                for s in SCHEDULES]
        rows += [plan_row("llama2-70b", "rtx4090-lohan", rank, batch, 60.0)
                 for batch in (2, 16) for rank in (None, 16)]
        rows += [capacity_row(b, fam, rank) for b in BOXES for fam in ("llama", "gpt") for rank in (None, 16)]
    write_csv(rows, out_dir / "lora_tiers.csv")
    if out_dir.resolve() == RESULTS_DIR.resolve():  # from the file, as tests/system/test_docs_tables.py does
        with open(out_dir / "lora_tiers.csv", newline="") as f:
            write_generated_block(DOC, DOC_TABLE, lora_tables(list(csv.DictReader(f))))
    print_table(rows, list(COLUMNS))
    return rows


def _f(x) -> float:
    return float(x) if x not in ("", None) else 0.0


def lora_tables(rows: list[dict]) -> str:
    """docs/lora.md's tables from the rows of lora_tiers.csv: per model, box and schedule the tokens/s of full
    fine-tuning and each rank (and LoRA r16's speed-up); the plans against the issue's targets; the largest
    model per box."""
    sched = [r for r in rows if r["kind"] == "schedule"]
    keys = list(dict.fromkeys((r["model"], r["box"], r["schedule"]) for r in sched))
    variants = list(dict.fromkeys(r["variant"] for r in sched))
    by = {(r["model"], r["box"], r["schedule"], r["variant"]): r for r in sched}
    out = []
    def cell(r: dict) -> str:
        if r["tokens_per_s"] in ("", None):
            return "does not fit"
        return f"{_f(r['tokens_per_s']):,.0f} ({_f(r['hw_tflops']):.0f})"

    for k in keys:
        cells = [cell(by[(*k, v)]) for v in variants]
        full, r16 = _f(by[(*k, "full")]["tokens_per_s"]), by.get((*k, "lora r16"))
        gain = f"{_f(r16['tokens_per_s']) / full:.2f}x" if r16 and full else "-"
        writes = by[(*k, "full")]["ssd_write_gb"]
        out.append((*k, *cells, gain, f"{_f(writes):,.0f}" if writes not in ("", None) else "-"))
    text = markdown_table(["model", "box", "schedule", *[f"{v} tokens/s (hw TFLOPS)" for v in variants],
                           "LoRA r16 / full", "full's SSD writes (GB / iteration)"], out)
    plans = [r for r in rows if r["kind"] == "plan"]
    if plans:
        full = {r["batch"]: _f(r["tokens_per_s"]) for r in plans if r["variant"] == "full"}
        text += "\n\n" + markdown_table(
            ["model", "box", "batch", "variant", "plan", "tokens/s", "vs full", "GPU busy", "SSD writes (GB)",
             "SSD reads (GB)"],
            [(r["model"], r["box"], r["batch"], r["variant"], r["schedule"], f"{_f(r['tokens_per_s']):,.0f}",
              f"{_f(r['tokens_per_s']) / full[r['batch']]:.2f}x" if full.get(r["batch"]) else "-",
              f"{_f(r['gpu_busy']):.0%}", f"{_f(r['ssd_write_gb']):,.0f}", f"{_f(r['ssd_read_gb']):,.0f}")
             for r in plans])
    caps = [r for r in rows if r["kind"] == "capacity"]
    if caps:
        text += "\n\n" + markdown_table(
            ["box", "family", "variant", "largest model", "params (B)", "tokens/s (simulated)"],
            [(r["box"], r["model"], r["variant"], r["largest_model"], r["largest_params_b"] or "-",
              f"{_f(r['tokens_per_s']):,.0f}" if r["tokens_per_s"] not in ("", None) else "-")
             for r in caps])
    return text


# -- part (b): LoRA on this CPU, tierflow against plain PyTorch + PEFT ---------------------------------------

CPU_PROFILE = REPO_DIR / "experiments" / "results" / "closed_loop_cpu.yaml"  # this box, `tierflow calibrate`d


def cpu_settings(quick: bool) -> dict:
    return {"files": 3 if quick else 60, "vocab": 384 if quick else 2048, "layers": 1 if quick else 4,
            "hidden": 64 if quick else 128, "steps": 6 if quick else 120, "batch": 4 if quick else 8,
            "seq": 64 if quick else 128, "rank": 8, "lr": 2e-3, "timing_steps": 4 if quick else 20,
            "repeats": 1 if quick else 5, "search_s": 10.0 if quick else 60.0}


def _llama_config(work: Path, s: dict, vocab: int) -> Path:
    import json

    path = work / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": s["layers"],
                                "hidden_size": s["hidden"], "intermediate_size": 3 * s["hidden"],
                                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": vocab,
                                "max_position_embeddings": s["seq"], "rms_norm_eps": 1e-5,
                                "tie_word_embeddings": False}))
    return path


def cpu_plans(model, s: dict) -> tuple[dict, str]:
    """`tierflow plan --lora`'s choice for the tiny model on this box's calibrated profile (fp32, the CPU as
    the device), as the plan with the frozen base in host memory ("host") and the same schedule with the base
    on the SSD tier ("ssd"); and a line saying what the planner chose. The planner's schedule, micro-batch,
    activations (kept, swapped or recomputed) and placement of checkpoints are taken as chosen; only the
    base's placement is set (to host memory where the planner put part of it elsewhere)."""
    import dataclasses

    from tierflow.planner.core.placement import Split
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import plan_from_graph

    hw = load_profile(CPU_PROFILE)
    opts = PlanOptions(time_limit_s=s["search_s"], window=False, baselines=False)
    planned = make_plan(model, hw, s["batch"], s["seq"], opts)
    model, cfg = planned.problem.model, planned.config
    swapped = cfg.swap_layers if cfg.recompute else model.num_layers
    w, c = cfg.placement.weights, cfg.placement.checkpoints
    chosen = (f"{cfg.family}, {cfg.batch // cfg.micro_batch} x {cfg.micro_batch}, {swapped} of "
              f"{model.num_layers} layers keep their activations (the rest recompute), activations and "
              f"checkpoints {c.gpu:.0%} device / {c.cpu:.0%} host / {c.ssd:.0%} SSD, base "
              f"{w.gpu:.0%} device / {w.cpu:.0%} host / {w.ssd:.0%} SSD")
    plans = {}
    for name, where in (("host", Split(0.0, 1.0, 0.0)), ("ssd", Split(0.0, 0.0, 1.0))):
        c = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, weights=where),
                                iterations=2)
        plans[name] = plan_from_graph(model, hw, c, build_graph(model, hw, c))
    return plans, chosen


def _run_opts(data: Path, tok: Path, work: Path, s: dict, name: str, steps: int):
    from tierflow.executor.options import (
        EvalOptions,
        ModelDataOptions,
        OptimizerOptions,
        OutputOptions,
        RunConfig,
    )

    d = work / name
    d.mkdir(exist_ok=True)
    return RunConfig(steps=steps, device="cpu", ssd_dir=str(d),
                     model_data=ModelDataOptions(data=str(data), tokenizer=str(tok)),
                     optimizer=OptimizerOptions(lr=s["lr"], weight_decay=0.0, betas=(0.9, 0.95)),
                     evaluation=EvalOptions(every=steps, val_fraction=0.1, batches=2),
                     output=OutputOptions(quiet=False))


def _tierflow_lora(plan, opts) -> tuple[list, list[float]]:
    """tierflow's LoRA run of `plan`: (its step records, the process's CPU seconds at the end of each step,
    all threads)."""
    import time

    from tierflow.executor.train_loop import run_plan

    cpu: list[float] = []

    def log(msg: str = "", **_kw) -> None:
        if msg.startswith("step"):
            cpu.append(time.process_time())

    return run_plan(plan, opts, log=log).records, cpu


def _peft_net(model, opts, s: dict):
    """Plain PyTorch + PEFT: tierflow's blocks of the base under the run's seed, PEFT's adapters on the same
    projections set to tierflow's initial ones (the same draw as the run's)."""
    import peft
    import torch

    from tierflow.executor.lora import LoraState, lora_state_dict
    from tierflow.executor.models import BlockModel, build_blocks

    base = model.with_lora(None)
    torch.manual_seed(opts.model_data.seed)
    net = peft.get_peft_model(BlockModel(base, build_blocks(base)),
                              peft.LoraConfig(r=s["rank"], lora_alpha=model.lora.alpha,
                                              target_modules=list(model.lora.targets)))
    init = LoraState(model, torch.device("cpu"))
    init.init_random(opts.model_data.seed)
    named = dict(net.named_parameters())
    with torch.no_grad():
        for key, value in lora_state_dict(init).items():
            _, i, target, ab = key.split(".")
            module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            named[f"base_model.model.blocks.{int(i) + 1}.{module}.{target}.{ab}.default.weight"].copy_(value)
    return net


def _lora_loop(model, opts, s: dict, micro: int, micro_step, step_end, logits_of) -> list[dict]:
    """The baselines' training loop over the run's data (tierflow's order and validation split):
    `micro_step(x, y)` runs one micro-batch's forward and backward (its loss, a float), `step_end()` the
    optimizer; per step its loss, wall and process CPU seconds; the last row holds the validation loss of
    `logits_of` over tierflow's held-out sequences."""
    import time

    import torch

    from tierflow.executor.models import loss as lm_loss
    from tierflow.executor.train_loop import load_data

    train, val = load_data(opts.model_data.data, opts, model.vocab_size).split(0.1)
    rows, batch, seq = [], s["batch"], s["seq"]
    for step in range(1, opts.steps + 1):
        t, c = time.perf_counter(), time.process_time()
        x, y = train.batch(step - 1, batch, seq)
        total = sum(micro_step(x[m:m + micro], y[m:m + micro]) * micro / batch
                    for m in range(0, batch, micro))
        step_end()
        rows.append({"step": step, "loss": total, "step_s": time.perf_counter() - t,
                     "cpu_s": time.process_time() - c, "val_loss": None})
    n = min(2 * batch, (len(val.tokens) - 1) // seq)  # tierflow's evaluation's held-out sequences
    with torch.no_grad():
        vx, vy = val.batch(0, n, seq)
        rows[-1]["val_loss"] = float(lm_loss(logits_of(vx), vy))
    return rows


def _peft_lora(model, opts, s: dict, micro: int) -> list[dict]:
    """The same LoRA training in plain PyTorch + PEFT, everything in memory (_peft_net), torch AdamW, `micro`
    sequences per forward (the plan's micro-batch)."""
    import torch

    from tierflow.executor.models import loss as lm_loss

    net = _peft_net(model, opts, s)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=s["lr"], weight_decay=0.0,
                            betas=(0.9, 0.95))
    scale = micro / s["batch"]

    def micro_step(x, y) -> float:
        loss = lm_loss(net(x), y)
        (loss * scale).backward()
        return loss.item()

    def step_end() -> None:
        opt.step()
        opt.zero_grad()

    return _lora_loop(model, opts, s, micro, micro_step, step_end, net)


# DeepSpeed ZeRO-3 + PEFT, as the race harness runs DeepSpeed: one gloo rank on its CPU accelerator, its own
# process; variant: where ZeRO-3 offloads the parameters and the optimizer states
DS_LORA = {"ds-cpu": "cpu", "ds-nvme": "nvme"}


def ds_lora_config(s: dict, micro: int, variant: str, nvme_dir: str) -> dict:
    """DeepSpeed's config of the LoRA baseline: ZeRO-3, parameters and optimizer states offloaded (to host
    memory, or to the SSD directory), fp32, AdamW as the others (its CPU Adam), no clipping."""
    where = DS_LORA[variant]
    offload = {"device": where, **({"nvme_path": nvme_dir} if where == "nvme" else {})}
    return {"train_batch_size": s["batch"], "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": s["batch"] // micro,
            "optimizer": {"type": "AdamW", "params": {"lr": s["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_param": dict(offload),
                                  "offload_optimizer": dict(offload)},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def ds_lora_worker(job: dict) -> dict:
    """In its own process (race_deepspeed.run_worker): the PEFT model of _peft_net trained by DeepSpeed ZeRO-3
    with the job's config; the rows of _lora_loop."""
    import torch

    torch.set_num_threads(job["threads"])
    import deepspeed

    from tierflow.executor.models import loss as lm_loss

    s, work = job["settings"], Path(job["work"])
    model = get_model(job["model"]).with_precision("fp32").with_lora(LoraConfig(rank=s["rank"], alpha=16.0))
    opts = _run_opts(Path(job["data"]), Path(job["tokenizer"]), work, s, job["name"], job["steps"])
    net = _peft_net(model, opts, s)

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y=None):
            logits = self.net(x)
            return logits if y is None else lm_loss(logits, y)

    deepspeed.init_distributed(dist_backend="gloo")
    wrapped = WithLoss()
    engine, *_ = deepspeed.initialize(model=wrapped, config=job["ds_config"],
                                      model_parameters=[p for p in wrapped.parameters() if p.requires_grad])

    def micro_step(x, y) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()  # applies the update at the accumulation boundary only
        return loss.item()

    return {"rows": _lora_loop(model, opts, s, job["micro"], micro_step, lambda: None, engine)}


def deepspeed_lora(variant: str, model_path: Path, data: Path, tok: Path, work: Path, s: dict, micro: int,
                   steps: int) -> dict:
    """One DeepSpeed ZeRO-3 + PEFT run in its own process: {"rows": ...} or {"error": one line}."""
    from race_deepspeed import run_worker

    nvme = work / f"{variant}-nvme"
    nvme.mkdir(exist_ok=True)
    job = {"kind": "ds_lora", "threads": 1, "settings": s, "model": str(model_path), "data": str(data),
           "tokenizer": str(tok), "work": str(work), "name": variant, "steps": steps, "micro": micro,
           "ds_config": ds_lora_config(s, micro, variant, str(nvme))}
    return run_worker(job, work, timeout_s=1800, script=Path(__file__).resolve())


def worker_main(path: str) -> None:
    """`lora_tiers.py --worker JOB`: one DeepSpeed job, its result printed (race_deepspeed's protocol)."""
    import json

    from race_deepspeed import RESULT_TAG

    job = json.loads(Path(path).read_text())
    print(RESULT_TAG + json.dumps(ds_lora_worker(job)), flush=True)


def _median_after(xs: list[float], skip: int) -> float:
    import statistics

    return statistics.median(xs[skip:])


def _cpu_per_step(stamps: list[float], skip: int) -> float:
    """CPU seconds a step from the process-time stamps at each step's end, after the first `skip` steps."""
    return (stamps[-1] - stamps[skip - 1]) / (len(stamps) - skip) if len(stamps) > skip else float("nan")


def _timing_rounds(plan, model, data: Path, tok: Path, work: Path, s: dict, micro: int,
                   skip: int) -> list[dict]:
    """`repeats` rounds of short runs, tierflow (`plan`) and PEFT alternating, the order flipped every round:
    per round each one's median step time after `skip` steps, wall and process CPU (all threads), and the
    load."""
    import os

    rounds = []
    for r in range(s["repeats"]):
        short = _run_opts(data, tok, work, s, f"t{r}", s["timing_steps"])
        got = {}
        for v in (("tierflow", "peft") if r % 2 == 0 else ("peft", "tierflow")):
            if v == "tierflow":
                recs, stamps = _tierflow_lora(plan, short)
                got[v] = (_median_after([x.step_s for x in recs], skip), _cpu_per_step(stamps, skip))
            else:
                rows = _peft_lora(model, short, s, micro)
                got[v] = (_median_after([x["step_s"] for x in rows], skip),
                          _median_after([x["cpu_s"] for x in rows], skip))
        (tf_s, tf_cpu), (peft_s, peft_cpu) = got["tierflow"], got["peft"]
        rounds.append({"tierflow_host_step_s": tf_s, "tierflow_host_cpu_s": tf_cpu, "peft_step_s": peft_s,
                       "peft_cpu_s": peft_cpu, "load_1min": round(os.getloadavg()[0], 2)})
    return rounds


def _deepspeed_columns(model_path: Path, data: Path, tok: Path, work: Path, s: dict, micro: int,
                       skip: int) -> dict:
    """DeepSpeed ZeRO-3 + PEFT, parameters and optimizer states offloaded to host memory and to the SSD
    directory: per variant its validation loss and median step time (wall, process CPU), or the one line
    saying why it did not run (also printed)."""
    import importlib.metadata as md

    from race_deepspeed import DS_VERSION

    out, missing = {}, None
    try:
        md.version("deepspeed")
    except md.PackageNotFoundError:
        missing = (f"DeepSpeed is not installed (pip install deepspeed=={DS_VERSION} with DS_BUILD_OPS=0: "
                   "its CPU Adam builds with ninja at first use)")
        print(f"lora_tiers --cpu: DeepSpeed ZeRO-3 + PEFT did not run: {missing}", file=sys.stderr)
    for variant in DS_LORA:
        key = variant.replace("-", "_")
        res = ({"error": missing} if missing else
               deepspeed_lora(variant, model_path, data, tok, work, s, micro, s["steps"]))
        rows = res.get("rows")
        if rows is None and variant == "ds-nvme" and "async_io" in res["error"]:  # say what it lacks
            res["error"] = ("DeepSpeed's async_io op (its NVMe offload) does not load here: libaio is not "
                            "installed (apt-get install libaio-dev); " + res["error"])
        if rows is None and not missing:
            print(f"lora_tiers --cpu: DeepSpeed ZeRO-3 + PEFT ({variant}) did not run: {res['error']}",
                  file=sys.stderr)
        out.update({f"{key}_val": rows[-1]["val_loss"] if rows else "",
                    f"{key}_step_s": _median_after([r["step_s"] for r in rows], skip) if rows else "",
                    f"{key}_cpu_s": _median_after([r["cpu_s"] for r in rows], skip) if rows else "",
                    f"{key}_note": "" if rows else res["error"]})
    return out


def cpu_run(quick: bool, out_dir: Path) -> dict:
    """Part (b): a tiny LLaMA fine-tuned with LoRA on Python's stdlib sources (experiments/finetune.py's
    corpus and BPE), in tierflow (`tierflow plan --lora`'s plan on this box's profile, the base on the SSD
    tier and in host memory), in plain PyTorch + PEFT at the plan's micro-batch, and in DeepSpeed ZeRO-3 +
    PEFT (offloaded to host memory, and to the SSD directory) where it runs; one torch thread. Quality: the
    full runs' validation losses. Speed: `repeats` rounds alternating tierflow (base in host memory) and
    PEFT (_timing_rounds); the figures are the medians over the rounds, with the ratio's spread."""
    import shutil
    import tempfile

    import torch
    from finetune import prepare

    torch.set_num_threads(1)
    s = cpu_settings(quick)
    work = Path(tempfile.mkdtemp(prefix="tierflow-lora-cpu-"))
    skip = 1 if quick else 3
    try:
        data, tok, _ = prepare(work, s)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(tok)))
        lora = LoraConfig(rank=s["rank"], alpha=16.0)
        model_path = _llama_config(work, s, vocab)
        model = get_model(str(model_path)).with_precision("fp32").with_lora(lora)
        plans, chosen = cpu_plans(model, s)
        micro = plans["host"].config.micro_batch
        # the simulator's step of the plan on the profile, to set against the measured one
        predicted_s = simulate_config(plans["host"].model, load_profile(CPU_PROFILE),
                                      plans["host"].config).iteration_s
        print(f"lora_tiers --cpu: the plan: {chosen}", file=sys.stderr)
        full = _run_opts(data, tok, work, s, "ssd", s["steps"])
        ssd, _ = _tierflow_lora(plans["ssd"], full)
        host, _ = _tierflow_lora(plans["host"], _run_opts(data, tok, work, s, "host", s["steps"]))
        plain = _peft_lora(model, full, s, micro)
        rounds = _timing_rounds(plans["host"], model, data, tok, work, s, micro, skip)
        ds = _deepspeed_columns(model_path, data, tok, work, s, micro, skip)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(key):
        return _median_after([r[key] for r in rounds], 0)

    speed = [r["peft_step_s"] / r["tierflow_host_step_s"] for r in rounds]
    loads = [r["load_1min"] for r in rounds]
    out = {"steps": s["steps"], "plan": chosen, "micro_batch": micro,
           "tierflow_host_predicted_s": predicted_s,
           "tierflow_ssd_val": ssd[-1].val_loss, "tierflow_host_val": host[-1].val_loss,
           "peft_val": plain[-1]["val_loss"], "first_loss": plain[0]["loss"],
           "tierflow_ssd_step_s": _median_after([r.step_s for r in ssd], skip),
           "tierflow_host_step_s": med("tierflow_host_step_s"), "peft_step_s": med("peft_step_s"),
           "tierflow_host_cpu_s": med("tierflow_host_cpu_s"), "peft_cpu_s": med("peft_cpu_s"),
           "rounds": len(rounds), "load_1min": f"{min(loads):.1f}-{max(loads):.1f}", **ds}
    out["val_rel_diff"] = abs(out["tierflow_ssd_val"] - out["peft_val"]) / out["peft_val"]
    out["host_speed_vs_peft"] = _median_after(speed, 0)
    out["host_speed_spread"] = f"{min(speed):.3f}-{max(speed):.3f}"
    out["host_cpu_speed_vs_peft"] = med("peft_cpu_s") / med("tierflow_host_cpu_s")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv([out], out_dir / "lora_cpu.csv")
    write_csv(rounds, out_dir / "lora_cpu_rounds.csv")
    return out


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
        return
    ap = arg_parser(__doc__)
    ap.add_argument("--cpu", action="store_true",
                    help="part (b) only: LoRA fine-tuning on this CPU, tierflow against plain PyTorch + PEFT")
    args = ap.parse_args(argv)
    if args.cpu:
        out = cpu_run(args.quick, args.out)
        print_table([out], list(out))
        print(f"wrote {args.out / 'lora_cpu.csv'}", file=sys.stderr)
        return
    run(args.quick, args.out)
    print(f"wrote {args.out / 'lora_tiers.csv'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
