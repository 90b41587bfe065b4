"""Benchmark: the discrete-event simulator and the planner, timed as a user runs them.

1. The simulator's tasks per second on GPT-3 175B (batch 64, micro-batch 1, one iteration) for every schedule
   and on a 4-GPU graph (Llama-2 70B, 4 ranks), against SimPy playing the same graph in the same run when
   simpy is installed (`pip install -e '.[bench]'`): each resource serves its queue in the schedule's order, a
   task takes its fixed cost plus its work at its resource's solo rate, with no memory and no fluid links (it
   does less than tierflow's simulator). The two alternate, best of --repeat.
2. `tierflow plan` of GPT-3 13B (batch 16) and 175B (batch 64) on rtx4090-lohan, each in a fresh process, its
   wall time and peak memory (RSS, sampled) per phase: candidates (CP-SAT placement and the loads), slot LP,
   verification (graph building and simulation), CP-SAT window, plan file, the rest.
3. One `--adapt` decision on tiny-gpt (the fit of the profile to the measured trace, the new search, the old
   plan on the refit profile; the setup of tests/executor/test_adapt.py with the default options).

Targets: simulator >= 3x SimPy on the 175B graphs; one simulated 175B iteration <= 0.12 s; `tierflow plan` of
175B <= 8 s and <= 0.5 GB; an --adapt decision <= 2 s. Writes bench_simulator.csv (simulator),
bench_planner_phases.csv and bench_decisions.csv; docs/performance.md shows them. --quick: small models, one
repeat (structure only).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from expcommon import (
    REPO_DIR,
    RESULTS_DIR,
    arg_parser,
    markdown_table,
    script_main,
    write_csv,
    write_generated_block,
)

from tierflow.api import resolve
from tierflow.planner.core import simkernel
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.graph import RESOURCES
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import simulate_graph

TARGET_RATIO = 3.0  # simulator over SimPy on the same graph
TARGET_ITERATION_S = 0.12  # one simulated 175B iteration
TARGET_PLAN_S, TARGET_PLAN_GB = 8.0, 0.5
TARGET_DECISION_S = 2.0
RESULTS = RESULTS_DIR / "bench_simulator.csv"
DOC = REPO_DIR / "docs" / "performance.md"
DOC_TABLE = ("simulator benchmark (experiments/bench_simulator.py from "
             "experiments/results/bench_simulator.csv)")
PHASES = ("candidates", "slot_lp", "verification", "window", "plan_file", "other")


# ---- 1. the simulator against SimPy ------------------------------------------------------------------------

def sim_cases(quick: bool) -> list[dict]:
    """(name, model, hw, schedule, batch, micro-batch, gpus) of each graph timed."""
    if quick:
        return [dict(name=f"tiny-gpt {f}", model="tiny-gpt", hw="rtx3090-desktop", family=f, batch=8,
                     micro_batch=1, gpus=1) for f in ("horizontal", "vertical")] + [
            dict(name="tiny-gpt 4 GPUs", model="tiny-gpt", hw="rtx4090-lohan-4gpu", family="vertical",
                 batch=8, micro_batch=1, gpus=4)]
    return [dict(name=f"gpt3-175b {f}", model="gpt3-175b", hw="rtx4090-lohan", family=f, batch=64,
                 micro_batch=1, gpus=1) for f in ("horizontal", "fuyou", "vertical")] + [
        dict(name="llama2-70b 4 GPUs vertical", model="llama2-70b", hw="rtx4090-lohan-4gpu",
             family="vertical", batch=64, micro_batch=4, gpus=4)]


def simpy_play(graph, hw, world) -> float:
    """The graph played in SimPy: each resource a process that serves its queue in order, a task waiting for
    its dependencies' events and then its fixed cost plus its work at its resource's solo rate. Returns the
    makespan."""
    import simpy

    rates = link_rates(hw, world)
    solo = {"gpu": 1.0, "cpu": 1.0, "h2d": rates.h2d, "d2h": rates.d2h, "ssd_read": rates.ssd_read,
            "ssd_write": rates.ssd_write, "net": rates.net}
    lat = {r: rates.latency_s(r) for r in RESOURCES}
    tasks = graph.tasks
    env = simpy.Environment()
    done = [env.event() for _ in tasks]
    order = graph.resource_order()

    def serve(queue):
        for tid in queue:
            t = tasks[tid]
            if t.deps:
                yield env.all_of([done[d] for d in set(t.deps)])
            yield env.timeout(lat[t.resource] + t.work / solo[t.resource])
            done[tid].succeed()

    for r in RESOURCES:
        if order[r]:
            env.process(serve(order[r]))
    env.run()
    return env.now


def bench_graph(case: dict, repeat: int, with_simpy: bool) -> dict:
    """Build one graph, then alternate tierflow's simulator and SimPy on it `repeat` times (best of each)."""
    model, hw = resolve(case["model"], case["hw"])
    cfg = make_schedule(case["family"], model, hw, batch=case["batch"], micro_batch=case["micro_batch"],
                        iterations=1, gpus=case["gpus"])
    t0 = time.perf_counter()
    g = build_graph(model, hw, cfg)
    build_s = time.perf_counter() - t0
    if cfg.world.ranks > 1:
        g.meta["world"] = cfg.world.to_dict()
    sims, simpys, sims_cpu, simpys_cpu = [], [], [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate_graph(g, hw, cfg.world)
        sims.append(time.perf_counter() - t0)
        sims_cpu.append(time.process_time() - c0)
        if with_simpy:
            t0, c0 = time.perf_counter(), time.process_time()
            simpy_play(g, hw, cfg.world)
            simpys.append(time.perf_counter() - t0)
            simpys_cpu.append(time.process_time() - c0)
    sim_s = min(sims)
    row = {"graph": case["name"], "tasks": len(g.tasks), "build_s": round(build_s, 3),
           "simulate_s": round(sim_s, 5), "simulate_max_s": round(max(sims), 5),
           "simulate_cpu_s": round(min(sims_cpu), 5),
           "tasks_per_s": round(len(g.tasks) / sim_s), "simulated_iteration_s": round(res.iteration_s, 3)}
    if simpys:
        # CPU time as well: on a loaded machine the wall time also counts the other processes' turns
        row.update(simpy_s=round(min(simpys), 5), simpy_max_s=round(max(simpys), 5),
                   simpy_cpu_s=round(min(simpys_cpu), 5), speed_vs_simpy=round(min(simpys) / sim_s, 2),
                   speed_vs_simpy_cpu=round(min(simpys_cpu) / max(min(sims_cpu), 1e-9), 2))
    return row


def bench_table(rows: list[dict]) -> str:
    """docs/performance.md's simulator table, from the rows as written to or read from bench_simulator.csv."""
    out = []
    for r in rows:
        simpy_s = r.get("simpy_s") or ""
        out.append((r["graph"], f"{int(r['tasks']):,}", f"{float(r['build_s']):.2f} s",
                    f"{float(r['simulate_s']):.3f} s ({float(r['simulate_cpu_s']):.3f} s)",
                    f"{float(r['tasks_per_s']):,.0f}",
                    f"{float(simpy_s):.3f} s ({float(r['simpy_cpu_s']):.3f} s)" if simpy_s else "-",
                    f"{float(r['speed_vs_simpy']):.2f}x ({float(r['speed_vs_simpy_cpu']):.2f}x)" if simpy_s
                    else "-", r.get("load", "")))
    return markdown_table(["graph (one iteration)", "tasks", "build", "simulate (CPU)", "tasks/s",
                           "SimPy, same graph (CPU)", "speed vs SimPy (CPU)", "load"], out)


# ---- 2. the planner, phase by phase ------------------------------------------------------------------------

class _PhaseClock:
    """Wall time and peak RSS per phase: the wrapped functions set the phase; a thread samples the RSS."""

    def __init__(self) -> None:
        self.phase = "other"
        self.wall_s = dict.fromkeys(PHASES, 0.0)
        self.peak_bytes = dict.fromkeys(PHASES, 0)
        self._stop = False
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop:
            p, rss = self.phase, self._rss()
            if rss > self.peak_bytes[p]:
                self.peak_bytes[p] = rss
            time.sleep(0.005)

    def wrap(self, module, name: str, phase: str) -> None:
        fn = getattr(module, name)

        def timed(*a, **kw):
            outer = self.phase
            if outer != "other":  # nested in a timed phase: counts there
                return fn(*a, **kw)
            self.phase = phase
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.wall_s[phase] += time.perf_counter() - t0
                self.phase = outer

        setattr(module, name, timed)

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def plan_phases(model: str, hw: str, batch: int, out: str) -> dict:
    """`tierflow plan` in this process with its phases timed (run by `plan_row` in a fresh process)."""
    import tierflow.cli.plan as cli_plan
    import tierflow.planner.core.schedules as schedules
    import tierflow.planner.io.planfile as planfile
    import tierflow.planner.search.plan_search as ps
    from tierflow.cli import main as cli_main

    clock = _PhaseClock()
    for mod, name, phase in ((ps, "solve_placement", "candidates"), (ps, "predict_config", "slot_lp"),
                             (ps, "simulate_config", "verification"), (ps, "window_check", "window"),
                             (planfile, "plan_from_graph", "plan_file"),
                             (cli_plan, "write_plan_file", "plan_file"),
                             (schedules, "build_graph", "plan_file")):  # the CLI's graph of the plan file
        clock.wrap(mod, name, phase)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli_main(["-q", "plan", "--model", model, "--hw", hw, "--batch", str(batch), "-o", out,
                       "--json"])
    wall = time.perf_counter() - t0
    clock.stop()
    search = wall - sum(clock.wall_s.values())
    clock.wall_s["other"] = search  # what no wrapped call covers: candidates' loads, the search's own work
    return {"model": model, "hw": hw, "batch": batch, "rc": rc, "wall_s": round(wall, 2),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3),
            **{f"{p}_s": round(clock.wall_s[p], 2) for p in PHASES},
            **{f"{p}_peak_gb": round(clock.peak_bytes[p] / 1e9, 3) for p in PHASES}}


def plan_row(model: str, hw: str, batch: int, tmp: Path) -> dict:
    """plan_phases in a fresh process (its own peak memory), its stdout's JSON line kept."""
    out = subprocess.run([sys.executable, __file__, "--plan-phases", model, hw, str(batch),
                          str(tmp / f"plan-{model}.json")], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- 3. an --adapt decision -----------------------------------------------------------------------------

def adapt_decision(quick: bool) -> dict:
    """One --adapt decision on tiny-gpt (tests/executor/test_adapt.py's wrong profile and measured box), the
    fit, the new search and the old plan's simulation timed apart."""
    import tierflow.executor.decide as dec
    from tierflow.executor.adapt import AdaptOptions, decide
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.devicemem import runtime_gpu_reserve_bytes
    from tierflow.planner.core.models import get_model
    from tierflow.planner.core.placement import Placement, Split
    from tierflow.planner.io.planfile import plan_from_graph

    caps = {"cpu.memory_gib": 0.02, "cpu.reserved_gib": 0}
    truth = load_profile(RESULTS_DIR / "closed_loop_cpu.yaml").with_overrides(caps)
    lohan = load_profile("rtx4090-lohan")
    runtime_gib = runtime_gpu_reserve_bytes("ideal", 1, lohan) / 2**30
    wrong = lohan.with_overrides({**caps, "gpu.memory_gib": truth.gpu.memory_gib + runtime_gib,
                                  "gpu.reserved_gib": 0, "ssd.count": 1})
    model = get_model("tiny-gpt")
    split = Split(0.0, 0.35, 0.65)
    cfg = make_schedule("vertical", model, wrong, batch=8, micro_batch=2, seq=64, alpha=0.25,
                        placement=Placement(master=split, adam_m=split, adam_v=split))
    plan = plan_from_graph(model, wrong, cfg, build_graph(model, wrong, cfg))
    measured = simulate_graph(build_graph(model, truth, plan.config), truth, plan.config.world)
    parts = {"fit": 0.0, "replan": 0.0}

    def timed(fn, part):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[part] += time.perf_counter() - t0
        return call

    fit0, replan0 = dec.fit_trace, dec.replan
    dec.fit_trace, dec.replan = timed(fit0, "fit"), timed(replan0, "replan")
    try:
        opts = AdaptOptions(fit_evaluations=50) if quick else AdaptOptions()
        t0 = time.perf_counter()
        d, _ = decide(plan, measured, 2, opts)
        wall = time.perf_counter() - t0
    finally:
        dec.fit_trace, dec.replan = fit0, replan0
    return {"what": "adapt decision, tiny-gpt", "wall_s": round(wall, 2), "fit_s": round(parts["fit"], 2),
            "replan_s": round(parts["replan"], 2),
            "other_s": round(wall - parts["fit"] - parts["replan"], 2),
            "fit_evaluations": opts.fit_evaluations, "switched": d.switched}


# ---- the whole run -------------------------------------------------------------------------------------

def run(quick: bool, out_dir: Path, repeat: int | None = None) -> list[dict]:
    import tempfile

    from expcommon import headline

    try:
        import simpy  # noqa: F401

        with_simpy = True
    except ImportError:
        with_simpy = False
        print("simpy is not installed (pip install -e '.[bench]'): no SimPy reference", file=sys.stderr)
    repeat = repeat or (1 if quick else 3)
    if simkernel.kernel() is None:  # loaded now, it plays every graph of this process
        print("numba is not installed (pip install -e '.[fast]'): the pure-Python loop is timed",
              file=sys.stderr)
    load = round(os.getloadavg()[0], 2)
    rows = []
    for case in sim_cases(quick):
        rows.append({**bench_graph(case, repeat, with_simpy), "load": load})
        print(rows[-1], flush=True)
    write_csv(rows, out_dir / "bench_simulator.csv")
    if (out_dir / "bench_simulator.csv").resolve() == RESULTS.resolve():
        write_generated_block(DOC, DOC_TABLE, bench_table(rows))
    plans = [("tiny-gpt", "rtx3090-desktop", 8)] if quick else [("gpt3-13b", "rtx4090-lohan", 16),
                                                                 ("gpt3-175b", "rtx4090-lohan", 64)]
    prow = []
    with tempfile.TemporaryDirectory() as tmp:
        for m, h, b in plans:
            prow.append({**plan_row(m, h, b, Path(tmp)), "load": round(os.getloadavg()[0], 2)})
            print(prow[-1], flush=True)
    write_csv(prow, out_dir / "bench_planner_phases.csv")
    drow = [{**adapt_decision(quick), "load": round(os.getloadavg()[0], 2)}]
    print(drow[-1], flush=True)
    write_csv(drow, out_dir / "bench_decisions.csv")
    heads = [headline("bench_simulator", f"simulator tasks/s, {r['graph']}", r["tasks_per_s"], None,
                      "tasks/s") for r in rows]
    heads += [headline("bench_simulator", f"tierflow plan {r['model']}", r["wall_s"], None, "s")
              for r in prow]
    return heads


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--plan-phases":  # one plan_row, in its process
        model, hw, batch, out = sys.argv[2:6]
        print(json.dumps(plan_phases(model, hw, int(batch), out)))
        return
    ap = arg_parser(__doc__)
    ap.add_argument("--repeat", type=int, default=None,
                    help="best of N runs per graph (default 3; --quick 1)")
    args = ap.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        print(f"bench_simulator: --repeat {args.repeat}: must be at least 1", file=sys.stderr)
        sys.exit(2)
    run(args.quick, args.out, args.repeat)


if __name__ == "__main__":
    sys.exit(script_main(main))
