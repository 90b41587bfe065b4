"""A block's parameters as the compute ops hand them to autograd (`BlockParams`).

Resident weights (every element a block computes with lies in its owners' device vectors) get autograd leaves
made once per executor: tensors of their own (their own version counter, so the optimizer's in-place update of
the vector between steps is no in-place modification of a saved leaf) over the vector's storage at the
parameter's offset, installed once in the executor's own copy of the block's module. A compute op on them
makes no tensor for its weights and swaps nothing into the module; the addresses never change, as a later
CUDA-graph capture needs. Weights a fetch_weights op brought (a new buffer per fetch) get leaves per op, put
into the module for the call and taken out after it (`call_with`), as before.
"""

from __future__ import annotations

import copy

import torch
from torch.func import functional_call

from tierflow.executor.ops.weights import OwnerWeights
from tierflow.executor.tiers.state import Slot


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out))


def _leaf_over(vec: torch.Tensor, at: int, shape: tuple[int, ...], stride: tuple[int, ...],
               trainable: bool = True) -> torch.Tensor:
    """A leaf over elements [at, at + numel) of `vec`, of its own (not a view: its own version counter);
    `trainable` False: a frozen weight (LoRA's base), which asks autograd for no gradient."""
    leaf = torch.empty(0, dtype=vec.dtype, device=vec.device)
    leaf.set_(vec.untyped_storage(), vec.storage_offset() + at, shape, stride)
    return leaf.requires_grad_(trainable)


class BlockParams:
    """Block b's module (a copy of the layout's template: the executor's own) and its parameters as autograd
    leaves: `leaves(vecs)` gives one leaf per slot (then a tied head's embedding matrix), `call` runs the
    module with them."""

    def __init__(self, template: torch.nn.Module, slots: list[Slot],
                 tied_shape: tuple[int, ...] | None, trainable: bool = True) -> None:
        self.module = copy.deepcopy(template)
        self.trainable = trainable  # False: frozen weights (LoRA's base), leaves without gradients
        self.slots = slots
        self.sites = param_sites(self.module, [s.name for s in slots])
        self.shapes = [s.shape for s in slots] + ([tied_shape] if tied_shape else [])
        self.strides = [_strides(s) for s in self.shapes]
        self.resident_leaves: list[torch.Tensor] | None = None  # over the vectors of `key`
        self.key: tuple | None = None
        self.vecs: list[OwnerWeights] | None = None  # the resident list they were last found for

    def leaves(self, vecs: list[OwnerWeights]) -> list[torch.Tensor]:
        """The leaves over `vecs` (the block's own weights, then a tied head's wte range): the persistent ones
        where every parameter is resident, else new ones over the fetched buffer (and the resident part)."""
        if vecs is self.vecs:  # WeightOps keeps one list per block while its vectors stay the same
            return self.resident_leaves
        if all(v.fetched is None for v in vecs):
            key = tuple((id(v.resident), v.resident.data_ptr(), v.lo) for v in vecs)
            if key != self.key:
                self._make_resident(vecs, key)
            self.vecs = vecs
            return self.resident_leaves
        return self._over(vecs)

    def is_resident(self, leaves: list[torch.Tensor]) -> bool:
        return leaves is self.resident_leaves

    def _over(self, vecs: list[OwnerWeights]) -> list[torch.Tensor]:
        own = vecs[0]
        out = []
        for s, stride in zip(self.slots, self.strides):
            a = s.offset  # as OwnerWeights.view: a parameter lies wholly in one of the two parts
            vec, at = (own.fetched, a - own.start) if a >= own.start else (own.resident, a)
            out.append(_leaf_over(vec, at, s.shape, stride, self.trainable))
        if len(vecs) > 1:  # a tied head: block 0's wte range
            wte = vecs[1]
            vec, at = (wte.fetched, wte.lo - wte.start) if wte.lo >= wte.start else (wte.resident, wte.lo)
            out.append(_leaf_over(vec, at, self.shapes[-1], self.strides[-1], self.trainable))
        return out

    def _make_resident(self, vecs: list[OwnerWeights], key: tuple) -> None:
        self.resident_leaves = self._over(vecs)
        self.key = key
        if self.sites is not None:  # installed for good: a call swaps nothing
            for (d, k), leaf in zip(self.sites, self.resident_leaves):
                d[k] = leaf

    def call(self, leaves: list[torch.Tensor], x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The block's module on `x` with `leaves` as its parameters."""
        if len(leaves) > len(self.slots):
            kwargs["tied_weight"] = leaves[-1]
        if self.sites is None:
            return functional_call(self.module, {s.name: leaf for s, leaf in zip(self.slots, leaves)}, (x,),
                                   kwargs)
        if leaves is self.resident_leaves:
            return self.module(x, **kwargs)
        return call_with(self.module, self.sites, leaves, x, kwargs)


Pair = tuple[torch.Tensor, torch.Tensor]


def adapter_leaves(vec: torch.Tensor, views: list[Pair]) -> list[Pair]:
    """LoRA: a leaf (trainable, its own version counter) over each (A, B) view of a layer's flat adapter
    vector `vec` (executor/lora.py AdapterLayout.views), made once: the optimizer updates `vec` in place."""
    out = []
    for a, b in views:
        at = [x.storage_offset() - vec.storage_offset() for x in (a, b)]
        out.append(tuple(_leaf_over(vec, o, tuple(x.shape), x.stride()) for o, x in zip(at, (a, b))))
    return out


def param_sites(module: torch.nn.Module, names: list[str]) -> list[tuple[dict, str]] | None:
    """For each parameter name of `module` (dotted), the `_parameters` dict that holds it and its key; None
    where two names share one parameter (tied inside the module: functional_call ties them)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    if len({id(p) for p in params.values()}) != len(params) or set(names) - set(params):
        return None
    out = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        out.append((module.get_submodule(prefix)._parameters, attr))
    return out


def call_with(module: torch.nn.Module, sites: list[tuple[dict, str]], leaves: list[torch.Tensor],
              x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """module(x, **kwargs) with `leaves` as its parameters (at `sites`, from param_sites), the module's own
    put back afterwards, as functional_call does."""
    originals = [d[k] for d, k in sites]
    try:
        for (d, k), leaf in zip(sites, leaves):
            d[k] = leaf
        return module(x, **kwargs)
    finally:
        for (d, k), orig in zip(sites, originals):
            d[k] = orig
