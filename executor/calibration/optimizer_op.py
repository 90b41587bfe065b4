"""The executor's own host optimizer op (`OptimizerOps.adam`, executor/ops/optimizer.py) on one block of flat
fp32 parameters, with the least state around it that the op reads: what `tierflow calibrate` times as the
CPU AdamW rate (cpu.measure_cpu_adam) and experiments/bench_optimizer.py sets against torch's fused AdamW.

The block's master weights and Adam moments live in host memory, its fp32 gradient accumulator too, and its
compute weights in host memory in the compute dtype (pinned where the backend pins, as a run keeps them), so
one op does all that a run's `adam` op does: the squares of the gradients for the step's norm (steps.csv),
the fused AdamW update, the zeroing of the gradient range and the compute copy of the updated weights.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from tierflow.executor.calibration.common import import_torch


class _FlatLayout:
    """A block layout of one decayed parameter of `n` elements (hashable by identity, as decay.py caches
    per layout)."""

    def __init__(self, n: int) -> None:
        from tierflow.executor.tiers.state import Slot

        self.slots = [[Slot("weight", (n,), 0, n)]]


class HostAdamOp:
    """The `adam` op of a block of `n` fp32 parameters, run by `step()` as the executor runs it (step k+1
    after k calls); `master`, `grads`, `m`, `v` and `weights` are the tensors it updates."""

    def __init__(self, n: int, compute_dtype=None, backend=None, seed: int = 0) -> None:
        torch = import_torch()
        from tierflow.executor.device.factory import as_backend
        from tierflow.executor.ops.context import OpContext
        from tierflow.executor.ops.optimizer import OptimizerOps
        from tierflow.executor.optim.adamw import TrainHyper
        from tierflow.executor.optim.clipping import GradNorms
        from tierflow.executor.tiers.state import TierVector
        from tierflow.planner.core.graph import Task
        from tierflow.planner.core.opkinds import ADAM
        from tierflow.planner.core.placement import Split

        be = backend if backend is not None else as_backend(torch.device("cpu"))
        dtype = compute_dtype if compute_dtype is not None else torch.bfloat16
        gen = torch.Generator().manual_seed(seed)
        parts = [(0, n)]
        vec = {}
        for cls in ("master", "adam_m", "adam_v"):
            v = TierVector(cls, 0, n, Split(), torch.float32, be, parts, False)
            v.host = be.host_buffer(n, torch.float32, pinned=False)
            vec[cls] = [v]
        vec["master"][0].host.copy_(torch.randn(n, generator=gen))
        vec["adam_m"][0].host.copy_(torch.randn(n, generator=gen)).mul_(1e-3)
        vec["adam_v"][0].host.copy_(torch.rand(n, generator=gen)).mul_(1e-6)
        W = TierVector("weights", 0, n, Split(), dtype, be, parts, True)
        W.host = be.host_buffer(n, dtype, pinned=True)
        W.host.copy_(vec["master"][0].host)
        vec["weights"] = [W]
        grads = be.host_buffer(n, torch.float32, pinned=False)
        self.state = SimpleNamespace(vec=vec, grads=[grads], parts=[parts], shards=[(0, n)],
                                     layout=_FlatLayout(n), placement=SimpleNamespace(gpu_optimizer=False),
                                     shard_numel=[n], grad_split=[(0, n, 0)],
                                     spec=SimpleNamespace(optimizer_states=None))  # fp32 states
        binding = SimpleNamespace(dep_of_kind={0: {}}, part_of={}, plan=None)
        hyper = TrainHyper()  # as `tierflow run` makes it: no clipping, the step's gradient norm for the log
        self.norms = GradNorms(hyper.clip_grad_norm, hyper.clip, parts_per_step=1)
        self.cx = OpContext(binding, self.state, be.device, hyper, None, be, None, norms=self.norms)
        self.ops = OptimizerOps(self.cx, None)
        self.task = Task(0, ADAM, "cpu", 0.0, "opt_states", 0, -1, 0, [], 0.0)
        self.n, self.steps, self.round = n, 0, None
        self.master, self.grads = vec["master"][0].host, grads
        self.m, self.v, self.weights = vec["adam_m"][0].host, vec["adam_v"][0].host, W.host
        self.hyper = self.cx.hyper
        self.fill_grads(seed + 1)

    def fill_grads(self, seed: int = 1) -> None:
        """Gradients as an accumulation would leave them (the op zeroes them)."""
        torch = import_torch()
        self.grads.copy_(torch.randn(self.n, generator=torch.Generator().manual_seed(seed))).mul_(1e-2)

    def step(self) -> None:
        """One `adam` op of the next step (in a round of its own, as a run's rounds hold many ops: the round's
        state is made once)."""
        if self.round is None:
            from tierflow.executor.ops.context import RoundState

            self.round = RoundState(num_ops=1, step0=0, batches=[], weight_users=Counter())
        self.round.step0 = self.steps
        self.ops.adam(self.round, self.task)
        self.steps += 1
