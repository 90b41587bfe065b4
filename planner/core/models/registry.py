"""The model families the planner knows, as plug-ins: each family module registers one :class:`Family`.

A family says what its layers are unless a model says otherwise (norm, MLP activation, biases, positions:
``layer_defaults``, the fields of :class:`~tierflow.planner.core.models.spec.ModelSpec` it fixes) and, when
transformers has a class with the same layers, how a Hugging Face ``config.json`` of that ``model_type`` is
read (``hf_defaults``: transformers' default for every key the reader reads; ``from_hf``: the reader).

    >>> from tierflow.planner.core.models import family_names
    >>> family_names()[:3]
    ('gpt', 'llama', 'mistral')

Families are kept in registration order (the order error messages list them in). Registering a name twice is
an error; :func:`unregister_family` removes one (for tests that plug in a family of their own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierflow.errors import TierflowError


class RegistryError(TierflowError, ValueError):
    """A family registered twice, or looked up but never registered."""


@dataclass(frozen=True)
class Family:
    """One model family as the planner sees it (shapes only, no weights)."""

    name: str
    layer_defaults: Mapping[str, Any]  # ModelSpec fields the family fixes unless a model gives them
    hf_model_type: str = ""  # transformers' model_type with the same layers ('': none read)
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' default of every key read
    hf_aliases: Mapping[str, str] = field(default_factory=dict)  # a key -> the generic name a config may use
    # (name, typed config) -> ModelSpec; the config is a tierflow.planner.core.models.hfconfig.HFConfig
    from_hf: Callable[[str, Any], Any] | None = None
    # the executor scales the token embedding's output (Gemma: by sqrt(hidden)), a copy of it in memory
    scaled_embedding: bool = False


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family` (its name must be new); returns it."""
    if family.name in _FAMILIES:
        raise RegistryError(f"model family {family.name!r} is already registered")
    kind = family.hf_model_type
    if kind and any(f.hf_model_type == kind for f in _FAMILIES.values()):
        raise RegistryError(f"Hugging Face model_type {kind!r} is already read by another family")
    _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove the family `name` (registered before)."""
    if name not in _FAMILIES:
        raise RegistryError(f"model family {name!r} is not registered")
    del _FAMILIES[name]


def get_family(name: str) -> Family:
    if name not in _FAMILIES:
        raise RegistryError(f"model family {name!r} is not registered (known: {', '.join(_FAMILIES)})")
    return _FAMILIES[name]


def is_family(name: object) -> bool:
    return isinstance(name, str) and name in _FAMILIES


def family_names() -> tuple[str, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES)


def hf_family(model_type: object) -> Family | None:
    """The family that reads a Hugging Face ``model_type``, or None."""
    for family in _FAMILIES.values():
        if family.hf_model_type and family.hf_model_type == model_type and family.from_hf is not None:
            return family
    return None


def hf_model_types() -> tuple[str, ...]:
    """Every ``model_type`` some family reads, sorted."""
    return tuple(sorted(f.hf_model_type for f in _FAMILIES.values() if f.hf_model_type and f.from_hf))


__all__ = ["Family", "RegistryError", "family_names", "get_family", "hf_family", "hf_model_types",
           "is_family", "register_family", "unregister_family"]
