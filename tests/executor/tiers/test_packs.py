"""A moved pack's round trip: its saved storages copied out through segments() into a flat byte buffer (at an
offset of a larger one, as a transfer-area slice is) and rebuilt by restore() give the backward plain autograd
computes, bit for bit, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tierflow.executor.models import build_blocks
from tierflow.executor.tiers.packs import PACK_ALIGN, Pack, PackLayout
from tierflow.planner.core.models import get_model


@pytest.mark.parametrize("model_name, dtype", [("tiny-gpt", torch.float32), ("tiny-llama", torch.bfloat16)])
def test_a_pack_moved_through_a_flat_buffer_restores_the_same_backward(model_name, dtype):
    torch.manual_seed(0)
    layer = build_blocks(get_model(model_name))[1].to(dtype)
    x = torch.randn(2, 16, get_model(model_name).hidden, dtype=dtype)
    g = torch.randn_like(x)
    xa = x.clone().requires_grad_()
    layer(xa).backward(g)
    want = [xa.grad, *(p.grad.clone() for p in layer.parameters())]
    layer.zero_grad()

    pack = Pack(list(layer.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook):
        pack.out = layer(pack.input(x.clone()))
    pack.release_output()
    segs, n = pack.segments()
    assert n % PACK_ALIGN == 0 and len(segs) == len(pack.desc) > 1
    area = torch.zeros(3 * PACK_ALIGN + n, dtype=torch.uint8)
    flat = area[2 * PACK_ALIGN: 2 * PACK_ALIGN + n]  # not at element 0 of its storage
    for off, seg in segs:
        flat[off: off + seg.numel()].copy_(seg)
    pack.saved = None  # the device copies are gone: only the flat bytes remain
    pack.restore(flat)
    grads, dx = pack.grads(g)
    got = [dx, *grads]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


def _round_trip(layer, x, g, layouts=None, key=None):
    """A pack of layer(x) moved through a flat buffer (at an offset of a larger one) and its backward:
    (the pack, [dx, *weight gradients]); the pack's bytes (saved_bytes) are those its segments move."""
    pack = Pack(list(layer.parameters()), layouts=layouts, key=key)
    with torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook):
        pack.out = layer(pack.input(x.clone()))
    pack.release_output()
    segs, n = pack.segments()
    assert pack.saved_bytes() == sum(seg.numel() for _off, seg in segs)
    flat = torch.zeros(PACK_ALIGN + n, dtype=torch.uint8)[PACK_ALIGN:]
    for off, seg in segs:
        flat[off: off + seg.numel()].copy_(seg)
    pack.saved = None
    pack.restore(flat)
    grads, dx = pack.grads(g)
    return pack, [dx, *grads]


def test_a_forward_sealed_by_an_earlier_layout_restores_the_same_backward():
    """Pack.seal with the executor's layouts: the second forward of a layer on an input of the same geometry
    takes the first one's layout (PackLayout.apply: no pass over its saved tensors), and its moved pack gives
    the backward the first way gives, bit for bit, on new values; a layout that does not match (another
    layer's weights under the same key) is not taken and the pack is sealed from scratch."""
    torch.manual_seed(0)
    blocks = build_blocks(get_model("tiny-llama"))
    layer, other = blocks[1], blocks[2]
    hidden = get_model("tiny-llama").hidden
    layouts: dict = {}
    first, _ = _round_trip(layer, torch.randn(2, 16, hidden), torch.randn(2, 16, hidden), layouts, "k")
    assert isinstance(layouts["k"], PackLayout) and first.layout is layouts["k"]
    for mod in (layer, other):
        x, g = torch.randn(2, 16, hidden), torch.randn(2, 16, hidden)
        plain, want = _round_trip(mod, x, g)
        pack, got = _round_trip(mod, x, g, layouts, "k")
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
        if mod is layer:  # sealed by the layout: its weight views are the layout's, made once
            assert pack.layout is first.layout and pack.desc is first.layout.desc
            assert pack.ranged  # its storages' ranges to move taken at the seal (the layout's flat layout)
            assert any(isinstance(r, torch.Tensor) for r in first.layout.refs)
        else:  # another layer's weights: its own seal, which becomes the key's layout
            assert pack.layout is not first.layout and layouts["k"] is pack.layout
