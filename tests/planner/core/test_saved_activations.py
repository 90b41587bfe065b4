"""The planner's activation bytes of a layer that keeps its activations (BlockCost.full_activation_bytes)
equal what the executor's layers really save for their backward, in bf16, and the layers that save less than
plain autograd would (RMSNorm, rotary positions, SwiGLU) compute bit-identical gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierflow.executor.models import RMSNorm, apply_rope, build_blocks, glu, rope_cos_sin
from tierflow.executor.tiers.packs import Pack
from tierflow.planner.core.models import get_model
from tierflow.planner.core.workload import layer_cost

MICRO, SEQ = 2, 64
# The planner counts LayerNorm's mean and rstd in fp32 (a CUDA kernel's); PyTorch's CPU kernel keeps them in
# the input's dtype, so on CPU a GPT layer saves 1,024 bytes (0.2%) less than the plan. Nothing else may
# differ.
TOLERANCE = 0.01


def _layer(name: str):
    torch.manual_seed(0)
    spec = get_model(name)
    blk = build_blocks(spec)[1].to(torch.bfloat16)
    x = torch.randn(MICRO, SEQ, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
    return spec, blk, x


def _distinct_saved_bytes(blk: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blk(x)
    return sum(saved.values())


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_saved_bytes_equal_the_planners_activation_bytes(name):
    spec, blk, x = _layer(name)
    plan_bytes = layer_cost(spec, MICRO, SEQ).full_activation_bytes
    storages = _distinct_saved_bytes(blk, x)
    # what the executor's pack of a swapped layer captures and moves (each saved tensor once, no padding)
    pack = Pack(list(blk.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook):
        out = blk(x)
    packed = pack.saved_bytes()
    assert abs(storages - plan_bytes) <= TOLERANCE * plan_bytes, (name, storages, plan_bytes)
    assert abs(packed - plan_bytes) <= TOLERANCE * plan_bytes, (name, packed, plan_bytes)
    out.sum().backward()  # the pack restores what the backward needs
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def _rms_autograd(x, w, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def _rope_autograd(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _grads(fn, *inputs):
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_that_save_less_compute_bit_identical_gradients(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=dtype)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    norm = RMSNorm(64).to(dtype)
    out, (gx, gw) = _grads(lambda a, b: torch.func.functional_call(norm, {"weight": b}, (a,)), x, w)
    ref, (rx, rw) = _grads(lambda a, b: _rms_autograd(a, b, norm.eps), x, w)
    assert torch.equal(out, ref) and torch.equal(gx, rx) and torch.equal(gw, rw)

    q = torch.randn(2, 4, 16, 32, dtype=dtype)
    cos, sin = rope_cos_sin(16, 32, 10000.0, "cpu", dtype)
    out, (gq,) = _grads(lambda a: apply_rope(a, cos, sin), q)
    ref, (rq,) = _grads(lambda a: _rope_autograd(a, cos, sin), q)
    assert torch.equal(out, ref) and torch.equal(gq, rq)

    gate, up = torch.randn(2, 16, 96, dtype=dtype), torch.randn(2, 16, 96, dtype=dtype)
    for geglu, act in ((False, F.silu), (True, lambda a: F.gelu(a, approximate="tanh"))):
        out, (gg, gu) = _grads(lambda a, b, geglu=geglu: glu(a, b, geglu), gate, up)
        ref, (rg, ru) = _grads(lambda a, b, act=act: act(a) * b, gate, up)
        assert torch.equal(out, ref) and torch.equal(gg, rg) and torch.equal(gu, ru)
