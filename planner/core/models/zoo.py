"""The named zoo and the one lookup every command uses, :func:`get_model`.

Models come from three places:

* the named zoo :data:`MODELS` (GPT-3 paper family, the GPT-65B/70B shapes of the seed papers, LLaMA-2, and
  two tiny models for tests and demos), looked up case-insensitively;
* a Hugging Face ``config.json`` (or a directory holding one), read by
  :func:`~tierflow.planner.core.models.hfconfig.from_hf_config` for the ``model_type`` kinds the registered
  families read;
* a hub id (``org/name``) whose config.json is in the local Hugging Face cache (nothing is downloaded).

:func:`register_model` adds a model to the zoo (a family's own named models, or a test's).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from tierflow.planner.core.models.gpt import gpt_model
from tierflow.planner.core.models.hfconfig import from_hf_config
from tierflow.planner.core.models.hub import hub_config_path, is_hub_id
from tierflow.planner.core.models.llama import llama_model
from tierflow.planner.core.models.spec import ModelError, ModelSpec

_ZOO: list[ModelSpec] = [
    # GPT-3 paper (Brown et al. 2020), Table 2.1.
    gpt_model("gpt3-125m", 12, 768, 12),
    gpt_model("gpt3-350m", 24, 1024, 16),
    gpt_model("gpt3-760m", 24, 1536, 16),
    # The paper lists 1.3B ("XL") as d_model 2048, n_heads 24, d_head 128, which is inconsistent (24 * 128 =
    # 3072 != 2048); we keep d_model 2048 and d_head 128, i.e. 16 heads.
    gpt_model("gpt3-1.3b", 24, 2048, 16),
    gpt_model("gpt3-2.7b", 32, 2560, 32),  # 32 heads x 80
    gpt_model("gpt3-6.7b", 32, 4096, 32),
    # The paper lists d_model 5140, which its 40 heads do not divide; the seed papers and Megatron use 5120.
    gpt_model("gpt3-13b", 40, 5120, 40),
    gpt_model("gpt3-175b", 96, 12288, 96),
    # GPT-style 65B shape used by the seed papers; gpt-70b is the same shape under the other name they use.
    gpt_model("gpt-65b", 80, 8192, 64),
    gpt_model("gpt-70b", 80, 8192, 64),
    # LLaMA-2 (Touvron et al. 2023); 70B uses grouped-query attention with 8 kv heads.
    llama_model("llama2-7b", 32, 4096, 32, 32, 11008),
    llama_model("llama2-13b", 40, 5120, 40, 40, 13824),
    llama_model("llama2-70b", 80, 8192, 64, 8, 28672),
    # LoHan's benchmark models (RC4ML/LoHan gpt_model.py:196-212): the GPT-3 shapes with no LM head, the loss
    # an MSE on the final hidden states. Its published runs (Fuyou 13B 156 TFLOPS, the SSD sweeps) trained
    # these; the executor refuses to train them (a language model needs its head).
    gpt_model("gpt3-13b-lohan", 40, 5120, 40, lm_head=False),
    gpt_model("gpt3-175b-lohan", 96, 12288, 96, lm_head=False),
    # Tiny models for tests and demos.
    gpt_model("tiny-gpt", 4, 128, 4, vocab=256, seq=64, positions=64),
    llama_model("tiny-llama", 4, 128, 4, 2, 344, vocab=256, seq=64),
]

MODELS: dict[str, ModelSpec] = {m.name.lower(): m for m in _ZOO}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add `spec` to the named zoo under its name (which must be new); returns it."""
    key = spec.name.lower()
    if key in MODELS:
        raise ModelError(f"model {spec.name!r} is already in the zoo")
    MODELS[key] = spec
    return spec


def unregister_model(name: str) -> None:
    """Remove the zoo model `name` (added by :func:`register_model`)."""
    if MODELS.pop(name.lower(), None) is None:
        raise ModelError(f"model {name!r} is not in the zoo")


def list_models() -> list[str]:
    """Names of the zoo models, in zoo order (small to large within each family)."""
    return list(MODELS)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(".json") or text.startswith((".", "~"))


def get_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A zoo model by name (case-insensitive), a model read from a config.json file or a model directory
    holding one, or a Hugging Face hub id (``org/name``) found in the local Hugging Face cache (never
    downloaded)."""
    text = os.fspath(name_or_path)
    key = text.strip().lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(text).expanduser()
    if not path.exists() and is_hub_id(text):
        return from_hf_config(hub_config_path(text), name=text)
    if path.exists() or _looks_like_path(text):
        return from_hf_config(path)
    close = difflib.get_close_matches(key, list(MODELS), n=4, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    else:
        hint = f"known models: {', '.join(MODELS)}."
    raise ModelError(f"unknown model {text!r}: {hint} (or give a path to a Hugging Face config.json)")


__all__ = ["MODELS", "get_model", "list_models", "register_model", "unregister_model"]
