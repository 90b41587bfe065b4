"""Exact global-norm gradient clipping as a schedule constraint: every optimizer op of a step waits for every
gradient op of the step (the norm needs all of the step's gradients before the first update).

`wait_for_norm` returns a copy of a task graph with those waits as dependencies and every resource's queue
re-ordered so that it can honour them: the ops in a topological order of the dependencies plus the waits,
ties broken by the schedule's own keys (so that an op keeps its place unless a wait moves it), each op's new
key its position. A schedule whose optimizer already follows the backward (horizontal) keeps its order; an
overlapped one (Fuyou, vertical and block with alpha) moves its optimizer steps behind the step's last
gradient, which the simulator then charges (and its memory model checks: gradients held longer). The
executor runs such a plan as it runs any other.
"""

from __future__ import annotations

from dataclasses import replace

from tierflow.planner.core import opkinds as k
from tierflow.planner.core.graph import TaskGraph, topological_order

OPTIMIZER_KINDS = frozenset({k.ADAM, k.ADAM_DEFERRED, k.ADAM_GPU})
# the ops that make a step's weight gradients final: on the device, in host memory, or (write_grads) in the
# SSD tier's files, where the norm reads them (a plan reads a block's gradients back from the SSD only when
# its optimizer step comes, after the previous block's: waiting for those reads would close a cycle)
GRAD_KINDS = frozenset({k.BWD, k.HEAD, k.OFFLOAD_GRADS, k.WRITE_GRADS, k.REDUCE_SCATTER_GRADS,
                        k.ALL_REDUCE_GRADS})


def grad_ops(graph: TaskGraph) -> dict[int, list[int]]:
    """The gradient ops of each iteration."""
    out: dict[int, list[int]] = {}
    for t in graph.tasks:
        if t.kind in GRAD_KINDS:
            out.setdefault(t.iteration, []).append(t.id)
    return out


def waits_for_norm(graph: TaskGraph) -> bool:
    """Whether every optimizer op of the graph already depends, directly, on every gradient op of its step."""
    grads = grad_ops(graph)
    return all(set(grads.get(t.iteration, ())) <= set(t.deps)
               for t in graph.tasks if t.kind in OPTIMIZER_KINDS)


def wait_for_norm(graph: TaskGraph) -> TaskGraph:
    """A copy of `graph` in which each optimizer op depends on every gradient op of its step, the resources'
    queues re-ordered to allow it (module docstring)."""
    grads = grad_ops(graph)
    deps = [sorted(set(t.deps) | set(grads.get(t.iteration, ()))) if t.kind in OPTIMIZER_KINDS
            else list(t.deps) for t in graph.tasks]
    order = topological_order(len(graph.tasks), deps, [t.key for t in graph.tasks],
                              cycle_message="the task graph has a dependency cycle")
    pos = {tid: i for i, tid in enumerate(order)}
    tasks = [replace(t, deps=deps[t.id], key=float(pos[t.id]), mem_start=list(t.mem_start),
                     mem_end=list(t.mem_end)) for t in graph.tasks]
    return replace(graph, tasks=tasks)
