"""Persistent worker threads for the executor's rounds (`WorkerPool`): one thread per lane name, kept from
round to round, so that a round submits each worker's loop as a job instead of creating, starting and
joining an OS thread per resource (about 1 ms of CPU per round on the 2-core AMD EPYC box, most of a tiny
round's time outside its workers), and each thread keeps its OpenMP team between rounds.

A job runs `fn(*args)`; `join(timeout)` and `is_alive()` read like a Thread's, so that the engine joins jobs
as it joined threads. A job's exception (the engine's worker reports its own failures to the round, so none is
expected) is kept in `error` and the thread serves the next job. The pool's threads are daemons; `close` ends
them (the executor closes its pool when it is collected), and a thread found dead (e.g. in a forked child) is
started again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Job:
    """One submitted call on a pool thread."""

    __slots__ = ("args", "done", "error", "fn", "name")

    def __init__(self, name: str, fn: Callable, args: tuple) -> None:
        self.name, self.fn, self.args = name, fn, args
        self.done = threading.Event()
        self.error: BaseException | None = None

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        return not self.done.is_set()


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.fn(*job.args)
        except BaseException as e:  # noqa: BLE001 - kept for the submitter; the thread serves on
            job.error = e
        finally:
            job.fn = job.args = None  # no reference to the round between jobs
            job.done.set()
        del job


class WorkerPool:
    """Threads named `prefix`-<lane>, started at a lane's first job and kept."""

    def __init__(self, prefix: str = "tierflow") -> None:
        self.prefix = prefix
        self._threads: dict[str, tuple[threading.Thread, queue.SimpleQueue]] = {}

    def submit(self, name: str, fn: Callable, *args) -> Job:
        job = Job(f"{self.prefix}-{name}", fn, args)
        entry = self._threads.get(name)
        if entry is None or not entry[0].is_alive():
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            th = threading.Thread(target=_serve, args=(jobs,), name=job.name, daemon=True)
            th.start()
            entry = self._threads[name] = (th, jobs)
        entry[1].put(job)
        return job

    def close(self, wait_s: float = 0.0) -> None:
        """End the threads once they have run their jobs; with `wait_s`, join each for up to that long (the
        run's end: no tierflow thread outlives run_plan)."""
        entries = list(self._threads.values())
        self._threads.clear()
        for _th, jobs in entries:
            jobs.put(None)
        if wait_s > 0:
            for th, _jobs in entries:
                th.join(wait_s)
