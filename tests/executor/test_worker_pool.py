"""The executor's persistent worker threads (executor/worker_pool.py): a round runs its workers on the threads
of the rounds before (no thread made per round), a job's escaped exception is kept and its thread serves on,
and a closed pool's threads end."""

from __future__ import annotations

import threading

import pytest

from tierflow.executor.calibration.dispatch import ITERATIONS, _executor, tiny_plan
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.engine import Executor
from tierflow.executor.worker_pool import WorkerPool


def test_rounds_reuse_the_same_worker_threads_and_train_as_fresh_ones():
    plan = tiny_plan("cpu", "checkpoints_host")
    seen: list[tuple[str, int]] = []

    class Recording(Executor):
        def worker(self, rs, resource, queue):
            seen.append((threading.current_thread().name, threading.get_ident()))
            super().worker(rs, resource, queue)

    ex = _executor(plan, PlainCpuBackend(), None)
    ex.__class__ = Recording
    losses = [ex.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(3)]
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0][0] == "tierflow-gpu"
    assert seen[0][1] != threading.get_ident()
    # the same plan with a thread made per round (the engine's way with several ranks): the same losses
    fresh = _executor(plan, PlainCpuBackend(), None)
    fresh.pool = None
    assert [fresh.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(3)] == losses


def test_a_jobs_exception_is_kept_and_its_thread_serves_the_next_job():
    pool = WorkerPool("test")
    try:
        def fail():
            raise RuntimeError("boom")

        bad = pool.submit("a", fail)
        bad.join(10)
        assert not bad.is_alive() and isinstance(bad.error, RuntimeError)
        out = []
        ok = pool.submit("a", lambda: out.append(threading.current_thread().name))
        ok.join(10)
        assert out == ["test-a"] and ok.error is None
    finally:
        pool.close()


def test_a_closed_pool_ends_its_threads():
    pool = WorkerPool("test-close")
    pool.submit("a", lambda: None).join(10)
    threads = [th for th in threading.enumerate() if th.name == "test-close-a"]
    assert len(threads) == 1
    pool.close()
    threads[0].join(10)
    assert not threads[0].is_alive()


@pytest.mark.parametrize("fail_round", [0, 1])
def test_a_failed_round_leaves_the_pool_ready_for_the_next(fail_round):
    plan = tiny_plan("cpu", "on_device")
    ex = _executor(plan, PlainCpuBackend(), None)
    run = ex.ops.run
    state = {"round": 0}

    def flaky(rs, t):
        if state["round"] == fail_round and t.kind == "bwd":
            raise RuntimeError("injected")
        run(rs, t)

    ex.ops.run = flaky
    for r in range(3):
        state["round"] = r
        if r == fail_round:
            with pytest.raises(Exception, match="injected"):
                ex.run_round(ITERATIONS, r * ITERATIONS)
        else:
            ex.run_round(ITERATIONS, r * ITERATIONS)


def test_no_worker_thread_outlives_the_run(tmp_path):
    """run_plan closes its executor's pool: after a run, however it ended, no tierflow worker thread is left
    (a notebook or an experiment running many plans would otherwise keep every run's idle threads)."""
    from tierflow.executor.run import RunConfig, run_plan

    before = {th.ident for th in threading.enumerate()}
    (tmp_path / "ssd").mkdir()
    config = RunConfig(steps=2, device="cpu", ssd_dir=str(tmp_path / "ssd"))
    run_plan(tiny_plan("cpu", "checkpoints_host"), config, log=lambda *a, **k: None)
    left = [th.name for th in threading.enumerate()
            if th.ident not in before and th.name.startswith("tierflow") and th.is_alive()]
    assert left == []
