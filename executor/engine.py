"""Replay a plan's operations on real hardware: one worker per resource, each running its queue in the plan's
order, an op starting only when its dependencies have finished. Nothing is scheduled here: every transfer,
compute step and optimizer step is an op of the plan, and the executor only decides *how* to carry it out.

Workers and streams
    gpu, h2d and d2h each own a CUDA stream (on a CPU "device" they are plain threads); a dependency between
    two stream resources is a CUDA event the waiting stream waits on, and a host worker (cpu, ssd_read,
    ssd_write) waiting on a stream op synchronizes on that op's event only. There is no device-wide
    synchronization inside an iteration; the only full synchronization is at the end of a round (the plan's
    iterations), to read the losses and the timings.

Data flow
    The plan's ops name their tensors by (iteration, block, micro-batch); the executor keeps the tensors that
    wait between ops in `entries`, keyed ("x", b, m) = the input activation of block b, ("dx", b, m) = the
    gradient of that input, ("pack", b, m) = the saved activations of a layer that is not recomputed. An offload
    splits an entry's flat bytes as the placement says ([0, g) kept on the device, then host memory, then SSD);
    a fetch puts them back together on the device. A consumer that has a fetch among its dependencies reads the
    fetched copy, otherwise the tensor still on the device. Weights are read per *owner*: a tied head computes
    with its own norm and the embedding's wte.

Numerics
    Compute in the weights' dtype (bf16 on CUDA, fp32 on a CPU device), fp32 gradient accumulation on the
    device, gradients sent to the host in the compute dtype and accumulated there in fp32, AdamW in fp32 on
    the host with PyTorch's fused/foreach kernel (or on the device for a GPU optimizer). The loss of each
    micro-batch is its mean token cross entropy divided by the number of micro-batches, so the step equals
    plain PyTorch training of the whole batch.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.data import TokenData
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.state import TrainState
from tierflow.executor.store import ChecksumError, SsdStore, host_empty, split_counts
from tierflow.planner.core.graph import TIERS, Task, TaskGraph
from tierflow.planner.core.simulator import SimResult, summarize
from tierflow.planner.io.planfile import Plan

STREAM_RESOURCES = ("gpu", "h2d", "d2h")
PACK_ALIGN = 256  # bytes: alignment of each saved tensor inside a flattened pack
ACT_TENSORS = {"act": "x", "act_grad": "dx"}
KINDS = {
    "fwd", "recompute", "bwd", "head", "adam_gpu", "adam", "adam_deferred", "fetch_weights", "update_weights",
    "read_weights", "offload_grads", "write_grads", "read_grads", "read_opt_states", "write_opt_states",
    *(f"{verb}_{x}" for verb in ("offload", "fetch", "write", "read") for x in ("checkpoint", "act", "act_grad")),
}


class ExecutionError(RuntimeError):
    """An op failed; the message names the op and, for a resource problem, the plan decision behind it."""


class OutOfMemory(ExecutionError):
    pass


class UnsupportedPlan(ValueError):
    """A plan this executor cannot run as written (refused before training starts)."""


@dataclass(frozen=True)
class Hyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class Entry:
    """A tensor waiting between ops (see the module docstring)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype
    users: int  # consumer ops still to come
    dev_users: int  # ops still to read the produced device tensor (direct consumers and offloads)
    dev: torch.Tensor | None = None
    pack: Pack | None = None
    kept: torch.Tensor | None = None
    host_cpu: torch.Tensor | None = None
    host_ssd: torch.Tensor | None = None
    g: int = 0
    c: int = 0
    s: int = 0
    ssd_name: str | None = None


class Pack:
    """The tensors autograd saves in the forward of a layer that is not recomputed, captured explicitly with
    saved_tensors_hooks so that the plan's offload/fetch ops can move them. Views of the layer's weights are
    not captured: they are rebuilt from the weights fetched for the backward."""

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        self.leaves = leaves
        self.saved: list[torch.Tensor] | None = []
        self.index: dict[tuple, int] = {}
        self.restored: list[torch.Tensor] | None = None
        self.desc: list[tuple] = []
        self.out: torch.Tensor | None = None
        self.x_leaf: torch.Tensor | None = None

    def pack_hook(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        for i, leaf in enumerate(self.leaves):
            if leaf.untyped_storage().data_ptr() == ptr:
                return ("w", i, t.storage_offset() - leaf.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.device != self.leaves[0].device:  # e.g. a CPU scalar (RNG seed) saved by a CUDA kernel: kept as is
            return ("c", t)
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self.index:
            self.index[key] = len(self.saved)
            self.saved.append(t)
        return ("t", self.index[key])

    def unpack_hook(self, ref):
        if ref[0] == "w":
            leaf = self.leaves[ref[1]]
            return leaf.detach().as_strided(ref[3], ref[4], leaf.storage_offset() + ref[2])
        if ref[0] == "c":
            return ref[1]
        return (self.restored if self.restored is not None else self.saved)[ref[1]]

    def flatten(self) -> torch.Tensor:
        """All captured tensors as one flat uint8 device tensor (each at a 256-byte aligned offset, as kernels
        such as fused attention expect of their inputs); remembers how to rebuild them."""
        chunks, self.desc, off = [], [], 0
        for t in self.saved:
            dense = _dense_strides(t)
            data = (t.permute(*dense[0]) if dense else t).contiguous().reshape(-1).view(torch.uint8)
            self.desc.append((tuple(t.shape), tuple(t.stride()) if dense else None, dense[0] if dense else None,
                              t.dtype, off, data.numel()))
            chunks.append(data)
            off += data.numel()
            pad = -off % PACK_ALIGN
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=data.device))
                off += pad
        return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=self.leaves[0].device)

    def restore(self, flat: torch.Tensor) -> None:
        out = []
        for shape, stride, perm, dtype, off, n in self.desc:
            data = flat[off: off + n].view(dtype)
            if stride is None:
                out.append(data.view(shape))
            else:  # a permuted dense tensor: same memory layout as when it was saved
                permuted_shape = [shape[i] for i in perm]
                t = data.view(permuted_shape)
                inv = [perm.index(i) for i in range(len(perm))]
                out.append(t.permute(*inv))
        self.restored = out


def _dense_strides(t: torch.Tensor) -> tuple[list[int]] | None:
    """For a non-contiguous tensor whose memory is a permutation of a contiguous one: (dims by stride)."""
    if t.is_contiguous() or t.dim() == 0:
        return None
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    expect = 1
    for d in reversed(perm):
        if t.size(d) != 1 and t.stride(d) != expect:
            return None
        expect *= t.size(d)
    return (perm,)


@dataclass
class RoundResult:
    iterations: int
    losses: list[float]
    start_s: np.ndarray
    end_s: np.ndarray
    peak_bytes: dict[str, float]
    memory_trace: list[tuple[float, float, float, float]]
    wall_s: float
    extra: dict = field(default_factory=dict)


class Executor:
    def __init__(self, plan: Plan, state: TrainState, data: TokenData, device: torch.device, hyper: Hyper,
                 ssd: SsdStore | None) -> None:
        self.plan, self.state, self.data, self.device, self.hyper, self.ssd = plan, state, data, device, hyper, ssd
        self.cfg, self.spec = plan.config, plan.model
        self.L = self.spec.num_layers
        self.head = self.L + 1
        self.M = self.cfg.num_micro_batches
        self.layout = state.layout
        self.tasks: list[Task] = plan.graph.tasks
        self.cuda = device.type == "cuda"
        self.dtype = state.compute_dtype
        unknown = sorted({t.kind for t in self.tasks} - KINDS)
        if unknown:
            raise UnsupportedPlan(f"{plan.source}: op kind {unknown[0]!r} is not implemented by this executor "
                                 f"(it runs {', '.join(sorted(KINDS))}); upgrade tierflow")
        self._bind()
        self.lock = threading.Lock()

    # -- binding: which tensor each op reads, derived from the plan's dependencies --------------------------------

    def rec(self, b: int) -> bool:
        return self.cfg.recompute and b <= self.L - self.cfg.swap_layers

    def entry_key(self, t: Task) -> tuple:
        """The waiting tensor a transfer op of activations moves."""
        if t.tensor == "checkpoint":
            name = "pack" if 1 <= t.block <= self.L and not self.rec(t.block) else "x"
        else:
            name = ACT_TENSORS[t.tensor]
        return (t.iteration, name, t.block, t.mb)

    def inputs(self, t: Task) -> list[tuple]:
        it, b, m = t.iteration, t.block, t.mb
        if t.kind == "fwd":
            return [(it, "x", b, m)] if b >= 1 else []
        if t.kind == "head":
            return [(it, "x", b, m)]
        if t.kind == "recompute":
            return [(it, "x", b, m)]
        if t.kind == "bwd":
            keys = [(it, "dx", b + 1, m)]
            if 1 <= b <= self.L and not self.rec(b):
                keys.append((it, "pack", b, m))
            return keys
        return []

    def _bind(self) -> None:
        tasks = self.tasks
        self.fetch_for: dict[int, dict[tuple, int]] = {}  # consumer op -> {entry key: fetch op}
        self.consumers: Counter = Counter()
        self.direct_users: Counter = Counter()
        self.wfetch: dict[int, int | None] = {}  # compute op -> its fetch_weights op
        self.wfetch_users: Counter = Counter()
        self.dep_of_kind: dict[int, dict[str, int]] = {}
        self.part_of: dict[int, int] = {}  # read/write_opt_states, update_weights -> optimizer part
        for t in tasks:
            by_kind = {}
            for d in t.deps:
                by_kind[tasks[d].kind] = d
            self.dep_of_kind[t.id] = by_kind
            if t.resource == "gpu" and t.kind in ("fwd", "recompute", "bwd", "head"):
                fetches = {self.entry_key(tasks[d]): d for d in t.deps
                           if tasks[d].kind.startswith("fetch_") and tasks[d].kind != "fetch_weights"}
                self.fetch_for[t.id] = fetches
                for key in self.inputs(t):
                    self.consumers[key] += 1
                    if key not in fetches:
                        self.direct_users[key] += 1
                wf = [d for d in t.deps if tasks[d].kind == "fetch_weights" and tasks[d].block == t.block]
                self.wfetch[t.id] = wf[-1] if wf else None
                if wf:
                    self.wfetch_users[wf[-1]] += 1
            elif t.kind.startswith("offload_") and t.tensor != "grads":
                self.direct_users[self.entry_key(t)] += 1
            if t.kind in ("adam", "adam_deferred"):
                part = 0 if t.kind == "adam" else 1
                for d in t.deps:
                    if tasks[d].kind == "read_opt_states":
                        self.part_of[d] = part
        for t in tasks:
            if t.kind in ("write_opt_states", "update_weights"):
                a = t.deps[0]
                self.part_of[t.id] = 0 if tasks[a].kind == "adam" else 1
        self._bind_grad_groups()

    def _bind_grad_groups(self) -> None:
        """Which op takes each compute op's weight gradients: the first offload_grads of its block after it on the
        GPU queue (or, for a GPU optimizer, the owner's adam_gpu). Gradients of different groups never share a
        buffer, so a transfer never reads a buffer that a later backward is adding into."""
        tasks = self.tasks
        pos = {tid: i for i, tid in enumerate(self.plan.graph.resource_order()["gpu"])}
        offloads: dict[tuple[int, int], list[tuple[int, int]]] = {}
        adam_gpu: dict[tuple[int, int], int] = {}
        for t in tasks:
            if t.kind == "offload_grads":
                offloads.setdefault((t.iteration, t.block), []).append((pos[t.deps[0]], t.id))
            elif t.kind == "adam_gpu":
                adam_gpu[(t.iteration, t.block)] = t.id
        for v in offloads.values():
            v.sort()
        self.grad_group: dict[tuple[int, int], int] = {}
        for t in tasks:
            if t.kind not in ("head", "bwd"):
                continue
            for o, _lo, _hi in self.layout.owners(t.block):
                if self.cfg.placement.gpu_optimizer:
                    group = adam_gpu.get((t.iteration, o))
                else:
                    group = next((oid for p, oid in offloads.get((t.iteration, t.block), []) if p >= pos[t.id]), None)
                if group is None:
                    raise ExecutionError(f"{self.plan.source}: the gradients of op {t.id} ({t.label}) are never taken "
                                         "by an offload_grads or adam_gpu op (inconsistent plan)")
                self.grad_group[(t.id, o)] = group

    # -- running a round ---------------------------------------------------------------------------------------

    def run_round(self, iterations: int, step0: int, on_step=None) -> RoundResult:
        """Run the plan's ops of its first `iterations` iterations as training steps step0 .. step0+iterations-1.
        `on_step(iteration, loss, end_s)` is called (from a reporter thread) as soon as an iteration's last GPU
        op has finished, so that long rounds show progress; it waits on that op's event only."""
        n = sum(1 for t in self.tasks if t.iteration < iterations)
        if any(t.iteration >= iterations for t in self.tasks[:n]):
            raise ExecutionError(f"{self.plan.source}: ops are not ordered by iteration; cannot run "
                                 f"{iterations} of its {self.plan.graph.num_iterations} iterations (use whole rounds)")
        for t in self.tasks[:n]:
            for d in t.deps:
                if d >= n:
                    raise ExecutionError(f"{self.plan.source}: op {t.id} depends on a later iteration's op {d}")
        self.step0 = step0
        self.entries: dict[tuple, Entry] = {}
        self.fetched: dict[int, torch.Tensor] = {}
        self.graphs: dict[tuple, tuple] = {}
        self.gacc: dict[tuple[int, int], torch.Tensor] = {}
        self.staged: dict[int, object] = {}
        self.wbuf: dict[int, dict[int, torch.Tensor]] = {}
        self.wfull: dict[int, dict[int, torch.Tensor]] = {}
        self.wusers = Counter({k: v for k, v in self.wfetch_users.items() if k < n})
        self.loss_sum = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in range(iterations)]
        self.batches = []
        mb = self.cfg.micro_batch
        for it in range(iterations):
            x, y = self.data.batch(step0 + it, self.cfg.batch, self.cfg.seq)
            self.batches.append([(x[m * mb:(m + 1) * mb].to(self.device), y[m * mb:(m + 1) * mb].to(self.device))
                                 for m in range(self.M)])
        self.done = [threading.Event() for _ in range(n)]
        self.abort = threading.Event()
        self.errors: list[BaseException] = []
        self.start_s = np.full(n, np.nan)
        self.end_s = np.full(n, np.nan)
        self.mem = [float(self.plan.graph.static_bytes[t]) for t in TIERS]
        self.peak = list(self.mem)
        self.mem_trace = [(0.0, *self.mem)]
        if self.cuda:
            self.streams = {r: torch.cuda.Stream(self.device) for r in STREAM_RESOURCES}
            self.ev_start: dict[int, torch.cuda.Event] = {}
            self.ev_end: dict[int, torch.cuda.Event] = {}
            torch.cuda.synchronize(self.device)
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev0.record()
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        queues = {r: [i for i in ids if i < n] for r, ids in self.plan.graph.resource_order().items()}
        threads = [threading.Thread(target=self._worker, args=(r, q), name=f"tierflow-{r}", daemon=True)
                   for r, q in queues.items() if q]
        if on_step is not None:
            last = {}
            for tid in queues["gpu"]:
                last[self.tasks[tid].iteration] = tid
            threads.append(threading.Thread(target=self._reporter, args=(last, on_step), daemon=True,
                                            name="tierflow-reporter"))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.t0
        if self.errors:
            raise self.errors[0]
        if self.cuda:
            for tid, ev in self.ev_start.items():
                self.start_s[tid] = self.ev0.elapsed_time(ev) / 1e3
                self.end_s[tid] = self.ev0.elapsed_time(self.ev_end[tid]) / 1e3
        leftover = [k for k in self.entries]
        losses = [float(v) for v in self.loss_sum]
        return RoundResult(iterations, losses, self.start_s.copy(), self.end_s.copy(),
                           {t: self.peak[i] for i, t in enumerate(TIERS)}, list(self.mem_trace), wall,
                           extra={"leftover_entries": leftover})

    def _reporter(self, last: dict[int, int], on_step) -> None:
        try:
            for it in sorted(last):
                tid = last[it]
                self._wait(tid)
                if self.cuda:
                    self.ev_end[tid].synchronize()
                    end = self.ev0.elapsed_time(self.ev_end[tid]) / 1e3
                else:
                    end = float(self.end_s[tid])
                on_step(it, float(self.loss_sum[it]), end)
        except _Aborted:
            return

    def _wait(self, d: int) -> None:
        ev = self.done[d]
        while not ev.wait(0.05):
            if self.abort.is_set():
                raise _Aborted()

    def _worker(self, resource: str, queue: list[int]) -> None:
        stream = self.streams[resource] if self.cuda and resource in STREAM_RESOURCES else None
        try:
            for tid in queue:
                t = self.tasks[tid]
                for d in t.deps:
                    self._wait(d)
                    if self.cuda and self.tasks[d].resource in STREAM_RESOURCES:
                        if stream is not None:
                            stream.wait_event(self.ev_end[d])
                        else:
                            self.ev_end[d].synchronize()
                self._apply_mem(t.mem_start)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(stream)
                        self.ev_start[tid] = ev
                        self._run_op(t)
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(stream)
                        self.ev_end[tid] = ev
                else:
                    self.start_s[tid] = time.perf_counter() - self.t0
                    self._run_op(t)
                    self.end_s[tid] = time.perf_counter() - self.t0
                self._apply_mem(t.mem_end)
                self.done[tid].set()
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the other workers stop
            self.errors.append(self._explain(t, e))
            self.abort.set()

    def _apply_mem(self, effects) -> None:
        if not effects:
            return
        with self.lock:
            for tier, delta in effects:
                self.mem[tier] += delta
                self.peak[tier] = max(self.peak[tier], self.mem[tier])
            self.mem_trace.append((time.perf_counter() - self.t0, *self.mem))

    def _explain(self, t: Task, e: BaseException) -> BaseException:
        what = f"op {t.id} ({t.label} on {t.resource})"
        if isinstance(e, ExecutionError | ChecksumError):
            return e
        oom_gpu = isinstance(e, torch.OutOfMemoryError)
        full_disk = isinstance(e, OSError) and e.errno == errno.ENOSPC
        if oom_gpu or isinstance(e, MemoryError) or full_disk:
            tier = "gpu" if oom_gpu else "ssd" if full_disk else "cpu"
            return OutOfMemory(f"{tier} out of memory in {what}: caused by the plan's {self._decision(t)}; "
                               f"plan again for this machine (tierflow calibrate, then tierflow plan --hw box.yaml)")
        return ExecutionError(f"{what} failed: {type(e).__name__}: {e}")

    def _decision(self, t: Task) -> str:
        p, cfg = self.cfg.placement, self.cfg

        def split(name: str) -> str:
            s = getattr(p, name)
            return f"placement.{name} (gpu {s.gpu:g}, cpu {s.cpu:g}, ssd {s.ssd:g})"

        if t.tensor == "weights":
            return f"{split('weights')} with prefetch_depth {cfg.prefetch_depth}"
        if t.tensor in ("checkpoint", "act", "act_grad"):
            return f"{split('checkpoints')} at micro_batch {cfg.micro_batch} with swap_layers {cfg.swap_layers}"
        if t.tensor == "grads":
            return split("grads")
        if t.tensor == "opt_states":
            return f"{split('master')}, {split('adam_m')}, {split('adam_v')} with alpha {cfg.alpha:g}"
        return f"micro_batch {cfg.micro_batch} (the working memory of {t.kind})"

    # -- ops ---------------------------------------------------------------------------------------------------

    def _run_op(self, t: Task) -> None:
        k = t.kind
        if k in ("fwd", "recompute", "bwd", "head"):
            getattr(self, f"op_{k}")(t)
            self._release_weights(t)
        elif k in ("adam", "adam_deferred"):
            self.op_adam(t)
        elif k.startswith(("offload_", "fetch_", "write_", "read_")) and t.tensor in ("checkpoint", "act", "act_grad"):
            getattr(self, f"op_{k.split('_')[0]}_entry")(t)
        else:
            getattr(self, f"op_{k}")(t)

    # entries

    def _put(self, key: tuple, dev: torch.Tensor | None = None, pack: Pack | None = None) -> None:
        users = self.consumers[key]
        if users == 0:
            return
        e = Entry(shape=tuple(dev.shape) if dev is not None else None,
                  dtype=dev.dtype if dev is not None else torch.uint8, users=users,
                  dev_users=self.direct_users[key], dev=dev, pack=pack)
        with self.lock:
            self.entries[key] = e

    def _take(self, t: Task, key: tuple):
        fid = self.fetch_for[t.id].get(key)
        e = self.entries[key]
        if fid is not None:
            data = self.fetched.pop(fid)
            self._use_on(data, "gpu")
        elif key[1] == "pack":
            return e.pack
        elif e.dev is not None:
            return e.dev
        elif e.kept is not None and e.g == int(np.prod(e.shape)):
            data = e.kept
        else:
            raise ExecutionError(f"op {t.id} ({t.label}): {key} is neither on the device nor fetched by one of its "
                                 "dependencies (inconsistent plan)")
        if key[1] == "pack":
            e.pack.restore(data)
            return e.pack
        return data.view(e.shape)

    def _done_with(self, t: Task, key: tuple) -> None:
        with self.lock:
            e = self.entries[key]
            if key not in self.fetch_for[t.id]:
                self._dev_release(e)
            e.users -= 1
            if e.users == 0:
                del self.entries[key]
                name = e.ssd_name
            else:
                name = None
        if name and self.ssd:
            self.ssd.delete(name)

    def _dev_release(self, e: Entry) -> None:
        e.dev_users -= 1
        if e.dev_users <= 0:
            e.dev = None
            if e.pack is not None:
                e.pack.saved = None

    def _use_on(self, x: torch.Tensor | None, resource: str) -> None:
        """A device tensor made on one stream and used on another: tell the caching allocator (CUDA only)."""
        if self.cuda and x is not None and x.is_cuda:
            x.record_stream(self.streams[resource])

    def op_offload_entry(self, t: Task) -> None:
        key = self.entry_key(t)
        e = self.entries[key]
        if e.pack is not None:
            for x in e.pack.saved:
                self._use_on(x, "d2h")
            flat = e.pack.flatten()
            e.dtype, e.shape = torch.uint8, (flat.numel(),)
        else:
            flat = e.dev.reshape(-1)
            self._use_on(e.dev, "d2h")
        ck = self.cfg.placement.checkpoints
        e.g, e.c, e.s = split_counts(flat.numel(), ck.gpu, ck.ssd)
        g, c = e.g, e.c
        if g:
            e.kept = flat[:g].clone()
        pin = self.cuda
        if c:
            e.host_cpu = host_empty(c, flat.dtype, pin)
            e.host_cpu.copy_(flat[g:g + c], non_blocking=pin)
        if e.s:
            e.host_ssd = host_empty(e.s, flat.dtype, pin)
            e.host_ssd.copy_(flat[g + c:], non_blocking=pin)
        with self.lock:
            if e.pack is not None:
                e.pack.saved = None  # its bytes now live in kept / host
            self._dev_release(e)

    def _ssd_name(self, key: tuple) -> str:
        it, name, b, m = key
        return f"{name}_it{it}_b{b}_m{m}"

    def op_write_entry(self, t: Task) -> None:
        e = self.entries[self.entry_key(t)]
        name = self._ssd_name(self.entry_key(t))
        self.ssd.write(name, e.host_ssd)
        e.ssd_name, e.host_ssd = name, None

    def op_read_entry(self, t: Task) -> None:
        e = self.entries[self.entry_key(t)]
        e.host_ssd = self.ssd.read(e.ssd_name, e.dtype, e.s)

    def op_fetch_entry(self, t: Task) -> None:
        e = self.entries[self.entry_key(t)]
        parts = []
        if e.g:
            self._use_on(e.kept, "h2d")
            parts.append(e.kept)
        if e.c:
            parts.append(e.host_cpu.to(self.device, non_blocking=self.cuda))
        if e.s:
            parts.append(e.host_ssd.to(self.device, non_blocking=self.cuda))
            e.host_ssd = None
        self.fetched[t.id] = torch.cat(parts) if len(parts) > 1 else parts[0].clone() if parts[0] is e.kept else parts[0]

    # weights

    def op_read_weights(self, t: Task) -> None:
        out = {}
        for o, lo, hi in self.layout.owners(t.block):
            W = self.state.vec["weights"][o]
            a = max(lo, W.ssd_lo)
            if hi <= a:
                continue
            buf = torch.empty(hi - a, dtype=W.dtype, pin_memory=self.cuda)
            for name, _j, plo, phi in W.ssd_pieces():
                x, z = max(plo, a), min(phi, hi)
                if z > x:
                    buf[x - a: z - a].copy_(self.ssd.read(name, W.dtype, phi - plo)[x - plo: z - plo])
            out[o] = buf
        self.staged[t.id] = out

    def op_fetch_weights(self, t: Task) -> None:
        rid = self.dep_of_kind[t.id].get("read_weights")
        staged = self.staged.pop(rid) if rid is not None else {}
        out = {}
        for o, lo, hi in self.layout.owners(t.block):
            W = self.state.vec["weights"][o]
            parts = []
            a, z = max(lo, W.g), min(hi, W.ssd_lo)
            if z > a:
                parts.append(W.host[a - W.g: z - W.g].to(self.device, non_blocking=self.cuda))
            if o in staged:
                parts.append(staged[o].to(self.device, non_blocking=self.cuda))
            if parts:
                out[o] = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.wbuf[t.id] = out

    def _weights(self, t: Task) -> list[torch.Tensor]:
        """One flat vector per owner of block t.block: the resident part and the fetched part, joined."""
        fid = self.wfetch[t.id]
        out = []
        for o, lo, hi in self.layout.owners(t.block):
            W = self.state.vec["weights"][o]
            if fid is None:
                if W.g < hi:
                    raise ExecutionError(f"op {t.id} ({t.label}): weights of block {o} are not all on the device and "
                                         "no fetch_weights precedes it (inconsistent plan)")
                out.append(W.dev[lo:hi])
                continue
            cache = self.wfull.setdefault(fid, {})
            if o not in cache:
                off = self.wbuf[fid].get(o)
                self._use_on(off, "gpu")
                res = W.dev[lo: min(hi, W.g)] if W.g > lo else None
                cache[o] = off if res is None else res if off is None else torch.cat([res, off])
            out.append(cache[o])
        return out

    def _release_weights(self, t: Task) -> None:
        fid = self.wfetch.get(t.id)
        if fid is None:
            return
        self.wusers[fid] -= 1
        if self.wusers[fid] == 0:
            self.wbuf.pop(fid, None)
            self.wfull.pop(fid, None)

    def op_update_weights(self, t: Task) -> None:
        a, z, w = self.staged.pop(("w_gpu", t.deps[0]))
        if z > a:
            self.state.vec["weights"][t.block].dev[a:z].copy_(w, non_blocking=self.cuda)

    # compute

    def _call(self, b: int, vecs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        params = self.layout.params(b, vecs[0])
        module = self.layout.templates[b]
        if b == self.head and self.spec.tied_embeddings:
            return functional_call(module, params, (x,), {"tied_weight": vecs[1].view(self.spec.vocab_size, -1)})
        return functional_call(module, params, (x,))

    def op_fwd(self, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        vecs = self._weights(t)
        if b == 0:
            with torch.no_grad():
                out = self._call(0, vecs, self.batches[it][m][0])
        elif self.rec(b):
            x = self._take(t, (it, "x", b, m))
            with torch.no_grad():
                out = self._call(b, vecs, x)
        else:  # keep every activation: autograd's saved tensors go into a Pack the plan's ops move
            x = self._take(t, (it, "x", b, m))
            leaves = [v.detach().requires_grad_() for v in vecs]
            pack = Pack(leaves)
            pack.x_leaf = x.detach().requires_grad_()
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook):
                pack.out = self._call(b, leaves, pack.x_leaf)
            for leaf in leaves:  # the weight buffer is not kept: backward gets its own fetch
                leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            self._put((it, "pack", b, m), pack=pack)
            out = pack.out
        if b >= 1:
            self._done_with(t, (it, "x", b, m))
        self._put((it, "x", b + 1, m), out.detach())

    def op_recompute(self, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x = self._take(t, (it, "x", b, m)).detach().requires_grad_()
        leaves = [v.detach().requires_grad_() for v in self._weights(t)]
        with torch.enable_grad():
            out = self._call(b, leaves, x)
        self.graphs[(it, b, m)] = (out, x, leaves)
        self._done_with(t, (it, "x", b, m))

    def op_head(self, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x = self._take(t, (it, "x", b, m)).detach().requires_grad_()
        leaves = [v.detach().requires_grad_() for v in self._weights(t)]
        with torch.enable_grad():
            logits = self._call(b, leaves, x)
            loss = lm_loss(logits, self.batches[it][m][1])
            (loss / self.M).backward()
        self.loss_sum[it] += loss.detach() / self.M
        self._done_with(t, (it, "x", b, m))
        self._grads(t, leaves)
        self._put((it, "dx", b, m), x.grad)

    def op_bwd(self, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        gout = self._take(t, (it, "dx", b + 1, m))
        if b == 0:
            self._embedding_grads(t, gout, self.batches[it][m][0])
        elif self.rec(b):
            out, x, leaves = self.graphs.pop((it, b, m))
            torch.autograd.backward(out, gout)
            self._grads(t, leaves)
            self._put((it, "dx", b, m), x.grad)
        else:
            pack = self._take(t, (it, "pack", b, m))
            for leaf, vec in zip(pack.leaves, self._weights(t)):
                leaf.data = vec
            torch.autograd.backward(pack.out, gout)
            self._grads(t, pack.leaves)
            self._put((it, "dx", b, m), pack.x_leaf.grad)
            pack.restored = pack.out = None
            self._done_with(t, (it, "pack", b, m))
        self._done_with(t, (it, "dx", b + 1, m))

    def _embedding_grads(self, t: Task, gout: torch.Tensor, tokens: torch.Tensor) -> None:
        H = self.spec.hidden
        grads = []
        for s in self.layout.slots[0]:
            g = torch.zeros(s.shape, dtype=torch.float32, device=self.device)
            if s.name == "wte.weight":
                g.index_add_(0, tokens.reshape(-1), gout.reshape(-1, H).float())
            else:  # learned positions: position p gets the sum over the batch of the gradient at p
                g[: gout.size(1)] = gout.float().sum(0)
            grads.append(g.reshape(-1))
        self._accumulate(t, 0, torch.cat(grads))

    def _grads(self, t: Task, leaves: list[torch.Tensor]) -> None:
        for (o, lo, hi), leaf in zip(self.layout.owners(t.block), leaves):
            self._accumulate(t, o, leaf.grad, lo, hi)

    def _accumulate(self, t: Task, o: int, grad: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """fp32 accumulation on the device into owner o's range [lo, hi), in the buffer of the op that will take
        these gradients (a buffer spans the owner's whole vector: a tied head adds the wte range of block 0)."""
        key = (self.grad_group[(t.id, o)], o)
        with self.lock:
            acc = self.gacc.get(key)
        if acc is None:
            acc = torch.zeros(self.layout.numel[o], dtype=torch.float32, device=self.device)
            with self.lock:
                self.gacc[key] = acc
        acc[lo:hi] += grad.reshape(-1)

    def _take_grads(self, group: int) -> list[tuple[int, torch.Tensor]]:
        with self.lock:
            keys = [k for k in self.gacc if k[0] == group]
            return [(k[1], self.gacc.pop(k)) for k in keys]

    # gradients

    def op_offload_grads(self, t: Task) -> None:
        """Send a block's gradients to the host in the compute dtype and add them to the fp32 accumulators."""
        for o, g in self._take_grads(t.id):
            self._use_on(g, "d2h")
            wire = g.to(self.dtype)
            if self.cuda:
                host = host_empty(wire.numel(), wire.dtype, True)
                host.copy_(wire, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.streams["d2h"])
                done.synchronize()  # this op's own copy only: the host accumulation below needs its bytes
            else:
                host = wire
            self.state.grads[o] += host.float()

    def _grad_ssd_range(self, b: int) -> tuple[int, int]:
        _g, c, s = self.state.grad_split[b]
        n = self.layout.numel[b]
        return n - s, n

    def op_write_grads(self, t: Task) -> None:
        a, z = self._grad_ssd_range(t.block)
        if z > a:
            self.ssd.write(f"grads_b{t.block}", self.state.grads[t.block][a:z])
            self.state.grads[t.block][a:z].zero_()

    def op_read_grads(self, t: Task) -> None:
        a, z = self._grad_ssd_range(t.block)
        if z > a:
            self.state.grads[t.block][a:z].copy_(self.ssd.read(f"grads_b{t.block}", torch.float32, z - a))

    # optimizer

    def _adamw(self, params, grads, ms, vs, step: int, fused: bool) -> None:
        h = self.hyper
        steps = [torch.tensor(float(step - 1), device=p.device) for p in params]
        adamw_step(params, grads, ms, vs, [], steps, foreach=False if fused else None, fused=fused,
                                amsgrad=False, beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay,
                                eps=h.eps, maximize=False)

    def op_read_opt_states(self, t: Task) -> None:
        j = self.part_of[t.id]
        out = {}
        for cls in ("master", "adam_m", "adam_v"):
            V = self.state.vec[cls][t.block]
            for name, pj, lo, hi in V.ssd_pieces():
                if pj == j:
                    out[cls] = (lo, hi, self.ssd.read(name, torch.float32, hi - lo))
        self.staged[("states", t.id)] = out

    def op_adam(self, t: Task) -> None:
        b = t.block
        j = 0 if t.kind == "adam" else 1
        lo, hi = self.state.parts[b][j]
        rid = self.dep_of_kind[t.id].get("read_opt_states")
        ssd_parts = self.staged.pop(("states", rid)) if rid is not None else {}
        vecs = {cls: self.state.vec[cls][b] for cls in ("master", "adam_m", "adam_v")}
        cuts = sorted({lo, hi, *(min(max(v.ssd_lo, lo), hi) for v in vecs.values())})

        def view(cls: str, a: int, z: int) -> torch.Tensor:
            V = vecs[cls]
            if a >= V.ssd_lo:
                plo, _phi, data = ssd_parts[cls]
                return data[a - plo: z - plo]
            return V.host[a - V.g: z - V.g]

        params, grads, ms, vs = [], [], [], []
        for a, z in zip(cuts, cuts[1:]):
            if z <= a:
                continue
            params.append(view("master", a, z))
            ms.append(view("adam_m", a, z))
            vs.append(view("adam_v", a, z))
            grads.append(self.state.grads[b][a:z])
        step = self.step0 + t.iteration + 1
        self._adamw(params, grads, ms, vs, step, fused=True)
        master = torch.cat(params) if len(params) > 1 else params[0]
        self.state.grads[b][lo:hi].zero_()
        # the compute copy of the updated range, to wherever the weights live
        W = self.state.vec["weights"][b]
        new = master.to(W.dtype)
        a, z = max(lo, W.g), min(hi, W.ssd_lo)
        if z > a:
            W.host[a - W.g: z - W.g].copy_(new[a - lo: z - lo])
        a, z = lo, min(hi, W.g)
        self.staged[("w_gpu", t.id)] = (a, z, new[: max(z - a, 0)].to(self.device) if not self.cuda
                                        else new[: max(z - a, 0)].pin_memory())
        w_ssd = [(name, new[plo - lo: phi - lo]) for name, pj, plo, phi in W.ssd_pieces() if pj == j]
        self.staged[("w_ssd", t.id)] = w_ssd
        self.staged[("states_out", t.id)] = ssd_parts

    def op_write_opt_states(self, t: Task) -> None:
        a = t.deps[0]
        for cls, (_lo, _hi, data) in self.staged.pop(("states_out", a)).items():
            j = self.part_of[t.id]
            name = next(n for n, pj, _l, _h in self.state.vec[cls][t.block].ssd_pieces() if pj == j)
            self.ssd.write(name, data)
        for name, data in self.staged.pop(("w_ssd", a)):
            self.ssd.write(name, data)

    def op_adam_gpu(self, t: Task) -> None:
        b = t.block
        grad = None
        for _o, g in self._take_grads(t.id):
            grad = g if grad is None else grad + g
        vecs = [self.state.vec[cls][b].dev for cls in ("master", "adam_m", "adam_v")]
        self._adamw([vecs[0]], [grad], [vecs[1]], [vecs[2]], self.step0 + t.iteration + 1,
                    fused=self.cuda)
        self.state.vec["weights"][b].dev.copy_(vecs[0].to(self.dtype))


class _Aborted(Exception):
    pass


def measured_result(plan: Plan, rr: RoundResult) -> SimResult:
    """The measured round as a SimResult over the plan's graph (its first `rr.iterations` iterations), so that
    every output of the simulator (CSV, Chrome trace, Gantt) works on measurements too."""
    g = plan.graph
    n = len(rr.start_s)
    graph = TaskGraph(g.tasks[:n], g.static_bytes, g.capacity_bytes, rr.iterations, g.num_blocks, dict(g.meta))
    return summarize(graph, rr.start_s, rr.end_s, [rr.peak_bytes[t] for t in TIERS], rr.memory_trace)
