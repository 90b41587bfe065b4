"""Fuyou / LoHan (Ratel, arXiv 2403.06504) on its own box (rtx4090-lohan): ours vs the paper.

Headlines: GPT-3 13B (40 x 5120, seq 1024) at batch 64 with 12 SSDs, Fuyou 156 TFLOPS vs ZeRO-Infinity 45
(hardware FLOPs: recompute counted); GPT-3 175B at batch 16, Fuyou ~87 TFLOPS, ZeRO-Infinity cannot run it.
Sweeps for 13B: batch size (8..128) and SSD count (1..12), naming the resource that binds at every point.

Both systems train LoHan's benchmark models (gpt3-13b-lohan, gpt3-175b-lohan: the GPT-3 shapes without an LM
head, as its code builds them), on the bundled profile whose SSD write rate is fitted to LoHan's batch-48 SSD
sweep. Fuyou = our `fuyou` schedule, ZeRO-Infinity = our `horizontal` schedule, both with the placement the
paper's code uses when the model lives on the SSDs (weights + optimizer states on SSD; Fuyou keeps fp32
gradients in host memory, ZeRO-Infinity spills them to NVMe with the optimizer; checkpoints in CPU memory).
Each point uses the micro-batch (power of two, up to the whole batch as LoHan's code runs it) that
simulates fastest.
Writes experiments/results/fuyou_lohan.csv and fuyou_lohan.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

from expcommon import (
    PAPER_PLACEMENTS,
    Progress,
    arg_parser,
    best_micro_batch,
    divisors_up_to,
    headline,
    new_figure,
    no_fit_markers,
    paper_point,
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

HW = "rtx4090-lohan"
# LoHan's benchmark models: the GPT-3 shapes with no LM head (RC4ML/LoHan gpt_model.py:196-212), which is what
# its published numbers trained; with no vocab-sized logits the whole batch goes through at once,
# as its code runs it
M13, M175 = "gpt3-13b-lohan", "gpt3-175b-lohan"
# REFERENCE.md: the 13B experiment uses seq 1024; assumed for 175B too (its 175B sequence length is not given)
SEQ = 1024
FAMILIES = {"fuyou": "Fuyou", "horizontal": "ZeRO-Infinity"}
# ZeRO-Infinity with the DeepSpeed swapper keys the seed's own artifact sets (RC4ML/LoHan @feb88fe
# config.json: offload_optimizer nvme with buffer_count 8 and pin_memory true; offload_param nvme with
# buffer_count 6, buffer_size 1.2e9, max_in_cpu 1e8 and pin_memory true; its nvme_ds/ is a fork of DeepSpeed's
# swap_tensor that reads the same keys, in DeepSpeed's ZeRO-Infinity config layout). The paper did not publish
# the config its ZeRO-Infinity runs used; this is the hypothesis that they used the same template.
# pin_memory true page-locks DeepSpeed's gradient partitions through torch's caching host allocator
# (rounded up to a power of two, pageable and pinned at once at set-up: planner/core/dsruntime.py
# deepspeed_setup_peak_bytes).
# max_in_cpu 1e8 keeps no 13B or 175B sub-group in host memory (each is over 1e8 elements).
ZI_DS_CONFIG = {"ds_pin_memory": True, "ds_opt_buffer_count": 8, "ds_param_buffer_count": 6,
                "ds_param_buffer_elems": int(1.2e9)}
OVERRIDES = {"horizontal": ZI_DS_CONFIG}
PAPER = {"fuyou_13b_tflops": 156.0, "zero_13b_tflops": 45.0, "fuyou_175b_tflops": 87.0}
SOURCE = "Fuyou/LoHan arXiv 2403.06504 abstract and paper (REFERENCE.md section 1)"


def settings(quick: bool) -> dict:
    """Which points to simulate (micro-batches per model, sweep values)."""
    if quick:
        return {
            "mb_13b": [16, 64],
            "mb_175b": [8],
            "batches": [16, 64],
            "ssd_counts": [2, 12],
            "sweep_mb_limit": 16,
        }
    return {
        "mb_13b": divisors_up_to(64, 64),
        "mb_175b": divisors_up_to(16, 16),
        "batches": [8, 16, 32, 64, 128],
        "ssd_counts": [1, 2, 3, 6, 12],
        "sweep_mb_limit": 128,
    }


def simulate_point(part: str, model_name: str, hw, family: str, batch: int, micro_batches, progress) -> dict:
    """The best micro-batch of one family at one point, as a CSV row (fits=False, with why, if none fits)."""
    model, _ = resolve(model_name, hw)
    model = model.with_seq(SEQ)
    mb, res, errors = best_micro_batch(
        model, hw, family, batch, SEQ, micro_batches, PAPER_PLACEMENTS[family], progress,
        OVERRIDES.get(family),
    )
    row = {
        "part": part,
        "model": model_name,
        "system": FAMILIES[family],
        "family": family,
        "batch": batch,
        "seq": SEQ,
        "ssd_count": hw.ssd.count,
        "micro_batch": mb or "",
        "fits": res is not None,
        "micro_batches_tried": " ".join(map(str, micro_batches)),
        "error": "" if res is not None else "; ".join(f"mb {k}: {v}" for k, v in errors.items())[:300],
    }
    if res is not None:
        row.update(result_row(res, hw))
        row["per_micro_batch_hw_tflops"] = ""
    return row


def headline_points(quick: bool, progress: Progress) -> list[dict]:
    """13B at batch 64 and 175B at batch 16 on the paper's box; every micro-batch kept (the spread is
    shown)."""
    _, hw = resolve(M13, HW)
    s = settings(quick)
    rows = []
    for model_name, batch, mbs in ((M13, 64, s["mb_13b"]), (M175, 16, s["mb_175b"])):
        for family in FAMILIES:
            per_mb = []
            for mb in mbs:
                per_mb.append(
                    simulate_point("per_micro_batch", model_name, hw, family, batch, [mb], progress)
                )
            fitting = [r for r in per_mb if r["fits"]]
            best = dict(min(fitting, key=lambda r: r["iteration_s"])) if fitting else dict(per_mb[0])
            best["part"] = "headline"
            best["micro_batches_tried"] = " ".join(map(str, mbs))
            best["per_micro_batch_hw_tflops"] = " ".join(
                f"{r['micro_batch'] or mb}:{r.get('hw_tflops', 'no-fit')}" for r, mb in zip(per_mb, mbs)
            )
            rows += per_mb + [best]
    return rows


def sweeps(quick: bool, progress: Progress) -> list[dict]:
    """13B: batch size at 12 SSDs, then SSD count at batch 64."""
    _, hw = resolve(M13, HW)
    s = settings(quick)
    rows = []
    for batch in s["batches"]:
        for family in FAMILIES:
            rows.append(
                simulate_point(
                    "batch_sweep",
                    M13,
                    hw,
                    family,
                    batch,
                    divisors_up_to(batch, s["sweep_mb_limit"]),
                    progress,
                )
            )
    for count in s["ssd_counts"]:
        hw_n = hw.with_overrides({"ssd.count": count})
        for family in FAMILIES:
            rows.append(
                simulate_point(
                    "ssd_sweep",
                    M13,
                    hw_n,
                    family,
                    64,
                    divisors_up_to(64, s["sweep_mb_limit"]),
                    progress,
                )
            )
    return rows


def bottleneck_story(rows: list[dict], part: str, key: str, unit: str) -> list[str]:
    """One line per family: how throughput and the binding resource change along a sweep."""
    lines = []
    for family, name in FAMILIES.items():
        pts = [r for r in rows if r["part"] == part and r["family"] == family]
        steps = [
            f"{r[key]}{unit}: {r['hw_tflops']:.0f} TFLOPS, {r['binding']}"
            if r["fits"]
            else f"{r[key]}{unit}: does not fit"
            for r in pts
        ]
        lines.append(f"{name}: " + "; ".join(steps))
    return lines


def pick(rows: list[dict], part: str, model: str, family: str) -> dict:
    return next(r for r in rows if r["part"] == part and r["model"] == model and r["family"] == family)


def _first_error(rows: list[dict], model: str, family: str) -> str:
    """The simulator's reason for the first micro-batch of a headline point that does not fit."""
    errs = [r["error"] for r in rows if r["part"] == "per_micro_batch" and r["model"] == model
            and r["family"] == family and not r["fits"] and r["error"]]
    return errs[0] if errs else "no micro-batch fits"


def make_headlines(rows: list[dict]) -> list[dict]:
    f13, z13 = pick(rows, "headline", M13, "fuyou"), pick(rows, "headline", M13, "horizontal")
    f175, z175 = (
        pick(rows, "headline", M175, "fuyou"),
        pick(rows, "headline", M175, "horizontal"),
    )
    z13_small = [
        r
        for r in rows
        if r["part"] == "per_micro_batch"
        and r["model"] == M13
        and r["family"] == "horizontal"
        and r["fits"]
        and r["micro_batch"] <= 2
    ]
    small = ", ".join(f"{r['hw_tflops']:.0f} at micro-batch {r['micro_batch']}" for r in z13_small)
    out = [
        headline(
            "fuyou_lohan",
            "Fuyou, GPT-3 13B, batch 64, 12 SSDs (hw TFLOPS)",
            f13.get("hw_tflops"),
            PAPER["fuyou_13b_tflops"],
            "TFLOPS (recompute counted)",
            note=(
                f"hardware-FLOP convention on both sides; our micro-batch {f13['micro_batch']} (best of "
                f"{f13['micro_batches_tried']}), the paper's is not published; binds: {f13.get('binding')}"
            )
            if f13["fits"]
            else "does not fit in our simulator",
            source=SOURCE,
        ),
        headline(
            "fuyou_lohan",
            "ZeRO-Infinity, GPT-3 13B, batch 64 (hw TFLOPS)",
            z13.get("hw_tflops"),
            PAPER["zero_13b_tflops"],
            "TFLOPS (recompute counted)",
            note=(
                "ours models ZeRO-Infinity as DeepSpeed's code runs it (runtime deepspeed: NVMe parameters "
                "fetched on demand, optimizer sub-groups swapped one after the other, gradients in buckets "
                "waited for after each backward, its GPU and host buffers; "
                "docs/baselines-as-coded.md), with the DeepSpeed keys of LoHan's artifact config.json, at "
                f"the best micro-batch that fits ({z13['micro_batch']}). Read at DeepSpeed 0.5.10, 0.9.5, "
                "0.16.9 and 0.19.8 (docs/deepspeed.md): 0.5.10's fully serial parameter path and 0.9.5's "
                "blocking cpu_checkpointing copies, neither modelled, would cost at most 9.8 s and 17.7 s "
                "more here (72 TFLOPS with both). Still missing: its per-module Python hooks, the H2D half "
                "of the per-micro-batch gradient round trip, the CPU-side casts and unscaling, and the "
                "paper's ZeRO-Infinity configuration. The paper did not publish ZeRO-Infinity's "
                "micro-batch; with small "
                + (
                    f"micro-batches ours gives {small}, which brackets the paper's 45."
                    if small
                    else "micro-batches (1-2) ours drops towards it (run without --quick to see)."
                )
            ),
            source=SOURCE,
        ),
        headline(
            "fuyou_lohan",
            "Fuyou / ZeRO-Infinity speedup, 13B batch 64",
            _div(f13.get("hw_tflops"), z13.get("hw_tflops")),
            PAPER["fuyou_13b_tflops"] / PAPER["zero_13b_tflops"],
            "x",
            note=(
                "follows from the ZeRO-Infinity row: our model of DeepSpeed still lacks its software "
                "overheads, so the gap Fuyou closes is smaller here"
            ),
            source=SOURCE,
        ),
        headline(
            "fuyou_lohan",
            "Fuyou, GPT-3 175B, batch 16 (hw TFLOPS)",
            f175.get("hw_tflops"),
            PAPER["fuyou_175b_tflops"],
            "TFLOPS (recompute counted)",
            note=(
                f"seq {SEQ} assumed (the 175B sequence length is not in REFERENCE.md); our micro-batch "
                f"{f175['micro_batch']} (best of {f175['micro_batches_tried']}{_no_fit(rows, M175)}); "
                f"binds: {f175.get('binding')}. Fuyou runs as LoHan's code runs it (runtime lohan: its "
                "training thread waits for each optimizer read and write and fetches backward weights "
                "without prefetch, docs/baselines-as-coded.md B2, B3, D); the drives' write rate and the "
                "array's host path are fitted to LoHan's 13B batch-48 SSD sweep; the CPU Adam rate is an "
                "assumption. Still missing: a per-iteration cost that shrinks with neither the batch nor the "
                "SSD count (LoHan's held-out 13B runs at 12 SSDs take about 20 s at batch 8 and at 16, ours "
                "13-14 s; experiments/fidelity.py); unmeasured candidates: CPU Adam in LoHan's child "
                "process, GPU-memory pressure while its thread runs ahead"
            )
            if f175["fits"]
            else "does not fit in our simulator",
            source=SOURCE,
        ),
        headline(
            "fuyou_lohan",
            "ZeRO-Infinity, GPT-3 175B, batch 16 (runs?)",
            f"runs, {z175['hw_tflops']:.0f} TFLOPS" if z175["fits"] else "cannot run",
            "cannot run",
            "",
            note=(
                f"our horizontal schedule fits (micro-batch {z175['micro_batch']}, peak CPU "
                f"{z175['peak_cpu_bytes'] / 1e9:,.0f} GB of the usable "
                f"{resolve(M175, HW)[1].cpu.capacity_bytes / 1e9:,.0f} GB) with the host memory "
                "DeepSpeed's code allocates for itself counted (planner/core/dsruntime.py: 16-bit gradient "
                "partitions of every parameter, 350 GB at 175B; one sub-group's fp32 gradient buffer, the "
                "fp32 gradients being swapped to NVMe with the optimizer; the swappers' pinned buffers): "
                "host memory as that code allocates it does not explain the paper's failure. Not modelled: "
                "the GPU memory of DeepSpeed's runtime beyond its buckets (activation checkpoints stay on "
                "the GPU by default), the OS's limit on pinned memory. We do not force it to fail."
            )
            if z175["fits"]
            else ("agrees with the paper: with the DeepSpeed swapper keys of LoHan's artifact config.json "
                  "(pin_memory true) DeepSpeed's set-up holds its 350 GB of bf16 gradient partitions "
                  "pageable (torch.zeros) and page-locked at once, the pinned copy rounded up to 2^39 B = "
                  "550 GB by torch's caching host allocator (stage3.py:791-795 @0.19.8, :400-404 @0.9.5; "
                  "ATen/core/CachingHostAllocator.h:300-309 @torch 2.13): "
                  f"{_first_error(rows, M175, 'horizontal')}"),
            source=SOURCE,
        ),
    ]
    return out


def _no_fit(rows: list[dict], model: str) -> str:
    """'; micro-batch 16 does not fit (gpu memory exceeded ...)' for the Fuyou headline case, or ''."""
    bad = [
        r
        for r in rows
        if r["part"] == "per_micro_batch" and r["model"] == model and r["family"] == "fuyou" and not r["fits"]
    ]
    return "".join(
        f"; micro-batch {r['micro_batches_tried']} does not fit ({r['error'].split(' at t=')[0]})"
        for r in bad
    )


def _div(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def short_binding(binding: str) -> str:
    """'gpu 99%' -> 'gpu'; 'mixed: ssd 68% / gpu 39%' -> 'ssd/gpu' (for plot labels)."""
    words = binding.replace("mixed: ", "").replace("/", " ").split()
    return "/".join(w for w in words if not w.endswith("%"))


def plot(rows: list[dict], path: Path) -> Path:
    fig, (ax1, ax2) = new_figure(2)
    for family, name in FAMILIES.items():
        color = schedule_color(family)
        for ax, part, key in ((ax1, "batch_sweep", "batch"), (ax2, "ssd_sweep", "ssd_count")):
            pts = [r for r in rows if r["part"] == part and r["family"] == family and r["fits"]]
            xs, ys = [r[key] for r in pts], [r["hw_tflops"] for r in pts]
            ax.plot(xs, ys, marker="o", color=color, label=f"{name} ({family}, ours)")
            for r in pts:
                ax.annotate(
                    short_binding(r["binding"]),
                    (r[key], r["hw_tflops"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(0, 5 if family == "fuyou" else -10),
                )
            no_fit_markers(ax, [r[key] for r in rows if r["part"] == part and r["family"] == family
                                and not r["fits"]], family, f"{name}: does not fit")
    for ax, x in ((ax1, 64), (ax2, 12)):  # the paper's 13B numbers: batch 64 on 12 SSDs
        paper_point(ax, x, PAPER["fuyou_13b_tflops"], "fuyou",
                    f"Fuyou (paper): {PAPER['fuyou_13b_tflops']:g}")
        paper_point(ax, x, PAPER["zero_13b_tflops"], "horizontal",
                    f"ZeRO-Infinity (paper): {PAPER['zero_13b_tflops']:g}")
    ax1.set(
        xscale="log",
        xlabel=f"batch (sequences of {SEQ} tokens)",
        ylabel="hardware TFLOPS (recompute counted)",
        title="GPT-3 13B, 12 SSDs: batch size",
    )
    ax2.set(xlabel="SSD count (RAID0)", ylabel="hardware TFLOPS", title="GPT-3 13B, batch 64: SSD count")
    gpu = resolve(M13, HW)[1].gpu
    for ax in (ax1, ax2):
        ax.set_ylim(0, gpu.peak_tflops * 1.08)
        reference_line(ax, gpu.peak_tflops, f"{gpu.model} peak {gpu.peak_tflops:g} TFLOPS", ls=":")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.legend(fontsize=7, loc="lower center")
    return save_figure(fig, path)


def run(quick: bool = False, out_dir: Path | None = None, progress: Progress | None = None) -> list[dict]:
    """Simulate, write fuyou_lohan.csv / .png under out_dir, print the tables; return the headline rows."""
    from expcommon import RESULTS_DIR

    out_dir = Path(out_dir or RESULTS_DIR)
    s = settings(quick)
    total = 2 * (len(s["mb_13b"]) + len(s["mb_175b"]))
    total += sum(2 * len(divisors_up_to(b, s["sweep_mb_limit"])) for b in s["batches"])
    total += 2 * len(s["ssd_counts"]) * len(divisors_up_to(64, s["sweep_mb_limit"]))
    progress = progress or Progress(total, "fuyou_lohan")
    rows = headline_points(quick, progress) + sweeps(quick, progress)
    progress.finish()
    write_csv(rows, out_dir / "fuyou_lohan.csv")
    plot(rows, out_dir / "fuyou_lohan.png")
    heads = make_headlines(rows)
    print_report(rows, heads)
    return heads


def print_report(rows: list[dict], heads: list[dict]) -> None:
    cols = [
        "model",
        "system",
        "batch",
        "ssd_count",
        "micro_batch",
        "iteration_s",
        "tokens_per_s",
        "hw_tflops",
        "model_tflops",
        "util_gpu",
        "util_pcie",
        "util_ssd",
        "util_cpu_adam",
        "binding",
    ]
    print(f"Fuyou/LoHan on {HW} (seq {SEQ}; best micro-batch per point; the paper's placement)")
    print_table([r for r in rows if r["part"] == "headline"], cols)
    print("\nper micro-batch (headline cases): hardware TFLOPS at each micro-batch tried")
    for r in (r for r in rows if r["part"] == "headline"):
        print(f"  {r['model']} {r['system']}: {r['per_micro_batch_hw_tflops']}")
    print("\nbatch sweep (13B, 12 SSDs):")
    print_table([r for r in rows if r["part"] == "batch_sweep"], cols)
    print("\nSSD-count sweep (13B, batch 64):")
    print_table([r for r in rows if r["part"] == "ssd_sweep"], cols)
    print(
        "\nwhere the bottleneck moves (binding = the resource nearest saturation; pcie counts both "
        "directions "
        "at the duplex rates, ssd counts reads + writes on the shared array):"
    )
    for line in bottleneck_story(rows, "batch_sweep", "batch", "") + bottleneck_story(
        rows, "ssd_sweep", "ssd_count", " SSDs"
    ):
        print("  " + line)
    print_headlines(heads, "ours vs the paper (Fuyou/LoHan)")


def main(argv=None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    run(args.quick, args.out)
    print(f"\nwrote {args.out / 'fuyou_lohan.csv'} and {args.out / 'fuyou_lohan.png'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
