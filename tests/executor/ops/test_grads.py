"""The host gradient accumulators without a zeroing pass (executor/ops/grads.py): the step's first write of
an accumulator overwrites it, later ones add, a first write that covers part of it zeroes the rest; the plan
says which write is first, once per iteration and owner; and a run whose accumulators start as NaN (stale
values that any read before the step's first write would carry into the update) trains exactly as plain
PyTorch does, with micro-batches, a tied head, the SSD range of the gradients, a deferred optimizer part and
the streams' asynchronous adds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.runs import make_plan, reference, rel_err, run

from tierflow.executor.binding import Binding
from tierflow.executor.ops.grads import accumulate, host_grad_writes
from tierflow.executor.optim import fused_host_adamw, host_adamw
from tierflow.executor.tiers.state import BlockLayout, TrainState
from tierflow.planner.core.opkinds import ADAM, OFFLOAD_GRADS


def test_first_write_overwrites_later_ones_add():
    acc = torch.full((8,), float("nan"))
    g = torch.arange(8, dtype=torch.bfloat16)
    accumulate(acc, 0, g, first=True)
    assert torch.equal(acc, g.float())
    accumulate(acc, 2, torch.ones(3), first=False)
    assert torch.equal(acc, torch.tensor([0, 1, 3, 4, 5, 5, 6, 7], dtype=torch.float32))


def test_a_first_write_of_part_of_the_accumulator_zeroes_the_rest():
    acc = torch.full((8,), float("nan"))
    accumulate(acc, 3, torch.full((2,), 2.0, dtype=torch.bfloat16), first=True)
    assert torch.equal(acc, torch.tensor([0, 0, 0, 2, 2, 0, 0, 0], dtype=torch.float32))


def test_the_plan_names_one_first_write_per_iteration_and_owner():
    """tiny-gpt (tied head: its offload takes block 0's wte range too), 4 micro-batches, 2 iterations: each
    owner's first write is the earliest offload_grads taking it in the d2h queue, one per iteration."""
    plan = make_plan("tiny-gpt", "horizontal", "mix", 0.25)
    binding = Binding(plan, BlockLayout(plan.model))
    writes = host_grad_writes(binding)
    tasks = plan.graph.tasks
    queue = plan.graph.resource_order()["d2h"]
    takers = {(op, o) for op, o in binding.grad_range if tasks[op].kind == OFFLOAD_GRADS}
    per = Counter((tasks[op].iteration, o) for op, o in writes.first)
    owners = {(tasks[op].iteration, o) for op, o in takers}
    assert set(per) == owners and set(per.values()) == {1}
    for op, o in writes.first:
        earlier = [x for x in queue[: queue.index(op)] if (x, o) in takers
                   and tasks[x].iteration == tasks[op].iteration]
        assert not earlier
    # the head's offload writes block 0's wte range before block 0's own offload does
    head = plan.model.num_layers + 1
    assert any(tasks[op].block == head and o == 0 for op, o in writes.first)
    assert not writes.unwritten
    assert {(t.iteration, t.block) for t in tasks if t.kind == ADAM} <= owners


@pytest.mark.parametrize("model_name, family, placement, alpha, device, kernel", [
    ("tiny-gpt", "horizontal", "mix", 0.25, "cpu", False),
    ("tiny-llama", "vertical", "weights_cpu", 0.0, "cpu-adversarial", False),
    ("tiny-gpt", "fuyou", "states_ssd", 0.0, "cpu-adversarial", False),
    ("tiny-gpt", "horizontal", "mix", 0.25, "cpu", True),  # the one-pass kernel's adam op
])
def test_stale_accumulators_are_never_read(model_name, family, placement, alpha, device, kernel, tmp_path,
                                           monkeypatch):
    if kernel:
        if not fused_host_adamw.available():
            pytest.skip(f"the one-pass kernel: {fused_host_adamw.status(0)}")
        monkeypatch.setattr(host_adamw, "MIN_KERNEL_ELEMENTS", 0)  # tiny-gpt's blocks are smaller

    def nan_grads(self, b):
        self.grads[b] = None if self.placement.gpu_optimizer else torch.full((self.shard_numel[b],),
                                                                             float("nan"))
    monkeypatch.setattr(TrainState, "reset_grads", nan_grads)
    plan = make_plan(model_name, family, placement, alpha)
    res = run(plan, tmp_path, steps=3, device=device)
    ref_losses, ref_weights = reference(model_name, steps=3)
    assert max(abs(a - b) / b for a, b in zip(res.losses, ref_losses)) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(res.final_master, ref_weights)) <= 1e-5
