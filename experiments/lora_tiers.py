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


def cpu_settings(quick: bool) -> dict:
    return {"files": 3 if quick else 60, "vocab": 384 if quick else 2048, "layers": 1 if quick else 4,
            "hidden": 64 if quick else 128, "steps": 6 if quick else 120, "batch": 4 if quick else 8,
            "seq": 64 if quick else 128, "rank": 8, "lr": 2e-3}


def _llama_config(work: Path, s: dict, vocab: int) -> Path:
    import json

    path = work / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": s["layers"],
                                "hidden_size": s["hidden"], "intermediate_size": 3 * s["hidden"],
                                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": vocab,
                                "max_position_embeddings": s["seq"], "rms_norm_eps": 1e-5,
                                "tie_word_embeddings": False}))
    return path


def _tierflow_lora(model, data: Path, tok: Path, work: Path, s: dict, weights, name: str):
    """tierflow's LoRA run with the base placed by `weights`; (records, the run's config)."""
    from finetune import MICRO

    from tierflow.executor.options import (
        EvalOptions,
        ModelDataOptions,
        OptimizerOptions,
        OutputOptions,
        RunConfig,
    )
    from tierflow.executor.train_loop import run_plan
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import plan_from_graph

    hw = load_profile("rtx3090-desktop")  # for the plan only; the run is on this machine's CPU
    cfg = make_schedule("vertical", model, hw, batch=s["batch"], micro_batch=MICRO, seq=s["seq"],
                        placement=Placement(weights=weights, checkpoints=Split(1.0, 0.0, 0.0)), iterations=2)
    plan = plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))
    (work / name).mkdir()
    opts = RunConfig(steps=s["steps"], device="cpu", ssd_dir=str(work / name),
                     model_data=ModelDataOptions(data=str(data), tokenizer=str(tok)),
                     optimizer=OptimizerOptions(lr=s["lr"], weight_decay=0.0, betas=(0.9, 0.95)),
                     evaluation=EvalOptions(every=s["steps"], val_fraction=0.1, batches=2),
                     output=OutputOptions(quiet=True))
    return run_plan(plan, opts).records, opts


def _peft_lora(model, opts, s: dict) -> list[dict]:
    """The same LoRA training in plain PyTorch + PEFT, everything in memory: tierflow's blocks under the
    run's seed, PEFT's adapters on the same projections set to tierflow's initial ones, torch AdamW."""
    import time

    import peft
    import torch
    from finetune import MICRO

    from tierflow.executor.lora import LoraState, lora_state_dict
    from tierflow.executor.models import BlockModel, build_blocks
    from tierflow.executor.models import loss as lm_loss
    from tierflow.executor.train_loop import load_data

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
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=s["lr"], weight_decay=0.0,
                            betas=(0.9, 0.95))
    train, val = load_data(opts.model_data.data, opts, model.vocab_size).split(0.1)
    rows, batch, seq = [], s["batch"], s["seq"]
    for step in range(1, s["steps"] + 1):
        t = time.perf_counter()
        x, y = train.batch(step - 1, batch, seq)
        opt.zero_grad()
        total = 0.0
        for m in range(0, batch, MICRO):
            loss = lm_loss(net(x[m:m + MICRO]), y[m:m + MICRO])
            (loss * MICRO / batch).backward()
            total += loss.item() * MICRO / batch
        opt.step()
        rows.append({"step": step, "loss": total, "step_s": time.perf_counter() - t, "val_loss": None})
    n = min(2 * batch, (len(val.tokens) - 1) // seq)  # tierflow's evaluation's held-out sequences
    with torch.no_grad():
        vx, vy = val.batch(0, n, seq)
        rows[-1]["val_loss"] = float(lm_loss(net(vx), vy))
    return rows


def cpu_run(quick: bool, out_dir: Path) -> dict:
    """Part (b): a tiny LLaMA fine-tuned with LoRA on Python's stdlib sources (experiments/finetune.py's
    corpus and BPE), in tierflow with the base on the SSD tier and in host memory, and in plain PyTorch +
    PEFT; one torch thread. Returns the validation losses and the median step times (after the first 3
    steps)."""
    import shutil
    import statistics
    import tempfile

    import torch
    from finetune import prepare

    from tierflow.planner.core.placement import Split

    torch.set_num_threads(1)
    s = cpu_settings(quick)
    work = Path(tempfile.mkdtemp(prefix="tierflow-lora-cpu-"))
    try:
        data, tok, _ = prepare(work, s)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(tok)))
        lora = LoraConfig(rank=s["rank"], alpha=16.0)
        model = get_model(str(_llama_config(work, s, vocab))).with_lora(lora)
        ssd, opts = _tierflow_lora(model, data, tok, work, s, Split(0.0, 0.0, 1.0), "ssd")
        host, _ = _tierflow_lora(model, data, tok, work, s, Split(0.0, 1.0, 0.0), "host")
        plain = _peft_lora(model, opts, s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    skip = 3 if len(plain) > 6 else 1

    def med(xs):
        return statistics.median(xs[skip:])

    out = {"steps": s["steps"], "tierflow_ssd_val": ssd[-1].val_loss, "tierflow_host_val": host[-1].val_loss,
           "peft_val": plain[-1]["val_loss"], "first_loss": plain[0]["loss"],
           "tierflow_ssd_step_s": med([r.step_s for r in ssd]),
           "tierflow_host_step_s": med([r.step_s for r in host]),
           "peft_step_s": med([r["step_s"] for r in plain])}
    out["val_rel_diff"] = abs(out["tierflow_ssd_val"] - out["peft_val"]) / out["peft_val"]
    out["host_speed_vs_peft"] = out["peft_step_s"] / out["tierflow_host_step_s"]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv([out], out_dir / "lora_cpu.csv")
    return out


def main(argv: list[str] | None = None) -> None:
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
