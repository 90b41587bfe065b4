"""A CUDA graph as the adversarial emulation plays it (`EmuGraph`, made by AdversarialCpuBackend.new_graph): a
capture is the list of aten ops the captured code ran, each with its tensors as the memory they were at that
moment (storage, offset, sizes, strides: a kernel's pointers), and a replay runs that list again in order,
writing every result into the memory the capture's result lay in. No Python of the captured code runs again,
so whatever the executor did in Python during the capture (its entries, its gradient buffers' bookkeeping) is
not repeated by a replay, exactly as on CUDA.

What it refuses, as CUDA does (a refusal during the capture is a `CaptureError`, and the executor falls back
to eager launches; one at a replay is a `GraphReplayError`, a bug of the executor):
  * a host synchronization during the capture (`.item()`, `.tolist()`, a host wait: HiddenSyncError);
  * a copy with host memory or a host allocation during the capture (a transfer inside a segment);
  * a read of device memory the graph neither allocated (its pool) nor was told is kept across iterations
    (`persistent`, given by the executor: the training state's resident tensors, its static buffers): such a
    tensor has a new address on the next iteration, and a replay would read the old one;
  * at a replay, a persistent tensor whose memory moved since the capture (new tensor addresses).
Unlike CUDA's, this capture runs the ops it records (the emulation needs their results to go on); the
executor's graph runner replays a CUDA graph once right after capturing it instead (`capture_executes`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierflow.executor.device.base import CaptureError, GraphReplayError

_tls = threading.local()


def capturing() -> EmuGraph | None:
    """The graph the calling thread is capturing, if any."""
    return getattr(_tls, "graph", None)


class EmuPool:
    """The graphs' private pool: the memory every capture allocated, held for as long as the pool lives."""

    def __init__(self) -> None:
        self.storages: dict[int, torch.Tensor] = {}  # data pointer -> a tensor holding that storage

    def hold(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in self.storages:
            self.storages[ptr] = _snapshot(t)


class EmuGraph:
    """One captured graph (see the module docstring)."""

    capture_executes = True

    def __init__(self, pool: EmuPool, persistent: Callable[[], dict[int, torch.Tensor]],
                 is_host: Callable[[torch.Tensor], bool]) -> None:
        self.pool, self.persistent, self.is_host = pool, persistent, is_host
        self.ops: list[tuple] = []  # (func, args with snapshots, [(result index, destination)], rerun)
        self.external: dict[int, tuple] = {}  # storage pointer -> geometry at capture (ptr, dtype)
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> None:
        if capturing() is not None:
            raise CaptureError("a capture inside a capture")
        allowed = self.persistent()
        _tls.graph = self
        try:
            with _Recorder(self, allowed):
                fn()
        finally:
            _tls.graph = None

    def replay(self) -> None:
        """Run the recorded ops again on the memory they used; refuse if a persistent tensor moved."""
        now = self.persistent()
        for ptr, what in self.external.items():
            if ptr not in now:
                raise GraphReplayError(f"a graph replay reads {what}, whose memory is no longer where it was "
                                       "at the capture (a new tensor address: on CUDA the replay would read "
                                       "freed or reused memory)")
        with torch.no_grad():
            for func, args, kwargs, dests in self.ops:
                out = func(*args, **kwargs)
                if dests:
                    flat, _ = tree_flatten(out)
                    for i, dst in dests:
                        dst.copy_(flat[i])
        self.replays += 1


class _Recorder(TorchDispatchMode):
    """Records every aten op of a capture (see EmuGraph) and refuses what CUDA refuses during one."""

    def __init__(self, graph: EmuGraph, allowed: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.graph, self.allowed = graph, allowed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if name in _HOST_SYNC_OPS:
            raise CaptureError(f"a host synchronization ({name}) inside a capture: CUDA cannot capture it "
                               "(the host would wait for a value the graph has not computed)")
        flat, spec = tree_flatten((args, kwargs))
        pool = self.graph.pool.storages
        if name in _LIFT_OPS:  # a tensor made from Python data (torch.tensor): a constant of the graph
            for x in flat:
                if isinstance(x, torch.Tensor):
                    self.graph.pool.hold(x)
        snap = []
        for x in flat:
            if isinstance(x, torch.Tensor) and x.layout == torch.strided:
                self._check_input(func, x, pool)
                snap.append(_snapshot(x))
            else:
                snap.append(x)
        out = func(*args, **kwargs)
        aliased = [r.alias_info is not None for r in func._schema.returns]
        outs, _ = tree_flatten(out)
        dests = []
        if not all(aliased):
            for i, y in enumerate(outs):
                if isinstance(y, torch.Tensor) and y.layout == torch.strided:
                    if self.graph.is_host(y):
                        raise CaptureError(f"{name} inside a capture writes host memory (a host copy: CUDA "
                                           "would not replay it; a transfer belongs outside the segment)")
                    self.graph.pool.hold(y)
                    dests.append((i, _snapshot(y)))
        s_args, s_kwargs = tree_unflatten(snap, spec)
        self.graph.ops.append((func, s_args, s_kwargs, dests))
        return out

    def _check_input(self, func, x: torch.Tensor, pool: dict[int, torch.Tensor]) -> None:
        if x.device.type == "meta" or not x.numel():
            return
        if self.graph.is_host(x):
            raise CaptureError(f"{func} inside a capture reads host memory {tuple(x.shape)} {x.dtype} "
                               "(a host copy: a transfer belongs outside the segment)")
        ptr = x.untyped_storage().data_ptr()
        if ptr in pool:
            return
        if ptr not in self.allowed:
            raise CaptureError(f"{func} reads a device tensor {tuple(x.shape)} {x.dtype} that the capture "
                               "did not allocate and that is not kept across iterations: it would have a new "
                               "address at the next replay")
        self.graph.external.setdefault(ptr, f"a tensor {tuple(x.shape)} {x.dtype}")


_LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
# aten ops that make the host wait for a device value
_HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero"})


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory as it is now (what a kernel's pointer is), whatever t's Python object
    becomes."""
    with _disable_current_modes():
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
