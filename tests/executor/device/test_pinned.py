"""Host memory as every backend allocates it: one code path (DeviceBackend.host_buffer
and pinned_area over the primitive host_bytes_raw), so that a buffer asked for as pinned is one that the
backend's own copy_async accepts, on every backend. The CUDA backend runs here against a fake of torch's CUDA
allocator and streams: the fake pins only what torch is asked to pin (`torch.empty(pin_memory=True)` or
cudaHostRegister), so the test fails if CudaBackend hands out pageable memory for a pinned request, as it did
on the first GPU run (PageableCopyError at op 1)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from tierflow.executor.device.base import HiddenSyncError, PageableCopyError, PlainCpuBackend
from tierflow.executor.device.cuda import CudaBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend


class FakeCuda:
    """torch's CUDA pieces that CudaBackend's host memory and copies use, on a CPU: page-locked ranges are
    those torch was asked to pin; streams are tokens with a per-thread current one."""

    def __init__(self, monkeypatch) -> None:
        self.pinned: list[tuple[int, int]] = []
        self.asked: list[bool] = []  # pin_memory of every torch.empty call
        self.tls = threading.local()
        self.default = object()
        real_empty = torch.empty
        fake = self

        def empty(*args, pin_memory=False, **kwargs):
            t = real_empty(*args, **kwargs)
            fake.asked.append(bool(pin_memory))
            if pin_memory:
                fake._pin(t.data_ptr(), t.untyped_storage().nbytes())
            return t

        class Cudart:
            def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 (CUDA's name)
                fake._pin(ptr, nbytes)
                return 0

            def cudaHostUnregister(self, ptr):  # noqa: N802
                fake.pinned = [(lo, hi) for lo, hi in fake.pinned if lo != ptr]
                return 0

        @contextmanager
        def stream(s):
            prev = getattr(fake.tls, "cur", fake.default)
            fake.tls.cur = s
            try:
                yield
            finally:
                fake.tls.cur = prev

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: fake.covers(t))
        monkeypatch.setattr(torch.cuda, "cudart", Cudart)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(fake.tls, "cur",
                                                                                       fake.default))
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: fake.default)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: object())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def _pin(self, ptr: int, nbytes: int) -> None:
        self.pinned.append((ptr, ptr + nbytes))

    def covers(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(lo <= p and p + t.numel() * t.element_size() <= hi for lo, hi in self.pinned)

    def backend(self) -> CudaBackend:
        be = CudaBackend.__new__(CudaBackend)  # no device to set up; every primitive it calls is faked
        be.device, be.name = torch.device("cpu"), "cuda:fake"
        real_empty = torch.empty

        def device_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
            t = real_empty(numel, dtype=dtype)  # "device memory": not pageable host memory either
            self._pin(t.data_ptr(), t.untyped_storage().nbytes())
            return t

        be.empty = device_empty
        return be


def _plain(monkeypatch):
    return PlainCpuBackend(), None


def _adversarial(monkeypatch):
    be = AdversarialCpuBackend(max_delay_s=0.0)
    be.errors = []
    be.start_round(threading.Event(), lambda label, e: be.errors.append((label, e)))
    return be, None


def _cuda(monkeypatch):
    fake = FakeCuda(monkeypatch)
    return fake.backend(), fake


BACKENDS = {"cpu": _plain, "cpu-adversarial": _adversarial, "cuda (faked allocator)": _cuda}


def _copy_on_a_stream(be, dst: torch.Tensor, src: torch.Tensor) -> None:
    """copy_async inside an op on a d2h stream (where the executor issues them); its error raised here."""
    stream = be.new_stream("d2h") if be.streams_async else None
    box: list[BaseException] = []

    def op():
        try:
            be.copy_async(dst, src)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    be.launch(stream, op, "copy")
    be.synchronize()
    if isinstance(be, AdversarialCpuBackend):
        box += [e for _label, e in be.errors]
        be.close_streams(list(be.streams))
    if box:
        raise box[0]


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_a_pinned_host_buffer_is_accepted_by_the_backends_own_copy(monkeypatch, name, dtype):
    be, _fake = BACKENDS[name](monkeypatch)
    src = be.empty(1000, dtype)
    src.fill_(3)
    host = be.host_buffer(1000, dtype, pinned=True)
    assert host.shape == (1000,) and host.dtype == dtype
    _copy_on_a_stream(be, host, src)
    assert torch.equal(host, torch.full((1000,), 3, dtype=dtype))


@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_transfer_areas_memory_is_accepted_by_the_backends_own_copy(monkeypatch, name):
    be, _fake = BACKENDS[name](monkeypatch)
    area = be.pinned_area(10_000)
    assert area.dtype == torch.uint8 and area.numel() == 10_000
    view = area[4096: 4096 + 4000].view(torch.float32)
    src = be.empty(1000, torch.float32)
    src.fill_(5)
    _copy_on_a_stream(be, view, src)
    assert torch.equal(view, torch.full((1000,), 5.0))


@pytest.mark.parametrize("name", ["cpu-adversarial", "cuda (faked allocator)"])
def test_a_pageable_host_buffer_is_refused_where_the_backend_pins(monkeypatch, name):
    """The check is not vacuous: on a backend that pins, pageable memory fails the same copy."""
    be, _fake = BACKENDS[name](monkeypatch)
    assert be.pins
    host = be.host_buffer(64, torch.float32, pinned=False)
    with pytest.raises(PageableCopyError):
        _copy_on_a_stream(be, host, be.empty(64, torch.float32))


def test_cuda_asks_torch_for_page_locked_memory_exactly_when_asked(monkeypatch):
    be, fake = _cuda(monkeypatch)
    fake.asked.clear()
    be.host_buffer(256, torch.float32, pinned=True)
    assert fake.asked == [True]
    fake.asked.clear()
    be.host_buffer(256, torch.float32, pinned=False)  # host-only state: pageable (pinned memory is scarce)
    assert fake.asked == [False]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_copies_every_backend_refuses(monkeypatch, name):
    """What CUDA would do wrong silently is refused on every backend with streams: other shapes (copy_ would
    broadcast) and, where streams are asynchronous, a copy outside an op on a stream (it would run on the
    default stream, ordered with nothing)."""
    be, _fake = BACKENDS[name](monkeypatch)
    host = be.host_buffer(64, torch.float32, pinned=True)
    with pytest.raises(RuntimeError, match="shapes"):
        _copy_on_a_stream(be, host, be.empty(1, torch.float32))
    if be.streams_async:
        with pytest.raises(RuntimeError, match="outside an op on a stream"):
            be.copy_async(host, be.empty(64, torch.float32))


@pytest.mark.parametrize("name", ["cpu-adversarial", "cuda (faked allocator)"])
def test_a_host_synchronization_inside_a_stream_op_is_refused(monkeypatch, name):
    """The emulation's HiddenSyncError check is the CUDA backend's too (one shared check)."""
    be, _fake = BACKENDS[name](monkeypatch)
    stream = be.new_stream("gpu")
    box: list[BaseException] = []

    def op():
        try:
            be.synchronize()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    be.launch(stream, op, "sync")
    if name == "cpu-adversarial":
        be.synchronize()
        be.close_streams(list(be.streams))
    assert box and isinstance(box[0], HiddenSyncError), box
