"""How the plan's ops bind to tensors and state: which waiting tensor (entry) each op reads or moves, which
fetch a consumer reads instead of the device copy, which optimizer part an op belongs to, which op takes each
compute op's weight gradients. All of it is derived once per plan from the ops' dependencies (`Binding`).

Data flow
    The plan's ops name their tensors by (iteration, block, micro-batch); the executor keeps the tensors that
    wait between ops as entries (`Entry`, in RoundState.entries), keyed EntryKey(it, "x", b, m) = the input
    activation of block b, (it, "dx", b, m) = the gradient of that input, (it, "pack", b, m) = the saved
    activations of a layer that is not recomputed (a `Pack`). An offload splits an entry's flat elements as
    the placement says ([0, gpu_elems) kept on the device, then host memory, then SSD); a fetch puts them back
    together on the device. A consumer that has a fetch among its dependencies reads the fetched copy,
    otherwise the tensor still on the device. Weights are read per *owner*: a tied head computes with its own
    norm and the embedding's wte.

Entry states (`EntryState`): an entry is produced ON_DEVICE; an offload makes it OFFLOADED (its SSD part
staged in host memory), a write ON_SSD, a read READ_BACK, a fetch FETCHED (a later read may bring the SSD
part back again for a second fetch); its last consumer makes it RELEASED. Independently of that path, the
produced device tensor (or the pack's saved tensors) is held while `dev_users` (direct consumers and offloads
still to come) is positive.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from tierflow.errors import TierflowError
from tierflow.executor.tiers.packs import Pack
from tierflow.executor.tiers.state import BlockLayout
from tierflow.planner.core import opkinds as k
from tierflow.planner.core.contract import Plan
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import COMPUTE_KINDS, ENTRY_KINDS

ACT_TENSORS = {"act": "x", "act_grad": "dx"}
OPTIMIZER_PART = {k.ADAM: 0, k.ADAM_DEFERRED: 1}  # CPU optimizer op kind -> part (main step, deferred alpha)


class ExecutionError(TierflowError, RuntimeError):
    """An op failed; the message names the op and, for a resource problem, the plan decision behind it."""

    exit_code = 1  # a failure of the executor itself, not of the input
    prefix = ""  # the message names the op and what failed


class EntryKey(NamedTuple):
    """A waiting tensor: name "x" (input activation of `block`),
    "dx" (its gradient) or "pack" (saved tensors)."""

    iteration: int
    name: str
    block: int
    mb: int


class EntryState(Enum):
    """Where an entry's bytes are on the offload -> fetch path (see the module docstring)."""

    ON_DEVICE = "on_device"  # produced: only the device tensor (or the pack's saved tensors) holds it
    # split: kept on the device / host_cpu / host_ssd (the SSD part, staged for the write)
    OFFLOADED = "offloaded"
    ON_SSD = "on_ssd"  # the SSD part is in its file only (ssd_name)
    READ_BACK = "read_back"  # the SSD part is back in host memory (host_ssd)
    FETCHED = "fetched"  # a fetch joined the parts into a device copy (RoundState.fetched); host_ssd freed
    RELEASED = "released"  # the last consumer is done: dropped from the round, its SSD file deleted


_E = EntryState
ENTERED_FROM: dict[EntryState, frozenset[EntryState]] = {  # state -> the states an entry may enter it from
    _E.ON_DEVICE: frozenset(),
    _E.OFFLOADED: frozenset({_E.ON_DEVICE}),
    _E.ON_SSD: frozenset({_E.OFFLOADED}),
    _E.READ_BACK: frozenset({_E.ON_SSD, _E.READ_BACK, _E.FETCHED}),  # again after a fetch, for a second one
    _E.FETCHED: frozenset({_E.OFFLOADED, _E.READ_BACK, _E.FETCHED}),
    _E.RELEASED: frozenset(set(_E) - {_E.RELEASED}),
}


@dataclass
class Entry:
    """A tensor waiting between ops (see the module docstring)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype
    users: int  # consumer ops still to come
    dev_users: int  # ops still to read the produced device tensor (direct consumers and offloads)
    state: EntryState = EntryState.ON_DEVICE
    dev: torch.Tensor | None = None
    pack: Pack | None = None
    kept: torch.Tensor | None = None  # [0, gpu_elems) of the flat entry, kept on the device by the offload
    host_cpu: torch.Tensor | None = None  # [gpu_elems, gpu_elems + cpu_elems) in host memory
    host_ssd: torch.Tensor | None = None  # the SSD part while in host memory (OFFLOADED, READ_BACK)
    gpu_elems: int = 0  # elements of the flat entry (bytes for a pack) on each tier after the offload
    cpu_elems: int = 0
    ssd_elems: int = 0
    ssd_name: str | None = None

    @property
    def is_pack(self) -> bool:
        return self.pack is not None

    @property
    def holds_device_copy(self) -> bool:
        """The produced device tensor (or the pack's saved tensors) is still held for its direct readers."""
        return self.dev_users > 0

    def move(self, new: EntryState) -> None:
        """Enter state `new`; the plan's dependencies guarantee the order, so a wrong one is a bug."""
        assert self.state in ENTERED_FROM[new], f"entry {self.state.name} -> {new.name}"
        self.state = new


class Binding:
    """Which tensor or state each op of the plan reads, derived from the plan's dependencies."""

    def __init__(self, plan: Plan, layout: BlockLayout) -> None:
        self.plan, self.layout = plan, layout
        self.cfg = plan.config
        self.num_layers = plan.model.num_layers
        self.tasks: list[Task] = plan.graph.tasks
        self.fetch_for: dict[int, dict[EntryKey, int]] = {}  # consumer op -> {entry key: fetch op}
        self.consumers: Counter = Counter()  # entry key -> consumer ops
        self.direct_users: Counter = Counter()  # entry key -> ops reading the produced device tensor
        self.last_fetch: set[int] = set()  # fetch ops after which no other fetch of their entry comes
        self.wfetch: dict[int, int | None] = {}  # compute op -> its fetch_weights (or all_gather_weights) op
        self.wfetch_users: Counter = Counter()  # that op -> compute ops reading it
        # reduce_scatter_grads (LoRA: all_reduce_grads) op -> the op taking its shard (its sum)
        self.scatter_to: dict[int, int] = {}
        self.dep_of_kind: dict[int, dict[str, int]] = {}  # op -> {kind: its (last) dependency of that kind}
        self.part_of: dict[int, int] = {}  # read/write_opt_states, update_weights -> optimizer part
        self.grad_group: dict[tuple[int, int], int] = {}  # (compute op, owner) -> op that takes its gradients
        # (taking op, owner) -> compute ops adding into its buffer
        self.grad_contributors: Counter = Counter()
        # (taking op, owner) -> elements [lo, hi)
        self.grad_range: dict[tuple[int, int], tuple[int, int]] = {}
        self._bind()
        self._bind_grad_groups()

    def rec(self, b: int) -> bool:
        """Is layer block b recomputed in backward? (the plan's ScheduleConfig.recomputes)"""
        return self.cfg.recomputes(b, self.num_layers)

    def entry_key(self, t: Task) -> EntryKey:
        """The waiting tensor a transfer op of activations moves."""
        if t.tensor == "checkpoint":
            name = "pack" if 1 <= t.block <= self.num_layers and not self.rec(t.block) else "x"
        else:
            name = ACT_TENSORS[t.tensor]
        return EntryKey(t.iteration, name, t.block, t.mb)

    def inputs(self, t: Task) -> list[EntryKey]:
        """The entries a compute op consumes."""
        it, b, m = t.iteration, t.block, t.mb
        if t.kind == k.FWD:
            return [EntryKey(it, "x", b, m)] if b >= 1 else []
        if t.kind in (k.HEAD, k.RECOMPUTE):
            return [EntryKey(it, "x", b, m)]
        if t.kind == k.BWD:
            keys = [EntryKey(it, "dx", b + 1, m)]
            if 1 <= b <= self.num_layers and not self.rec(b):
                keys.append(EntryKey(it, "pack", b, m))
            return keys
        return []

    def _bind(self) -> None:
        tasks = self.tasks
        last: dict[EntryKey, int] = {}
        for t in tasks:
            if t.kind in ENTRY_KINDS["fetch"]:
                last[self.entry_key(t)] = t.id
        self.last_fetch = set(last.values())
        for t in tasks:
            by_kind = {}
            for d in t.deps:
                by_kind[tasks[d].kind] = d
            self.dep_of_kind[t.id] = by_kind
            if t.resource == "gpu" and t.kind in COMPUTE_KINDS:
                self._bind_compute(t)
            elif t.kind in ENTRY_KINDS["offload"]:
                self.direct_users[self.entry_key(t)] += 1
            if t.kind in OPTIMIZER_PART:
                for d in t.deps:
                    if tasks[d].kind == k.READ_OPT_STATES:
                        self.part_of[d] = OPTIMIZER_PART[t.kind]
        for t in tasks:
            if t.kind in (k.WRITE_OPT_STATES, k.UPDATE_WEIGHTS):
                self.part_of[t.id] = 0 if tasks[t.deps[0]].kind == k.ADAM else 1

    def _bind_compute(self, t: Task) -> None:
        """A compute op's inputs: through a fetch among its dependencies, or the device copy;
        its weight fetch."""
        tasks = self.tasks
        fetches = {self.entry_key(tasks[d]): d for d in t.deps if tasks[d].kind in ENTRY_KINDS["fetch"]}
        # a recomputed layer's backward depends on its recompute, which waits for the fetch
        if t.kind == k.BWD:
            mine = set(self.inputs(t))  # of the backward's input (the activation gradient)
            for r in t.deps:
                if tasks[r].kind == k.RECOMPUTE:
                    fetches.update({key: d for d in tasks[r].deps if tasks[d].kind in ENTRY_KINDS["fetch"]
                                    for key in [self.entry_key(tasks[d])] if key in mine})
        self.fetch_for[t.id] = fetches
        for key in self.inputs(t):
            self.consumers[key] += 1
            if key not in fetches:
                self.direct_users[key] += 1
        # the op whose weight buffers it reads: with several ranks the all-gather that completed its fetch
        wf = ([d for d in t.deps if tasks[d].kind == k.ALL_GATHER_WEIGHTS and tasks[d].block == t.block]
              or [d for d in t.deps if tasks[d].kind == k.FETCH_WEIGHTS and tasks[d].block == t.block])
        self.wfetch[t.id] = wf[-1] if wf else None
        if wf:
            self.wfetch_users[wf[-1]] += 1

    def _bind_grad_groups(self) -> None:
        """Which op takes each compute op's weight gradients: the first offload_grads of its block after it on
        the GPU queue (or, for a GPU optimizer, the owner's adam_gpu). Gradients of different groups never
        share a buffer, so a transfer never reads a buffer that a later backward is adding into. With several
        ranks the reduce_scatter_grads ops take them instead (the first of its block after it; for a GPU
        optimizer the first of the owner's), and hand each shard to the offload_grads or adam_gpu that depends
        on them."""
        tasks = self.tasks
        pos = {tid: i for i, tid in enumerate(self.plan.graph.resource_order()["gpu"])}
        scatters = [t for t in tasks if t.kind == k.REDUCE_SCATTER_GRADS]
        if scatters:
            self._bind_scatters(scatters, pos)
            return
        offloads: dict[tuple[int, int], list[tuple[int, int]]] = {}
        adam_gpu: dict[tuple[int, int], int] = {}
        reduces: dict[tuple[int, int], int] = {}
        for t in tasks:
            if t.kind == k.OFFLOAD_GRADS:
                offloads.setdefault((t.iteration, t.block), []).append((pos[t.deps[0]], t.id))
            elif t.kind == k.ADAM_GPU:
                adam_gpu[(t.iteration, t.block)] = t.id
            elif t.kind == k.ALL_REDUCE_GRADS:
                reduces[(t.iteration, t.block)] = t.id
        for v in offloads.values():
            v.sort()
        if self.plan.model.lora is not None:
            self._bind_adapter_grads(adam_gpu, reduces)
            return
        for t in tasks:
            if t.kind not in (k.HEAD, k.BWD):
                continue
            for o, lo, hi in self.layout.owners(t.block):
                if self.cfg.placement.gpu_optimizer:
                    group = adam_gpu.get((t.iteration, o))
                else:
                    queue = offloads.get((t.iteration, t.block), [])
                    group = next((oid for p, oid in queue if p >= pos[t.id]), None)
                if group is None:
                    raise ExecutionError(f"{self.plan.source}: the gradients of op {t.id} ({t.label}) are "
                                         "never taken by an offload_grads or adam_gpu op (inconsistent plan)")
                self.grad_group[(t.id, o)] = group
                self.grad_contributors[(group, o)] += 1
                a, z = self.grad_range.get((group, o), (lo, hi))
                self.grad_range[(group, o)] = (min(a, lo), max(z, hi))

    def _bind_adapter_grads(self, adam_gpu: dict[tuple[int, int], int],
                            reduces: dict[tuple[int, int], int]) -> None:
        """LoRA (executor/lora.py): only a decoder layer's backward has weight gradients, its adapters' (the
        base, the embedding and the head are frozen); the layer's adam_gpu of the iteration takes them, the
        range the layer's flat adapter vector. With several ranks the layer's all_reduce_grads takes them and
        hands the sum to that adam_gpu (scatter_to)."""
        n = self.layout.adapters.numel
        for key, r in reduces.items():
            if key not in adam_gpu:
                raise ExecutionError(f"{self.plan.source}: the adapters' gradients all-reduced by op {r} are "
                                     "taken by no adam_gpu op (inconsistent plan)")
            self.scatter_to[r] = adam_gpu[key]
            self.grad_range[(adam_gpu[key], key[1])] = (0, n)  # the sum it hands on: the whole vector
        for t in self.tasks:
            if t.kind != k.BWD or t.block not in self.layout.adapters.blocks():
                continue
            group = (reduces if self.cfg.world.ranks > 1 else adam_gpu).get((t.iteration, t.block))
            if group is None:
                raise ExecutionError(f"{self.plan.source}: the adapters' gradients of op {t.id} ({t.label}) "
                                     "are never taken by an adam_gpu op (or, with several ranks, an "
                                     "all_reduce_grads op) (inconsistent plan)")
            self.grad_group[(t.id, t.block)] = group
            self.grad_contributors[(group, t.block)] += 1
            self.grad_range[(group, t.block)] = (0, n)

    def _bind_scatters(self, scatters: list[Task], pos: dict[int, int]) -> None:
        """Several ranks: the buffer of a reduce_scatter_grads op spans each owner's whole vector padded to
        W*S elements (grad_range), and the shard it hands on starts at element 0 of this rank's shard."""
        tasks = self.tasks
        by_key: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for r in scatters:
            gpu_deps = [pos[d] for d in r.deps if d in pos]
            if not gpu_deps:
                raise ExecutionError(f"{self.plan.source}: op {r.id} ({r.label}) depends on no backward "
                                     "(inconsistent plan)")
            by_key.setdefault((r.iteration, r.block), []).append((max(gpu_deps), r.id))
        for v in by_key.values():
            v.sort()
        for t in tasks:  # the taker of the same block (a tied embedding's adam_gpu also waits for the head's)
            for d in t.deps:
                if tasks[d].kind == k.REDUCE_SCATTER_GRADS and t.kind in (k.OFFLOAD_GRADS, k.ADAM_GPU) \
                        and tasks[d].block == t.block:
                    self.scatter_to[d] = t.id
        missing = [r.id for r in scatters if r.id not in self.scatter_to]
        if missing:
            raise ExecutionError(f"{self.plan.source}: the gradient shard of op {missing[0]} is taken by no "
                                 "offload_grads or adam_gpu op (inconsistent plan)")
        gpu_opt = self.cfg.placement.gpu_optimizer
        ranks = self.cfg.world.ranks
        for t in tasks:
            if t.kind not in (k.HEAD, k.BWD):
                continue
            for o, _lo, _hi in self.layout.owners(t.block):
                key = (t.iteration, o if gpu_opt else t.block)
                group = next((rid for p, rid in by_key.get(key, []) if p >= pos[t.id]), None)
                if group is None:
                    raise ExecutionError(f"{self.plan.source}: the gradients of op {t.id} ({t.label}) are "
                                         "never reduce-scattered by a later reduce_scatter_grads op "
                                         "(inconsistent plan)")
                self.grad_group[(t.id, o)] = group
                self.grad_contributors[(group, o)] += 1
                slot = -(-self.layout.numel[o] // ranks)  # S = ceil(n / W): every rank's slot
                # the whole vector, padded for the reduce-scatter
                self.grad_range[(group, o)] = (0, slot * ranks)
                # the shard (the last rank's may be shorter)
                self.grad_range[(self.scatter_to[group], o)] = (0, slot)
