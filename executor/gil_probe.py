"""GilProbe: when, and for how long, other threads of this process hold the interpreter lock (the GIL).

A probe thread loops on a C call that releases the GIL and takes it back (libc's getpid through ctypes,
about a microsecond). While no other thread holds the GIL, each turn takes that long; a turn longer than
`threshold_s` is a gap in which the probe did not run, for one of three reasons, which the kernel's
scheduler statistics of the probe thread (/proc/thread-self/schedstat: time on a CPU, time runnable but
waiting for one) tell apart: it ran (its own turn: on a CPU), the OS kept it off its core (a busy machine:
runnable, waiting for a CPU, including the wake-up after the GIL came free), or it was blocked, which the
probe only ever is waiting for the GIL that another thread holds. The blocked part of a gap is the GIL time
it records; the rest is the machine's load (`preempted_s`), not the lock's.

What it sees: every interval in which some other thread held the GIL for longer than `threshold_s` (held
time is the sum of those intervals), whoever held it, including a holder that the OS preempted while it held
the lock (on a loaded machine that time is real, and longer than on an idle one); an interval ends when the
holder releases the GIL or the interpreter's switch interval (5 ms) forces it to. What it does not see:
holds shorter than the threshold, which thread held the lock (attribution is the caller's: run one thing at
a time, or intersect the gaps with what ran when, `held_s(t0, t1)`), and holds while the probe itself was
off its core (the OS's time, not counted: a loaded machine reads low, not high). The probe costs a core
while it runs, and a thread that takes the GIL back after a release may find the probe holding it for one
turn (about a microsecond).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

THRESHOLD_S = 20e-6  # a probe turn longer than this is a gap (a free turn is ~1-3 us)
SCHEDSTAT = "/proc/thread-self/schedstat"


def supported() -> bool:
    """Whether this machine has the scheduler statistics the probe reads (Linux with schedstats)."""
    try:
        with open(SCHEDSTAT) as f:
            return len(f.read().split()) >= 2
    except OSError:
        return False


@dataclass(frozen=True)
class Gap:
    """An interval in which the probe did not run, and how much of it the probe was blocked on the GIL."""

    start_s: float  # time.perf_counter
    end_s: float
    gil_s: float  # at most end_s - start_s

    @property
    def gil_share(self) -> float:
        return self.gil_s / (self.end_s - self.start_s)


class GilProbe:
    """A thread that records the intervals in which another thread held the GIL (module doc). Use as a
    context manager, or start() / stop(); then held_s(t0, t1) for any interval of perf_counter time."""

    def __init__(self, threshold_s: float = THRESHOLD_S) -> None:
        self.threshold_s = threshold_s
        self.gaps: list[Gap] = []
        self.turns = 0
        self.cpu_s = 0.0  # the probe thread's own CPU seconds
        self.error: Exception | None = None  # why the probe thread could not start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0_s = self.t1_s = 0.0

    def __enter__(self) -> GilProbe:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(ready,), name="tierflow-gil-probe",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if self.error is not None:
            self._thread.join()
            raise RuntimeError(f"GilProbe: cannot read the probe thread's scheduler statistics "
                               f"({self.error}); it needs Linux's /proc/thread-self/schedstat")
        self.t0_s = time.perf_counter()

    def stop(self) -> None:
        self.t1_s = time.perf_counter()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, ready: threading.Event) -> None:
        release = ctypes.CDLL(None).getpid  # a ctypes call: the GIL is released around it
        clock, thr, gaps, stop = time.perf_counter, self.threshold_s, self.gaps, self._stop
        try:
            stat = os.open(SCHEDSTAT, os.O_RDONLY)  # this thread's: on CPU, runnable (ns)
            _busy_s(stat)
        except (OSError, ValueError) as e:
            self.error = e
            ready.set()
            return
        try:
            turns, cpu0 = 0, time.thread_time()
            last = clock()
            seen_s, busy_s = last, _busy_s(stat)
            ready.set()
            while not stop.is_set():
                release()
                now = clock()
                if now - last > thr:
                    # blocked since the last reading: the time neither on a CPU nor waiting for one
                    busy = _busy_s(stat)
                    blocked = max(0.0, (now - seen_s) - (busy - busy_s))
                    gaps.append(Gap(last, now, min(now - last, blocked)))
                    now = clock()
                    seen_s, busy_s = now, _busy_s(stat)
                last = now
                turns += 1
            self.turns, self.cpu_s = turns, time.thread_time() - cpu0
        finally:
            os.close(stat)

    def held_s(self, t0_s: float, t1_s: float) -> float:
        """Seconds of [t0_s, t1_s] in which the probe waited for the GIL."""
        return sum(_overlap(g, t0_s, t1_s) * g.gil_share for g in self.gaps)

    def preempted_s(self, t0_s: float, t1_s: float) -> float:
        """Seconds of [t0_s, t1_s] that the OS took from the probe without a GIL wait (the machine's load)."""
        return sum(_overlap(g, t0_s, t1_s) * (1.0 - g.gil_share) for g in self.gaps)


def _overlap(g: Gap, t0_s: float, t1_s: float) -> float:
    return max(0.0, min(g.end_s, t1_s) - max(g.start_s, t0_s))


def _busy_s(fd: int) -> float:
    """Seconds on a CPU plus seconds runnable and waiting for one, from a schedstat file."""
    on_cpu, waiting = os.pread(fd, 128, 0).split()[:2]
    return (int(on_cpu) + int(waiting)) * 1e-9


@dataclass(frozen=True)
class GilShare:
    """A function called in a loop beside the probe: calls, wall and GIL seconds per call, and the share of
    the wall time in which it held the GIL."""

    calls: int
    wall_s_per_call: float
    held_s_per_call: float
    cpu_s_per_call: float  # the process's CPU but the probe's (every thread's: pools, OpenMP), GIL or not
    preempted_share: float  # of the wall time, taken from the probe by the OS (the machine's load)

    @property
    def held_share(self) -> float:
        """Of the wall time: the GIL held (a busy machine stretches the wall, not the GIL time)."""
        return self.held_s_per_call / self.wall_s_per_call if self.wall_s_per_call > 0 else 0.0

    @property
    def held_per_cpu(self) -> float:
        """GIL seconds per CPU second of the work: ~1 for pure Python, ~0 for C that releases the GIL; about
        as high on a loaded machine as on an idle one (both count only the time the work ran)."""
        return self.held_s_per_call / self.cpu_s_per_call if self.cpu_s_per_call > 0 else 0.0


def gil_share(fn: Callable[[], object], duration_s: float = 0.3, min_calls: int = 3) -> GilShare:
    """Call `fn` in this thread for about `duration_s` (at least `min_calls` times) beside a GilProbe: how
    long it holds the GIL per call."""
    with GilProbe() as probe:
        c0, t0 = time.process_time(), time.perf_counter()
        calls = 0
        while calls < min_calls or time.perf_counter() - t0 < duration_s:
            fn()
            calls += 1
        t1, c1 = time.perf_counter(), time.process_time()
    wall = t1 - t0
    cpu = max(0.0, c1 - c0 - probe.cpu_s)
    wall = max(wall, 1e-9)
    return GilShare(calls, wall / calls, probe.held_s(t0, t1) / calls, cpu / calls,
                    probe.preempted_s(t0, t1) / wall)
