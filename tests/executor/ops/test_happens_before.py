"""A happens-before checker over a real run: every access an op makes to what ops hand each other (entries,
fetched copies, staged buffers, weight buffers, gradient accumulators, recompute graphs) is logged with the
op, and each two accesses to the same thing by different ops, one of them a write, must be ordered by the
plan's dependencies and queue orders (the only orders the executor keeps on a GPU, where an op's worker does
not wait for the ops of other streams to finish). Every read must also come after a write that happens before
it. The complement on the allocator side (a block freed on one stream and reused on another without a recorded
use) is checked by the emulation itself: tests/executor/device/test_device.py."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
from support.runs import make_plan, run

from tierflow.executor.engine import Executor
from tierflow.executor.ops.context import RoundState
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.table import Ops
from tierflow.planner.core.graph import topological_order
from tierflow.planner.core.opkinds import ENTRY_KINDS

_current = threading.local()
LOGGED = ("entries", "fetched", "staged", "weight_bufs", "grad_acc", "graphs")


class AccessLog:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accesses: dict[tuple, list[tuple[int, str]]] = defaultdict(list)

    def note(self, what: str, key, mode: str) -> None:
        op = getattr(_current, "op", None)
        if op is None:
            return
        with self.lock:
            self.accesses[(what, _freeze(key))].append((op, mode))
            if what == "entries" and getattr(_current, "moves", False):
                # offload, write, read and fetch change the parts of the entry they look up (kept / host /
                # SSD); its device tensor is read concurrently by its direct consumers (a lock-protected
                # count)
                self.accesses[("entry_parts", _freeze(key))].append((op, "w"))


def _freeze(key):
    return tuple(key) if isinstance(key, list) else key


def _logging_dict(log: AccessLog, what: str, base: dict) -> dict:
    class Logged(dict):
        def __setitem__(self, k, v):
            log.note(what, k, "w")
            super().__setitem__(k, v)

        def __getitem__(self, k):
            log.note(what, k, "r")
            return super().__getitem__(k)

        def get(self, k, default=None):
            if k in self:  # a look-up of what is not there reads nothing
                log.note(what, k, "r")
            return super().get(k, default)

        def pop(self, k, *default):
            if k in self:
                log.note(what, k, "r")
            return super().pop(k, *default)

        def setdefault(self, k, default=None):
            log.note(what, k, "w")
            return super().setdefault(k, default)

    return Logged(base)


def record_accesses(monkeypatch) -> AccessLog:
    log = AccessLog()
    real_run, real_new, real_add = Ops.run, Executor.new_round, GradBuffers.add

    def run_op(self, rs, t):
        _current.op, _current.moves = t.id, any(t.kind in kinds for kinds in ENTRY_KINDS.values())
        try:
            real_run(self, rs, t)
        finally:
            _current.op, _current.moves = None, False

    def new_round(self, *a) -> RoundState:
        rs = real_new(self, *a)
        for name in LOGGED:
            setattr(rs, name, _logging_dict(log, name, getattr(rs, name)))
        return rs

    def add(self, rs, t, o, lo, hi, grad):
        log.note("grad_acc_data", (self.cx.binding.grad_group[(t.id, o)], o), "w")
        real_add(self, rs, t, o, lo, hi, grad)

    monkeypatch.setattr(Ops, "run", run_op)
    monkeypatch.setattr(Executor, "new_round", new_round)
    monkeypatch.setattr(GradBuffers, "add", add)
    return log


def happens_before(plan, n: int, drop=lambda t, d: False) -> list[int]:
    """hb[i]: bitset of the ops that happen before op i (dependencies and queue order, transitively)."""
    tasks = plan.graph.tasks[:n]
    preds = [{d for d in t.deps if not drop(t, d)} for t in tasks]
    for ids in plan.graph.resource_order().values():
        ids = [i for i in ids if i < n]
        for a, b in zip(ids, ids[1:]):
            preds[b].add(a)
    hb = [0] * n
    for i in topological_order(n, [sorted(p) for p in preds]):
        for p in preds[i]:
            hb[i] |= hb[p] | (1 << p)
    return hb


def races(log: AccessLog, hb: list[int]) -> list[str]:
    out = []
    for key, acc in log.accesses.items():
        ops = {}
        for op, mode in acc:
            ops[op] = "w" if mode == "w" or ops.get(op) == "w" else "r"
        writers = [op for op, m in ops.items() if m == "w"]
        items = sorted(ops.items())
        for i, (a, ma) in enumerate(items):
            for b, mb in items[i + 1:]:
                if "w" in (ma, mb) and not (hb[b] >> a & 1 or hb[a] >> b & 1):
                    out.append(f"{key}: ops {a} ({ma}) and {b} ({mb}) are unordered")
            if ma == "r" and not any(hb[a] >> w & 1 for w in writers):
                out.append(f"{key}: op {a} reads it after no write that happens before it")
    return out


CASES = [("vertical", "mix"), ("block", "mix"), ("horizontal", "states_ssd"), ("fuyou", "ckpt_ssd")]


@pytest.mark.parametrize(("family", "placement"), CASES)
@pytest.mark.parametrize("model_name", ["tiny-gpt", "tiny-llama"])
def test_every_access_is_ordered_after_its_writer(model_name, family, placement, tmp_path, monkeypatch):
    plan = make_plan(model_name, family, placement, 0.25)
    log = record_accesses(monkeypatch)
    run(plan, tmp_path, steps=2)
    n = len(plan.graph.tasks)
    assert len(log.accesses) > 50  # the log sees the hand-offs
    assert races(log, happens_before(plan, n)) == []


def test_the_checker_finds_the_races_of_missing_offload_fetch_waits(tmp_path, monkeypatch):
    """With the fetches' dependencies on their offloads, writes and reads removed (what a worker would do
    without those waits), the same accesses are unordered."""
    plan = make_plan("tiny-llama", "vertical", "mix", 0.25)
    log = record_accesses(monkeypatch)
    run(plan, tmp_path, steps=2)
    tasks = plan.graph.tasks
    n = len(tasks)

    def drop(t, d):
        return t.kind in ENTRY_KINDS["fetch"] and tasks[d].kind.split("_")[0] in ("offload", "write", "read")

    found = races(log, happens_before(plan, n, drop))
    assert len(found) > 10 and all("'entry_parts'" in f for f in found)
