"""Compressed optimizer states in the executor: the block-wise 8-bit quantizer (executor/optim/quant8.py)
against brute force and against bitsandbytes on the same inputs (where installed), stochastic rounding, and
runs of each format on the host, the device and the SSD tier, with checkpoints that resume bit for bit."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.runs import make_plan, reference
from support.runs import run as _run
from torch.optim.adamw import adamw as adamw_step

from tierflow.executor.optim.quant8 import BLOCK, Q8, dynamic_map, packed_bytes, stochastic_round_bf16_
from tierflow.executor.options import CheckpointOptions
from tierflow.planner.core.optstates import quantized_bytes
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.io.planfile import plan_from_graph

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def _moments(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4 * 1e-3
    v = (torch.randn(n, generator=g) * 1e-3) ** 2
    return m, v


@pytest.mark.parametrize("signed", [True, False])
def test_map_is_sorted_with_zero_and_one(signed):
    q = dynamic_map(signed)
    assert q.numel() == 256 and torch.all(q[1:] > q[:-1])
    assert 0.0 in q.tolist() and q[-1] == 1.0 and q[0] == (-1.0 if signed else 0.0)


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_the_nearest_map_values(signed):
    m, v = _moments(5 * BLOCK + 17)
    x = m if signed else v
    q = Q8.of(x, signed)
    assert q.buf.numel() == packed_bytes(x.numel()) == quantized_bytes(x.numel())
    scale = q.absmax.repeat_interleave(BLOCK)[: x.numel()]
    table = dynamic_map(signed)
    best = (table[None, :] * scale[:, None] - x[:, None]).abs().min(dim=1).values
    err = (q.decode() - x).abs()
    # nearest up to the code table's resolution (2^-12 of the quotient near a midpoint)
    assert torch.all(err <= best + scale * 2.0 ** -11)
    want = torch.cat([x[: 5 * BLOCK].abs().view(5, BLOCK).amax(1), x[5 * BLOCK:].abs().amax()[None]])
    assert torch.equal(q.absmax, want)


@pytest.mark.parametrize("signed", [True, False])
def test_decode_then_encode_gives_the_same_bytes(signed):
    m, v = _moments(3 * BLOCK + 5, seed=1)
    x = m if signed else v
    x[:BLOCK] = 0.0  # an all-zero block
    q = Q8.of(x, signed)
    assert torch.equal(Q8.of(q.decode(), signed).buf, q.buf)


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = torch.full((200_000,), 1.0 + 2.0 ** -10)  # between two bf16 values (gap 2^-7)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_bf16_(out, x, torch.Generator().manual_seed(3))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2.0 ** -10, abs=2e-5)
    again = torch.empty_like(out)
    stochastic_round_bf16_(again, x, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("signed", [True, False])
def test_quantizer_against_bitsandbytes(signed):
    import bitsandbytes.functional as F

    lib_map = F.create_dynamic_map(signed=signed)
    ours = dynamic_map(signed)
    differ = (lib_map != ours).nonzero().flatten().tolist()
    assert differ == ([0] if signed else [])  # only the most negative value (quant8's doc)
    m, v = _moments(64 * BLOCK + 3, seed=2)
    x = m if signed else v
    codes, st = F.quantize_blockwise(x, code=lib_map, blocksize=BLOCK)
    q = Q8.of(x, signed)
    assert torch.equal(st.absmax, q.absmax)
    lib_err = (F.dequantize_blockwise(codes, st) - x).abs().mean()
    assert (q.decode() - x).abs().mean() <= lib_err * 1.001


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
def test_adamw_update_against_bitsandbytes():
    """20 AdamW steps on one flat tensor: 8-bit states (decode, torch's AdamW, encode) and bitsandbytes'
    AdamW8bit stay as close to fp32 AdamW as each other."""
    import bitsandbytes as bnb

    n = 16 * BLOCK
    g = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 1e-2 for _ in range(20)]
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

    ref = torch.nn.Parameter(p0.clone())
    lib = torch.nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([ref], **kw)
    lib_opt = bnb.optim.AdamW8bit([lib], min_8bit_size=0, **kw)
    ours = p0.clone()
    m, v = Q8.of(torch.zeros(n), True), Q8.of(torch.zeros(n), False)
    for step, gr in enumerate(grads, 1):
        for param, opt in ((ref, ref_opt), (lib, lib_opt)):
            param.grad = gr.clone()
            opt.step()
        mf, vf = m.decode(), v.decode()
        adamw_step([ours], [gr.clone()], [mf], [vf], [], [torch.tensor(float(step - 1))],
                                foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3,
                                weight_decay=0.1, eps=1e-8, maximize=False)
        m.encode(mf)
        v.encode(vf)
    moved = (ref.detach() - p0).abs().mean()
    ours_off = (ours - ref.detach()).abs().mean() / moved
    lib_off = (lib.detach() - ref.detach()).abs().mean() / moved
    assert ours_off < 0.05 and ours_off <= max(lib_off * 1.5, 0.01)


# -- the executor -------------------------------------------------------------------------------------------


def run(plan, d, **kw):
    d.mkdir(parents=True, exist_ok=True)
    return _run(plan, d, **kw)


def _plan(fmt: str, placement: str, alpha: float = 0.0):
    plan = make_plan("tiny-gpt", "vertical", placement, alpha, iterations=1)
    model = plan.model.with_optimizer_states(fmt)
    graph = build_graph(model, plan.hardware, plan.config)
    return plan_from_graph(model, plan.hardware, plan.config, graph)


@pytest.mark.parametrize("fmt", ["8bit", "8bit-bf16master"])
def test_states_on_the_ssd_train_as_in_host_memory_and_move_fewer_bytes(fmt, tmp_path):
    host = run(_plan(fmt, "weights_cpu"), tmp_path / "h", steps=3)
    ssd = run(_plan(fmt, "states_ssd"), tmp_path / "s", steps=3)
    fp32 = run(_plan("fp32", "states_ssd"), tmp_path / "f", steps=3)
    assert ssd.losses == host.losses
    assert all(torch.equal(a, b) for a, b in zip(ssd.final_master, host.final_master))
    assert ssd.ssd_bytes_read < fp32.ssd_bytes_read
    ref_losses, _ = reference("tiny-gpt", steps=3)
    assert ssd.losses == pytest.approx(ref_losses, rel=2e-3)


@pytest.mark.parametrize("placement,alpha", [("device", 0.0), ("mix", 0.25)])
def test_every_tier_trains_close_to_fp32_adamw(placement, alpha, tmp_path):
    got = run(_plan("8bit", placement, alpha), tmp_path / "q", steps=3)
    ref_losses, _ = reference("tiny-gpt", steps=3)
    assert got.losses == pytest.approx(ref_losses, rel=2e-3)


@pytest.mark.parametrize("fmt", ["8bit", "8bit-bf16master"])
def test_checkpoint_resumes_bit_for_bit(fmt, tmp_path):
    plan = _plan(fmt, "mix", 0.25)
    never = run(plan, tmp_path / "never", steps=4)
    ck = str(tmp_path / "ck")
    first = run(plan, tmp_path / "a", steps=2, checkpoint=CheckpointOptions(ck, every=2))
    then = run(plan, tmp_path / "b", steps=4, checkpoint=CheckpointOptions(ck, every=0))
    assert then.first_step == 2
    assert first.losses + then.losses == never.losses
    for got, want in ((then.final_master, never.final_master), (then.final_adam_m, never.final_adam_m)):
        assert all(torch.equal(x, y) for x, y in zip(got, want))
