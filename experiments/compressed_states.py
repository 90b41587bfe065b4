"""Quality and speed of the optimizer-state formats: fp32, 8-bit moments, 8-bit moments with a bf16 master.

    python experiments/compressed_states.py [--quick] [--out DIR]

The training of experiments/finetune.py (the same tiny GPT-2-style model, the same real text: the Python
standard library's sources, the same BPE tokenizer, AdamW with warmup + cosine and global-norm clipping, a
held-out 10% for validation) run by `tierflow run`'s code (run_plan; horizontal schedule, master and Adam
states on the SSD tier, this machine's CPU) once per format, and, where bitsandbytes is installed, in plain
PyTorch with fp32 AdamW and with bitsandbytes' AdamW8bit (the library's own result on the same run).

Writes compressed_states.csv (per step and format: training loss, validation loss where evaluated, step
seconds), compressed_states.png (the loss curves) and prints per format: last validation loss and its
difference to fp32 (target: within 1% after 300 steps), the final weights' relative L2 distance to fp32
AdamW's, the SSD bytes the run moved, the median measured step and the step the plan predicts on this
machine's profile (experiments/results/closed_loop_cpu.yaml). --quick: 10 steps of a smaller model (a CI
test, structure only).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    markdown_table,
    new_figure,
    print_table,
    save_figure,
    script_main,
    write_csv,
    write_generated_block,
)
from finetune import MICRO, SSD, optimizer_of, prepare, settings

from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.options import EvalOptions, ModelDataOptions, OutputOptions, RunConfig
from tierflow.executor.train_loop import load_data, run_plan
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.optstates import STATE_FORMATS
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.io.planfile import plan_from_graph

CPU_PROFILE = REPO_DIR / "experiments" / "results" / "closed_loop_cpu.yaml"  # this machine, as fitted
DOC = REPO_DIR / "docs" / "compressed-states.md"
QUALITY_TABLE = "quality (experiments/compressed_states.py from experiments/results/compressed_states.csv)"


def tierflow_run(model, fmt: str, data: Path, tok: Path, work: Path, h: TrainHyper, s: dict) -> dict:
    """One run of `model` with its optimizer states in `fmt` on the SSD tier: records, final master, the SSD
    bytes moved, wall seconds, the predicted iteration on this machine's profile."""
    model = model.with_optimizer_states(fmt)
    hw = load_profile("rtx3090-desktop")  # for the plan's shape only; the run is on this machine's CPU
    cfg = make_schedule("horizontal", model, hw, batch=s["batch"], micro_batch=MICRO, seq=s["seq"],
                        placement=Placement(master=SSD, adam_m=SSD, adam_v=SSD), iterations=2)
    plan = plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))
    here = load_profile(CPU_PROFILE)
    hcfg = make_schedule("horizontal", model, here, batch=s["batch"], micro_batch=MICRO, seq=s["seq"],
                         placement=cfg.placement, iterations=3, runtime="ideal")
    predicted_s = simulate_config(model, here, hcfg).iteration_s
    d = work / fmt
    (d / "ssd").mkdir(parents=True)
    opts = RunConfig(steps=s["steps"], device="cpu", ssd_dir=str(d / "ssd"),
                     model_data=ModelDataOptions(data=str(data), tokenizer=str(tok)),
                     optimizer=optimizer_of(h),
                     evaluation=EvalOptions(every=s["eval_every"], val_fraction=0.1, batches=2),
                     output=OutputOptions(out=str(d / "out"), quiet=True, collect_final=True))
    t0 = time.perf_counter()
    res = run_plan(plan, opts)
    return {"records": res.records, "master": res.final_master, "wall_s": time.perf_counter() - t0,
            "ssd_bytes": res.ssd_bytes_read + res.ssd_bytes_written, "predicted_s": predicted_s,
            "opts": opts}


def plain_run(model, opts: RunConfig, h: TrainHyper, s: dict, eight_bit: bool) -> list[dict]:
    """finetune.plain_run's training with torch.optim.AdamW, or bitsandbytes' AdamW8bit (`eight_bit`):
    per step the loss and, where evaluated, the validation loss."""
    import torch
    from transformers import get_scheduler

    from tierflow.executor.models import BlockModel, build_blocks
    from tierflow.executor.models import loss as lm_loss
    from tierflow.executor.optim.decay import decayed

    torch.manual_seed(opts.model_data.seed)
    ref = BlockModel(model, build_blocks(model))
    named = [(n, p) for b in ref.blocks for n, p in b.named_parameters()]
    groups = [{"params": [p for n, p in named if decayed(n)], "weight_decay": h.weight_decay},
              {"params": [p for n, p in named if not decayed(n)], "weight_decay": 0.0}]
    kw = dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps)
    if eight_bit:
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(groups, min_8bit_size=0, **kw)
    else:
        opt = torch.optim.AdamW(groups, **kw)
    sched = get_scheduler(h.schedule, opt, num_warmup_steps=h.warmup_steps, num_training_steps=s["steps"])
    train, val = load_data(opts.model_data.data, opts, model.vocab_size).split(0.1)
    rows, batch, seq = [], s["batch"], s["seq"]
    for step in range(1, s["steps"] + 1):
        x, y = train.batch(step - 1, batch, seq)
        opt.zero_grad()
        total = 0.0
        for m in range(0, batch, MICRO):
            loss = lm_loss(ref(x[m:m + MICRO]), y[m:m + MICRO])
            (loss * MICRO / batch).backward()
            total += loss.item() * MICRO / batch
        torch.nn.utils.clip_grad_norm_(ref.parameters(), h.clip_grad_norm)
        opt.step()
        sched.step()
        row = {"step": step, "loss": total, "val_loss": None}
        if step % s["eval_every"] == 0 or step == s["steps"]:
            with torch.no_grad():
                row["val_loss"] = sum(float(lm_loss(ref(vx), vy)) for vx, vy in
                                      (val.batch(i, batch, seq) for i in range(2))) / 2
        rows.append(row)
    return rows


def weight_distance(a: list, b: list) -> float:
    """||a - b|| / ||b|| over every block's master weights."""
    import torch

    num = sum(float(torch.sum((x.float() - y.float()) ** 2)) for x, y in zip(a, b, strict=True))
    den = sum(float(torch.sum(y.float() ** 2)) for y in b)
    return (num / den) ** 0.5


def plot(rows: list[dict], runs: list[str], path: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    for name in runs:
        ax.plot([r["step"] for r in rows], [r[f"{name}_loss"] for r in rows], label=name)
        ev = [r for r in rows if r.get(f"{name}_val") is not None]
        ax2.plot([r["step"] for r in ev], [r[f"{name}_val"] for r in ev], "o-", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.legend(fontsize=7)
    ax2.set_xlabel("step")
    ax2.set_ylabel("validation loss")
    ax2.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool, out_dir: Path, library: bool = True) -> tuple[list[dict], list[dict]]:
    """(per-step rows, per-run summary)."""
    import importlib.util

    from tierflow.planner.core.models import get_model

    s = settings(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierflow-compressed-"))
    library = library and importlib.util.find_spec("bitsandbytes") is not None
    try:
        data, tok, config = prepare(work, s)
        model = get_model(str(config))
        h = TrainHyper(lr=1e-3, schedule="cosine", warmup_steps=s["warmup"], total_steps=s["steps"],
                       clip_grad_norm=1.0, weight_decay=0.1)
        runs = {fmt: tierflow_run(model, fmt, data, tok, work, h, s) for fmt in STATE_FORMATS}
        opts = runs["fp32"]["opts"]
        plain = {}
        if library:
            plain = {"plain-fp32": plain_run(model, opts, h, s, False),
                     "plain-bnb-8bit": plain_run(model, opts, h, s, True)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for i in range(s["steps"]):
        row = {"step": i + 1}
        for fmt, r in runs.items():
            rec = r["records"][i]
            row.update({f"{fmt}_loss": rec.loss, f"{fmt}_val": rec.val_loss, f"{fmt}_step_s": rec.step_s})
        for name, p in plain.items():
            row.update({f"{name}_loss": p[i]["loss"], f"{name}_val": p[i]["val_loss"]})
        rows.append(row)
    write_csv(rows, out_dir / "compressed_states.csv")
    plot(rows, [*runs, *plain], out_dir / "compressed_states.png")
    summary = summarize(rows, runs, plain)
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, QUALITY_TABLE, quality_table(rows))
    print_table(summary, list(summary[0]))
    return rows, summary


def summarize(rows: list[dict], runs: dict, plain: dict) -> list[dict]:
    base_val = rows[-1]["fp32_val"]
    out = []
    for fmt, r in runs.items():
        val = rows[-1][f"{fmt}_val"]
        out.append({"run": f"tierflow {fmt}", "last_val_loss": round(val, 4),
                    "val_vs_fp32_pct": round(100 * (val - base_val) / base_val, 3),
                    "weights_dist_to_fp32": f"{weight_distance(r['master'], runs['fp32']['master']):.2e}",
                    "ssd_mb": round(r["ssd_bytes"] / 1e6, 2),
                    "median_step_s": round(statistics.median(x.step_s for x in r["records"][1:] or
                                                             r["records"]), 4),
                    "predicted_step_s": round(r["predicted_s"], 4)})
    for name in plain:
        val = rows[-1][f"{name}_val"]
        out.append({"run": name, "last_val_loss": round(val, 4),
                    "val_vs_fp32_pct": round(100 * (val - base_val) / base_val, 3),
                    "weights_dist_to_fp32": "-", "ssd_mb": "-", "median_step_s": "-",
                    "predicted_step_s": "-"})
    return out


def quality_table(rows: list[dict]) -> str:
    """docs/compressed-states.md's quality table from the rows of compressed_states.csv: per run, the last
    training and validation loss and the validation loss against fp32's."""
    base = float(rows[-1]["fp32_val"])
    names = [k[: -len("_val")] for k in rows[0] if k.endswith("_val")]
    out = []
    for name in names:
        val = float(rows[-1][f"{name}_val"])
        label = f"tierflow, {name} states" if not name.startswith("plain") else name
        out.append((label, len(rows), f"{float(rows[-1][f'{name}_loss']):.3f}", f"{val:.4f}",
                    f"{100 * (val - base) / base:+.2f}%"))
    return markdown_table(["run", "steps", "last loss", "last validation loss", "validation vs fp32"], out)


def main(argv: list[str] | None = None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"wrote {args.out / 'compressed_states.csv'} and {args.out / 'compressed_states.png'}",
          file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
