"""What-if for GPT-3 175B on a 4090 box: SSD count, CPU memory and PCIe generation, and the cheapest box for a
target throughput.

Setting: GPT-3 175B, batch 32 x seq 2048, on rtx4090-lohan with one field changed at a time
(HardwareProfile.with_overrides). Every point is the best of the fixed schedules (horizontal, fuyou, vertical)
with their default placement (CPU memory filled first, the rest on the SSDs) over micro-batches 2-32
(tierflow.planner.search.plan_search.fixed_baselines; micro-batch 1 is never the fastest here and the slowest
to simulate); own_plans.py shows what the planner adds on top.
PCIe 5.0 is hypothetical for an RTX 4090 (the card is PCIe 4.0): we double every PCIe rate (one direction and
the duplex rates, as REFERENCE.md's ~25 -> ~50 GB/s) and keep everything else, including the SSD array
ceiling.
Cost = the box's purchase price from its profile's price section (GPU + DRAM + SSDs + the rest); $ per million
tokens = price / tokens trained in 3 years of 24/7 use (no power, hosting or resale counted).
Also checks Fuyou v2's claim that 175B fine-tunes with only 256 GB of CPU memory.
Writes experiments/results/what_if.csv and what_if.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

from expcommon import (
    PAPER_PLACEMENTS,
    Progress,
    arg_parser,
    best_micro_batch,
    headline,
    new_figure,
    no_fit_markers,
    print_headlines,
    print_table,
    reference_line,
    result_row,
    save_figure,
    schedule_color,
    script_main,
    write_csv,
)

from tierflow.api import resolve
from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.search.plan_search import fixed_baselines
from tierflow.planner.search.problem import Problem

MODEL, BASE_HW, BATCH, SEQ = "gpt3-175b", "rtx4090-lohan", 32, 2048
YEARS = 3
SECONDS_OF_USE = YEARS * 365 * 24 * 3600
TARGETS_TOKENS_PER_S = [25, 50, 100, 150, 200]
SOURCE_256 = (
    "Fuyou/LoHan v2 abstract: 175B fine-tuned with only 256 GB of CPU memory (REFERENCE.md section 1)"
)


def settings(quick: bool) -> dict:
    if quick:
        return {
            "ssd_counts": [2, 12],
            "cpu_gib": [256],
            "pcie": [5],
            "micro_batches": [2, 4],
            "other_boxes": [("a100-80g-nvme", {})],
            "check_256_batches": [8],
        }
    return {
        "ssd_counts": [1, 2, 3, 6, 12],
        "cpu_gib": [128, 256, 384, 512, 768, 1024],
        "pcie": [5],
        "micro_batches": [2, 4, 8, 16, 32],
        "other_boxes": [
            ("a100-80g-nvme", {}),
            ("a100-80g-nvme", {"ssd.count": 8}),
            ("h100-80g", {}),
            ("h100-80g", {"ssd.count": 8}),
            ("v100-32g", {}),
            ("rtx3090-desktop", {}),
            ("rtx2060-laptop", {}),
        ],
        "check_256_batches": [8, 16, 32],
    }


def pcie_gen5(hw: HardwareProfile) -> dict:
    """Overrides for the hypothetical PCIe 5.0 version of a PCIe 4.0 box: every rate doubled."""
    p = hw.pcie
    return {
        "pcie.generation": 5,
        "pcie.h2d_gbps": 2 * p.h2d_gbps,
        "pcie.d2h_gbps": 2 * p.d2h_gbps,
        "pcie.duplex_h2d_gbps": 2 * p.duplex_h2d_gbps,
        "pcie.duplex_d2h_gbps": 2 * p.duplex_d2h_gbps,
    }


def boxes(s: dict) -> list[tuple[str, str, HardwareProfile]]:
    """(sweep name, label, profile) for every box to simulate; the base box once."""
    base = load_profile(BASE_HW)
    out = [("base", "12 SSDs, 768 GiB, PCIe 4 (as published)", base)]
    out += [
        ("ssd_count", f"{n} SSDs", base.with_overrides({"ssd.count": n})) for n in s["ssd_counts"] if n != 12
    ]
    out += [
        ("cpu_memory", f"{g} GiB DRAM", base.with_overrides({"cpu.memory_gib": g}))
        for g in s["cpu_gib"]
        if g != 768
    ]
    out += [("pcie", f"PCIe {g}.0 (rates x2)", base.with_overrides(pcie_gen5(base))) for g in s["pcie"]]
    for name, ov in s["other_boxes"]:
        hw = load_profile(name).with_overrides(ov)
        out.append(("other_box", hw.name, hw))
    return out


def evaluate_box(sweep: str, label: str, hw: HardwareProfile, micro_batches: list[int]) -> dict:
    """Best fixed schedule on one box, with each family's best, the price and $ per million tokens."""
    model, _ = resolve(MODEL, hw)
    model = model.with_seq(SEQ)
    base = {
        "sweep": sweep,
        "label": label,
        "hw": hw.name,
        "ssd_count": hw.ssd.count,
        "cpu_memory_gib": hw.cpu.memory_gib,
        "pcie_generation": hw.pcie.generation,
        "h2d_gbps": hw.pcie.h2d_gbps,
        "price_usd": round(hw.price.total_usd(hw)),
    }
    found = fixed_baselines(Problem(model, hw, BATCH, SEQ), micro_batches)
    for key, (_, res) in found.items():
        base[f"{key.split()[0]}_tokens_per_s"] = round(res.tokens_per_s, 2)
    if not found:
        return {**base, "fits": False, "best_schedule": "none fits"}
    key, (cfg, res) = max(found.items(), key=lambda kv: kv[1][1].tokens_per_s)
    row = {**base, "fits": True, "best_schedule": key, **result_row(res, hw)}
    row["usd_per_million_tokens"] = round(base["price_usd"] / (res.tokens_per_s * SECONDS_OF_USE) * 1e6, 3)
    row["usd_per_token_per_s"] = round(base["price_usd"] / res.tokens_per_s, 1)
    return row


def cheapest_for_targets(rows: list[dict]) -> list[dict]:
    out = []
    for target in TARGETS_TOKENS_PER_S:
        ok = [r for r in rows if r["fits"] and r["tokens_per_s"] >= target]
        if not ok:
            out.append(
                {
                    "target_tokens_per_s": target,
                    "cheapest_box": "none of these",
                    "price_usd": "",
                    "tokens_per_s": "",
                    "usd_per_million_tokens": "",
                }
            )
            continue
        best = min(ok, key=lambda r: (r["price_usd"], -r["tokens_per_s"]))
        out.append(
            {
                "target_tokens_per_s": target,
                "cheapest_box": best["hw"],
                "price_usd": best["price_usd"],
                "tokens_per_s": best["tokens_per_s"],
                "best_schedule": best["best_schedule"],
                "usd_per_million_tokens": best["usd_per_million_tokens"],
            }
        )
    return out


def check_256gb(s: dict, progress: Progress) -> list[dict]:
    """Does 175B train on the Fuyou box cut to 256 GiB? Fuyou's schedule with its paper placement, and
    vertical with the default placement, at seq 1024 (the study-a setting) and a few batches."""
    hw = load_profile(BASE_HW).with_overrides({"cpu.memory_gib": 256})
    model = resolve(MODEL, hw)[0].with_seq(1024)
    rows = []
    for batch in s["check_256_batches"]:
        for family, placement in (("fuyou", PAPER_PLACEMENTS["fuyou"]), ("vertical", None)):
            mbs = [m for m in (1, 2, 4, 8) if batch % m == 0]
            mb, res, errors = best_micro_batch(model, hw, family, batch, 1024, mbs, placement, progress)
            rows.append(
                {
                    "sweep": "cpu_256_check",
                    "label": f"{family} batch {batch} x 1024",
                    "hw": hw.name,
                    "family": family,
                    "batch": batch,
                    "micro_batch": mb or "",
                    "fits": res is not None,
                    "tokens_per_s": round(res.tokens_per_s, 2) if res else "",
                    "hw_tflops": round(res.hw_tflops, 2) if res else "",
                    "error": "" if res else next(iter(errors.values()), "")[:200],
                }
            )
    return rows


def make_headlines(check: list[dict]) -> list[dict]:
    fits = [r for r in check if r["fits"]]
    fuyou_ok = [r["label"] for r in check if r["family"] == "fuyou" and r["fits"]]
    fuyou_fail = [r["label"] for r in check if r["family"] == "fuyou" and not r["fits"]]
    parts = [
        "in our simulator: "
        + ("; ".join(f"{r['label']} {r['tokens_per_s']:.0f} tokens/s" for r in fits) or "nothing fits")
    ]
    if fuyou_fail:
        parts.append(
            f"Fuyou's schedule does not fit at {', '.join(fuyou_fail)}: with gradient accumulation its "
            "fp32 gradients (4 B/param = 700 GB) all wait in host memory for the last micro-batch; it "
            f"fits with one micro-batch per iteration ({', '.join(fuyou_ok) or 'none tried'})"
        )
    parts.append(
        "the vertical schedule keeps only a few layers' gradients on the host, so it fits at every batch "
        "tried"
        if all(r["fits"] for r in check if r["family"] == "vertical")
        else "the vertical schedule does not fit at every batch"
    )
    return [
        headline(
            "what_if",
            "GPT-3 175B on the 4090 box with 256 GiB CPU memory",
            "runs" if fits else "does not fit",
            "runs",
            "",
            note="; ".join(parts),
            source=SOURCE_256,
        )
    ]


def sensitivity_lines(rows: list[dict]) -> list[str]:
    """One line per sweep: how the best and each family's tokens/s change from one end to the other."""
    base = next(r for r in rows if r["sweep"] == "base")
    lines = []
    for sweep, key, unit in (
        ("ssd_count", "ssd_count", " SSDs"),
        ("cpu_memory", "cpu_memory_gib", " GiB"),
        ("pcie", "pcie_generation", ""),
    ):
        pts = sorted([r for r in rows if r["sweep"] == sweep] + [base], key=lambda r: r[key])
        if len(pts) < 2:
            continue
        cells = []
        for fam in ("horizontal", "fuyou", "vertical"):
            vals = [f"{r.get(f'{fam}_tokens_per_s', '-')}" for r in pts]
            cells.append(f"{fam} " + " -> ".join(vals))
        xs = " -> ".join(f"{r[key]:g}{unit}" for r in pts)
        lines.append(f"{sweep} ({xs}): " + "; ".join(cells) + " tokens/s")
    return lines


def plot(rows: list[dict], path: Path) -> Path:
    fig, axes = new_figure(4, width_in=4.0, height_in=4.4)
    base = next(r for r in rows if r["sweep"] == "base")
    for ax, sweep, key, xlabel in (
        (axes[0], "ssd_count", "ssd_count", "SSD count"),
        (axes[1], "cpu_memory", "cpu_memory_gib", "CPU memory (GiB)"),
        (axes[2], "pcie", "pcie_generation", "PCIe generation (rates x2 for 5)"),
    ):
        pts = sorted([r for r in rows if r["sweep"] == sweep] + [base], key=lambda r: r[key])
        for level, fam in enumerate(("horizontal", "fuyou", "vertical")):
            fit = [r for r in pts if r.get(f"{fam}_tokens_per_s")]
            ax.plot([r[key] for r in fit], [r[f"{fam}_tokens_per_s"] for r in fit], marker="o",
                    color=schedule_color(fam), label=fam)
            no_fit_markers(ax, [r[key] for r in pts if not r.get(f"{fam}_tokens_per_s")], fam, level=level)
        lo, hi = pts[0][key], pts[-1][key]
        ax.set_xlim(lo - 0.06 * (hi - lo), hi + 0.06 * (hi - lo))
        reference_line(ax, base[key], "as published", vertical=True, ls=":")
        ax.set(xlabel=xlabel, ylabel="tokens/s", title=f"175B, batch {BATCH}x{SEQ}: {xlabel.split(' (')[0]}")
        ax.set_ylim(bottom=0)
        if sweep == "pcie":
            ax.set_xticks([4, 5])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    reference_line(axes[1], 256, "Fuyou v2: 175B in 256 GB", vertical=True)
    ax = axes[3]
    boxes = [r for r in rows
             if r["sweep"] not in ("cpu_256_check", "cheapest_for_target") and r.get("price_usd")]
    ok = [r for r in boxes if r.get("fits")]
    for fam in dict.fromkeys(r["best_schedule"].split()[0] for r in ok):
        pts = [r for r in ok if r["best_schedule"].split()[0] == fam]
        ax.scatter([r["price_usd"] / 1e3 for r in pts], [r["tokens_per_s"] for r in pts],
                   color=schedule_color(fam), label=f"best: {fam}")
    no_fit_markers(ax, [r["price_usd"] / 1e3 for r in boxes if not r.get("fits")], None, "no schedule fits")
    for r in ok:
        if r["sweep"] in ("base", "other_box"):
            ax.annotate(r["hw"].replace("[", "\n["), (r["price_usd"] / 1e3, r["tokens_per_s"]), fontsize=6)
    ax.set(xlabel="box price (k$)", ylabel="tokens/s (best fixed schedule)", title="price vs throughput")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def run(quick: bool = False, out_dir: Path | None = None, progress: Progress | None = None) -> list[dict]:
    from expcommon import RESULTS_DIR

    out_dir = Path(out_dir or RESULTS_DIR)
    s = settings(quick)
    todo = boxes(s)
    progress = progress or Progress(len(todo) + 2 * 4 * len(s["check_256_batches"]), "what_if")
    rows = []
    for sweep, label, hw in todo:
        progress.step(f"{hw.name}")
        rows.append(evaluate_box(sweep, label, hw, s["micro_batches"]))
    check = check_256gb(s, progress)
    progress.finish()
    targets = cheapest_for_targets(rows)
    write_csv(
        rows + check + [{"sweep": "cheapest_for_target", **t} for t in targets], out_dir / "what_if.csv"
    )
    plot(rows, out_dir / "what_if.png")
    print(
        f"What-if: {MODEL}, batch {BATCH} x {SEQ}, best fixed schedule (default placement, micro-batch 2-32)"
    )
    cols = [
        "sweep",
        "label",
        "best_schedule",
        "tokens_per_s",
        "hw_tflops",
        "horizontal_tokens_per_s",
        "fuyou_tokens_per_s",
        "vertical_tokens_per_s",
        "binding",
        "price_usd",
        "usd_per_million_tokens",
    ]
    print_table(rows, cols)
    print("\nsensitivity (tokens/s of each schedule along each sweep, '-' = does not fit):")
    for line in sensitivity_lines(rows):
        print("  " + line)
    print(
        f"\ncheapest box for a target throughput (price = purchase; $/M tokens over {YEARS} years of 24/7 "
        "use, no power or hosting):"
    )
    print_table(
        targets,
        [
            "target_tokens_per_s",
            "cheapest_box",
            "price_usd",
            "tokens_per_s",
            "best_schedule",
            "usd_per_million_tokens",
        ],
    )
    print("\n175B with 256 GiB of CPU memory (seq 1024):")
    print_table(check, ["label", "micro_batch", "fits", "tokens_per_s", "hw_tflops", "error"])
    heads = make_headlines(check)
    print_headlines(heads, "ours vs the paper (Fuyou v2, 256 GB claim)")
    return heads


def main(argv=None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"\nwrote {args.out / 'what_if.csv'} and {args.out / 'what_if.png'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
