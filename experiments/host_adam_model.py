"""CPU Adam from the host, per implementation (planner/core/hostadam.py), against the measured rates.

    python experiments/host_adam_model.py [--quick] [--no-measure] [--deepspeed] [--out DIR]
    python experiments/host_adam_model.py --write-profiles   # the bundled profiles' CPU Adam lines

1. Measures this machine at one thread (CPU time of the thread, best of 7, so other sessions' load slows it
   little): the per-core costs the model takes (a cache-resident vector sqrt and division, ns per element; a
   core's streaming rate from add_ / addcmul_ / addcmul(out=) over 128 MiB arrays) and, as checks, the rates
   of torch's fused AdamW and tierflow's host optimizer op (executor/calibration/optimizer_op.HostAdamOp) over
   8 Mi parameters; with --deepspeed DeepSpeedCPUAdam's too (its C++ op builds on first use: minutes).
   --no-measure reuses the measured rows of the results file.
2. Predicts every measured rate (these, Polaris' DeepSpeed step, the H200 box's fused AdamW) from the box's
   cores, clock, microarchitecture and memory with the committed per-core costs (hostadam.CORE_COSTS), and
   once more with the per-core streaming rate fitted on the other one-thread optimizer rates of this machine
   (each left out in turn); the rule of thumb it replaces (0.5 x memory_gbps / 32, half of it for DeepSpeed)
   beside them.

Writes host_adam_model.csv and the table of docs/hardware-profiles.md ("CPU Adam from the host").

--write-profiles (alone: measures nothing) rewrites each bundled profile's `cpu.adam_gparams_per_s` and
`cpu.deepspeed_adam_gparams_per_s` lines with the model's rates (hostadam.profile_fields: tierflow's kernel
and DeepSpeedCPUAdam on the profile's cores, clock, microarchitecture and memory), each comment naming the
model and its inputs; a line whose comment starts "measured" or "fitted" stays, and so does a profile the
model cannot describe (no clock or cores).
"""

from __future__ import annotations

import csv
import re
import sys
import time
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    markdown_table,
    print_table,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.hwprofiles import list_profiles, load_profile
from tierflow.planner.core import hostadam

DOC = REPO_DIR / "docs" / "hardware-profiles.md"
DOC_TABLE = ("CPU Adam from the host (experiments/host_adam_model.py from "
             "experiments/results/host_adam_model.csv)")
VM_CLOCK_GHZ = 2.45  # the dev VM's TSC (lscpu BogoMIPS 4890.86 / 2); KVM hides the boost clock
N_STREAM = 32 * 2**20
N_OPT = 8 * 2**20
# Measured elsewhere (not re-run here): (box, implementation, threads, G params/s, what it is, source)
POLARIS = dict(box="polaris-a100-40g", impl="deepspeed", threads=32, measured=1.417, cores=32, clock=2.8,
               arch="zen3", memory_gbps=204.8, what="DeepSpeed ZeRO-3 step (optimizer_step timer, 11.2B)",
               source="dos_polaris_13b_sweep.csv optimizer_step_s 7.75-8.06 s (DeepSpeed 0.13.3)")
H200 = dict(box="h200-lent", impl="torch_fused", threads=16, measured=3.98, cores=16, clock=None,
            arch="unknown", memory_gbps=None, what="torch fused AdamW (calibrate)",
            source="REFERENCE.md section 6; hwprofiles/h200-lent.yaml")


# Measured on this machine by `tierflow calibrate` (not re-run here): the calibrated profiles the race, the
# closed loop and the executor benchmark committed; each rate with its thread count and the box's measured
# copy rate (cpu.memory_gbps, memory_efficiency 1.0), which is the memory the model is given for them.
CALIBRATED = (("race_box.yaml", "torch_fused", "adam_gparams_per_s"),
              ("race_box.yaml", "deepspeed", "deepspeed_adam_gparams_per_s"),
              ("closed_loop_cpu.yaml", "torch_fused", "adam_gparams_per_s"),
              ("bench_executor_box.yaml", "torch_fused", "adam_gparams_per_s"))


def calibrated_rates(folder: Path = RESULTS_DIR) -> list[dict]:
    """The CALIBRATED rates as measured-elsewhere points (threads read from each line's comment)."""
    out = []
    for file, impl, key in CALIBRATED:
        text = (Path(folder) / file).read_text()
        m = re.search(rf"^  {key}: ([\d.]+)  # measured: (.*? on (\d+) threads?)", text, re.M)
        gbps = re.search(r"^  memory_gbps: ([\d.]+)", text, re.M)
        if m is None or gbps is None:
            continue
        out.append(dict(box=f"dev VM, {file}", impl=impl, threads=int(m.group(3)), measured=float(m.group(1)),
                        cores=int(m.group(3)), clock=VM_CLOCK_GHZ, arch="zen3",
                        memory_gbps=float(gbps.group(1)), efficiency=1.0, what=f"calibrate: {m.group(2)}",
                        source=f"experiments/results/{file} (memory: its measured copy rate)"))
    return out


def _best(fn, reps: int = 7) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        out = min(out, time.thread_time() - t0)
    return out


def measure(quick: bool, deepspeed: bool) -> list[dict]:
    """This machine's per-core costs and one-thread optimizer rates (rows of kind 'core' and 'rate')."""
    import torch

    torch.set_num_threads(1)
    rows = []
    n, inner = 1 << 18, (10 if quick else 50)
    x, y = torch.rand(n) + 0.5, torch.rand(n) + 0.5
    for name, f in (("sqrt", lambda: x.sqrt_()), ("div", lambda: x.div_(y))):
        x.fill_(1.5)
        t = _best(lambda f=f: [f() for _ in range(inner)])
        rows.append({"kind": "core", "what": f"{name}_ns_per_elem", "value": t / (n * inner) * 1e9})
    big = N_STREAM // (8 if quick else 1)
    a, b, c, d = (torch.rand(big) for _ in range(4))
    streams = [12 * big / _best(lambda: a.add_(b)), 16 * big / _best(lambda: a.addcmul_(b, c)),
               20 * big / _best(lambda: torch.addcmul(a, b, c, out=d))]
    rows.append({"kind": "core", "what": "stream_gbps", "value": sorted(streams)[1] / 1e9,
                 "spread": f"{min(streams) / 1e9:.1f}-{max(streams) / 1e9:.1f}"})
    rows += _optimizer_rates(N_OPT // (4 if quick else 1), deepspeed)
    return rows


def _optimizer_rates(n: int, deepspeed: bool) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_optimizer import fused_adamw

    from tierflow.executor.calibration.optimizer_op import HostAdamOp

    op = HostAdamOp(n)
    calls = {"torch_fused": fused_adamw(op), "tierflow": op.step}
    if deepspeed:
        calls["deepspeed"] = _deepspeed_step(op)
    rows = []
    for impl, call in calls.items():
        op.grads.fill_(1e-3)
        call()
        t = _best(call)
        rows.append({"kind": "rate", "box": "dev VM (AMD EPYC Milan, 2 vCPU, KVM)", "impl": impl,
                     "threads": 1,
                     "measured": n / t / 1e9, "what": f"{impl}, {n / 2**20:g} Mi params, 1 thread (CPU time)",
                     "source": "this script"})
    return rows


def _deepspeed_step(op):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(op.master)
    p.grad = op.grads
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    return opt.step


def core_costs(rows: list[dict]) -> hostadam.CoreCosts:
    """This run's zen3 costs (cycles at the VM's clock), as measured."""
    v = {r["what"]: float(r["value"]) for r in rows if r["kind"] == "core"}
    return hostadam.CoreCosts("zen3 (this run)", v["sqrt_ns_per_elem"] * VM_CLOCK_GHZ,
                              v["div_ns_per_elem"] * VM_CLOCK_GHZ, v["stream_gbps"], "this run")


def _cpu(p: dict, core: hostadam.CoreCosts) -> hostadam.HostCpu | None:
    if p["clock"] is None or p["memory_gbps"] is None or p["arch"] != "zen3":
        return None
    return hostadam.HostCpu(p["threads"], p["clock"], core, p["memory_gbps"], p.get("efficiency", 0.75))


def checks(rows: list[dict]) -> list[dict]:
    """Every measured rate against the model: with the committed costs, and with the core's streaming rate
    fitted on this machine's other one-thread optimizer rates (left out in turn)."""
    vm = [dict(r, cores=1, clock=VM_CLOCK_GHZ, arch="zen3", memory_gbps=1e9, box=r["box"])
          for r in rows if r["kind"] == "rate"]
    vm = [dict(r, threads=int(r["threads"]), measured=float(r["measured"])) for r in vm]
    base = hostadam.CORE_COSTS["zen3"]
    out = []
    for p in vm + calibrated_rates() + [POLARIS, H200]:
        cpu = _cpu(p, base)
        pred = hostadam.adam_rate(p["impl"], cpu) if cpu else None
        row = {"kind": "check", "box": p["box"], "impl": p["impl"], "threads": p["threads"],
               "what": p["what"], "measured": round(p["measured"], 3), "source": p["source"]}
        if pred is not None:
            row.update(predicted=round(pred.gparams_per_s, 3), bound=pred.bound,
                       error=round(pred.gparams_per_s / p["measured"] - 1, 3))
        others = [o for o in vm if o is not p]
        if p in vm and others:  # core_gbps fitted on the others: mean of measured x bytes
            fit = sum(o["measured"] * hostadam.IMPLS[o["impl"]].bytes_per_param for o in others) / len(others)
            loo = hostadam.adam_rate(p["impl"], _cpu(p, _with_gbps(base, fit)))
            row.update(loo_core_gbps=round(fit, 1), loo_predicted=round(loo.gparams_per_s, 3),
                       loo_error=round(loo.gparams_per_s / p["measured"] - 1, 3))
        if p is POLARIS:  # the rule of thumb this model replaces, where the box's memory is published
            rule = 0.5 * p["memory_gbps"] / 32 * (0.5 if p["impl"] == "deepspeed" else 1.0)
            row.update(rule=round(rule, 3), rule_error=round(rule / p["measured"] - 1, 3))
        out.append(row)
    return out


def _with_gbps(c: hostadam.CoreCosts, gbps: float) -> hostadam.CoreCosts:
    return hostadam.CoreCosts(c.name, c.sqrt_cycles, c.div_cycles, gbps, "fitted on the others")


def _pct(x) -> str:
    return "-" if x in (None, "") else f"{float(x):+.0%}"


def doc_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if r["kind"] != "check":
            continue
        pred = r.get("predicted")
        body.append([r["box"], r["impl"], r["threads"], r["what"], r["measured"],
                     f"{float(pred):.3g} ({r['bound']})" if pred not in (None, "") else "cannot say",
                     _pct(r.get("error")),
                     f"{float(r['loo_predicted']):.3g} ({_pct(r['loo_error'])})"
                     if r.get("loo_predicted") not in (None, "") else "-",
                     f"{float(r['rule']):.3g} ({_pct(r['rule_error'])})"
                     if r.get("rule") not in (None, "") else "-"])
    core = [r for r in rows if r["kind"] == "core"]
    head = ["box", "implementation", "threads", "measured what", "measured G/s", "model G/s (bound)", "error",
            "core rate fitted on the others: model (error)", "rule of thumb (error)"]
    text = markdown_table(head, body)
    if core:
        text += "\n\nThis run's per-core costs: " + "; ".join(
            f"{r['what']} {float(r['value']):.3g}" + (f" ({r['spread']})" if r.get("spread") else "")
            for r in core)
    return text


PROFILES_DIR = REPO_DIR / "hwprofiles"


def rewrite_profile_text(text: str, fields: dict[str, tuple[float, str]]) -> str:
    """`text` (a profile's YAML) with each of `fields`' lines of its cpu section set to (value, comment), but
    for a line whose comment starts with a kept source (measured, fitted)."""
    for key, (value, comment) in fields.items():
        pat = re.compile(rf"^(  {key}: )([^#\n]*?)(\s*#\s*)(.*)$", re.M)
        m = pat.search(text)
        if m is None or m.group(4).startswith(hostadam.KEPT_SOURCES):
            continue
        text = text[:m.start()] + f"  {key}: {value:g}  # {comment}" + text[m.end():]
    return text


def write_profiles(folder: Path = PROFILES_DIR) -> list[str]:
    """Rewrites the bundled profiles' CPU Adam lines from the host model; returns the files it changed."""
    changed = []
    for name in list_profiles():
        path = folder / f"{name}.yaml"
        text = path.read_text()
        new = rewrite_profile_text(text, hostadam.profile_fields(load_profile(name)))
        if new != text:
            path.write_text(new)
            changed.append(path.name)
    return changed


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--no-measure", action="store_true", help="reuse the measured rows of the results file")
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeedCPUAdam (builds its op)")
    ap.add_argument("--write-profiles", action="store_true",
                    help="only rewrite the bundled profiles' CPU Adam lines from the host model")
    args = ap.parse_args(argv)
    if args.write_profiles:
        changed = write_profiles()
        print("rewrote " + (", ".join(changed) if changed else "nothing: every line is the model's already"))
        return 0
    out_dir = Path(args.out or RESULTS_DIR)
    path = out_dir / "host_adam_model.csv"
    if args.no_measure:
        measured = [r for r in read_rows(path) if r["kind"] in ("core", "rate")]
    else:
        measured = measure(args.quick, args.deepspeed)
    rows = measured + checks(measured)
    write_csv(rows, path)
    if out_dir.resolve() == Path(RESULTS_DIR).resolve() and not args.quick:
        write_generated_block(DOC, DOC_TABLE, doc_table(read_rows(path)))
    print_table([r for r in rows if r["kind"] == "core"], ["what", "value", "spread"])
    print()
    print_table([r for r in rows if r["kind"] == "check"],
                ["box", "impl", "threads", "measured", "predicted", "bound", "error", "loo_predicted",
                 "loo_error", "rule", "rule_error"])
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
