"""Validation loss and perplexity of the current weights (`tierflow run --eval-every N`).

The forward is the training forward without the backward: the same block modules (the layout's templates,
called with torch.func.functional_call on the weights' compute-dtype copy; a LoRA layer's with its adapters
merged, W + alpha / rank B A), block by block, with each block's
weights read from the tier the plan put them on (device, host memory or the SSD tier's files) and released
before the next block's, so that evaluation needs one block's weights and one micro-batch's activations on
the device at a time, as training does. Held-out tokens come from the tail of --data (--val-fraction) or from
--val-data; the sequences are the same at every evaluation (the first `batches` x batch-size windows of
seq + 1 held-out tokens, consecutive windows sharing one boundary token as training's do), so that successive
values compare. An evaluation never repeats a token: when the held-out set holds fewer windows than asked, it
uses those it holds, and the run says so before it starts (`check_held_out`); shorter than one window is
refused. The loss is the mean over the targets counted (a masked prompt token is not one), and the result
says how many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from tierflow.executor.data import DataError, TokenData
from tierflow.executor.lora import merge_into
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.models.lmloss import IGNORE_INDEX
from tierflow.executor.tiers.state import TrainState


@dataclass
class EvalResult:
    step: int
    val_loss: float
    val_ppl: float
    tokens: int  # the targets the mean is over (masked prompt tokens are not counted)
    sequences: int  # the distinct held-out sequences evaluated


def held_out_sequences(val: TokenData, seq: int) -> int:
    """The windows of seq + 1 tokens the held-out set holds without repeating a token (as training's batches
    cut them: each window's last token is the next one's first)."""
    return max((len(val.tokens) - 1) // seq, 0)


def check_held_out(val: TokenData, seq: int, sequences: int, batches: int) -> str | None:
    """Before training: refuse (DataError) a held-out set shorter than one sequence; a note when it holds
    fewer sequences than the `batches` x `sequences` an evaluation asks for (each evaluation then uses those
    it holds, none twice); None when it holds them all."""
    have, want = held_out_sequences(val, seq), sequences * batches
    where = val.source
    if have == 0:
        raise DataError(f"held-out data {where}: {len(val.tokens):,} tokens, shorter than one sequence of "
                        f"{seq} + 1 tokens (hold out more: a larger --val-fraction, or a longer --val-data)")
    if have >= want:
        return None
    return (f"--eval-batches {batches}: the held-out data {where} holds {have:,} sequences of {seq} tokens, "
            f"fewer than the {batches} x {sequences} = {want:,} asked for; each evaluation uses those "
            f"{have:,}, none twice (hold out more with --val-fraction or --val-data, or pass fewer "
            "--eval-batches)")


def evaluate(state: TrainState, val: TokenData, step: int, sequences: int, seq: int, chunk: int,
             batches: int) -> EvalResult:
    """Mean next-token loss over the targets of `batches` batches of `sequences` x `seq` held-out tokens (at
    most the sequences the held-out set holds, none repeated), computed `chunk` sequences at a time (with
    several ranks every rank computes it; the weights are gathered)."""
    device = state.backend.device
    n = min(sequences * batches, held_out_sequences(val, seq))
    if n == 0:
        raise DataError(f"held-out data {val.source}: shorter than one sequence of {seq} + 1 tokens")
    x_all, y_all = val.batch(0, n, seq)  # windows k * seq for k < n: within the held-out set, no wrap
    xs = [x_all[c: c + chunk] for c in range(0, n, chunk)]
    ys = [y_all[c: c + chunk] for c in range(0, n, chunk)]
    layout = state.layout
    last = len(layout.numel) - 1
    wte = None
    acts: list[torch.Tensor] = []
    total, counted = 0.0, 0
    with torch.no_grad():
        for b in range(last + 1):
            w = state.gathered("weights", b).to(device)
            params = layout.params(b, w)
            if state.lora is not None and b in state.lora.master:  # LoRA: W + (alpha / rank) B A, merged
                params = {k: v.to(device, w.dtype) for k, v in merge_into(state.lora, b, params).items()}
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
                    targets = int(y.ne(IGNORE_INDEX).sum())
                    if targets:  # a chunk of prompt tokens only has no loss to add
                        logits = functional_call(module, params, (a.to(device),), extra)
                        total += float(lm_loss(logits, y.to(device))) * targets
                        counted += targets
            if b != 0 or wte is None:
                del w, params
    mean = total / counted if counted else float("nan")
    return EvalResult(step, mean, math.exp(min(mean, 700.0)), counted, n)
