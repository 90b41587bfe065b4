"""PyTorch model code for the executor, built from a :class:`tierflow.planner.core.models.ModelSpec`, one
module per block, one family a plug-in (as torchtitan's model folders).

* :mod:`.layers`: what every family shares (norms, attention, rotary positions, gated activations, the
  :class:`Embedding` and the :class:`Head`); :mod:`.lmloss`: the language-model loss;
* :mod:`.registry`: the families (:class:`BlockFamily`, :func:`register_block_family`);
* one module per family: its decoder layer, what it refuses, its Hugging Face layout and ``config.json``
  (:mod:`.gpt`, :mod:`.llama`, :mod:`.phi3`, :mod:`.opt`, :mod:`.gpt_neox`);
* :mod:`.build`: :func:`build_blocks` (``[Embedding, layer_1, ..., layer_L, Head]``), :class:`BlockModel`;
* :mod:`.hf`: Hugging Face import (:func:`hf_state_dict_to_blocks`) and export (:func:`export_hf`).

A new family is one module that calls :func:`register_block_family` plus its line in the registry below
(and its planner side in ``tierflow.planner.core.models``); the registry lists the families in the order
messages list them.
"""

from __future__ import annotations

# isort: off
# The registry: one line per family module (importing it registers its families), in the order messages list
# the families.
from tierflow.executor.models import gpt  # noqa: F401
from tierflow.executor.models import llama  # noqa: F401
from tierflow.executor.models import phi3  # noqa: F401
from tierflow.executor.models import opt  # noqa: F401
from tierflow.executor.models import gpt_neox  # noqa: F401
# isort: on
from tierflow.executor.models.build import (
    BlockModel,
    build_blocks,
    check_supported,
    init_weights,
    make_blocks,
    param_count,
)
from tierflow.executor.models.gpt import GPTBlock
from tierflow.executor.models.gpt_neox import NeoXBlock
from tierflow.executor.models.hf import (
    blocks_to_hf_state_dict,
    check_block_state_dicts,
    export_hf,
    hf_config,
    hf_key_target,
    hf_state_dict_to_blocks,
)
from tierflow.executor.models.layers import (
    INIT_STD,
    LAYERNORM_EPS,
    RMSNORM_EPS,
    ROPE_THETA,
    Embedding,
    GemmaRMSNorm,
    Head,
    RMSNorm,
    apply_rope,
    glu,
    rope_cos_sin,
    save_inputs_only,
)
from tierflow.executor.models.llama import LlamaBlock
from tierflow.executor.models.lmloss import IGNORE_INDEX, chunked_lm_loss, loss
from tierflow.executor.models.opt import OPTBlock
from tierflow.executor.models.phi3 import Phi3Block
from tierflow.executor.models.registry import (
    BlockFamily,
    BlockRegistryError,
    HFLayout,
    block_family_names,
    get_block_family,
    register_block_family,
    unregister_block_family,
)

# the built-in families (the registry has the live list)
SUPPORTED_FAMILIES = block_family_names()

__all__ = [
    "IGNORE_INDEX",
    "INIT_STD",
    "LAYERNORM_EPS",
    "RMSNORM_EPS",
    "ROPE_THETA",
    "SUPPORTED_FAMILIES",
    "BlockFamily",
    "BlockModel",
    "BlockRegistryError",
    "Embedding",
    "GPTBlock",
    "GemmaRMSNorm",
    "HFLayout",
    "Head",
    "LlamaBlock",
    "NeoXBlock",
    "OPTBlock",
    "Phi3Block",
    "RMSNorm",
    "apply_rope",
    "block_family_names",
    "blocks_to_hf_state_dict",
    "build_blocks",
    "check_block_state_dicts",
    "check_supported",
    "chunked_lm_loss",
    "export_hf",
    "get_block_family",
    "glu",
    "hf_config",
    "hf_key_target",
    "hf_state_dict_to_blocks",
    "init_weights",
    "loss",
    "make_blocks",
    "param_count",
    "register_block_family",
    "rope_cos_sin",
    "save_inputs_only",
    "unregister_block_family",
]
