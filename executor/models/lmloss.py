"""The language-model loss: mean next-token cross entropy, and the chunked form the head computes without
ever holding the whole fp32 logits (the planner counts its memory: tierflow.planner.core.workload)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierflow.planner.core.workload import loss_chunk_tokens

IGNORE_INDEX = -100  # targets equal to it are ignored (transformers' convention)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32;
    targets equal to -100 are ignored (transformers' convention)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """lm_head + mean cross-entropy over chunks of tokens, the gradients computed in the forward (as Liger
    Kernel's fused linear cross-entropy does): per chunk the logits (compute dtype), in fp32, and their
    softmax gradient; what is kept is the hidden states' and the weight's gradient, never the whole logits.
    The planner counts this (tierflow.planner.core.workload.loss_working_bytes). Same values as `loss` on the
    full logits: the fp32 logits are the compute-dtype logits cast, the gradient is cast back to the compute
    dtype before the two GEMMs, as autograd does."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        # few torch calls (each costs microseconds of host time on a tiny op): the target's logit and its -1
        # by gather / scatter_add along the rows (bit for bit the indexing's values), one chunk without slices
        keep_all = targets.ne(IGNORE_INDEX)
        valid_count = keep_all.sum()
        # each gradient only where it is asked for: a frozen head (LoRA) computes no weight gradient
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need = need_dx or need_dw
        n = x.size(0)
        one = chunk >= n
        total = None
        dx = torch.empty_like(x) if need_dx and not one else None
        dw = torch.zeros_like(weight) if need_dw else None
        idx_all = targets.clamp(min=0).unsqueeze(1)
        minus_one = None
        for lo in range(0, n, chunk):
            if one:
                xc, keep, idx = x, keep_all, idx_all
            else:
                xc, keep, idx = x[lo: lo + chunk], keep_all[lo: lo + chunk], idx_all[lo: lo + chunk]
            logits = F.linear(xc, weight).float()  # in fp32 (the same tensor when fp32)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, idx).squeeze(1)
            part = ((lse - picked) * keep).sum()
            total = part if total is None else total.add_(part)
            if need:
                g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the fp32 logits
                if minus_one is None or minus_one.size(0) != idx.size(0):
                    minus_one = torch.full(idx.shape, -1.0, dtype=g.dtype, device=g.device)
                g.scatter_add_(1, idx, minus_one)  # the target's probability - 1
                g = g.mul_(keep.unsqueeze(1)).to(x.dtype)
                if need_dx and one:
                    dx = g @ weight
                elif need_dx:
                    torch.matmul(g, weight, out=dx[lo: lo + chunk])
                if need_dw:
                    dw.addmm_(g.t(), xc)
            del logits
        if total is None:  # no tokens
            total = torch.zeros((), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(dx, dw, valid_count)
        return total / valid_count

    @staticmethod
    def backward(ctx, grad):
        dx, dw, valid_count = ctx.saved_tensors
        scale = (grad / valid_count).to((dx if dx is not None else dw).dtype)
        # in place: no second copy (one backward only); None for a gradient not asked for
        return (dx.mul_(scale) if dx is not None else None, dw.mul_(scale) if dw is not None else None,
                None, None)


def chunked_lm_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of `x @ weight.T` (hidden (..., embed) -> vocabulary logits) against
    `targets`, over chunks of tokens (the planner's loss_chunk_tokens), never materialising the full fp32
    logits; equal to `loss(F.linear(x, weight), targets)`."""
    x2 = x.reshape(-1, x.size(-1))
    chunk = loss_chunk_tokens(weight.size(0), x2.size(0))
    return _ChunkedLinearCrossEntropy.apply(x2, weight, targets.reshape(-1), chunk)


__all__ = ["IGNORE_INDEX", "chunked_lm_loss", "loss"]
