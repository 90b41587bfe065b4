"""What an op sees: the executor's fixed context (`OpContext`: the plan's binding, the training state, the
device) and the state of the round it runs in (`RoundState`, created fresh by every `Executor.run_round`)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from tierflow.executor.binding import Binding, Entry, EntryKey
from tierflow.executor.device.base import DeviceBackend, PlainCpuBackend
from tierflow.executor.optim.adamw import (
    Hyper,  # the optimizer's settings, beside the context that holds them
)
from tierflow.executor.optim.clipping import GradNorms
from tierflow.executor.tiers.arena import TransferArena
from tierflow.executor.tiers.ssd_store import SsdStore, aligned_empty
from tierflow.executor.tiers.state import BlockLayout, TrainState
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec

# resources with a stream each (executor/device; none on a plain CPU)
STREAM_RESOURCES = ("gpu", "h2d", "d2h")


@dataclass(frozen=True)
class OpContext:
    """The fixed part of what every op reads: one per Executor."""

    binding: Binding
    state: TrainState
    device: torch.device
    hyper: Hyper
    ssd: SsdStore | None
    backend: DeviceBackend = field(default_factory=PlainCpuBackend)
    # the pinned transfer area (tiers/arena.py); None: the backend's pinned buffers
    arena: TransferArena | None = None
    # the run's gradient norms and clipping (the Trainer's, train_loop.py); None: no norms, no clipping
    norms: GradNorms | None = None

    def transfer_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that crosses PCIe: a view into the transfer area."""
        if self.arena is None:
            return self.backend.host_buffer(numel, dtype, pinned=True)
        return self.arena.take(numel, dtype)

    def transfer_bytes(self, nbytes: int) -> torch.Tensor:
        """A page-aligned uint8 transfer buffer of at least `nbytes` (an SSD read's destination)."""
        if self.arena is None:
            return aligned_empty(nbytes, self.backend.pins, self.backend)
        return self.arena.take_bytes(nbytes)

    @property
    def asynchronous(self) -> bool:
        """Stream ops run asynchronously to their workers (CUDA and its emulation): results cross streams by
        events only, copies are copy_async between device and pinned host memory."""
        return self.backend.streams_async

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (of the weights)."""
        return self.state.compute_dtype

    @property
    def layout(self) -> BlockLayout:
        return self.state.layout

    @property
    def cfg(self) -> ScheduleConfig:
        return self.binding.cfg

    @property
    def spec(self) -> ModelSpec:
        return self.binding.plan.model


STAGED_KINDS = frozenset({
    "weights_read",  # read_weights -> fetch_weights: {owner: pinned host buffer of its SSD range}
    "opt_states_read",  # read_opt_states -> adam: {class: (lo, hi, host tensor)} of its part's SSD range
    "weights_gpu",  # adam -> update_weights: (lo, hi, updated compute weights of the device range)
    "weights_ssd",  # adam -> write_opt_states: [(file name, updated compute weights)]
    "opt_states_out",  # adam -> write_opt_states: the opt_states_read dict, updated in place
})


@dataclass(frozen=True)
class Staged:
    """A key of RoundState.staged: what the op `task_id` left there for a later op."""

    kind: str
    task_id: int

    def __post_init__(self) -> None:
        assert self.kind in STAGED_KINDS, self.kind


@dataclass
class RoundState:
    """Everything one round of the plan's ops (Executor.run_round) creates and shares between its workers."""

    num_ops: int  # the round runs ops [0, num_ops) of the plan
    step0: int  # training step of the round's first iteration
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [iteration][micro-batch] -> (tokens, targets)
    weight_users: Counter  # fetch_weights op -> compute ops still to read its buffers
    lock: threading.Lock = field(default_factory=threading.Lock)  # entries, grad_acc, memory accounting
    # data between ops
    entries: dict[EntryKey, Entry] = field(default_factory=dict)
    fetched: dict[int, torch.Tensor] = field(default_factory=dict)  # fetch op -> the device copy it made
    graphs: dict[tuple[int, int, int], tuple] = field(default_factory=dict)  # (it, b, m) -> recompute's graph
    # (taking op, owner) -> weight gradients of the owner's range binding.grad_range
    # (grad_buffers.GradBuffers)
    # (a single contribution without streams: its [(first element, gradient)], not copied)
    grad_acc: dict[tuple[int, int], torch.Tensor | list[tuple[int, torch.Tensor]]] = field(
        default_factory=dict)
    # ... compute ops still to add into it
    grad_left: dict[tuple[int, int], int] = field(default_factory=dict)
    staged: dict[Staged, object] = field(default_factory=dict)
    # fetch_weights -> owner -> (first element, device buffer of the owner's elements from there on)
    weight_bufs: dict[int, dict[int, tuple[int, torch.Tensor]]] = field(default_factory=dict)
    loss_sum: list[torch.Tensor] = field(default_factory=list)  # per iteration, on the device
    # progress and timing
    done: list[threading.Event] = field(default_factory=list)  # per op
    abort: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    start_s: np.ndarray = field(default_factory=lambda: np.empty(0))  # per op, from t0_s (CPU device)
    end_s: np.ndarray = field(default_factory=lambda: np.empty(0))
    mem_bytes: list[float] = field(default_factory=list)  # per tier, as the plan's memory effects say
    peak_bytes: list[float] = field(default_factory=list)
    mem_trace: list[tuple[float, ...]] = field(default_factory=list)  # (seconds, bytes per tier)
    # (seconds, the op's memory effects) as the workers applied them (Executor.apply_mem; folded into the
    # three above after the round)
    mem_log: list[tuple[float, list]] = field(default_factory=list)
    t0_s: float = 0.0  # time.perf_counter() at the start
    # with streams only (None / empty on a plain CPU): the backend's streams and events
    backend: DeviceBackend | None = None
    streams: dict[str, object] | None = None
    ev0: object | None = None
    ev_start: dict[int, object] = field(default_factory=dict)
    ev_end: dict[int, object] = field(default_factory=dict)
    grad_adds: object | None = None  # grads.HostGradAdds: host fp32 accumulation of offloaded gradients

    def use_on(self, x: torch.Tensor | None, resource: str) -> None:
        """A device tensor made on one stream and used on another: tell the allocator (record_stream)."""
        if self.streams is not None and x is not None:
            self.backend.record_stream(x, self.streams[resource])
