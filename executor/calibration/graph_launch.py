"""The host cost of one CUDA graph replay (`gpu.graph_launch_us`, what the simulator charges a captured
segment instead of gpu.op_overhead_us per compute op: planner/core/capture.py's `graphed_graph`), measured by
the executor itself: the plan of tiny ops on the device (executor/calibration/dispatch.py) run with
--cuda-graphs, its one segment per iteration replayed, and the host time of each replay's launch timed by the
graph runner (executor/graphs.py). On CUDA a launch returns before its kernels run, so this is the launch
alone; on the emulation a replay runs its ops in the call, so the figure there is the replay, not a launch
(tests run it for structure only).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from tierflow.executor.calibration.dispatch import ITERATIONS, tiny_plan
from tierflow.executor.device.base import DeviceBackend


@dataclass
class GraphLaunch:
    backend: str
    replays: int
    launch_us: float  # median host time of one replay's launch
    ops_per_replay: int  # compute ops in the replayed segment


def measure_graph_launch(backend: DeviceBackend, rounds: int = 3) -> GraphLaunch | None:
    """`rounds` rounds of the tiny plan on `backend` with graphs on (the first warms up and captures); None
    where nothing was replayed (the backend has no graphs, or every segment fell back)."""
    from tierflow.executor.data import TokenData
    from tierflow.executor.engine import Executor
    from tierflow.executor.ops.context import Hyper
    from tierflow.executor.tiers.state import TrainState

    plan = tiny_plan(backend.device.type, "on_device")
    dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, backend, dtype, None)
    state.init_random(0)
    data = TokenData.load(None, plan.model.vocab_size, seed=0)
    ex = Executor(plan, state, data, backend, Hyper(), None, cuda_graphs=True)
    ex.arena.warn = None
    runner = ex.graph_runner
    if runner is None:
        return None
    for r in range(rounds):
        ex.run_round(ITERATIONS, r * ITERATIONS)
    if not runner.replay_host_s:
        return None
    ops = max(len(s.ops) for s in runner.capture.segments)
    return GraphLaunch(backend.name, len(runner.replay_host_s), statistics.median(runner.replay_host_s) * 1e6,
                       ops)
