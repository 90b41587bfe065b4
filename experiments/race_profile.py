"""Where each side's step goes, per resource, at the race's points where tierflow lost (the race against
DeepSpeed ZeRO-Infinity, docs/deepspeed.md).

    python experiments/race_profile.py [--steps N] [--profile race_box.yaml] [--points I ...] [--out DIR]

DeepSpeed (race_deepspeed.py's configs, same model, data, threads and SSD directory): the step's wall time
split into forward / backward / optimizer step (timed around engine(x), engine.backward, engine.step), and
inside them the time spent in its NVMe swapper calls (parameter swap-in / swap-out / synchronise,
optimizer-state swap in / out, inclusive of their waits), the time blocked in its aio handles' wait() (read
and write handles apart), and its CPU Adam kernel. The rest of a phase is its compute, DeepSpeed's module
hooks and casts.

tierflow (race_deepspeed.py's plans, and tf-plan as the race ran it): the measured trace of `run_plan`
(RunResult.measured, the executor's own per-op times): busy time per resource over the last measured step, and
the critical path of that step, walked back from its last compute op through each op's latest-ending
dependency or resource predecessor, summed per resource; the gaps on the path are time no op ran (dispatch,
Python, waits the plan does not show).

Writes race_profile.md and race_profile.json under --out (--points: those points of race_deepspeed.SWEEP,
merged into the race_profile.json already there). Timing on a shared 2-core machine is noisy.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import race_deepspeed as race
from expcommon import arg_parser, script_main

POINTS = [race.SWEEP[0], race.SWEEP[1]]  # where tierflow lost in the first sweep
DS_VARIANTS = ("ds-default", "ds-tuned")
# and tf-plan as the race ran it, where race_runs.json has it
TF_VARIANTS = ("tf-horizontal", "tf-hostweights")
RESOURCES = ("gpu", "cpu", "ssd_read", "ssd_write", "h2d", "d2h")


# ---- DeepSpeed: timers around its phases, swapper calls and aio waits --------------------------------------


class _Clock:
    """Seconds per (phase, what), the phase being the engine call in progress."""

    def __init__(self) -> None:
        self.phase = "init"
        self.s: dict[str, dict[str, float]] = {}

    def add(self, what: str, dt: float) -> None:
        d = self.s.setdefault(self.phase, {})
        d[what] = d.get(what, 0.0) + dt

    def timed(self, what: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(what, time.perf_counter() - t0)
        return wrapper


class _TimedHandle:
    """An aio handle whose wait() is timed, as a read or a write wait by the last op submitted to it."""

    def __init__(self, handle, clock: _Clock) -> None:
        self._h, self._clock, self._dir = handle, clock, "read"

    def __getattr__(self, name):
        attr = getattr(self._h, name)
        if name in ("async_pread", "sync_pread", "pread"):
            self._dir = "read"
        elif name in ("async_pwrite", "sync_pwrite", "pwrite"):
            self._dir = "write"
        if name in ("wait", "sync_pread", "sync_pwrite"):
            rw = "read" if "read" in name else "write" if "write" in name else self._dir
            return self._clock.timed(f"aio wait ({rw})", attr)
        return attr


def _instrument_deepspeed(clock: _Clock) -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.swap_tensor import (
        partitioned_optimizer_swapper,
        partitioned_param_swapper,
        pipelined_optimizer_swapper,
    )

    for mod in (partitioned_param_swapper, partitioned_optimizer_swapper, pipelined_optimizer_swapper):
        builder = getattr(mod, "AsyncIOBuilder", None)
        if builder is None or getattr(builder.load, "_race_timed", False):
            continue
        orig_load = builder.load

        def load(self, *a, _orig=orig_load, **k):
            op = _orig(self, *a, **k)

            class Op:
                def __getattr__(self, name):
                    return getattr(op, name)

                @staticmethod
                def aio_handle(*ha, **hk):
                    return _TimedHandle(op.aio_handle(*ha, **hk), clock)
            return Op()
        load._race_timed = True
        builder.load = load
    sw = partitioned_param_swapper.AsyncPartitionedParameterSwapper
    for name in ("swap_in", "swap_out_and_release", "synchronize_reads", "synchronize_writes",
                 "swap_out_partitioned_params"):
        setattr(sw, name, clock.timed(f"param swap ({name})", getattr(sw, name)))
    for cls in (partitioned_optimizer_swapper.PartitionedOptimizerSwapper,
                pipelined_optimizer_swapper.PipelinedOptimizerSwapper):
        for name in ("swap_in_optimizer_state", "swap_out_optimizer_state", "swap_out_gradients"):
            setattr(cls, name, clock.timed(f"optimizer swap ({name})", getattr(cls, name)))
    DeepSpeedCPUAdam.step = clock.timed("cpu adam", DeepSpeedCPUAdam.step)


def ds_profile_worker(job: dict) -> dict:
    clock = _Clock()
    ds = race.ds_engine(job, before_init=lambda: _instrument_deepspeed(clock))
    engine, data, p = ds.engine, ds.data, ds.point
    steps = []
    for step in range(job["warmup"] + job["steps"]):
        clock.s = {}
        x, y = data.batch(step, p.batch, p.seq)
        wall = {}
        t0 = time.perf_counter()
        clock.phase = "forward"
        loss = engine(x, y)
        t1 = time.perf_counter()
        clock.phase = "backward"
        engine.backward(loss)
        t2 = time.perf_counter()
        clock.phase = "step"
        engine.step()
        t3 = time.perf_counter()
        wall = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}
        steps.append({"wall_s": wall, "inside_s": clock.s})
    return {"steps": steps[job["warmup"]:]}


# ---- tierflow: the executor's measured trace ---------------------------------------------------------------


def trace_profile(res) -> dict:
    """Busy time per resource and the critical path over the last measured iteration of a measured
    SimResult."""
    tasks = res.graph.tasks
    n_it = res.graph.num_iterations
    last = n_it - 1
    gpu_end = {}
    for t in tasks:
        if t.resource == "gpu":
            gpu_end[t.iteration] = max(gpu_end.get(t.iteration, 0.0), float(res.end_s[t.id]))
    w0, w1 = (gpu_end[last - 1] if last >= 1 else 0.0), gpu_end[last]
    busy = dict.fromkeys(RESOURCES, 0.0)
    for t in tasks:
        s, e = float(res.start_s[t.id]), float(res.end_s[t.id])
        busy[t.resource] = busy.get(t.resource, 0.0) + max(0.0, min(e, w1) - max(s, w0))
    # resource predecessors: the op that ran before on the same resource
    by_res: dict[str, list] = {}
    for t in sorted(tasks, key=lambda t: float(res.start_s[t.id])):
        by_res.setdefault(t.resource, []).append(t)
    prev_on_res = {}
    for lst in by_res.values():
        for a, b in zip(lst, lst[1:]):
            prev_on_res[b.id] = a.id
    end_t = max((t for t in tasks if t.resource == "gpu" and t.iteration == last),
                key=lambda t: float(res.end_s[t.id]))
    path = dict.fromkeys(RESOURCES, 0.0)
    kinds: dict[str, float] = {}
    gap = 0.0
    cur = end_t
    while cur is not None and float(res.end_s[cur.id]) > w0:
        s, e = float(res.start_s[cur.id]), float(res.end_s[cur.id])
        d = max(0.0, min(e, w1) - max(s, w0))
        path[cur.resource] += d
        kinds[f"{cur.kind} ({cur.resource})"] = kinds.get(f"{cur.kind} ({cur.resource})", 0.0) + d
        cands = [*cur.deps, *([prev_on_res[cur.id]] if cur.id in prev_on_res else [])]
        cands = [tasks[i] for i in cands if float(res.end_s[i]) <= s + 1e-6]
        nxt = max(cands, key=lambda t: float(res.end_s[t.id]), default=None)
        nxt_end = max(float(res.end_s[nxt.id]), w0) if nxt is not None else w0
        gap += max(0.0, max(s, w0) - nxt_end)
        cur = nxt
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:6]
    return {"window_s": w1 - w0, "busy_s": busy, "critical_s": path, "critical_gap_s": gap,
            "critical_kinds_s": dict(top)}


def tf_profile_worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    from tierflow.executor.run import OutputOptions, RunConfig, run_plan
    from tierflow.planner.io.planfile import load_plan

    config = RunConfig(steps=job["warmup"] + job["steps"], device="cpu", ssd_dir=job["ssd_dir"],
                       output=OutputOptions(quiet=True))
    run = run_plan(load_plan(job["plan"]), config)
    prof = trace_profile(run.measured)
    prof["step_s"] = [r.step_s for r in run.records[job["warmup"]:]]
    return prof


# ---- driver ------------------------------------------------------------------------------------------------


def _phase_rows(ds: dict) -> dict[str, float]:
    """The median step's wall per phase and, summed over phases, the swapper, aio wait and Adam time."""
    st = sorted(ds["steps"], key=lambda s: s["wall_s"]["total"])[len(ds["steps"]) // 2]
    out = {f"{k} wall": v for k, v in st["wall_s"].items()}
    for phase, d in st["inside_s"].items():
        for what, v in d.items():
            key = f"{phase}: {what}"
            out[key] = out.get(key, 0.0) + v
    return out


def markdown(results: dict, versions: str) -> str:
    lines = [f"Produced by `python experiments/race_profile.py` ({versions}); one run per variant, "
             "the median of its measured steps after one warm-up step, on the shared 2-core dev machine "
             "(noisy: other processes ran beside it).", ""]
    for point, res in results.items():
        lines += [f"### {point}", "", "DeepSpeed (seconds of the median step; swapper calls include their "
                  "aio waits; the remainder of a phase is compute, hooks, casts):", "",
                  "| variant | phase / part | s |", "|---|---|---|"]
        for v in DS_VARIANTS:
            r = res.get(v)
            if not r or "error" in r:
                lines.append(f"| {v} | failed | {r.get('error') if r else 'not run'} |")
                continue
            for k, s in _phase_rows(r).items():
                lines.append(f"| {v} | {k} | {s:.3f} |")
        lines += ["", "tierflow (the executor's measured trace, last step: busy per resource and the "
                  "critical path per resource; gap = time on the path when no op ran):", "",
                  "| variant | step s | resource | busy s | on critical path s |", "|---|---|---|---|---|"]
        for v in [v for v in res if v.startswith("tf-")]:
            r = res.get(v)
            if not r or "error" in r:
                lines.append(f"| {v} | failed | {r.get('error') if r else 'not run'} | | |")
                continue
            step = sorted(r["step_s"])[len(r["step_s"]) // 2]
            for resource in RESOURCES:
                if r["busy_s"].get(resource, 0) or r["critical_s"].get(resource, 0):
                    lines.append(f"| {v} | {step:.3f} | {resource} | {r['busy_s'][resource]:.3f} | "
                                 f"{r['critical_s'][resource]:.3f} |")
            lines.append(f"| {v} | {step:.3f} | (gap) | | {r['critical_gap_s']:.3f} |")
            lines.append(f"| {v} | {step:.3f} | critical path by op kind | | "
                         + ", ".join(f"{k} {s:.3f}" for k, s in r["critical_kinds_s"].items()) + " |")
        lines.append("")
    return "\n".join(lines)


def recorded_plans(out: Path, p, hw, work: Path) -> dict[str, tuple[Path, dict]]:
    """The plans the race ran at point `p` (their decisions in race_runs.json under `out`, tf-plan
    included), rebuilt as plan files under `work`: the profile times the plans the race timed."""
    from tierflow.planner.core.contract import ScheduleConfig
    from tierflow.planner.core.schedules import build_graph
    from tierflow.planner.io.planfile import plan_from_graph, write_plan

    path = out / race.RUNS_FILE
    recs = json.loads(path.read_text())["points"] if path.exists() else []
    plans = {}
    for rec in (r for r in recs if race.Point(**r["point"]) == p):
        spec = p.spec()
        for v, d in rec["plans"].items():
            cfg = ScheduleConfig.from_dict(d)
            f = work / f"recorded-{p.layers}x{p.hidden}-b{p.batch}-{v}.json"
            write_plan(plan_from_graph(spec, hw, cfg, build_graph(spec, hw, cfg)), f)
            plans[v] = (f, d)
    return plans


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        job = json.loads(Path(sys.argv[2]).read_text())
        res = {"ds": ds_profile_worker, "tf": tf_profile_worker}[job["kind"]](job)
        print(race.RESULT_TAG + json.dumps(res), flush=True)
        return
    ap = arg_parser(__doc__)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run after one warm-up step")
    ap.add_argument("--profile", type=Path, default=None,
                    help="calibrated profile of this box (default: OUT/race_box.yaml from the race)")
    ap.add_argument("--points", nargs="+", type=int, choices=range(len(race.SWEEP)), default=None,
                    help="these points of race_deepspeed.SWEEP (0-based) instead of the two where tierflow "
                         "lost, merged into the race_profile.json under --out")
    args = ap.parse_args(argv)
    missing = race.deepspeed_missing()
    if missing:
        print(missing.replace("race_deepspeed", "race_profile"))
        return
    from tierflow.hwprofiles import load_profile

    hw = load_profile(args.profile or args.out / "race_box.yaml")
    work = Path(tempfile.mkdtemp(prefix="tierflow-race-profile-"))
    ssd = work / "ssd"
    ssd.mkdir()
    script = Path(__file__).resolve()
    old = args.out / "race_profile.json"
    results: dict[str, dict] = json.loads(old.read_text()) if args.points and old.exists() else {}
    try:
        for p in [race.SWEEP[i] for i in args.points] if args.points else POINTS:
            recorded = recorded_plans(args.out, p, hw, work)
            plans = {**race.tf_plans(p, hw, None, work, TF_VARIANTS),
                     **{v: f for v, f in recorded.items() if v in (*TF_VARIANTS, "tf-plan")}}
            res: dict[str, dict] = {}
            for v in (*DS_VARIANTS, *plans):
                print(f"race_profile: {p.name} {v}", file=sys.stderr)
                job = {"point": asdict(p), "threads": race.THREADS, "steps": args.steps, "warmup": 1}
                if v.startswith("ds-"):
                    nvme = ssd / "deepspeed"
                    shutil.rmtree(nvme, ignore_errors=True)
                    nvme.mkdir()
                    job.update(kind="ds", ds_config=race.ds_config(p, str(nvme), v))
                else:
                    job.update(kind="tf", plan=str(plans[v][0]), ssd_dir=str(ssd))
                res[v] = race.run_worker(job, work, script=script)
            results[p.name] = res
    finally:  # the SSD tier's files and the plans: gigabytes at the largest point
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "race_profile.json").write_text(json.dumps(results, indent=1))
    (args.out / "race_profile.md").write_text(markdown(results, race.versions()))
    print(f"wrote {args.out / 'race_profile.md'} and race_profile.json", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(script_main(main))
