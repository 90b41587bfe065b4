"""Reading a Hugging Face ``config.json`` into a :class:`~tierflow.planner.core.models.spec.ModelSpec`.

:func:`from_hf_config` reads the file, finds the family registered for its ``model_type``
(:func:`~tierflow.planner.core.models.registry.hf_family`) and hands that family's reader an
:class:`HFConfig`: typed access to the keys with transformers' defaults for that ``model_type`` and
one-line errors naming the file. The helpers below (:func:`head_shape`, :func:`sliding_window`, ...) are
shared by several families' readers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tierflow.hwprofiles.inputs import MIB, InputLimitError, loads_json_limited, read_limited_text
from tierflow.planner.core.models.registry import Family, hf_family, hf_model_types
from tierflow.planner.core.models.spec import ModelError, ModelSpec

# Rotary models advertise very long context windows (Mistral: 131072, Qwen2: 32768) that are not a sensible
# default *training* length; configs read from config.json train at min(max_position_embeddings, this).
DEFAULT_MAX_TRAIN_SEQ = 4096
MAX_CONFIG_BYTES = 16 * MIB  # a config.json is a few KiB


class HFConfig:
    """Typed access to one config.json with transformers' defaults and one-line errors naming the file."""

    def __init__(self, source: Path, data: dict[str, Any], family: Family) -> None:
        self.source = source
        self.data = data
        self.defaults = family.hf_defaults
        self.aliases = family.hf_aliases
        self.kind = family.hf_model_type

    def raw(self, key: str) -> Any:
        if key in self.data:
            return self.data[key]
        alias = self.aliases.get(key)
        if alias and alias in self.data:
            return self.data[alias]
        return self.defaults[key]

    def get_int(self, key: str, *, optional: bool = False, positive: bool = True) -> int | None:
        value = self.raw(key)
        if value is None and optional:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0):
            raise ModelError(f"{self.source}: {key}: expected a positive integer, got {value!r}")
        return value

    def get_bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise ModelError(f"{self.source}: {key}: expected true or false, got {value!r}")
        return value

    def get_str(self, key: str) -> str:
        value = self.raw(key)
        return value if isinstance(value, str) else ""


def _config_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if p.exists() and not p.is_file():
        raise ModelError(f"{p}: is not a regular file (give a Hugging Face config.json)")
    if not p.is_file():
        raise ModelError(f"{p}: model config not found (give a zoo name or a Hugging Face config.json)")
    return p


_MOE = "a mixture-of-experts MLP (tierflow's layer has one dense MLP, and its FLOPs count every weight)"
_ENCODER = "an encoder or encoder-decoder model (tierflow trains decoder-only causal language models)"
# model_type -> why tierflow cannot express it (the unknown rest are just "unsupported")
_WHY_NOT_KINDS = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx",
                     "granitemoe", "phimoe", "jamba"), _MOE),
    **dict.fromkeys(("bert", "roberta", "t5", "bart", "mt5", "electra", "deberta", "deberta-v2"), _ENCODER),
    "phi": "Phi-1/2 layers run attention and MLP in parallel from one LayerNorm (one norm a layer) and its "
           "lm_head has a bias: no tierflow layer shape",
    "gemma3": "a vision-language model (gemma3_text is the text-only kind)",
    "gemma3_text": "not read yet: its layers are expressible (qk-norm, sandwich norms, GeGLU) but 5 of every "
                   "6 slide over a 512- or 1024-token window, so only sequences that short would be modelled "
                   "exactly",
    "mamba": "a state-space model without attention",
}


def unsupported_kind_reason(kind: object) -> str:
    """Why a Hugging Face model_type is refused, when it is known ('' otherwise)."""
    return _WHY_NOT_KINDS.get(kind, "") if isinstance(kind, str) else ""


def from_hf_config(path: str | os.PathLike[str], name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a directory containing one) into a :class:`ModelSpec`.

    Supported ``model_type``: those the registered families read (``SUPPORTED_HF_KINDS`` for the built-in
    ones). Keys that the file leaves out take transformers' defaults for that model type. The name is the
    directory name for ``config.json`` files, else the file stem, unless ``name`` is given (a hub id). The
    default training sequence is the learned position table (gpt2, opt) or ``min(max_position_embeddings,
    4096)`` for rotary models.
    """
    file = _config_file(path)
    try:
        data = loads_json_limited(read_limited_text(file, MAX_CONFIG_BYTES))
    except InputLimitError as exc:
        raise ModelError(f"{file}: {exc} (give a Hugging Face config.json)") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise ModelError(f"{file}: cannot read JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{file}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("model_type")
    family = hf_family(kind)
    if family is None:
        why = f": {unsupported_kind_reason(kind)}" if unsupported_kind_reason(kind) else ""
        raise ModelError(
            f"{file}: unsupported model_type {kind!r}{why} (supported: {', '.join(hf_model_types())})"
        )
    name = name or (file.resolve().parent.name if file.name == "config.json" else file.stem) or kind
    cfg = HFConfig(file, data, family)
    try:
        return family.from_hf(name, cfg)
    except ModelError as exc:
        msg = str(exc)
        raise ModelError(msg if msg.startswith(str(file)) else f"{file}: {msg}") from None


# ------------------------------------------------------------------------------------------------------------
# Helpers the families' readers share
# ------------------------------------------------------------------------------------------------------------


def activation(name: str, default: str) -> str:
    """A plain MLP's activation from transformers' name (relu, any gelu), else `default`."""
    name = name.lower()
    if name == "relu":
        return "relu"
    if name.startswith("gelu"):
        return "gelu"
    return default


def train_seq(max_pos: int) -> int:
    """The default training sequence of a rotary model with `max_pos` positions."""
    return min(max_pos, DEFAULT_MAX_TRAIN_SEQ)


def head_shape(cfg: HFConfig, hidden: int, heads: int, kv_heads: int | None) -> tuple[int, int]:
    """(head_dim, kv heads): head_dim from the config where the kind has its own, else hidden / heads."""
    # gemma, gemma2 and qwen3 default to a head_dim of their own (256, 256, 128), not hidden / heads
    own_head_dim = "head_dim" in cfg.data or cfg.defaults.get("head_dim")
    head_dim = cfg.get_int("head_dim", optional=True) if own_head_dim else None
    if head_dim is None:
        if hidden % heads:
            raise ModelError(
                f"{cfg.source}: num_attention_heads {heads} does not divide hidden_size {hidden}"
            )
        head_dim = hidden // heads
    return head_dim, kv_heads if kv_heads is not None else heads


def rotary_fraction(cfg: HFConfig, legacy_key: str, default: float) -> float:
    """Share of head_dim that rotary positions rotate: ``rope_parameters.partial_rotary_factor`` (transformers
    5), else the legacy top-level key (GPT-NeoX ``rotary_pct``, Phi-3 ``partial_rotary_factor``), else
    ``default``."""
    rope = cfg.data.get("rope_parameters")
    value = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if value is None:
        value = cfg.data.get(legacy_key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ModelError(f"{cfg.source}: {legacy_key}: expected a number in (0, 1], got {value!r}")
    return float(value)


def gated_activation(cfg: HFConfig, key: str) -> str:
    """SwiGLU for a silu gate, GeGLU for a GELU gate (Gemma's gelu_pytorch_tanh); other gates are refused."""
    act = cfg.get_str(key).lower()
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    raise ModelError(f"{cfg.source}: {key}: gated MLP with {cfg.raw(key)!r} is not modelled (silu or gelu "
                     "gates only)")


def sliding_window(cfg: HFConfig) -> int:
    """The window of the layers that slide (0: none do). Qwen slides only with use_sliding_window, from layer
    max_window_layers on; Gemma2 on the layers layer_types names sliding_attention (every other one by
    default)."""
    if cfg.raw("sliding_window") is None:
        return 0
    window = cfg.get_int("sliding_window")
    types = cfg.raw("layer_types") if "layer_types" in cfg.defaults else None
    if isinstance(types, list):
        return window if "sliding_attention" in types else 0
    if cfg.kind in ("qwen2", "qwen3") and (
        not cfg.get_bool("use_sliding_window")
        or cfg.get_int("max_window_layers", positive=False) >= cfg.get_int("num_hidden_layers")
    ):
        return 0
    return window


__all__ = ["DEFAULT_MAX_TRAIN_SEQ", "MAX_CONFIG_BYTES", "HFConfig", "activation", "from_hf_config",
           "gated_activation", "head_shape", "rotary_fraction", "sliding_window", "train_seq",
           "unsupported_kind_reason"]
