"""The head's memory as the planner counts it (workload.head_cost, loss_working_bytes) against what the
executor's head really allocates (executor.models.Head with targets: the chunked cross-entropy), measured
as the peak of live tensor bytes while its forward and backward run; and the chunked loss equals the plain
one."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tierflow.executor import models as exec_models
from tierflow.planner.core import workload
from tierflow.planner.core.models import get_model

MICRO, SEQ, VOCAB = 2, 128, 4096
CHUNK_LOGIT_BYTES = 256 * 1024  # 16 tokens of fp32 logits a chunk: 16 chunks per micro-batch


class PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages that ops create while the mode is on (and are still alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage pointer -> bytes
        self.refs: dict[int, int] = {}  # storage pointer -> tensors created here still alive
        self.seen: set[int] = set()
        self.now = self.peak = 0

    def _gone(self, ptr: int, tid: int) -> None:
        self.seen.discard(tid)
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.now -= self.live.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in self.seen:
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.live:
                if any(st.data_ptr() == a.untyped_storage().data_ptr()
                       for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)):
                    continue  # a view or in-place result of an input: no new memory
                self.live[ptr] = st.nbytes()
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[ptr] = self.refs.get(ptr, 0) + 1
            self.seen.add(id(t))
            weakref.finalize(t, self._gone, ptr, id(t))
        return out


def _head(spec, dtype):
    torch.manual_seed(0)
    head = exec_models.Head(spec, dtype=dtype)
    tied = (torch.randn(spec.vocab_size, spec.hidden, dtype=dtype, requires_grad=True)
            if spec.tied_embeddings else None)
    x = torch.randn(MICRO, SEQ, spec.hidden, dtype=dtype, requires_grad=True)
    y = torch.randint(0, spec.vocab_size, (MICRO, SEQ))
    y[0, :7] = -100
    return head, tied, x, y


def _peak(fn) -> int:
    with PeakLiveBytes() as mode:
        fn().backward()
    return mode.peak


@pytest.mark.parametrize("name,precision", [("tiny-gpt", "fp32"), ("tiny-llama", "bf16")])
def test_head_peak_is_what_the_planner_counts(name, precision, monkeypatch):
    monkeypatch.setattr(workload, "LOSS_CHUNK_LOGIT_BYTES", CHUNK_LOGIT_BYTES)
    spec = replace(get_model(name), vocab_size=VOCAB).with_precision(precision)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    head, tied, x, y = _head(spec, dtype)
    plan = workload.head_cost(spec, MICRO, SEQ).bwd_working_bytes
    chunked = _peak(lambda: head(x, tied_weight=tied, targets=y))
    full_logits = _peak(lambda: exec_models.loss(head(x, tied_weight=tied), y))
    # the plan holds what the executor's head keeps at its peak, with little to spare; the whole fp32 logits
    # (the loss before chunking) would not fit in it
    assert 0.9 * plan <= chunked <= plan, (chunked, plan)
    assert full_logits > plan + 4 * MICRO * SEQ * VOCAB - CHUNK_LOGIT_BYTES, (full_logits, plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_the_plain_loss(dtype, monkeypatch):
    monkeypatch.setattr(workload, "LOSS_CHUNK_LOGIT_BYTES", CHUNK_LOGIT_BYTES)
    spec = replace(get_model("tiny-llama"), vocab_size=VOCAB)
    _head_module, _, x, y = _head(spec, dtype)
    w = torch.randn(VOCAB, spec.hidden, dtype=dtype) * 0.05
    w.requires_grad_()
    results = []
    for fn in (lambda: exec_models.chunked_lm_loss(x, w, y), lambda: exec_models.loss(F.linear(x, w), y)):
        x.grad = w.grad = None
        loss = fn()
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), w.grad.clone()))
    (l1, gx1, gw1), (l2, gx2, gw2) = results
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(l1, l2, rtol=tol, atol=tol)
    torch.testing.assert_close(gx1, gx2, rtol=tol, atol=tol * gx2.abs().max().item())
    torch.testing.assert_close(gw1, gw2, rtol=tol, atol=tol * gw2.abs().max().item())


class GemmCount(TorchDispatchMode):
    """The matrix products (mm, addmm, bmm and their in-place / out forms) that run while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunked", [True, False])
def test_a_frozen_head_computes_no_weight_gradient(chunked, monkeypatch):
    """LoRA's head is frozen: its loss computes the input's gradient only (per chunk two GEMMs, the logits
    and the input gradient, against three), the same gradient bit for bit as with a trainable weight."""
    if chunked:
        monkeypatch.setattr(workload, "LOSS_CHUNK_LOGIT_BYTES", CHUNK_LOGIT_BYTES)
    spec = replace(get_model("tiny-llama"), vocab_size=VOCAB)
    _head_module, _, x, y = _head(spec, torch.float32)
    w = torch.randn(VOCAB, spec.hidden) * 0.05
    got = {}
    for trainable in (True, False):
        w.requires_grad_(trainable)
        x.grad = w.grad = None
        with GemmCount() as gemms:
            exec_models.chunked_lm_loss(x, w, y).backward()
        got[trainable] = (len(gemms.ops), x.grad.clone(), w.grad)
    chunks = got[False][0] // 2
    assert chunks == (16 if chunked else 1) and got[True][0] == 3 * chunks
    assert torch.equal(got[True][1], got[False][1]) and got[False][2] is None
