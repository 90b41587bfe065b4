"""Fine-tune a small model on real text available offline: the Python standard library's source files.

    python experiments/finetune.py [--quick] [--out DIR]

A GPT-2-style model (random init) with a byte-level BPE tokenizer trained on the same files (`tokenizers`,
saved as transformers saves one), trained with `tierflow run`'s code (`run_plan`; plan: horizontal schedule,
fp32 master and Adam states on the SSD tier, on this machine's CPU) with AdamW, warmup + cosine, global-norm
clipping and a held-out 10% for validation, against the same run in plain PyTorch (same init, data order,
decay groups, `transformers.get_scheduler`, `clip_grad_norm_`). Writes finetune.csv (per step: both losses,
learning rate, gradient norm, validation loss where evaluated, tokens/s), finetune.png (train and validation
loss curves of both, tokens/s per step) and prints a summary table (median tokens/s per step; wall seconds
with tokenizing, evaluation and setup). --quick: fewer files, steps and layers (a CI test).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import sysconfig
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

from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.options import (
    EvalOptions,
    ModelDataOptions,
    OptimizerOptions,
    OutputOptions,
    RunConfig,
)
from tierflow.executor.train_loop import load_data, run_plan
from tierflow.hwprofiles import load_profile
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import plan_from_graph

MICRO = 2  # sequences per micro-batch
SSD = Split(0.0, 0.0, 1.0)


def settings(quick: bool) -> dict:
    return {"files": 3 if quick else 60, "vocab": 384 if quick else 2048, "layers": 1 if quick else 4,
            "hidden": 64 if quick else 128, "steps": 10 if quick else 300, "warmup": 2 if quick else 30,
            "eval_every": 5 if quick else 50, "batch": 4 if quick else 8, "seq": 64 if quick else 128}


def prepare(work: Path, s: dict) -> tuple[Path, Path, Path]:
    """(data directory, tokenizer directory, config.json): stdlib sources, a BPE trained on them, a model."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    data = work / "data"
    data.mkdir()
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: s["files"]]
    for f in files:
        shutil.copy(f, data / f.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([f.read_text(errors="replace") for f in files],
                            trainers.BpeTrainer(vocab_size=s["vocab"], special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_dir = work / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tok_dir)
    config = work / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": s["layers"], "n_embd": s["hidden"],
                                  "n_head": 4, "vocab_size": tok.get_vocab_size(), "n_positions": s["seq"],
                                  "tie_word_embeddings": True}))
    return data, tok_dir, config


def tierflow_run(model, data: Path, tok: Path, work: Path, h: TrainHyper, s: dict):
    hw = load_profile("rtx3090-desktop")  # for the plan only; the run is on this machine's CPU
    cfg = make_schedule("horizontal", model, hw, batch=s["batch"], micro_batch=MICRO, seq=s["seq"],
                        placement=Placement(master=SSD, adam_m=SSD, adam_v=SSD), iterations=2)
    plan = plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))
    (work / "ssd").mkdir()
    opts = RunConfig(steps=s["steps"], device="cpu", ssd_dir=str(work / "ssd"),
                     model_data=ModelDataOptions(data=str(data), tokenizer=str(tok)),
                     optimizer=optimizer_of(h),
                     evaluation=EvalOptions(every=s["eval_every"], val_fraction=0.1, batches=2),
                     output=OutputOptions(out=str(work / "out"), quiet=True))
    t0 = time.perf_counter()
    res = run_plan(plan, opts)
    return res.records, time.perf_counter() - t0, opts


def optimizer_of(h: TrainHyper) -> OptimizerOptions:
    """The run's optimizer options of `h` (the plain run's settings)."""
    return OptimizerOptions(lr=h.lr, weight_decay=h.weight_decay, betas=(h.beta1, h.beta2), eps=h.eps,
                            schedule=h.schedule, warmup_steps=h.warmup_steps, clip_grad_norm=h.clip_grad_norm,
                            clip=h.clip)


def plain_run(model, opts: RunConfig, h: TrainHyper, s: dict) -> tuple[list[dict], float]:
    """The same training in plain PyTorch (one model, torch.optim.AdamW with the two decay groups,
    transformers.get_scheduler, clip_grad_norm_); per step: loss, seconds, validation loss where tierflow
    evaluated."""
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
    opt = torch.optim.AdamW(groups, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps)
    sched = get_scheduler(h.schedule, opt, num_warmup_steps=h.warmup_steps, num_training_steps=s["steps"])
    train, val = load_data(opts.model_data.data, opts, model.vocab_size).split(0.1)
    rows, t0 = [], time.perf_counter()
    batch, seq = s["batch"], s["seq"]
    for step in range(1, s["steps"] + 1):
        t = time.perf_counter()
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
        row = {"step": step, "loss": total, "step_s": time.perf_counter() - t, "val_loss": None}
        if step % s["eval_every"] == 0 or step == s["steps"]:
            # tierflow's evaluation: the first 2 batches' worth of distinct held-out sequences (fewer where
            # the held-out set holds fewer; none twice), the mean loss over their targets
            n = min(2 * batch, (len(val.tokens) - 1) // seq)
            with torch.no_grad():
                vx, vy = val.batch(0, n, seq)
                row["val_loss"] = float(lm_loss(ref(vx), vy))
        rows.append(row)
    return rows, time.perf_counter() - t0


def plot(rows: list[dict], path: Path) -> Path:
    fig, (ax, ax2) = new_figure(2)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["tierflow_loss"] for r in rows], label="tierflow train", color="#ff7f0e")
    ax.plot(steps, [r["plain_loss"] for r in rows], label="plain PyTorch train", color="0.35", ls="--")
    ev = [r for r in rows if r["tierflow_val"] is not None]
    ax.plot([r["step"] for r in ev], [r["tierflow_val"] for r in ev], "o-", label="tierflow validation",
            color="#d62728")
    ax.plot([r["step"] for r in ev], [r["plain_val"] for r in ev], "x--", label="plain validation",
            color="0.2")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=7)
    ax2.plot(steps, [r["tierflow_tokens_per_s"] for r in rows], label="tierflow", color="#ff7f0e")
    ax2.plot(steps, [r["plain_tokens_per_s"] for r in rows], label="plain PyTorch", color="0.35", ls="--")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax2.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool, out_dir: Path) -> list[dict]:
    from tierflow.planner.core.models import get_model

    s = settings(quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierflow-finetune-"))
    try:
        data, tok, config = prepare(work, s)
        model = get_model(str(config))
        h = TrainHyper(lr=1e-3, schedule="cosine", warmup_steps=s["warmup"], total_steps=s["steps"],
                       clip_grad_norm=1.0, weight_decay=0.1)
        records, tier_s, opts = tierflow_run(model, data, tok, work, h, s)
        plain, plain_s = plain_run(model, opts, h, s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = s["batch"] * s["seq"]
    rows = [{"step": r.step, "tierflow_loss": r.loss, "plain_loss": p["loss"], "lr": r.lr,
             "grad_norm": r.grad_norm, "tierflow_val": r.val_loss, "plain_val": p["val_loss"],
             "tierflow_tokens_per_s": r.tokens_per_s, "plain_tokens_per_s": tokens / p["step_s"]}
            for r, p in zip(records, plain)]
    write_csv(rows, out_dir / "finetune.csv")
    plot(rows, out_dir / "finetune.png")
    if out_dir.resolve() == RESULTS_DIR.resolve():  # the docs show what the results files hold
        write_generated_block(DOC, DOC_TABLE, finetune_table(rows))
    worst = max(abs(r["tierflow_loss"] - r["plain_loss"]) / abs(r["plain_loss"]) for r in rows)
    last = rows[-1]
    summary = [{"run": name, "params_m": round(model.total_params() / 1e6, 2), "steps": s["steps"],
                "first_loss": round(rows[0][f"{key}_loss"], 4), "last_loss": round(last[f"{key}_loss"], 4),
                "last_val_loss": round(last[f"{key}_val"], 4),
                "median_tokens_per_s": round(statistics.median(r[f"{key}_tokens_per_s"] for r in rows)),
                "wall_s": round(wall, 1), "max_rel_loss_diff": f"{worst:.1e}"}
               for name, key, wall in (("tierflow (SSD states)", "tierflow", tier_s),
                                       ("plain PyTorch", "plain", plain_s))]
    print_table(summary, list(summary[0]))
    return rows


DOC = REPO_DIR / "docs" / "finetuning.md"
DOC_TABLE = "fine-tuning (experiments/finetune.py from experiments/results/finetune.csv)"


def finetune_table(rows: list[dict]) -> str:
    """docs/finetuning.md's table, from the per-step rows as written to or read from finetune.csv: per run,
    the steps, first and last training loss, last validation loss and median tokens/s."""
    out = []
    for name, key in (("tierflow (states on the SSD tier)", "tierflow"), ("plain PyTorch", "plain")):
        val = [float(r[f"{key}_val"]) for r in rows if r[f"{key}_val"] not in (None, "")]
        first, last = float(rows[0][f"{key}_loss"]), float(rows[-1][f"{key}_loss"])
        out.append((name, len(rows), f"{first:.2f}", f"{last:.2f}", f"{val[-1]:.2f}" if val else "-",
                    f"{statistics.median(float(r[f'{key}_tokens_per_s']) for r in rows):,.0f}"))
    return markdown_table(["run", "steps", "first loss", "last loss", "last validation loss",
                           "median tokens/s"], out)


def main(argv: list[str] | None = None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"wrote {args.out / 'finetune.csv'} and {args.out / 'finetune.png'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
