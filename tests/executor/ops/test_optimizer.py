"""The host adam op (executor/ops/optimizer.py `OptimizerOps.adam`) reuses what its part's ranges fix
(`HostPart`: the range, the decay groups, the vectors' whole host tensors, the kernel's cuts) from step to
step: made again where a block was set anew (TrainState.set_shard allocates new host tensors), so that no
step updates a tensor the state no longer holds."""

from __future__ import annotations

import torch

from tierflow.executor.calibration.optimizer_op import HostAdamOp
from tierflow.executor.optim.host_adamw import MIN_KERNEL_ELEMENTS


def test_the_part_is_reused_and_made_again_for_new_host_tensors():
    op = HostAdamOp(MIN_KERNEL_ELEMENTS + 5)  # the one-pass kernel's path where it builds
    op.step()
    part = op.ops.parts[(0, 0)]
    op.step()
    assert op.ops.parts[(0, 0)] is part  # reused
    vec = op.state.vec
    old = {c: vec[c][0].host for c in ("master", "adam_m", "adam_v", "weights")}
    kept = {c: t.clone() for c, t in old.items()}
    for c in old:  # as set_shard: the same values in new tensors
        vec[c][0].host = kept[c].clone()
    op.step()
    assert op.ops.parts[(0, 0)] is not part
    for c in old:
        assert torch.equal(old[c], kept[c]), c  # the tensors no longer held: untouched
        assert not torch.equal(vec[c][0].host, kept[c]), c  # the new ones: stepped
