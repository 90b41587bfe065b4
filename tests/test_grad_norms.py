"""The step's gradient norm (executor/optim/clipping.py GradNorms): every optimizer op adds its squares,
except with global clipping, whose norm is known before the step's first optimizer op: the ops then only
count themselves and read no gradient for it."""

import torch

from tierflow.executor.optim import clipping
from tierflow.executor.optim.clipping import GradNorms


def test_the_norm_is_the_sum_of_every_parts_squares():
    n = GradNorms(parts_per_step=2)
    a, b = torch.randn(100), torch.randn(50)
    n.observe(1, [a])
    assert n.value(1) is None
    n.observe(1, [b])
    assert abs(n.value(1) - float(torch.cat([a, b]).norm())) < 1e-5


def test_with_global_clipping_the_ops_read_no_gradient_for_the_norm(monkeypatch):
    n = GradNorms(max_norm=1.0, mode="global", parts_per_step=2)
    n.set_global(3, torch.tensor(2.5))
    calls = []
    real = clipping.sum_of_squares
    monkeypatch.setattr(clipping, "sum_of_squares", lambda g: calls.append(1) or real(g))
    n.observe(3, [torch.randn(10)])
    n.observe(3, [torch.randn(10)])
    assert not calls and n.value(3) == 2.5 and 3 not in n.seen and 3 not in n.sumsq
    n.observe(4, [torch.ones(4)])  # a step without a global norm yet: squares as before
    assert calls and 4 in n.sumsq
