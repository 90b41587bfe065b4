"""Shared test helpers: profiles, placements and hypothesis strategies for small models."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from hypothesis import strategies as st

from tierflow.hwprofiles import load_profile
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement, Split

CPU = Split(0.0, 1.0, 0.0)
SSD = Split(0.0, 0.0, 1.0)
GPU = Split(1.0, 0.0, 0.0)
BASE_MODELS = ("tiny-gpt", "tiny-llama", "gpt3-125m")


@cache
def profile(name: str = "rtx4090-lohan"):
    return load_profile(name)


def placement(weights=CPU, states=CPU, grads=CPU, checkpoints=CPU) -> Placement:
    return Placement(weights=weights, master=states, adam_m=states, adam_v=states, grads=grads,
                     checkpoints=checkpoints)


@st.composite
def small_models(draw):
    name = draw(st.sampled_from(BASE_MODELS))
    m = get_model(name)
    if name != "gpt3-125m" and draw(st.booleans()):
        heads = draw(st.sampled_from([2, 4]))
        head_dim = draw(st.sampled_from([16, 32]))
        hidden = heads * head_dim
        layers = draw(st.integers(1, 6))
        m = replace(
            m, name=f"{name}-{layers}x{hidden}", num_layers=layers, hidden=hidden, num_heads=heads,
            num_kv_heads=heads if m.family == "gpt" else draw(st.sampled_from([1, heads])), head_dim=head_dim,
            ffn_hidden=draw(st.sampled_from([2 * hidden, 4 * hidden])),
            vocab_size=draw(st.sampled_from([256, 1000])), tied_embeddings=draw(st.booleans()),
        )
    return m


@st.composite
def splits(draw, gpu: bool = True):
    """Fractions in quarters (exact in binary floating point, so they sum to exactly 1)."""
    g = draw(st.integers(0, 4)) if gpu else 0
    c = draw(st.integers(0, 4 - g))
    return Split(g / 4, c / 4, (4 - g - c) / 4)


def accumulate_gradients(ref, x, y, micro: int) -> float:
    """One step's forward and backward of a plain PyTorch model over the micro-batches of `micro` rows of
    (x, y), the gradients averaged as the executor accumulates them; returns the step's mean loss."""
    from tierflow.executor.models import loss as lm_loss

    M = len(x) // micro
    total = 0.0
    for m in range(M):
        loss = lm_loss(ref(x[m * micro:(m + 1) * micro]), y[m * micro:(m + 1) * micro])
        (loss / M).backward()
        total += loss.item() / M
    return total
