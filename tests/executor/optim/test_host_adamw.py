"""The host optimizer op's AdamW by torch's kernels (executor/optim/host_adamw.py without the one-pass kernel,
TIERFLOW_PURE_ADAMW=1: torch's fused kernel called directly, the cast straight into the destinations) against
what the op computed before: torch.optim.adamw's functional fused path over the decay groups, the gradient
range zeroed after, the updated master cast to the compute dtype in a new tensor - bit for bit, on 1 and 2
threads, whether or not the host/SSD boundary cuts the states. The one-pass kernel:
test_fused_host_adamw.py."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adamw import adamw as functional_adamw

from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.optim.host_adamw import host_adamw

# adjacent decay groups of odd lengths (biases and norms between matrices), none a multiple of a vector
GROUPS = [(0, 1001, True), (1001, 1038, False), (1038, 5021, True), (5021, 5024, False), (5024, 9000, True)]
N = GROUPS[-1][1]


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("TIERFLOW_PURE_ADAMW", "1")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(N, generator=g), "adam_m": torch.randn(N, generator=g) * 1e-3,
            "adam_v": torch.rand(N, generator=g) * 1e-6, "grads": torch.randn(N, generator=g) * 1e-2}


def _reference(s: dict[str, torch.Tensor], h: TrainHyper, step: int, coef: float | None,
               dtype: torch.dtype) -> torch.Tensor:
    """The update as the op made it before: whole groups, one fused call per decay flag."""
    if coef is not None:
        torch._foreach_mul_([s["grads"][a:z] for a, z, _d in GROUPS], coef)
    for on in (True, False):
        pick = [[s[k][a:z] for a, z, d in GROUPS if d == on] for k in ("master", "grads", "adam_m", "adam_v")]
        steps = [torch.full((), float(step - 1)) for _ in pick[0]]
        functional_adamw(*pick, [], steps, foreach=False, fused=True, amsgrad=False, beta1=h.beta1,
                         beta2=h.beta2, lr=h.lr_at(step), weight_decay=h.weight_decay if on else 0.0,
                         eps=h.eps, maximize=False)
    s["grads"].zero_()
    return s["master"].to(dtype)


def _stretches(t: torch.Tensor, cut: int | None) -> list[tuple[int, int, torch.Tensor]]:
    """`t` as the op sees it: one host stretch, or a host and an SSD stretch (separate tensors) cut at
    element `cut`."""
    if cut is None:
        return [(0, N, t)]
    return [(0, cut, t[:cut]), (cut, N, t[cut:].clone())]


@pytest.mark.parametrize("threads,cut", [(1, None), (2, 3333), (1, 1037), (2, 5022)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_update_is_bit_identical_to_the_functional_fused_path(threads, cut, dtype):
    h = TrainHyper(lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=2, total_steps=10)
    ref, got = _state(0), _state(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step, coef in ((1, None), (2, 0.5), (7, torch.tensor(0.25))):
            want = _reference(ref, h, step, coef, dtype)
            st = {k: _stretches(got[k], cut) for k in ("master", "adam_m", "adam_v")}
            host = torch.empty(N - 100, dtype=dtype)  # two destinations: a host range, a wire buffer
            wire = torch.empty(100, dtype=dtype)
            host_adamw(h, step, GROUPS, st, got["grads"], [(0, 100, wire), (100, N, host)], coef)
            for k in ("master", "adam_m", "adam_v"):
                whole = torch.cat([t for _a, _z, t in st[k]])
                assert torch.equal(whole, ref[k]), (k, step)
                got[k] = whole
            assert torch.equal(got["grads"], torch.zeros(N))
            assert torch.equal(torch.cat([wire, host]), want)
    finally:
        torch.set_num_threads(before)
