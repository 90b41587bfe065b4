"""Optimizer states in a compressed format (tierflow.planner.core.optstates: 8-bit moments, bf16 master): the
optimizer ops' decode / update / encode around the fp32 AdamW of host_adamw and adamw_update.

- Adam's m and v of an 8-bit format are tiers/qvector.py's `QTierVector`s: each stretch the optimizer steps
  at once is one quant8.Q8.
- The bf16 master of 8bit-bf16master is a plain TierVector in bf16 (its SSD files hold 2 bytes per element);
  after each update it is rounded stochastically (quant8.stochastic_round_bf16_, noise a function of the
  step, block and range only), and the compute weights are copied from it.

The update runs on fp32 copies of one optimizer part's stretches (12 bytes per parameter of the part, freed
after the step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierflow.executor.optim.decay import decay_pieces
from tierflow.executor.optim.host_adamw import host_adamw
from tierflow.executor.optim.quant8 import Q8, round_generator, stochastic_round_bf16_
from tierflow.executor.tiers.qvector import QTierVector

OPT_CLASSES = ("master", "adam_m", "adam_v")


def compressed(fmt: str | None) -> bool:
    return fmt not in (None, "fp32")


def read_piece(V, ssd, name: str, lo: int, hi: int):
    """One SSD piece of a state vector as its optimizer step takes it: a Q8 of quantized moments, else the
    tensor in the vector's dtype."""
    if isinstance(V, QTierVector):
        return V.read_q8(ssd, name, lo, hi)
    return ssd.read(name, V.dtype, hi - lo)


def payload(x) -> torch.Tensor:
    """What an SSD file of a state piece holds: a Q8's packed bytes, else the tensor."""
    return x.buf if isinstance(x, Q8) else x


def host_stretch(V, a: int, z: int):
    """The host range [a, z) of a part of V: a Q8 of quantized moments, else a view."""
    if isinstance(V, QTierVector):
        return V.host_q[(a, z)]
    if a == V.g and z - a == V.c:  # all of it: no view to make (a torch call costs ~20 us after a large op)
        return V.host
    return V.host[a - V.g: z - V.g]


def _decode(x) -> torch.Tensor:
    if isinstance(x, Q8):
        return x.decode()
    return x if x.dtype == torch.float32 else x.float()


def _encode(x, fp32: torch.Tensor, gen: torch.Generator | None) -> None:
    if isinstance(x, Q8):
        x.encode(fp32)
    elif x.dtype == torch.bfloat16:
        stochastic_round_bf16_(x, fp32, gen)
    elif x is not fp32:
        x.copy_(fp32)


def host_adamw_compressed(h, step: int, block: int, groups, states: dict, grads: torch.Tensor, dests: list,
                          coef=None, zero_grads: bool = True) -> None:
    """host_adamw on fp32 copies of compressed stretches (states[cls]: (a, z, Q8 or tensor)), encoded back
    after the update; the compute copy of the weights from the stored (rounded) master; the gradients zeroed
    with `zero_grads` (as host_adamw)."""
    fp32 = {cls: [(a, z, _decode(x)) for a, z, x in states[cls]] for cls in OPT_CLASSES}
    host_adamw(h, step, groups, fp32, grads, [], coef, zero_grads=zero_grads)
    lo, hi = groups[0][0], groups[-1][1]
    for cls in OPT_CLASSES:
        for (a, _z, x), (_a, _z2, f) in zip(states[cls], fp32[cls], strict=True):
            _encode(x, f, round_generator(0, step, block, a))
    for sa, sz, master in states["master"]:
        for a, z, buf in dests:
            x, y = max(a, sa, lo), min(z, sz, hi)
            if y > x:
                buf[x - a: y - a].copy_(master[x - sa: y - sa])


def adam_gpu_compressed(state, b: int, grad: torch.Tensor, step: int, update: Callable[..., None]) -> None:
    """OptimizerOps.adam_gpu with compressed states on the device (block b of the TrainState `state`, its
    summed gradient `grad`, optimizer step `step`): decode, the update (`update(p, g, m, v, decay)`: the op's
    AdamW over the decay groups' pieces), encode."""
    stored = []
    for cls in OPT_CLASSES:
        V = state.vec[cls][b]
        stored.append(V.dev_q if isinstance(V, QTierVector) else V.dev)
    fp32 = [_decode(x) for x in stored]
    groups = decay_pieces(state.layout, b, state.shards[b][0], 0, state.shard_numel[b])
    p, g, m, v = ([x[a:z] for a, z, _d in groups] for x in (fp32[0], grad, fp32[1], fp32[2]))
    update(p, g, m, v, [d for _a, _z, d in groups])
    for x, f in zip(stored, fp32, strict=True):
        _encode(x, f, round_generator(0, step, b, 0))
    W = state.vec["weights"][b].dev
    if W is not stored[0]:
        W.copy_(stored[0])
