"""Where compressed optimizer states pay, in simulation: each format's planned iteration and largest model.

    python experiments/compressed_sim.py [--quick] [--out DIR]

For GPT-3 175B and LLaMA-2 70B on the Fuyou box (rtx4090-lohan: 768 GB, 12 SSDs) and on a 4090 box with
256 GB and 4 SSDs (rtx4090-lohan with --set cpu.memory_gib=256, cpu.reserved_gib=19 (the profile's rule:
6 GiB + 5%), ssd.count=4): `tierflow plan`'s search (plan_search, batch BATCH) with each optimizer-state
format, its predicted iteration and tokens/s, where the states went, and the SSD bytes per iteration; and per
box and format the largest GPT-family model `tierflow capacity`'s memory model lets it train (with the SSDs,
batch 16 x 2048, not simulated). Writes compressed_sim.csv and the table of docs/compressed-states.md.
--quick: GPT-3 125M on the 4-SSD box, the plan search only (a CI test, structure only).
"""

from __future__ import annotations

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

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.models import get_model
from tierflow.planner.core.optstates import STATE_FORMATS
from tierflow.planner.io.planning import PlanOptions, make_plan
from tierflow.planner.search.capacity import largest

BATCH = 16
BOXES = {"rtx4090-lohan": {},
         "4090 256 GB 4 SSDs": BOX_4090_256GB_4SSDS}
DOC = REPO_DIR / "docs" / "compressed-states.md"
DOC_TABLE = "simulation (experiments/compressed_sim.py from experiments/results/compressed_sim.csv)"


def box(name: str):
    return load_profile("rtx4090-lohan").with_overrides(BOXES[name])


def plan_row(model_name: str, box_name: str, fmt: str, time_limit_s: float) -> dict:
    model = get_model(model_name).with_optimizer_states(fmt)
    hw = box(box_name)
    opts = PlanOptions(time_limit_s=time_limit_s, window=False)  # tierflow plan's, no window check
    sr = make_plan(model, hw, BATCH, model.seq_len, opts).search
    r, p = sr.best.result, sr.best.config.placement
    return {"kind": "plan", "model": model_name, "box": box_name, "format": fmt,
            "iteration_s": round(r.iteration_s, 2), "tokens_per_s": round(r.tokens_per_s, 1),
            "states_on_ssd": round(p.master.ssd, 2),
            "ssd_gb_per_iteration": round((r.link_bytes.get("ssd->cpu", 0.0)
                                           + r.link_bytes.get("cpu->ssd", 0.0)) / 1e9, 1),
            "largest_params_b": ""}


def capacity_row(box_name: str, fmt: str) -> dict:
    a = largest("gpt", box(box_name), 16, 2048, True, verify=False, optimizer_states=fmt)
    return {"kind": "capacity", "model": a.model.name if a.model else "-", "box": box_name, "format": fmt,
            "iteration_s": "", "tokens_per_s": "", "states_on_ssd": "", "ssd_gb_per_iteration": "",
            "largest_params_b": round(a.params / 1e9, 1)}


def run(quick: bool, out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    models = ["gpt3-125m"] if quick else ["gpt3-175b", "llama2-70b"]
    boxes = ["4090 256 GB 4 SSDs"] if quick else list(BOXES)
    rows = [plan_row(m, b, f, 2.0 if quick else 30.0) for m in models for b in boxes for f in STATE_FORMATS]
    if not quick:
        rows += [capacity_row(b, f) for b in boxes for f in STATE_FORMATS]
    write_csv(rows, out_dir / "compressed_sim.csv")
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_generated_block(DOC, DOC_TABLE, sim_table(rows))
    print_table(rows, list(rows[0]))
    return rows


def sim_table(rows: list[dict]) -> str:
    """docs/compressed-states.md's table from the rows of compressed_sim.csv: per model and box, each format's
    planned iteration (and its speed-up over fp32) and states on the SSDs; per box, the largest GPT-family
    model each format trains."""
    plans = [r for r in rows if r["kind"] == "plan"]
    base = {(r["model"], r["box"]): float(r["iteration_s"]) for r in plans if r["format"] == "fp32"}
    out = [(r["model"], r["box"], r["format"], f"{float(r['iteration_s']):,.1f}",
            f"{base[(r['model'], r['box'])] / float(r['iteration_s']):.2f}x",
            f"{float(r['tokens_per_s']):,.0f}", f"{float(r['states_on_ssd']):.2f}",
            f"{float(r['ssd_gb_per_iteration']):,.0f}") for r in plans]
    text = markdown_table(["model", "box", "states", f"iteration (s), batch {BATCH}", "vs fp32", "tokens/s",
                           "states on SSD", "SSD GB / iteration"], out)
    caps = [r for r in rows if r["kind"] == "capacity"]
    if caps:
        text += "\n\n" + markdown_table(["box", "states", "largest GPT-family model", "params (B)"],
                                        [(r["box"], r["format"], r["model"], r["largest_params_b"])
                                         for r in caps])
    return text


def main(argv: list[str] | None = None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"wrote {args.out / 'compressed_sim.csv'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
