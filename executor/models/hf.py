"""Hugging Face checkpoints: reading a transformers state dict into the blocks of
:func:`~tierflow.executor.models.build.build_blocks`, and exporting blocks as a directory
``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Parameter names inside each block equal Hugging Face's (``self_attn.q_proj.weight``, ``attn.c_attn.weight``,
...), so the mapping is mostly prefix stripping; where each family's embedding, head and layers live is its
:class:`~tierflow.executor.models.registry.HFLayout`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from tierflow.executor.models.build import check_supported, make_blocks
from tierflow.executor.models.registry import HFLayout, get_block_family
from tierflow.planner.core.models import ModelSpec

_LAYER_KEY = re.compile(r"^(?:h|layers)\.(\d+)\.(.+)$")
# Non-parameter buffers that older checkpoints saved: GPT-2's causal mask, LLaMA's rotary table.
_IGNORED_KEY = re.compile(
    r"(^|\.)(attn\.bias|attn\.masked_bias|attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$"
)


def hf_layout(spec: ModelSpec) -> HFLayout:
    """The checkpoint layout of `spec`'s family (ValueError for a family without one)."""
    layout = get_block_family(spec.family).hf
    if layout is None:
        raise ValueError(f"{spec.name}: family {spec.family!r} has no Hugging Face checkpoint layout")
    return layout


def _outer_keys(spec: ModelSpec) -> dict[str, tuple[int, str]]:
    """HF name (without the prefix) -> (block index, our name) of the embedding's and the head's tensors."""
    layout, last = hf_layout(spec), spec.num_layers + 1
    return {**{k: (0, v) for k, v in layout.embedding_keys.items()},
            **{k: (last, v) for k, v in layout.head_keys.items()}}


def hf_key_target(spec: ModelSpec, key: str) -> tuple[int, str, bool] | None | bool:
    """Where a transformers checkpoint tensor goes: (block index, our parameter name, transpose it?), ``None``
    for tensors to skip (buffers, a tied lm_head), ``False`` for a key this model does not have."""
    layout = hf_layout(spec)
    last = spec.num_layers + 1
    if _IGNORED_KEY.search(key):
        return None
    if key in (layout.lm_head, "lm_head.weight"):
        return None if spec.tied_embeddings else (last, "lm_head.weight", False)
    name = key
    for part in layout.prefix.split(".")[:-1]:  # OPT: "model." and "decoder." are each optional
        name = name.removeprefix(part + ".")
    layer = _LAYER_KEY.match(name)
    if layer and int(layer.group(1)) < spec.num_layers:
        sub = layer.group(2)
        return int(layer.group(1)) + 1, sub, sub in layout.conv1d
    outer = _outer_keys(spec)
    if name in outer:
        index, target = outer[name]
        return index, target, False
    return False


def check_block_state_dicts(spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]],
                            only: list[int] | None = None) -> None:
    """Names and shapes of per-block state dicts against the blocks we would build (meta device:
    no memory)."""
    expected = make_blocks(spec, "meta", None, None)
    for i, (block, got) in enumerate(zip(expected, blocks)):
        if only is not None and i not in only:
            continue
        want = {k: tuple(v.shape) for k, v in block.state_dict().items()}
        missing = sorted(set(want) - set(got))
        if missing:
            raise ValueError(f"{spec.name}: block {i} misses {', '.join(missing)} in the state dict")
        for k, t in got.items():
            if k not in want:
                raise ValueError(f"{spec.name}: block {i} has no parameter {k!r}")
            if tuple(t.shape) != want[k]:
                raise ValueError(f"{spec.name}: block {i} {k}: shape {tuple(t.shape)} != expected {want[k]}")


def hf_state_dict_to_blocks(
    spec: ModelSpec, state_dict: Mapping[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """Split a transformers state dict into one state dict per block of :func:`build_blocks`.

    Accepts the ``*ForCausalLM`` of every registered family (``model.`` prefix optional;
    OPT's ``model.decoder.``, GPT-NeoX's ``gpt_neox.``) and ``GPT2LMHeadModel`` (``transformer.`` prefix
    optional, as in the original GPT-2 checkpoints). GPT-2 Conv1D
    weights are transposed; a tied ``lm_head.weight`` is dropped (the head uses the embedding's). Each result
    loads with ``block.load_state_dict(sd)`` (strict); missing, unexpected or mis-shaped tensors raise
    :class:`ValueError`.
    """
    check_supported(spec)
    blocks: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.num_layers + 2)]
    unexpected = []
    for key, tensor in state_dict.items():
        target = hf_key_target(spec, key)
        if target is None:
            continue
        if target is False:
            unexpected.append(key)
            continue
        index, name, transpose = target
        blocks[index][name] = tensor.t().contiguous() if transpose else tensor
    if unexpected:
        raise ValueError(f"{spec.name}: unexpected tensors in the state dict: {', '.join(unexpected[:8])}")
    check_block_state_dicts(spec, blocks)
    return blocks


def blocks_to_hf_state_dict(
    spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_state_dict_to_blocks`: one transformers state dict with the full prefixes
    (``model.``, ``transformer.``, ``model.decoder.``, ``gpt_neox.``); a tied lm_head is left out
    (transformers ties it to the embedding on load), GPT-2 Conv1D weights are transposed back."""
    check_supported(spec)
    check_block_state_dicts(spec, blocks)
    layout = hf_layout(spec)
    prefix, last = layout.prefix, spec.num_layers + 1
    outer = {target: name for name, target in _outer_keys(spec).items()}  # (block, our name) -> HF name
    layer = layout.layers
    out: dict[str, torch.Tensor] = {}
    for i, sd in enumerate(blocks):
        for name, t in sd.items():
            if i == last and name == "lm_head.weight":
                key = layout.lm_head
            elif 0 < i < last:
                key = f"{prefix}{layer}.{i - 1}.{name}"
                if name in layout.conv1d:
                    t = t.t()
            else:
                key = prefix + outer[(i, name)]
            out[key] = t.detach().contiguous()
    return out


def hf_config(spec: ModelSpec) -> dict:
    """The ``config.json`` of the transformers model whose layers compute what tierflow's blocks compute: the
    executor's constants (norm eps 1e-5, rope theta 10000, no dropout) and no special-token ids. Raises
    :class:`ValueError` (one line) for a spec transformers' class for the family cannot express."""
    check_supported(spec)
    layout = hf_layout(spec)
    cfg: dict = {"architectures": [layout.architecture], "model_type": layout.model_type,
                 "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tied_embeddings,
                 "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    cfg.update(layout.config(spec))
    return cfg


def export_hf(spec: ModelSpec, blocks: list[Mapping[str, torch.Tensor]],
              directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (the tensors as given, e.g. fp32 master weights) into
    ``directory``, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Each file is written
    under a temporary name and renamed into place."""
    from safetensors.torch import save_file

    config = hf_config(spec)
    tensors = blocks_to_hf_state_dict(spec, blocks)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as any file this process creates (safetensors writes it owner-only)
    os.replace(tmp, out / "model.safetensors")
    tmp = out / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out


__all__ = ["blocks_to_hf_state_dict", "check_block_state_dicts", "export_hf", "hf_config", "hf_key_target",
           "hf_layout", "hf_state_dict_to_blocks"]
