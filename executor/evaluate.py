"""Validation loss and perplexity of the current weights (`tierflow run --eval-every N`).

The forward is the training forward without the backward: the same block modules (the layout's templates,
called with torch.func.functional_call on the weights' compute-dtype copy), block by block, with each block's
weights read from the tier the plan put them on (device, host memory or the SSD tier's files) and released
before the next block's, so that evaluation needs one block's weights and one micro-batch's activations on
the device at a time, as training does. Held-out tokens come from the tail of --data (--val-fraction) or from
--val-data; the batches are the same at every evaluation (the first `batches` of the held-out tokens), so
that successive values compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from tierflow.executor.data import TokenData
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.tiers.state import TrainState


@dataclass
class EvalResult:
    step: int
    val_loss: float
    val_ppl: float
    tokens: int


def evaluate(state: TrainState, val: TokenData, step: int, sequences: int, seq: int, chunk: int,
             batches: int) -> EvalResult:
    """Mean next-token loss of `batches` batches of `sequences` x `seq` held-out tokens, computed `chunk`
    sequences at a time (with several ranks every rank computes it; the weights are gathered)."""
    device = state.backend.device
    rows = [val.batch(i, sequences, seq) for i in range(batches)]
    xs = [x[c: c + chunk] for x, _y in rows for c in range(0, sequences, chunk)]
    ys = [y[c: c + chunk] for _x, y in rows for c in range(0, sequences, chunk)]
    layout = state.layout
    last = len(layout.numel) - 1
    wte = None
    acts: list[torch.Tensor] = []
    total = 0.0
    with torch.no_grad():
        for b in range(last + 1):
            w = state.gathered("weights", b).to(device)
            params = layout.params(b, w)
            module = layout.templates[b]
            if b == 0:
                acts = [functional_call(module, params, (x.to(device),)).cpu() for x in xs]
                if state.spec.tied_embeddings:
                    wte = params["wte.weight"]
            elif b < last:
                acts = [functional_call(module, params, (a.to(device),)).cpu() for a in acts]
            else:
                extra = {"tied_weight": wte} if wte is not None else {}
                for a, y in zip(acts, ys):
                    logits = functional_call(module, params, (a.to(device),), extra)
                    total += float(lm_loss(logits, y.to(device))) * a.size(0)
            if b != 0 or wte is None:
                del w, params
    n = sum(x.size(0) for x in xs)
    mean = total / n
    return EvalResult(step, mean, math.exp(min(mean, 700.0)), n * seq)
