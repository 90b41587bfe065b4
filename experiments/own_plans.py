"""tierflow's planner (plan_search) vs each paper's schedule on the same box, for the cases of
fuyou_lohan.py and greedysnake_a100.py: where the planner finds a better plan, by how much, and why (its
decisions).

Paper schedules are simulated exactly as in those scripts (the best micro-batch of each; on the RTX 4090 box
the placement the paper's code uses, on the A100 box the library's default placement). The plan is the best
verified plan of tierflow.planner.search.plan_search.plan_search (which also considers the fixed schedules
with default settings, so it is never slower than those). Speedups compare tokens/s (the same tokens per
iteration on both sides), not TFLOPS: a plan that swaps activations instead of recomputing does fewer hardware
FLOPs for the same work.
Writes experiments/results/own_plans.csv and own_plans.png.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import fuyou_lohan
import greedysnake_a100
from expcommon import (
    PAPER_PLACEMENTS,
    Progress,
    arg_parser,
    best_micro_batch,
    divisors_up_to,
    headline,
    new_figure,
    no_fit_markers,
    print_table,
    reference_line,
    result_row,
    save_figure,
    schedule_color,
    script_main,
    write_csv,
)

from tierflow.api import resolve
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.io.planning import PlanOptions, make_plan
from tierflow.planner.search.plan_search import PlanningError

# (case label, model, box, batch, seq, {family: system name}, paper placements?)
CASES = [
    ("Fuyou 13B", "gpt3-13b", fuyou_lohan.HW, 64, fuyou_lohan.SEQ, fuyou_lohan.FAMILIES, True),
    ("Fuyou 175B", "gpt3-175b", fuyou_lohan.HW, 16, fuyou_lohan.SEQ, fuyou_lohan.FAMILIES, True),
    (
        "GreedySnake 65B",
        "gpt-65b",
        greedysnake_a100.HW,
        32,
        greedysnake_a100.SEQ,
        greedysnake_a100.FAMILIES,
        False,
    ),
    (
        "GreedySnake 175B",
        "gpt3-175b",
        greedysnake_a100.HW,
        32,
        greedysnake_a100.SEQ,
        greedysnake_a100.FAMILIES,
        False,
    ),
]


def settings(quick: bool) -> dict:
    if quick:
        return {"cases": CASES[:1], "micro_batches": [8, 16], "time_limit_s": 20.0}
    return {"cases": CASES, "micro_batches": None, "time_limit_s": 60.0}


def paper_schedule(model, hw, family: str, batch: int, seq: int, paper_placement: bool, mbs, progress):
    """(micro-batch, SimResult) of one paper schedule at its best micro-batch, or (None, None)."""
    placement = PAPER_PLACEMENTS.get(family) if paper_placement else None
    mb, res, _ = best_micro_batch(model, hw, family, batch, seq, mbs, placement, progress)
    return mb, res


def decisions(cfg, batch: int) -> dict:
    """The decisions of a schedule config, as CSV columns (with one micro-batch per iteration horizontal and
    vertical orders coincide: the shape says so instead of naming either; one micro-batch per sweep is named
    by its family, horizontal or fuyou, as the optimizer runs after or during the backward)."""
    M = cfg.batch // cfg.micro_batch
    if M == 1:
        shape = "one micro-batch"
    elif cfg.group == 1:
        shape = cfg.family
    else:
        shape = "vertical" if cfg.group == M else f"block k={cfg.group}"
    return {
        "shape": f"{shape}, {M} x {cfg.micro_batch}",
        "micro_batch": cfg.micro_batch,
        "group": cfg.group,
        "alpha": cfg.alpha,
        "optimizer_overlap": cfg.optimizer_overlap,
        "prefetch_depth": cfg.prefetch_depth,
        "swap_layers": cfg.swap_layers,
        "placement": cfg.placement.describe(),
    }


def explain(plan: dict, ref: dict, layers: int) -> str:
    """Why the plan differs from one paper schedule, from the decisions and the simulated traffic."""
    parts = [f"plan {plan['shape']} vs {ref['shape']}"]
    if plan["swap_layers"] != ref["swap_layers"]:
        parts.append(
            f"{plan['swap_layers']} of {layers} layers keep their activations instead of recomputing "
            f"(hardware FLOPs per token {plan['hw_flops_per_model_flop']:.2f}x the model FLOPs, vs "
            f"{ref['hw_flops_per_model_flop']:.2f}x)"
        )
    if plan["alpha"] != ref["alpha"] or plan["optimizer_overlap"] != ref["optimizer_overlap"]:
        parts.append(
            f"optimizer {'overlapped' if plan['optimizer_overlap'] else 'after backward'}, alpha "
            f"{plan['alpha']:g} (vs {'overlapped' if ref['optimizer_overlap'] else 'after backward'}, "
            f"alpha {ref['alpha']:g})"
        )
    if plan["placement"] != ref["placement"]:
        parts.append(f"placement {plan['placement']} (vs {ref['placement']})")
    ssd = lambda r: (r["bytes_ssd_to_cpu"] + r["bytes_cpu_to_ssd"]) / 1e9  # noqa: E731
    pcie = lambda r: (r["bytes_cpu_to_gpu"] + r["bytes_gpu_to_cpu"]) / 1e9  # noqa: E731
    parts.append(
        f"SSD traffic {ssd(plan):,.0f} vs {ssd(ref):,.0f} GB/iteration, PCIe {pcie(plan):,.0f} vs "
        f"{pcie(ref):,.0f} GB"
    )
    parts.append(f"binds: {plan['binding']} (vs {ref['binding']})")
    return "; ".join(parts)


def run_case(case, s: dict, progress: Progress) -> list[dict]:
    label, model_name, hw_name, batch, seq, families, paper_placement = case
    model, hw = resolve(model_name, hw_name)
    model = model.with_seq(seq)
    mbs = s["micro_batches"] or divisors_up_to(batch, 64)
    rows = []
    for family, system in families.items():
        mb, res = paper_schedule(model, hw, family, batch, seq, paper_placement, mbs, progress)
        row = {
            "case": label,
            "model": model_name,
            "hw": hw_name,
            "batch": batch,
            "seq": seq,
            "system": system,
            "fits": res is not None,
        }
        if res is not None:
            row.update(_describe(res, hw, batch))
        rows.append(row)
    progress.step(f"{label}: plan_search (up to {s['time_limit_s']:.0f} s)")
    t0 = time.perf_counter()
    try:
        mbs = tuple(s["micro_batches"]) if s["micro_batches"] else None
        opts = PlanOptions(time_limit_s=s["time_limit_s"], micro_batches=mbs, window=False)
        sr = make_plan(model, hw, batch, seq, opts).search
    except PlanningError as e:
        rows.append(
            {
                "case": label,
                "model": model_name,
                "hw": hw_name,
                "batch": batch,
                "seq": seq,
                "system": "tierflow plan",
                "fits": False,
                "error": str(e),
            }
        )
        return rows
    plan = {
        "case": label,
        "model": model_name,
        "hw": hw_name,
        "batch": batch,
        "seq": seq,
        "system": "tierflow plan",
        "fits": True,
        **_describe(sr.best.result, hw, batch),
        "plan_search_s": round(time.perf_counter() - t0, 1),
        "plan_origin": sr.best.error or "searched",
    }
    for row in rows:
        if row["fits"]:
            row["plan_speedup"] = round(plan["tokens_per_s"] / row["tokens_per_s"], 3)
            row["why"] = explain(plan, row, model.num_layers)
    return rows + [plan]


def _describe(res, hw, batch: int) -> dict:
    """Decisions (from the config simulate_config recorded in res.meta) and the shared result columns."""
    cfg = ScheduleConfig.from_dict(res.meta["schedule"])
    out = decisions(cfg, batch)
    out.update(result_row(res, hw))
    out["hw_flops_per_model_flop"] = round(res.hw_flops_per_iteration / res.model_flops_per_iteration, 3)
    return out


def make_headlines(rows: list[dict]) -> list[dict]:
    """No paper number exists for the planner; these rows carry ours only (paper column empty)."""
    out = []
    for r in rows:
        if r["system"] == "tierflow plan" or not r.get("plan_speedup"):
            continue
        out.append(
            headline(
                "own_plans",
                f"{r['case']}: tierflow plan vs {r['system']}",
                r["plan_speedup"],
                None,
                "x (tokens/s)",
                note=r["why"],
                source="-",
            )
        )
    return out


def plot(rows: list[dict], path: Path) -> Path:
    family_of = {system: fam for case in CASES for fam, system in case[5].items()} | {"tierflow plan": "plan"}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = new_figure(len(cases), width_in=3.6, height_in=4.2)
    for ax, case in zip(axes, cases):
        pts = [r for r in rows if r["case"] == case]
        names = [r["system"].replace(" (", "\n(") for r in pts]
        vals = [r.get("tokens_per_s", 0) if r["fits"] else 0 for r in pts]
        bars = ax.bar(range(len(pts)), vals, color=[schedule_color(family_of[r["system"]]) for r in pts])
        for b, r in zip(bars, pts):
            ax.annotate(
                r.get("binding", "no fit").replace("mixed: ", ""),
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                fontsize=7,
                textcoords="offset points",
                xytext=(0, 2),
            )
        for i, r in enumerate(pts):
            if not r["fits"]:
                no_fit_markers(ax, [i], family_of[r["system"]], "does not fit")
        # the GPU's ceiling for this work: its peak at the model's FLOPs per token (recompute only adds FLOPs)
        ok = next((r for r in pts if r["fits"] and r.get("model_tflops")), None)
        if ok is not None:
            peak = resolve(ok["model"], ok["hw"])[1].gpu.peak_tflops
            ceiling = peak * ok["tokens_per_s"] / ok["model_tflops"]
            reference_line(ax, ceiling, f"GPU peak ({peak:g} TFLOPS)")
            ax.set_ylim(0, ceiling * 1.12)
        ax.set_xticks(range(len(pts)), names, fontsize=7)
        ax.set(ylabel="tokens/s", title=f"{case}\n{pts[0]['hw']}, batch {pts[0]['batch']} x {pts[0]['seq']}")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def run(quick: bool = False, out_dir: Path | None = None, progress: Progress | None = None) -> list[dict]:
    from expcommon import RESULTS_DIR

    out_dir = Path(out_dir or RESULTS_DIR)
    s = settings(quick)
    total = 0
    for case in s["cases"]:
        total += 1 + len(case[5]) * len(s["micro_batches"] or divisors_up_to(case[3], 64))
    progress = progress or Progress(total, "own_plans")
    rows = []
    for case in s["cases"]:
        rows += run_case(case, s, progress)
    progress.finish()
    write_csv(rows, out_dir / "own_plans.csv")
    plot(rows, out_dir / "own_plans.png")
    print(
        "tierflow plan vs the papers' schedules (same box, same batch; speedup = plan tokens/s / schedule's)"
    )
    print_table(
        rows,
        [
            "case",
            "system",
            "shape",
            "swap_layers",
            "alpha",
            "iteration_s",
            "tokens_per_s",
            "hw_tflops",
            "model_tflops",
            "binding",
            "plan_speedup",
        ],
    )
    print("\nwhy (decisions of the plan vs each paper schedule):")
    for r in rows:
        if r.get("why"):
            print(f"- {r['case']}, vs {r['system']} ({r['plan_speedup']:.2f}x): {r['why']}")
    for r in rows:
        if r["system"] == "tierflow plan" and r["fits"]:
            print(
                f"- {r['case']} plan placement: {r['placement']} (search {r['plan_search_s']} s, "
                f"{r['plan_origin']})"
            )
    return make_headlines(rows)


def main(argv=None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"\nwrote {args.out / 'own_plans.csv'} and {args.out / 'own_plans.png'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
