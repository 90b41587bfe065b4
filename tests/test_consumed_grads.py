"""The host gradient accumulators' consumed ranges (executor/tiers/consumed.py): an accumulator whose stepped
ranges are marked consumed instead of zeroed reads as one zeroed at once, through any sequence of adds,
consumes and reads; the adam op leaves its range consumed and the next add writes it."""

import random

import torch

from tierflow.executor.tiers.consumed import ConsumedGrads


def test_consumed_ranges_read_as_zeroed_ones():
    rnd = random.Random(0)
    n = 200
    ref = torch.zeros(n)  # zeroed at once
    acc = torch.full((n,), 7.0)  # stale values everywhere at first
    c = ConsumedGrads()
    c.consume(0, 0, n)
    for _ in range(400):
        a = rnd.randrange(n)
        z = rnd.randrange(a, n + 1)
        kind = rnd.choice(["add", "add", "consume", "read"])
        if kind == "add":
            g = torch.randn(z - a).to(torch.bfloat16)
            ref[a:z] += g.float()
            c.add(acc, 0, a, g)
        elif kind == "consume":
            ref[a:z] = 0
            c.consume(0, a, z)
        else:
            c.settle(acc, 0, a, z)
            assert torch.equal(acc[a:z], ref[a:z])
        spans = c.ranges.get(0, [])
        assert spans == sorted(spans) and all(x < y for x, y in spans)
        assert all(y1 < x2 for (_x1, y1), (x2, _y2) in zip(spans, spans[1:]))  # disjoint, merged
    c.settle(acc, 0, 0, n)
    assert torch.equal(acc, ref)


def test_the_adam_op_consumes_its_gradients_and_the_next_add_writes_them():
    from tierflow.executor.calibration.optimizer_op import HostAdamOp

    op = HostAdamOp(3000)
    op.step()
    assert op.grads.any()  # not zeroed ...
    g = torch.randn(1000).to(torch.bfloat16)
    op.state.grads_consumed.add(op.grads, 0, 1000, g)  # ... but the next add writes
    op.state.grads_consumed.settle(op.grads, 0, 0, 3000)
    assert torch.equal(op.grads[1000:2000], g.float())
    assert not op.grads[:1000].any() and not op.grads[2000:].any()
