"""The executor's units: the op dispatch table covers exactly the op kinds the planner emits, and an entry
that a plan offloads to the SSD goes through the states of binding.EntryState in order (real executor on a
CPU)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from support.dist_worker import make_plan as dist_plan
from support.lora_dist_worker import make_plan as lora_dist_plan
from support.runs import PLACEMENTS, make_plan, run

from tierflow.executor.binding import ENTERED_FROM, Entry, EntryState
from tierflow.executor.engine import Executor
from tierflow.executor.ops.table import Ops
from tierflow.planner.core.opkinds import OP_KINDS as KINDS


def planner_kinds() -> set[str]:
    """Every op kind the planner emits over the schedule families x placements x alpha x recompute/swap, and
    with two ranks (full fine-tuning and LoRA)."""
    kinds = set()
    for family in ("horizontal", "fuyou", "vertical", "block"):
        for placement in PLACEMENTS:
            for alpha in (0.0, 0.25):
                for swap in (None, 4):
                    plan = make_plan("tiny-gpt", family, placement, alpha, iterations=1, swap_layers=swap)
                    kinds |= {t.kind for t in plan.graph.tasks}
    # several ranks add the collectives (tests/executor/test_dist_executor.py runs them)
    for family in ("horizontal", "block"):
        kinds |= {t.kind for t in dist_plan("tiny-gpt", family, "weights_cpu", gpus=2).graph.tasks}
    # and LoRA on several ranks its adapters' all-reduce (tests/executor/test_lora_dist.py)
    kinds |= {t.kind for t in lora_dist_plan("fuyou", [0.0, 1.0, 0.0], 2).graph.tasks}
    return kinds


def test_dispatch_table_covers_exactly_the_planner_kinds(tmp_path, monkeypatch):
    assert planner_kinds() == KINDS
    built = []
    real_init = Ops.__init__

    def spy(self, cx):
        real_init(self, cx)
        built.append(self)

    monkeypatch.setattr(Ops, "__init__", spy)
    run(make_plan("tiny-gpt", "vertical", "mix", 0.25, iterations=1), tmp_path, steps=1)
    (ops,) = built
    assert set(ops.handlers) == KINDS
    assert all(callable(h) for h in ops.handlers.values())


def test_an_unknown_kind_is_refused_before_training():
    plan = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    plan.graph.tasks[5].kind = "teleport_weights"
    with pytest.raises(ValueError, match="'teleport_weights' is not implemented"):
        Executor(plan, None, None, torch.device("cpu"), None, None)


def test_entry_states_of_an_offload_fetch_round_trip(tmp_path, monkeypatch):
    plan = make_plan("tiny-gpt", "vertical", "ckpt_ssd", iterations=1)
    kinds = {t.kind for t in plan.graph.tasks}
    assert {"offload_checkpoint", "write_checkpoint", "read_checkpoint", "fetch_checkpoint"} <= kinds
    paths: dict[int, list[EntryState]] = defaultdict(list)
    entries: list[Entry] = []  # kept alive, so that ids are not reused
    real_move = Entry.move

    def move(self: Entry, new: EntryState) -> None:
        if id(self) not in paths:
            entries.append(self)
            paths[id(self)].append(self.state)
        real_move(self, new)
        paths[id(self)].append(new)

    monkeypatch.setattr(Entry, "move", move)
    run(plan, tmp_path, steps=1)
    assert paths
    trip = [EntryState.ON_DEVICE, EntryState.OFFLOADED, EntryState.ON_SSD, EntryState.READ_BACK,
            EntryState.FETCHED, EntryState.RELEASED]
    assert trip in paths.values()
    for path in paths.values():
        assert path[0] is EntryState.ON_DEVICE and path[-1] is EntryState.RELEASED
        assert all(a in ENTERED_FROM[b] for a, b in zip(path, path[1:]))
    # the entries moved to the SSD are back on the device (fetched) before their consumer releases them
    for path in paths.values():
        if EntryState.ON_SSD in path:
            assert path[-2] is EntryState.FETCHED


def test_an_illegal_entry_transition_is_caught():
    e = Entry(shape=(4,), dtype=None, users=1, dev_users=1)
    with pytest.raises(AssertionError, match="ON_DEVICE -> ON_SSD"):
        e.move(EntryState.ON_SSD)


@pytest.mark.parametrize("placement,dtype,aliased", [("device", torch.float32, True),
                                                      ("device", torch.bfloat16, False),
                                                      ("weights_cpu", torch.float32, False)])
def test_compute_weights_alias_the_master_only_when_both_are_fp32_on_the_device(placement, dtype, aliased):
    """One tensor for the compute weights and the fp32 master where the optimizer's copy from one to the other
    would be an exact copy (fp32 on the device); a separate copy otherwise. The run's numerics with the alias
    are checked against plain PyTorch by test_executor's equivalence tests (placement "device")."""
    from tierflow.executor.tiers.state import TrainState
    from tierflow.planner.core.models import get_model

    st = TrainState(get_model("tiny-gpt"), PLACEMENTS[placement], 0.0, torch.device("cpu"), dtype, None)
    st.init_random(0)
    for b in range(len(st.layout.numel)):
        W, M = st.vec["weights"][b], st.vec["master"][b]
        assert (W.dev is not None and W.dev is M.dev) == aliased
        assert torch.equal(st.full("weights", b).float(), st.full("master", b).to(dtype).float())


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_a_block_called_with_its_leaves_directly_equals_functional_call(model):
    """ops/compute.call_with (the leaves put into the template's parameter dicts, found once) computes what
    torch.func.functional_call does, bit for bit, forward and backward, and puts the template's own parameters
    back afterwards."""
    from torch.func import functional_call

    from tierflow.executor.ops.params import call_with, param_sites
    from tierflow.executor.tiers.state import BlockLayout
    from tierflow.planner.core.models import get_model

    layout = BlockLayout(get_model(model))
    b = 1
    module, slots = layout.templates[b], layout.slots[b]
    sites = param_sites(module, [s.name for s in slots])
    assert sites is not None
    before = dict(module.named_parameters())
    torch.manual_seed(0)
    vec = torch.randn(sum(s.numel for s in slots)) * 0.05
    x = torch.randn(2, 8, layout.spec.hidden)
    outs, grads = [], []
    for direct in (True, False):
        leaves = [vec[s.offset: s.offset + s.numel].view(s.shape).clone().requires_grad_() for s in slots]
        if direct:
            y = call_with(module, sites, leaves, x, {})
        else:
            y = functional_call(module, {s.name: leaf for s, leaf in zip(slots, leaves)}, (x,))
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append([leaf.grad for leaf in leaves])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(g0, g1) for g0, g1 in zip(*grads))
    after = dict(module.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    shared = torch.nn.Linear(2, 2)
    tied = torch.nn.ModuleDict({"a": shared, "b": shared})
    assert param_sites(tied, ["a.weight", "a.bias"]) is None  # tied inside: left to functional_call


@pytest.mark.parametrize("placement", ["on_device", "checkpoints_host"])
@pytest.mark.parametrize("backend", ["cpu", "cpu-adversarial"])
def test_persistent_parameters_train_as_leaves_made_per_call(placement, backend):
    """ops/params.BlockParams: resident weights' leaves made once (and a pack no op moves left to autograd)
    train bit for bit as a leaf made per parameter per call with every kept layer's saved tensors through the
    pack's hooks (the compute ops' way before), over two rounds (the leaves outlive a round and the
    optimizer's in-place steps), on the plain CPU backend and the emulation of CUDA."""
    from tierflow.executor.calibration.dispatch import ITERATIONS, tiny_plan
    from tierflow.executor.calibration.dispatch import _executor as make_executor
    from tierflow.executor.device.base import PlainCpuBackend
    from tierflow.executor.device.emulated import AdversarialCpuBackend

    plan = tiny_plan("cpu", placement)
    runs = []
    for persistent in (True, False):
        be = PlainCpuBackend() if backend == "cpu" else AdversarialCpuBackend(max_delay_s=0.0)
        ex = make_executor(plan, be, None)
        if not persistent:
            for p in ex.ops.compute.params:
                p.leaves = p._over
        losses = [x for r in range(2) for x in ex.run_round(ITERATIONS, r * ITERATIONS).losses]
        runs.append((losses, [v.dev.clone() for v in ex.state.vec["master"]]))
        kept = [p for p in ex.ops.compute.params if p.resident_leaves is not None]
        assert bool(kept) == persistent  # the path under test was taken
    (l0, m0), (l1, m1) = runs
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(m0, m1))
