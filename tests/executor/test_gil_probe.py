"""The hot-path functions that run beside the launcher (the SSD store, its CRCs, the casts, the host AdamW)
leave the interpreter lock to other threads: a probe thread (executor/gil_probe.py) finds the GIL held for
a small part of the CPU time they spend. A function that starts holding the GIL (a pure-Python loop in place
of a C kernel) holds it for most of its CPU time, and the check says so (the last tests)."""

from __future__ import annotations

import time

import pytest
import torch

from tierflow.executor.gil_probe import GilProbe, gil_share, supported
from tierflow.executor.optim.adamw import Hyper
from tierflow.executor.optim.host_adamw import _cast_into, host_adamw
from tierflow.executor.tiers import ssd_store
from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty, chunk_checksum

pytestmark = pytest.mark.skipif(not supported(), reason="no /proc/thread-self/schedstat (not Linux)")
MIB = 1 << 20
# GIL seconds per CPU second of the function's work (every thread but the probe's) over the same figure of a
# fixed pure-Python loop measured just before it, pair by pair. Pure Python reads about 1, C that releases
# the GIL 0.0-0.1 (its Python glue). A loaded machine moves a pair both ways: the OS keeps the probe off its
# core (a holder reads low) or preempts a thread in the middle of its few microseconds of glue (it then
# holds the GIL for a scheduler slice: a releasing function reads high, up to 0.5 at a load of 15 on 2
# cores). So a hot-path function passes when its best pair is below HOT_PATH_AT_MOST, and a holding one is
# caught when its best pair is above HOLDING_AT_LEAST.
HOT_PATH_AT_MOST = 0.3
HOLDING_AT_LEAST = 0.6


def _spin() -> None:
    """A fixed amount of pure-Python work (~2 ms)."""
    x = 0
    for i in range(40_000):
        x += i


def held_per_cpu(fn, tries: int = 4, duration_s: float = 0.08) -> list[float]:
    """Per pair of `tries`: gil_share(fn).held_per_cpu over that of _spin just before it; after one call to
    warm up (first-call compilation and allocation are not the hot path)."""
    fn()
    out = []
    for _ in range(tries):
        python = gil_share(_spin, duration_s).held_per_cpu
        out.append(gil_share(fn, duration_s).held_per_cpu / max(python, 1e-3))
    return out


def releases(fn, at_most: float = HOT_PATH_AT_MOST) -> bool:
    # the best of 8 pairs, up to three times: under load a preempted probe reads a release as a hold now and
    # then (a clean-clone suite here once read one of these as held with nothing else running); a function
    # that holds the lock reads >= HOLDING_AT_LEAST on every pair, so it still fails
    return any(min(held_per_cpu(fn, tries=8)) <= at_most for _ in range(3))


def holds(fn) -> bool:
    return max(held_per_cpu(fn)) >= HOLDING_AT_LEAST


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def store(tmp_path):
    s = SsdStore(tmp_path, warn=lambda m: None)
    yield s
    s.close()


def _store_round_trip(store: SsdStore, nbytes: int = 16 * MIB):
    data, out = aligned_empty(nbytes), aligned_empty(nbytes)
    data.random_(0, 255)

    def go() -> None:
        store.write("t", data)
        store.read("t", torch.uint8, nbytes, into=lambda n: out)

    return go


def test_probe_sees_a_pure_python_loop_and_not_a_sleep():
    # up to eight tries: on a box running two test suites at once the probe thread is kept off its core
    # for whole scheduler slices (docs/performance.md); one clean try shows the mechanism (three tries all
    # missed once in a clean-clone CI beside another, 2026-11-29; a try takes 0.4 s)
    tries = []
    for _ in range(8):
        busy = gil_share(_spin, 0.2)
        idle = gil_share(lambda: time.sleep(0.002), 0.2)
        tries.append((busy, idle))
        # 0.4 at a load of 15 on 2 cores
        if busy.held_per_cpu >= 0.3 and idle.held_s_per_call < 0.1 * busy.held_s_per_call:
            return
    raise AssertionError(tries)


def _attributed() -> tuple[float, float, float]:
    """(GIL seconds the probe saw in a 20 ms sleep, in the 60 ms pure-Python loop after it, the loop's CPU
    seconds)."""
    with GilProbe() as p:
        s0 = time.perf_counter()
        time.sleep(0.02)
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() < t0 + 0.06:
            pass
        t1, c1 = time.perf_counter(), time.thread_time()
    return p.held_s(s0, t0 - 0.001), p.held_s(t0, t1), c1 - c0


def test_probe_intervals_are_attributable():
    """held_s(t0, t1) finds the loop, not the sleep (three tries: a loaded machine may keep the probe off
    its core for a whole loop)."""
    tries = [_attributed() for _ in range(3)]
    assert any(loop >= 0.2 * cpu and sleep < 0.005 for sleep, loop, cpu in tries), tries


# the store's 16 MiB write + read holds the lock for part of its CPU time (its Python around the I/O and
# checksum calls): best-of-8 shares of 0.24-0.41 measured on the 2-vCPU AMD EPYC (2026-11-29), around
# HOT_PATH_AT_MOST; a store that held the lock through its I/O would read >= HOLDING_AT_LEAST
STORE_AT_MOST = 0.5


def test_ssd_store_write_and_read_release_the_gil(store):
    assert releases(_store_round_trip(store), STORE_AT_MOST)


def test_chunk_crc_releases_the_gil():
    _name, crc = chunk_checksum(lambda m: None)
    data = aligned_empty(4 * MIB)
    view = memoryview(data.numpy())
    assert releases(lambda: crc(view, data.data_ptr()))


def test_cast_to_bf16_releases_the_gil():
    n = MIB
    master, dest = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    assert releases(lambda: _cast_into([(0, n, master)], [(0, n, dest)], 0, n))


@pytest.mark.parametrize("pure", [False, True], ids=["as installed", "torch kernels"])
def test_host_adamw_releases_the_gil(pure, monkeypatch):
    if pure:
        monkeypatch.setenv("TIERFLOW_PURE_ADAMW", "1")
    n = MIB
    states = {k: [(0, n, torch.rand(n) if k == "adam_v" else torch.randn(n))]
              for k in ("master", "adam_m", "adam_v")}
    grads, dest = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    step = iter(range(1, 10_000))
    assert releases(lambda: host_adamw(Hyper(), next(step), [(0, n, True)], states, grads, [(0, n, dest)],
                                       squares=True))


def _python_crc(view: memoryview, address: int) -> int:
    """A CRC-like sum in pure Python: it holds the GIL for the whole chunk."""
    s = 0
    for b in view[:: 16]:
        s = (s * 31 + b) & 0xFFFFFFFF
    return s


def test_check_fails_when_the_store_holds_the_gil(tmp_path, monkeypatch):
    monkeypatch.setattr(ssd_store, "chunk_checksum", lambda warn: ("python", _python_crc))
    s = SsdStore(tmp_path, warn=lambda m: None)
    try:
        assert holds(_store_round_trip(s, MIB))
    finally:
        s.close()


def test_check_fails_when_a_cast_holds_the_gil():
    """An element-by-element copy in Python in place of the cast's one torch call."""
    n = 1 << 14
    master, dest = torch.randn(n), torch.empty(n)
    src, dst = memoryview(master.numpy()), memoryview(dest.numpy())

    def python_cast() -> None:
        for i in range(n):
            dst[i] = src[i]

    assert holds(python_cast)


def test_probe_refuses_without_scheduler_statistics(monkeypatch):
    import tierflow.executor.gil_probe as gp

    monkeypatch.setattr(gp, "SCHEDSTAT", "/nonexistent/schedstat")
    with pytest.raises(RuntimeError, match="schedstat"):
        GilProbe().start()
