"""The model zoo: decoder-only transformer shapes and their exact parameter counts, one family a plug-in.

* :mod:`.spec`: :class:`ModelSpec` (shapes, exact parameter counts) and :class:`ModelError`;
* :mod:`.registry`: the families (:class:`Family`, :func:`register_family`);
* one module per family: its layer defaults and its Hugging Face ``config.json`` reader (:mod:`.gpt`,
  :mod:`.llama`, :mod:`.opt`, :mod:`.gpt_neox`, :mod:`.llama_variants`);
* :mod:`.hfconfig` and :mod:`.hub`: reading a ``config.json``, finding one in the local Hugging Face cache;
* :mod:`.zoo`: the named models and :func:`get_model`.

A new family is one module that calls :func:`register_family` plus its line in the registry below (and,
for the executor to train it, one module in ``tierflow.executor.models``); the registry lists the families
in the order messages list them.

    >>> from tierflow.planner.core.models import get_model
    >>> get_model("gpt3-175b").describe()
    'gpt3-175b: 96 layers x 12288 (96 heads), 174.6B params, seq 2048'
"""

from __future__ import annotations

# isort: off
# The registry: one line per family module (importing it registers its families), in the order messages list
# the families.
from tierflow.planner.core.models import gpt  # noqa: F401
from tierflow.planner.core.models import llama  # noqa: F401
from tierflow.planner.core.models import opt  # noqa: F401
from tierflow.planner.core.models import gpt_neox  # noqa: F401
from tierflow.planner.core.models import llama_variants  # noqa: F401
# isort: on
from tierflow.planner.core.models.hfconfig import (
    DEFAULT_MAX_TRAIN_SEQ,
    MAX_CONFIG_BYTES,
    HFConfig,
    from_hf_config,
    unsupported_kind_reason,
)
from tierflow.planner.core.models.hub import find_cached_config, hf_cache_dir, hub_config_path, is_hub_id
from tierflow.planner.core.models.registry import (
    Family,
    RegistryError,
    family_names,
    get_family,
    hf_model_types,
    register_family,
    unregister_family,
)
from tierflow.planner.core.models.spec import (
    ACTIVATIONS,
    NORMS,
    OPTIMIZER_STATE_NAMES,
    PRECISION_NAMES,
    SHAPE_LIMITS,
    ModelError,
    ModelSpec,
    build_spec,
    model_dict,
)
from tierflow.planner.core.models.zoo import MODELS, get_model, list_models, register_model, unregister_model

# the built-in families and the Hugging Face model_types they read (the registry has the live lists)
FAMILIES = family_names()
SUPPORTED_HF_KINDS = hf_model_types()

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_MAX_TRAIN_SEQ",
    "FAMILIES",
    "MAX_CONFIG_BYTES",
    "MODELS",
    "NORMS",
    "OPTIMIZER_STATE_NAMES",
    "PRECISION_NAMES",
    "SHAPE_LIMITS",
    "SUPPORTED_HF_KINDS",
    "Family",
    "HFConfig",
    "ModelError",
    "ModelSpec",
    "RegistryError",
    "build_spec",
    "model_dict",
    "family_names",
    "find_cached_config",
    "from_hf_config",
    "get_family",
    "get_model",
    "hf_cache_dir",
    "hf_model_types",
    "hub_config_path",
    "is_hub_id",
    "list_models",
    "register_family",
    "register_model",
    "unregister_family",
    "unregister_model",
    "unsupported_kind_reason",
]
