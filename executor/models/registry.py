"""The model families the executor can build, as plug-ins: each family module registers one
:class:`BlockFamily`, as torchtitan's model folders register a train spec.

A family gives the executor its decoder layer (``make_layer``), what it refuses to build (``refuse``), the
layout of its Hugging Face checkpoints and ``config.json`` (:class:`HFLayout`) and a few flags that shared
code reads (Gemma's norms and embedding scale, qk-norm, partial rotary, OPT's position layout). The planner's
side of the same family is in :mod:`tierflow.planner.core.models` (its shapes and parameter counts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierflow.errors import TierflowError
from tierflow.planner.core.models import ModelSpec


class BlockRegistryError(TierflowError, ValueError):
    """A family registered twice, or looked up but never registered."""


@dataclass(frozen=True)
class HFLayout:
    """Where a family's tensors live in a transformers checkpoint, and its ``config.json``."""

    model_type: str
    architecture: str  # the transformers class with the same layers (``LlamaForCausalLM``)
    prefix: str  # the base model's prefix, e.g. "model." (optional when reading)
    embedding_keys: Mapping[str, str]  # HF name (no prefix) -> our name in the embedding block
    head_keys: Mapping[str, str]  # HF name (no prefix) -> our name in the head block
    # spec -> the family's keys of config.json (beyond the common ones); ValueError (export_refused) when
    # transformers' class cannot express the spec
    config: Callable[[ModelSpec], dict[str, Any]]
    layers: str = "layers"  # the decoder layers' list: "layers", GPT-2's "h"
    lm_head: str = "lm_head.weight"  # the lm_head's name as written on export
    conv1d: tuple[str, ...] = ()  # layer tensors stored transposed (GPT-2's Conv1D)


@dataclass(frozen=True)
class BlockFamily:
    """One model family as the executor builds it."""

    name: str
    # (spec, *, norm_eps, rope_theta, device) -> one decoder layer (an nn.Module, parameters named as HF's)
    make_layer: Callable[..., Any]
    refuse: Callable[[ModelSpec], str]  # '' when the layer builds `spec`, else why not (one line)
    hf: HFLayout | None = None  # None: no Hugging Face import or export
    gemma_norms: bool = False  # RMSNorms scale by 1 + weight and the embedding by sqrt(hidden)
    qk_norm: bool = False  # the layer implements an RMSNorm over each query and key head
    partial_rotary: bool = False  # the layer implements rotary_fraction < 1
    opt_positions: bool = False  # the family handles position_offset, embed_proj_dim and final_norm itself


_FAMILIES: dict[str, BlockFamily] = {}


def register_block_family(family: BlockFamily) -> BlockFamily:
    """Add `family` (its name must be new); returns it."""
    if family.name in _FAMILIES:
        raise BlockRegistryError(f"executor model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def unregister_block_family(name: str) -> None:
    if name not in _FAMILIES:
        raise BlockRegistryError(f"executor model family {name!r} is not registered")
    del _FAMILIES[name]


def is_block_family(name: object) -> bool:
    return isinstance(name, str) and name in _FAMILIES


def get_block_family(name: str) -> BlockFamily:
    if name not in _FAMILIES:
        raise BlockRegistryError(f"executor model family {name!r} is not registered "
                                 f"(known: {', '.join(_FAMILIES)})")
    return _FAMILIES[name]


def block_family_names() -> tuple[str, ...]:
    """The families the executor builds, in registration order."""
    return tuple(_FAMILIES)


def export_refused(spec: ModelSpec, why: str) -> ValueError:
    """The one-line error of a spec transformers' class for its family cannot express."""
    return ValueError(f"{spec.name}: cannot export to the Hugging Face layout: {why}")


def classic_heads(spec: ModelSpec) -> bool:
    """Neither grouped-query attention nor a head_dim other than hidden / heads."""
    return spec.num_kv_heads == spec.num_heads and spec.q_dim == spec.hidden


__all__ = ["BlockFamily", "BlockRegistryError", "HFLayout", "block_family_names", "classic_heads",
           "export_refused", "get_block_family", "is_block_family", "register_block_family",
           "unregister_block_family"]
