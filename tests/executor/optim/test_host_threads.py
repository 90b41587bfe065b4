"""The host optimizer's intra-op threads (executor/optim/host_threads.py): one fewer than torch's on a CUDA
run with host optimizer ops, set in the optimizer's own worker thread, the process-wide value back after the
round, the choice in the run's --json. Checked on the CPU with the choice forced."""

from __future__ import annotations

import json

import torch
from support.runs import make_plan, run

import tierflow.executor.engine as engine
from tierflow.cli import main
from tierflow.executor.ops.optimizer import OptimizerOps
from tierflow.executor.optim.host_threads import optimizer_threads
from tierflow.planner.io.planfile import write_plan


def test_cuda_with_a_host_optimizer_leaves_the_launching_thread_a_core():
    assert optimizer_threads("cuda", True, 16) == 15
    assert optimizer_threads("cuda", False, 16) is None  # a GPU optimizer: nothing on the host to share
    assert optimizer_threads("cpu", True, 16) is None  # compute on the host itself: torch's setting
    assert optimizer_threads("cuda", True, 1) is None  # no core to spare


def test_the_optimizer_worker_runs_on_its_own_thread_count_and_the_round_restores_the_rest(tmp_path,
                                                                                          monkeypatch):
    before = torch.get_num_threads()
    forced = 1 if before > 1 else 2
    monkeypatch.setattr(engine, "optimizer_threads", lambda device, host_opt, threads: forced if host_opt
                        else None)
    seen: list[int] = []
    adam = OptimizerOps.adam

    def spying_adam(self, rs, t):
        seen.append(torch.get_num_threads())
        adam(self, rs, t)

    monkeypatch.setattr(OptimizerOps, "adam", spying_adam)
    plan = make_plan("tiny-gpt", "fuyou", "weights_cpu", 0.25)
    res = run(plan, tmp_path, steps=2)
    assert res.optimizer_threads == forced
    assert seen and set(seen) == {forced}
    assert torch.get_num_threads() == before
    # a thread started now takes the process-wide value, which the round put back
    got = []
    th = __import__("threading").Thread(target=lambda: got.append(torch.get_num_threads()))
    th.start()
    th.join()
    assert got == [before]


def test_a_cpu_run_says_it_leaves_the_thread_count_alone_in_its_json(tmp_path, capsys):
    plan = make_plan("tiny-gpt", "fuyou", "weights_cpu", 0.25)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    assert main(["run", str(path), "--steps", "1", "--ssd-dir", str(ssd), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer_threads"] is None


def test_release_team_ends_the_calling_threads_openmp_team():
    """A thread's OpenMP team (its pool of idle workers, which would make libgomp throttle the spin-wait of
    every other team once the process holds more OpenMP threads than cores) ends at release_team(): the
    process has one thread fewer per released worker; the thread's next parallel op makes a new team."""
    import os
    import threading
    import time

    import pytest

    from tierflow.executor.optim import host_threads

    if host_threads._omp_pause() is None or not os.path.isdir("/proc/self/task"):
        pytest.skip("torch's threads are not OpenMP's here (or no /proc to count threads)")
    before = torch.get_num_threads()
    got = []

    def in_a_thread():
        torch.set_num_threads(2)
        x = torch.randn(1 << 20)
        x.mul_(2)  # a parallel region: this thread's team of 2 (itself and one worker)
        n = len(os.listdir("/proc/self/task"))
        released = host_threads.release_team()
        for _ in range(200):  # the released worker exits on its own (at most a moment)
            if len(os.listdir("/proc/self/task")) < n:
                break
            time.sleep(0.01)
        got.append((n, released, len(os.listdir("/proc/self/task"))))
        x.mul_(2)
        got.append(len(os.listdir("/proc/self/task")))

    th = threading.Thread(target=in_a_thread)
    th.start()
    th.join()
    torch.set_num_threads(before)
    (n, released, after), again = got
    assert released and after == n - 1 and again == n
