"""LoRA adapters in the executor (docs/lora.md): where each family's adapters sit, their flat fp32 state per
decoder layer (`LoraState`: master, AdamW moments, on the device), their forward (`attach`: a forward hook on
each adapted projection of the executor's copy of a layer) and their canonical names
(`lora_state_dict` / `load_lora_state_dict`).

For each target projection W (in -> out) of a decoder layer, A (rank x in) and B (out x rank) add
(alpha / rank) * B(A(dropout(x))) to W x, as Hugging Face PEFT's `lora.Linear` computes it: the input cast to
the adapters' fp32, the sum in fp32, the result cast back to the base's dtype. A is initialised as PEFT does
(kaiming_uniform_ with a = sqrt(5)), B with zeros. The base weights are frozen (TrainState holds only their
compute-dtype copy); the adapters are the only trainable state, one flat fp32 vector per decoder layer, in
the order of `AdapterLayout.slots` (per target: A then B).

A fused projection (GPT-2 c_attn, GPT-NeoX query_key_value, Phi-3 qkv_proj and gate_up_proj) gets one adapter
per targeted part, as planner/core/lora.py counts them: its output rows of that part (a slice; NeoX's q, k and
v interleaved per head: every head's rows of that part).

Dropout draws its mask from a generator seeded by (run seed, step, layer, micro-batch, target), so that a
recomputed forward drops exactly what the first forward dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierflow.errors import TierflowError
from tierflow.planner.core.lora import LORA_TARGETS, LoraConfig, target_shapes
from tierflow.planner.core.models import ModelSpec


class LoraError(TierflowError, ValueError):
    """Adapters that do not fit the model (a target the family lacks, a bad adapter tensor): one line."""


_LLAMA = {"q_proj": ("self_attn.q_proj", None), "k_proj": ("self_attn.k_proj", None),
          "v_proj": ("self_attn.v_proj", None), "o_proj": ("self_attn.o_proj", None),
          "gate_proj": ("mlp.gate_proj", None), "up_proj": ("mlp.up_proj", None),
          "down_proj": ("mlp.down_proj", None)}
_OPT = {"q_proj": ("self_attn.q_proj", None), "k_proj": ("self_attn.k_proj", None),
        "v_proj": ("self_attn.v_proj", None), "o_proj": ("self_attn.out_proj", None),
        "up_proj": ("fc1", None), "down_proj": ("fc2", None)}


def _family_map(spec: ModelSpec) -> dict[str, tuple[str, tuple | None]]:
    """target -> (module path in the decoder layer, part of its output rows: None for all of them,
    ("slice", first row), or ("heads", part index, parts) for NeoX's per-head interleaving)."""
    q, kv, f = spec.q_dim, spec.kv_dim, spec.ffn_hidden
    if spec.family == "gpt":
        return {"q_proj": ("attn.c_attn", ("slice", 0)), "k_proj": ("attn.c_attn", ("slice", q)),
                "v_proj": ("attn.c_attn", ("slice", q + kv)), "o_proj": ("attn.c_proj", None),
                "up_proj": ("mlp.c_fc", None), "down_proj": ("mlp.c_proj", None)}
    if spec.family == "gpt_neox":
        return {"q_proj": ("attention.query_key_value", ("heads", 0, 3)),
                "k_proj": ("attention.query_key_value", ("heads", 1, 3)),
                "v_proj": ("attention.query_key_value", ("heads", 2, 3)), "o_proj": ("attention.dense", None),
                "up_proj": ("mlp.dense_h_to_4h", None), "down_proj": ("mlp.dense_4h_to_h", None)}
    if spec.family == "phi3":
        qkv, gate_up = "self_attn.qkv_proj", "mlp.gate_up_proj"
        return {"q_proj": (qkv, ("slice", 0)), "k_proj": (qkv, ("slice", q)),
                "v_proj": (qkv, ("slice", q + kv)), "o_proj": ("self_attn.o_proj", None),
                "gate_proj": (gate_up, ("slice", 0)),
                "up_proj": (gate_up, ("slice", f)), "down_proj": ("mlp.down_proj", None)}
    if spec.family == "opt":
        return _OPT
    return _LLAMA


def check_targets(spec: ModelSpec, lora: LoraConfig) -> None:
    """LoraError (one line) for a target the family's layer does not have (gate_proj without a gated MLP).
    The default, every target (`--lora-targets all`), means every projection the layer has, as the planner
    counts them (planner/core/lora.py target_shapes)."""
    has = [t for t in _family_map(spec) if t != "gate_proj" or spec.gated_mlp]
    if set(lora.targets) == set(LORA_TARGETS):
        return
    for t in lora.targets:
        if t not in has:
            raise LoraError(f"lora target {t!r}: a {spec.family} layer has no such projection (drop it from "
                            f"--lora-targets; this model has {', '.join(has)})")


@dataclass(frozen=True)
class AdapterSlot:
    """One target's adapters in a layer's flat vector: A (rank x in) at `a_offset`, B (out x rank) at
    `b_offset`; `module` the adapted projection, `part` its rows (_family_map)."""

    target: str
    module: str
    part: tuple | None
    in_features: int
    out_features: int
    a_offset: int
    b_offset: int


class AdapterLayout:
    """The adapters of one decoder layer (every layer has the same): their slots, the flat vector's size."""

    def __init__(self, spec: ModelSpec) -> None:
        lora = spec.lora
        if lora is None:
            raise LoraError(f"model {spec.name!r} has no LoRA adapters")
        check_targets(spec, lora)
        self.spec, self.lora, self.rank = spec, lora, lora.rank
        fam = _family_map(spec)
        slots, off = [], 0
        for target, n_in, n_out in target_shapes(spec, lora):
            module, part = fam[target]
            slots.append(AdapterSlot(target, module, part, n_in, n_out, off, off + lora.rank * n_in))
            off += lora.rank * (n_in + n_out)
        self.slots: list[AdapterSlot] = slots
        self.numel = off

    def blocks(self) -> range:
        """The blocks (of [embedding, layers..., head]) that have adapters: the decoder layers."""
        return range(1, self.spec.num_layers + 1)

    def views(self, vec: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) of every slot as views of a layer's flat vector."""
        r = self.rank
        return [(vec[s.a_offset: s.b_offset].view(r, s.in_features),
                 vec[s.b_offset: s.b_offset + s.out_features * r].view(s.out_features, r))
                for s in self.slots]

    def init_vector(self, generator: torch.Generator) -> torch.Tensor:
        """A layer's adapters as PEFT initialises them: A kaiming_uniform_(a=sqrt(5)), B zeros."""
        vec = torch.zeros(self.numel, dtype=torch.float32)
        for a, _b in self.views(vec):
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        return vec


LORA_SEED_OFFSET = 0x10BA  # the adapters' generator: the run's seed plus this (the base's draws unchanged)


class LoraState:
    """The adapters of every decoder layer: fp32 master, Adam m and v, one flat vector each per layer, on the
    device for the whole run (the planner's placement of LoRA's trainable state). The vectors are made once
    and updated in place (their addresses never change: the compute ops' leaves are made over them once)."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.layout = AdapterLayout(spec)
        self.device = device
        self.seed = 0  # the run's seed (init_random): the dropout masks' too
        n = self.layout.numel
        self.master = {b: torch.zeros(n, dtype=torch.float32, device=device) for b in self.layout.blocks()}
        self.adam_m = {b: torch.zeros_like(v) for b, v in self.master.items()}
        self.adam_v = {b: torch.zeros_like(v) for b, v in self.master.items()}

    def init_random(self, seed: int) -> None:
        self.seed = seed
        g = torch.Generator().manual_seed(seed + LORA_SEED_OFFSET)
        for b in self.layout.blocks():
            self.master[b].copy_(self.layout.init_vector(g))
            self.adam_m[b].zero_()
            self.adam_v[b].zero_()

    def vectors(self, cls: str) -> dict[int, torch.Tensor]:
        return {"master": self.master, "adam_m": self.adam_m, "adam_v": self.adam_v}[cls]


def lora_state_dict(state: LoraState, cls: str = "master") -> dict[str, torch.Tensor]:
    """The adapters (or, with `cls` "adam_m" / "adam_v", their moments) under their canonical names:
    ``blocks.{i}.{target}.lora_A`` ([rank, in_features]) and ``...lora_B`` ([out_features, rank]), `i` the
    decoder layer from 0; fp32, on the CPU, contiguous."""
    out = {}
    vecs = state.vectors(cls)
    for b in state.layout.blocks():
        cpu = vecs[b].detach().to("cpu", torch.float32)
        for s, (a, bm) in zip(state.layout.slots, state.layout.views(cpu)):
            out[f"blocks.{b - 1}.{s.target}.lora_A"] = a.clone().contiguous()
            out[f"blocks.{b - 1}.{s.target}.lora_B"] = bm.clone().contiguous()
    return out


def load_lora_state_dict(state: LoraState, tensors: dict[str, torch.Tensor], cls: str = "master") -> None:
    """Set the adapters (or a moment, `cls`) from their canonical names: every key present, with its shape,
    and no other; LoraError naming the first bad key."""
    layout = state.layout
    want = {}
    for b in layout.blocks():
        for s in layout.slots:
            want[f"blocks.{b - 1}.{s.target}.lora_A"] = (b, s, (layout.rank, s.in_features))
            want[f"blocks.{b - 1}.{s.target}.lora_B"] = (b, s, (s.out_features, layout.rank))
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise LoraError(f"adapter tensor {extra[0]!r} is not one of this model's (expected keys like "
                        f"{next(iter(want))!r})")
    for key, (_b, _s, shape) in want.items():
        if key not in tensors:
            raise LoraError(f"adapter tensor {key!r} is missing")
        if tuple(tensors[key].shape) != shape:
            raise LoraError(f"adapter tensor {key!r} has shape {list(tensors[key].shape)}, expected "
                            f"{list(shape)}")
    vecs = state.vectors(cls)
    for b in layout.blocks():
        flat = torch.empty(layout.numel, dtype=torch.float32)
        for s, (a, bm) in zip(layout.slots, layout.views(flat)):
            a.copy_(tensors[f"blocks.{b - 1}.{s.target}.lora_A"])
            bm.copy_(tensors[f"blocks.{b - 1}.{s.target}.lora_B"])
        vecs[b].copy_(flat)


# ------------------------------------------------------------------------------------------------------------
# The adapters' forward
# ------------------------------------------------------------------------------------------------------------


class DropoutKey:
    """What a compute op is running (seed, step, layer, micro-batch), set before its call: the dropout masks'
    seed. `first_mb`: the global index of this rank's first micro-batch (rank r of W trains sequences
    [r * share, (r + 1) * share): r times its micro-batches per step), so that W ranks drop what one rank
    training the whole batch drops."""

    def __init__(self, seed: int, first_mb: int = 0) -> None:
        self.seed = seed
        self.first_mb = first_mb
        self.at: tuple[int, int, int] = (0, 0, 0)


def _mask_seed(seed: int, at: tuple[int, int, int], j: int) -> int:
    step, b, m = at
    return (((seed * 1_000_003 + step) * 1009 + b) * 1013 + m) * 31 + j & ((1 << 62) - 1)


def _dropout(x: torch.Tensor, p: float, key: DropoutKey, j: int) -> torch.Tensor:
    if p <= 0:
        return x
    step, b, m = key.at
    g = torch.Generator(device=x.device).manual_seed(_mask_seed(key.seed, (step, b, key.first_mb + m), j))
    keep = torch.rand(x.shape, generator=g, device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, p: float, key: DropoutKey,
           j: int) -> torch.Tensor:
    x = x.to(a.dtype)
    return F.linear(F.linear(_dropout(x, p, key, j), a), b) * scaling


def _plus_delta(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                p: float, key: DropoutKey, j: int) -> torch.Tensor:
    """out + scaling * B(A(dropout(x))), in the adapters' dtype, cast back to out's: PEFT's lora.Linear sum,
    with the scaling and the sum made by B's GEMM (addmm, beta 1, alpha scaling), as the planner counts it,
    instead of two more passes over the output (the product scaled, then added) forward and one backward."""
    xa = F.linear(_dropout(x.to(a.dtype), p, key, j), a)
    base = out.to(a.dtype)
    res = torch.addmm(base.reshape(-1, base.size(-1)), xa.reshape(-1, xa.size(-1)), b.t(), alpha=scaling)
    return res.view(out.shape).to(out.dtype)


def attach(module: torch.nn.Module, layout: AdapterLayout, leaves: list[tuple[torch.Tensor, torch.Tensor]],
           key: DropoutKey) -> None:
    """Forward hooks on the adapted projections of `module` (a decoder layer, the executor's own copy): each
    adds its targets' B(A(dropout(x))) * scaling with the (A, B) `leaves` (one pair per slot)."""
    lora = layout.lora
    by_module: dict[str, list[tuple[int, AdapterSlot]]] = {}
    for j, s in enumerate(layout.slots):
        by_module.setdefault(s.module, []).append((j, s))
    for path, items in by_module.items():
        module.get_submodule(path).register_forward_hook(
            _hook(items, leaves, lora.scaling, lora.dropout, key, layout.spec.num_heads))


def _hook(items, leaves, scaling: float, p: float, key: DropoutKey, heads: int):
    def hook(_mod, inputs, out):
        x = inputs[0]
        if len(items) == 1 and items[0][1].part is None:
            j = items[0][0]
            a, b = leaves[j]
            return _plus_delta(out, x, a, b, scaling, p, key, j)
        res = out.to(torch.float32)
        if res is out:
            res = out.clone()
        for j, s in items:
            a, b = leaves[j]
            delta = _delta(x, a, b, scaling, p, key, j)
            if s.part is None:
                res = res + delta
            elif s.part[0] == "slice":
                res[..., s.part[1]: s.part[1] + s.out_features] += delta
            else:  # NeoX: (heads, parts, head_dim) rows; part j of every head
                _, pj, parts = s.part
                hd = s.out_features // heads
                view = res.view(*res.shape[:-1], heads, parts, hd)
                view[..., pj, :] += delta.view(*delta.shape[:-1], heads, hd)
        return res.to(out.dtype)
    return hook


def slot_rows(spec: ModelSpec, slot: AdapterSlot) -> torch.Tensor:
    """The output rows of the (possibly fused) projection that `slot`'s adapter adds to."""
    if slot.part is None:
        return torch.arange(slot.out_features)
    if slot.part[0] == "slice":
        return torch.arange(slot.part[1], slot.part[1] + slot.out_features)
    _, j, parts = slot.part  # NeoX: part j of every head's rows
    hd = slot.out_features // spec.num_heads
    return torch.cat([torch.arange((h * parts + j) * hd, (h * parts + j + 1) * hd)
                      for h in range(spec.num_heads)])


def merge_into(state: LoraState, b: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Decoder layer b's parameters (fp32, by name) with its adapters merged: W + (alpha / rank) B A on each
    adapter's rows (what `--export-hf` of a LoRA run writes; the layer then computes W x + s B A x)."""
    layout = state.layout
    out = dict(params)
    scaling = layout.lora.scaling
    for s, (a, bm) in zip(layout.slots, layout.views(state.master[b].detach())):
        name = f"{s.module}.weight"
        w = out[name].float()
        delta = ((bm @ a) * scaling).to(w.device)
        out[name] = w.index_add(0, slot_rows(layout.spec, s).to(w.device), delta)
    return out
