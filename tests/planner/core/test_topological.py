"""The one topological sort (tierflow.planner.core.graph.topological_order): every edge respected, the
tie-break honoured, a cycle reported with the cycle; and the exact orders of the sorts it replaces (window's
first ready first out, slots' queue-order heap with its cycle fallback; planfile's cycle messages are in
test_planfile)."""

from __future__ import annotations

import heapq

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import profile

from tierflow.planner.core.families import FAMILIES
from tierflow.planner.core.graph import CycleError, TaskGraph, find_cycle, topological_order
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.search.slots import topological_by_queue as slots_topological

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def dags(draw, max_nodes: int = 25):
    """(n, preds, keys): a random DAG (edges go forward in a random permutation, repeats allowed) and a random
    tie-break key per node (with ties between nodes)."""
    n = draw(st.integers(0, max_nodes))
    perm = draw(st.permutations(range(n)))
    preds: list[list[int]] = [[] for _ in range(n)]
    if n >= 2:
        pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
        for a, b in pairs:
            if a != b:
                lo, hi = min(a, b), max(a, b)
                preds[perm[hi]].append(perm[lo])
    keys = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return n, preds, keys


@st.composite
def digraphs(draw, max_nodes: int = 20):
    """(n, preds): any directed graph, cycles and self-loops included."""
    n = draw(st.integers(1, max_nodes))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    preds: list[list[int]] = [[] for _ in range(n)]
    for p, i in pairs:
        preds[i].append(p)
    return n, preds


def respects_edges(order: list[int], preds: list[list[int]]) -> bool:
    pos = {v: k for k, v in enumerate(order)}
    return all(pos[p] < pos[i] for i in order for p in preds[i] if p in pos)


# ---- the three sorts it replaced, frozen as they were ------------------------------------------------------


def old_window_topological(n: int, preds: list[list[int]]) -> list[int]:
    """planner/search/window.py `_topological` before the merge (first ready, first out)."""
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for d in set(preds[i]):
            succ[d].append(i)
            indeg[i] += 1
    out = [i for i in range(n) if indeg[i] == 0]
    for i in out:
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                out.append(s)
    if len(out) < n:
        raise ValueError("the task graph has a dependency cycle")
    return out


def old_slots_topological(n, preds, prev_in_queue, queue_order):
    """planner/search/slots/template.py `_topological`, now `topological_by_queue` (queue-order heap; on a
    cycle the rest in queue order)."""
    rank = {i: r for r, i in enumerate(queue_order)}
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i in range(n):
        ps = set(preds[i])
        if prev_in_queue[i] >= 0:
            ps.add(prev_in_queue[i])
        for p in ps:
            succ[p].append(i)
            indeg[i] += 1
    heap = [(rank[i], i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i = heapq.heappop(heap)
        out.append(i)
        for s_ in succ[i]:
            indeg[s_] -= 1
            if indeg[s_] == 0:
                heapq.heappush(heap, (rank[s_], s_))
    if len(out) < n:
        seen = set(out)
        out += [i for i in queue_order if i not in seen]
    return out


# ---- properties --------------------------------------------------------------------------------------------


@PROPERTY
@given(dags())
def test_every_edge_respected_and_tie_break_honoured(case):
    n, preds, keys = case
    for tie_break in (None, keys):
        order = topological_order(n, preds, tie_break)
        assert sorted(order) == list(range(n))
        assert respects_edges(order, preds)
    # the tie-break: each node placed is the smallest (key, id) among the nodes ready at that point
    order = topological_order(n, preds, keys)
    placed: set[int] = set()
    for i in order:
        ready = [j for j in range(n) if j not in placed and all(p in placed for p in preds[j])]
        assert (keys[i], i) == min((keys[j], j) for j in ready)
        placed.add(i)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((p, i) for i in range(n) for p in preds[i])
    assert order == list(nx.lexicographical_topological_sort(g, key=lambda i: (keys[i], i)))


@PROPERTY
@given(dags())
def test_no_tie_break_is_first_ready_first_out_as_window_sorted(case):
    n, preds, _ = case
    assert topological_order(n, preds) == old_window_topological(n, preds)


@PROPERTY
@given(digraphs(), st.data())
def test_slots_order_is_expressible(case, data):
    n, preds = case
    queue_order = data.draw(st.permutations(range(n)))
    prev_in_queue = data.draw(st.lists(st.integers(-1, n - 1), min_size=n, max_size=n))
    assert slots_topological(n, preds, prev_in_queue, queue_order) == \
        old_slots_topological(n, preds, prev_in_queue, queue_order)


@PROPERTY
@given(digraphs())
def test_a_cycle_is_reported_with_the_cycle(case):
    n, preds = case
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((p, i) for i in range(n) for p in preds[i])
    if nx.is_directed_acyclic_graph(g):
        assert respects_edges(topological_order(n, preds), preds)
        return
    with pytest.raises(CycleError, match="dependency cycle") as info:
        topological_order(n, preds)
    e = info.value
    assert isinstance(e, ValueError)
    # the sorted part is topological, and the rest is exactly what a cycle blocks (on one or after one)
    assert respects_edges(e.order, preds) and set(e.order).isdisjoint(e.left)
    assert set(e.order) | e.left == set(range(n))
    blocked = {v for c in nx.simple_cycles(g) for v in c}
    blocked |= {d for v in set(blocked) for d in nx.descendants(g, v)}
    assert e.left == blocked
    # the cycle: each node a predecessor of the next, the last of the first, no node twice
    c = e.cycle
    assert c and len(set(c)) == len(c) and set(c) <= e.left
    assert all(c[k] in preds[c[(k + 1) % len(c)]] for k in range(len(c)))
    assert c == find_cycle(preds, e.left)


def test_cycle_examples():
    with pytest.raises(CycleError) as info:
        topological_order(1, [[0]])
    assert info.value.cycle == [0] and info.value.order == []
    with pytest.raises(CycleError) as info:  # 0 -> 1 -> 2 -> 1, 3 after the cycle, 4 free
        topological_order(5, [[], [0, 2], [1], [2], []])
    assert info.value.order == [0, 4] and info.value.left == {1, 2, 3} and info.value.cycle == [2, 1]
    assert topological_order(4, [[], [], [], []], tie_break=[3, 1, 2, 1]) == [1, 3, 2, 0]
    assert topological_order(4, [[1, 1], [], [1], [0, 2]]) == [1, 0, 2, 3]


def test_bad_input():
    with pytest.raises(ValueError, match="outside"):
        topological_order(2, [[], [2]])
    with pytest.raises(ValueError, match="outside"):
        topological_order(2, [[-1], []])
    with pytest.raises(ValueError, match="lists for"):
        topological_order(3, [[], []])
    with pytest.raises(ValueError, match="keys for"):
        topological_order(2, [[], [0]], tie_break=[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_task_graph_order(family):
    hw = profile()
    model = get_model("tiny-gpt")
    g = build_graph(model, hw, make_schedule(family, model, hw, batch=4, micro_batch=2, iterations=2))
    order = g.topological_order()
    preds = [t.deps for t in g.tasks]
    assert order == old_window_topological(len(g.tasks), preds)
    keyed = g.topological_order([t.key for t in g.tasks])
    assert respects_edges(keyed, preds)
    # GraphBuilder makes every key >= its dependencies' keys: the queue order (key, id) is already topological
    assert keyed == sorted(range(len(g.tasks)), key=lambda i: (g.tasks[i].key, i))
    g.tasks[0].deps.append(g.tasks[-1].id)
    broken = TaskGraph(g.tasks, g.static_bytes, g.capacity_bytes, g.num_iterations, g.num_blocks)
    with pytest.raises(CycleError, match="the task graph has a dependency cycle") as info:
        broken.topological_order()
    assert 0 in info.value.cycle
