"""The executor's persistent worker threads (executor/worker_pool.py): a round runs its workers on the threads
of the rounds before (no thread made per round), a job's escaped exception is kept and its thread serves on,
and a closed pool's threads end."""

from __future__ import annotations

import signal
import threading

import pytest

from tierflow.executor.calibration.dispatch import ITERATIONS, _executor, tiny_plan
from tierflow.executor.device.base import PlainCpuBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend
from tierflow.executor.engine import Executor
from tierflow.executor.signals import Interrupted
from tierflow.executor.worker_pool import WorkerPool


def _recording(ex: Executor, seen: list) -> Executor:
    """`ex` with each worker call noted as (lane, thread name, thread id)."""

    class Recording(Executor):
        def worker(self, rs, resource, queue, caller=False):
            seen.append((resource, threading.current_thread().name, threading.get_ident()))
            super().worker(rs, resource, queue, caller)

    ex.__class__ = Recording
    return ex


def test_rounds_reuse_the_same_worker_threads_and_train_as_fresh_ones():
    # the CUDA emulation (streams): every lane on the pool, the compute lane too
    backend = AdversarialCpuBackend(max_delay_s=0.0)
    plan = tiny_plan(backend.device.type, "checkpoints_host")
    seen: list[tuple[str, str, int]] = []
    ex = _recording(_executor(plan, backend, None), seen)
    losses = [ex.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(3)]
    gpu = [s for s in seen if s[0] == "gpu"]
    assert len(gpu) == 3 and len(set(gpu)) == 1 and gpu[0][1] == "tierflow-gpu"
    assert gpu[0][2] != threading.get_ident()
    # the same plan with a thread made per round (the engine's way with several ranks): the same losses
    fresh = _executor(plan, AdversarialCpuBackend(max_delay_s=0.0), None)
    fresh.pool = None
    assert [fresh.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(3)] == losses


def test_a_plain_cpu_runs_the_compute_lane_in_the_calling_thread_with_the_same_losses():
    """No streams: the compute lane (every op of these plans) runs in run_round's thread, on its OpenMP team
    as plain PyTorch's ops do; the losses equal those of the lane on a pool thread."""
    for placement in ("on_device", "checkpoints_host"):
        plan = tiny_plan("cpu", placement)
        seen: list[tuple[str, str, int]] = []
        ex = _recording(_executor(plan, PlainCpuBackend(), None), seen)
        losses = [ex.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(2)]
        assert [s[0] for s in seen] == ["gpu", "gpu"] and {s[2] for s in seen} == {threading.get_ident()}
        pooled = _executor(plan, PlainCpuBackend(), None)
        pooled.compute_in_caller = False
        assert [pooled.run_round(ITERATIONS, r * ITERATIONS).losses for r in range(2)] == losses


def test_a_stop_signal_in_the_calling_threads_lane_is_raised_as_itself():
    """A stop signal's exception (or Ctrl-C) raised while run_round's own thread runs the compute lane ends
    the round as itself (tierflow run saves its last state on it), not as an op's failure."""
    plan = tiny_plan("cpu", "on_device")
    ex = _executor(plan, PlainCpuBackend(), None)
    ran = []

    def stop(rs, t):
        ran.append(t.id)
        if len(ran) == 3:
            raise Interrupted(signal.SIGINT)

    ex.ops.run = stop
    with pytest.raises(Interrupted):
        ex.run_round(ITERATIONS, 0)
    assert len(ran) == 3


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
