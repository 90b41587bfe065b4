"""The given A100 sweep: Deep Optimizer States' DeepSpeed ZeRO-3 runs on one ALCF Polaris GPU,
reproduced phase by phase (forward, backward, optimizer step) from the DeepSpeed config the logs print.

    python experiments/dos_polaris.py [--quick] [--out DIR]

The runs: experiments/data/dos_polaris_13b_sweep.csv (its header names the logs: repository, commit, files,
and what they print). The box: hwprofiles/polaris-a100-40g.yaml. Two of its values are fitted on this
sweep, each on one phase, and checked by leaving each point out of the fit:

- pcie.pageable_d2h_gbps on the backward: DeepSpeed's blocking copy of the 16-bit gradients into the
  optimizer's fp32 gradient at the accumulation boundary (stage3.py partition_grads
  `fp32_grad_tensor.copy_(grad_buffer)`, a dtype-changing copy_ that PyTorch stages through pageable
  memory; dsruntime.ds_fp32_grad_copy_s);
- cpu.deepspeed_adam_gparams_per_s on the step: DeepSpeedCPUAdam over the 11.2B fp32 parameters, sub-group by
  sub-group, with the copy of each updated sub-group back to the GPU inside it (pcie.pageable_h2d_gbps is not
  published for this box and cannot be told apart from the Adam rate here: every point's step is the same).

Each phase is affine in the inverse of its fitted rate (the blocking copies run alone), so the fit is a least
squares on two simulations per point; every number reported comes from a full simulation at the fitted value.
Writes dos_polaris.csv (per point: measured, before (the profile without the fitted values and with flash
attention's published rates), after, leave-one-out; per phase) under the output folder.
"""

from __future__ import annotations

import csv
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    headline,
    markdown_table,
    print_headlines,
    print_table,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.opkinds import BWD, FWD, HEAD, RECOMPUTE
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.io.deepspeed.bridge import simulate_ds
from tierflow.planner.io.deepspeed.config import parse_ds_config

HERE = Path(__file__).parent
DATA = HERE / "data" / "dos_polaris_13b_sweep.csv"
HW = "polaris-a100-40g"
SOURCE = ("Deep Optimizer States results (arXiv 2410.21316), mauryaavinash95/deep-optimizer-states-results @ "
          "a9408cdb, act-output-13B-scale-GA-single-GPU/")
BAND = 0.15
PHASES = ("fwd", "bwd", "step")
# the fitted values: (profile key, the phase it is fitted on)
FITTED = (("pcie.pageable_d2h_gbps", "bwd"), ("cpu.deepspeed_adam_gparams_per_s", "step"))
# "before": the profile as tierflow had it before this sweep's mechanisms (no pageable copies, torch's Adam
# rule, flash attention's published rates on an A100: FlashAttention-2 paper, as a100-80g-nvme)
BEFORE = {"pcie.pageable_d2h_gbps": None, "cpu.deepspeed_adam_gparams_per_s": None,
          "compute.attention_fwd_fraction": 0.73, "compute.attention_bwd_fraction": 0.63,
          "compute.layer_ops": "fused"}
ITERATIONS = 3


@dataclass(frozen=True)
class Point:
    """One measured run of the sweep (a row of DATA)."""

    batch: int
    micro_batches: int
    iteration_s: float
    fwd_s: float
    bwd_s: float
    step_s: float

    def measured(self, phase: str) -> float:
        return {"fwd": self.fwd_s, "bwd": self.bwd_s, "step": self.step_s,
                "iteration": self.iteration_s}[phase]


def load_points(path: Path = DATA) -> list[Point]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [Point(int(r["global_batch"]), int(r["micro_batches"]), float(r["iteration_s"]), float(r["fwd_s"]),
                  float(r["bwd_s"]), float(r["step_s"])) for r in rows]


def dos_model() -> ModelSpec:
    """The fork's model as its printed arguments give it: LLaMA-2 13B's block with 4 kv heads
    (num_key_value_heads 4), ffn 13632, GPT-2's vocabulary padded to 50304, seq 2048."""
    return dataclasses.replace(get_model("llama2-13b"), name="dos-llama-13b-gqa4", num_kv_heads=4,
                               ffn_hidden=13632, vocab_size=50304, seq_len=2048)


def ds_config(batch: int) -> dict:
    """The DeepSpeed config the logs print (print_user_config), at global batch `batch`."""
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 3, "sub_group_size": 100000000,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "bf16": {"enabled": True}}


def simulate_point(p: Point, hw: HardwareProfile, model: ModelSpec | None = None) -> SimResult:
    model = model or dos_model()
    ds = parse_ds_config(ds_config(p.batch), f"gbs{p.batch}", model)
    _, res = simulate_ds(model, hw, ds, ITERATIONS)
    if not isinstance(res, SimResult):
        raise SystemExit(f"dos_polaris: batch {p.batch} does not fit on {hw.name}: {res}")
    return res


def phases(res: SimResult) -> dict[str, float]:
    """DeepSpeed's timers on the simulated iteration (the one before the last): per micro-batch, the forward
    from its first forward kernel to its last (the head's loss included), the backward from there to the next
    micro-batch's first forward kernel (the epilogue's waits included), and the step from the last
    micro-batch's backward (and the boundary's gradient copies) to the next iteration's first forward
    kernel."""
    rep = len(res.iteration_ends_s) - 2  # the iteration reported: from its first forward kernel to the next's
    tasks = [t for t in res.graph.tasks if t.iteration == rep]
    compute = [t for t in tasks if t.kind in (FWD, HEAD, RECOMPUTE, BWD)]
    lo = min(res.start_s[t.id] for t in compute)
    hi = min(res.start_s[t.id] for t in res.graph.tasks if t.iteration == rep + 1 and t.kind == FWD)
    mbs = sorted({t.mb for t in compute})
    fwd = bwd = 0.0
    last_bwd_end = lo
    for i, m in enumerate(mbs):
        mine = [t for t in compute if t.mb == m]
        f = [t for t in mine if t.kind in (FWD, HEAD)]
        f_start = min(res.start_s[t.id] for t in f)
        f_end = max(res.end_s[t.id] for t in f)
        fwd += f_end - f_start
        if i + 1 < len(mbs):
            b_end = min(res.start_s[t.id] for t in compute if t.mb == mbs[i + 1] and t.kind == FWD)
        else:
            b_end = max(res.end_s[t.id] for t in tasks if t.mb == m and t.kind in (BWD, RECOMPUTE))
            # the boundary's gradient copies the host waits for before it returns from backward
            b_end = max([b_end] + [res.end_s[t.id] for t in tasks if t.mb == -1 and t.resource == "cpu"
                                   and t.kind == "offload_grads"])
            last_bwd_end = b_end
        bwd += b_end - f_end
    return {"fwd": fwd, "bwd": bwd, "step": hi - last_bwd_end, "iteration": hi - lo}


def with_values(hw: HardwareProfile, values: dict) -> HardwareProfile:
    return hw.with_overrides({k: ("null" if v is None else v) for k, v in values.items()})


def fit_inverse_rate(points: list[Point], hw: HardwareProfile, key: str, phase: str,
                     r0: float, r1: float) -> tuple[float, dict]:
    """The rate of `key` that best fits `phase` over `points` (least squares of the relative error), the phase
    being affine in 1 / rate: two simulations per point. Returns the rate and each point's (a, b)."""
    coef = {}
    for p in points:
        t0 = phases(simulate_point(p, with_values(hw, {key: r0})))[phase]
        t1 = phases(simulate_point(p, with_values(hw, {key: r1})))[phase]
        b = (t1 - t0) / (1 / r1 - 1 / r0)
        coef[p.batch] = (t0 - b / r0, b)
    return solve(points, coef, phase), coef


def solve(points: list[Point], coef: dict, phase: str) -> float:
    """Least squares of sum((a + b x) / m - 1)^2 over x = 1 / rate."""
    num = sum(coef[p.batch][1] / p.measured(phase) * (1 - coef[p.batch][0] / p.measured(phase))
              for p in points)
    den = sum((coef[p.batch][1] / p.measured(phase)) ** 2 for p in points)
    return 1.0 / (num / den)


def run(quick: bool, out_dir: Path) -> list[dict]:
    points = load_points()
    if quick:
        points = points[:2]
    hw = load_profile(HW)
    before = with_values(hw, BEFORE)
    fitted, loo = {}, {p.batch: {} for p in points}
    base = with_values(hw, {k: getattr(getattr(hw, k.split(".")[0]), k.split(".")[1]) for k, _ in FITTED})
    for key, phase in FITTED:
        value, coef = fit_inverse_rate(points, base, key, phase, 1.0, 4.0)
        fitted[key] = round(value, 3)
        for p in points:
            rest = [q for q in points if q.batch != p.batch]
            loo[p.batch][key] = round(solve(rest, coef, phase), 3) if rest else value
    rows = []
    for p in points:
        ph_before = phases(simulate_point(p, before))
        ph_after = phases(simulate_point(p, with_values(hw, fitted)))
        ph_loo = phases(simulate_point(p, with_values(hw, loo[p.batch])))
        for phase in (*PHASES, "iteration"):
            m = p.measured(phase)
            rows.append({"batch": p.batch, "micro_batches": p.micro_batches, "phase": phase, "measured_s": m,
                         "before_s": round(ph_before[phase], 3), "after_s": round(ph_after[phase], 3),
                         "loo_s": round(ph_loo[phase], 3),
                         "error_before": round(ph_before[phase] / m - 1, 4),
                         "error_after": round(ph_after[phase] / m - 1, 4),
                         "error_loo": round(ph_loo[phase] / m - 1, 4),
                         "loo_values": "; ".join(f"{k}={v}" for k, v in loo[p.batch].items())})
    write_csv(rows, out_dir / "dos_polaris.csv")
    if out_dir.resolve() == Path(RESULTS_DIR).resolve():  # the docs show what the results file holds
        write_generated_block(DOC, DOC_TABLE, sweep_table(rows))
    print_table([{**r, **{k: f"{r[k]:+.1%}" for k in ("error_before", "error_after", "error_loo")}}
                 for r in rows], ["batch", "phase", "measured_s", "before_s", "after_s", "loo_s",
                                  "error_before", "error_after", "error_loo"])
    print("fitted on the sweep: " + ", ".join(f"{k} = {v}" for k, v in fitted.items())
          + f"; profile has: {', '.join(f'{k} = {_profile_value(hw, k)}' for k, _ in FITTED)}")
    its = [r for r in rows if r["phase"] == "iteration"]
    worst = max(its, key=lambda r: abs(r["error_loo"]))
    heads = [headline("dos_polaris", "iterations within 15% (after / leave-one-out)",
                      f"{sum(abs(r['error_after']) <= BAND for r in its)} / "
                      f"{sum(abs(r['error_loo']) <= BAND for r in its)} of {len(its)}", None, "",
                      note=f"worst leave-one-out {worst['error_loo']:+.1%} (batch {worst['batch']}); fitted "
                      + ", ".join(f"{k} {v}" for k, v in fitted.items()), source=SOURCE)]
    print_headlines(heads, "dos_polaris")
    return heads


DOC = REPO_DIR / "docs" / "reproductions.md"
DOC_TABLE = "the given A100 sweep (experiments/dos_polaris.py from experiments/results/dos_polaris.csv)"


def sweep_table(rows: list[dict]) -> str:
    """docs/reproductions.md's table: per point, the iteration measured, before, after and with the point left
    out of the fit (error: predicted / measured - 1), and each phase measured / after."""
    out = []
    for batch in sorted({int(r["batch"]) for r in rows}):
        ph = {r["phase"]: r for r in rows if int(r["batch"]) == batch}
        it = ph["iteration"]
        cells = [f"{float(it[col]):.2f} ({float(it[err]):+.1%})"
                 for col, err in (("before_s", "error_before"), ("after_s", "error_after"),
                                  ("loo_s", "error_loo"))]
        phases_ = [f"{float(ph[p]['measured_s']):.2f} / {float(ph[p]['after_s']):.2f}" for p in PHASES]
        out.append((batch, int(it["micro_batches"]), f"{float(it['measured_s']):.2f}", *cells, *phases_))
    return markdown_table(["global batch", "micro-batches", "measured s/it", "before", "after",
                           "leave-one-out", "fwd measured / after", "bwd measured / after",
                           "step measured / after"], out)


def _profile_value(hw: HardwareProfile, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(hw, section), name)


def main(argv: list[str] | None = None) -> None:
    args = arg_parser(__doc__).parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run(args.quick, out)


if __name__ == "__main__":
    sys.exit(script_main(main))
