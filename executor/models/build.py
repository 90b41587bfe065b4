"""Building a model from its spec: :func:`build_blocks` returns ``[Embedding, layer_1, ..., layer_L, Head]``.

The executor runs a model *block by block* (embedding, each decoder layer, head) while it streams the weights
between GPU memory, CPU memory and NVMe, so the model is not one monolithic ``nn.Module``: the caller chains
the blocks. Each decoder layer comes from the spec's family (:mod:`tierflow.executor.models.registry`); the
parameter count of every block equals the spec's (``embedding_params``, ``layer_params``,
``final_norm_params + head_params``). :class:`BlockModel` chains the blocks for a plain full forward; it is
the PyTorch reference in correctness tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tierflow.executor.lora import LoraError, check_targets
from tierflow.executor.models.layers import INIT_STD, Embedding, GemmaRMSNorm, Head, RMSNorm
from tierflow.executor.models.lmloss import loss
from tierflow.executor.models.registry import block_family_names, get_block_family, is_block_family
from tierflow.planner.core.models import ModelSpec

_WHY_UNSUPPORTED = {
    "gemma2": "Gemma2 soft-caps attention and final logits and scales queries by query_pre_attn_scalar; the "
              "model spec does not carry those constants, so its logits could not match the checkpoint's",
}


def check_supported(spec: ModelSpec) -> None:
    """Raise :class:`NotImplementedError` (one line) if the executor cannot build ``spec``."""

    def no(what: str) -> NotImplementedError:
        return NotImplementedError(
            f"tierflow.executor.models: model {spec.name!r} (family {spec.family!r}): {what}")

    if not is_block_family(spec.family):
        why = _WHY_UNSUPPORTED.get(spec.family, "unknown family")
        raise no(f"not supported yet ({why}); supported families: {', '.join(block_family_names())}")
    family = get_block_family(spec.family)
    why = family.refuse(spec)
    if why:
        raise no(why)
    if not family.opt_positions and (spec.embed_proj_dim or spec.position_offset or not spec.final_norm):
        raise no("OPT-only features (embed_proj_dim, position_offset, no final norm) outside an OPT model")
    if not spec.norm_affine:
        raise no("norms without weights (layer_norm_elementwise_affine=false) are not implemented")
    if spec.sandwich_norm or (spec.qk_norm and not family.qk_norm):
        raise no("sandwich norms (Gemma2) and qk-norm outside Qwen3 are not implemented")
    if spec.rotary_fraction != 1.0 and not family.partial_rotary:
        raise no("partial rotary embeddings are implemented for GPT-NeoX and Phi-3 only")
    if not spec.lm_head:
        raise no("a model without an lm_head (a benchmark stand-in whose loss is on the hidden states) is "
                 "simulated, not trained")
    if spec.lora is not None:
        try:
            check_targets(spec, spec.lora)
        except LoraError as e:
            raise no(str(e)) from None


def make_blocks(
    spec: ModelSpec, device, norm_eps: float | None = None, rope_theta: float | None = None
) -> list[nn.Module]:
    """Uninitialised blocks (meant for ``device="meta"``): the layout every block's parameters have."""
    check_supported(spec)
    make_layer = get_block_family(spec.family).make_layer
    layers = [make_layer(spec, norm_eps=norm_eps, rope_theta=rope_theta, device=device)
              for _ in range(spec.num_layers)]
    return [Embedding(spec, device=device), *layers, Head(spec, norm_eps=norm_eps, device=device)]


@torch.no_grad()
def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """GPT-2 style init: Linear/Embedding weights ~ N(0, std), biases 0, norm weights 1 (in module order)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, GemmaRMSNorm):  # scales by 1 + weight: zero is the identity
            nn.init.zeros_(m.weight)
        elif isinstance(m, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def build_blocks(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    norm_eps: float | None = None,
    rope_theta: float | None = None,
) -> list[nn.Module]:
    """``[Embedding, block_1, ..., block_L, Head]`` for ``spec``, initialised GPT-2 style.

    Weights are drawn in float32 on the CPU generator (in block order) and then moved to ``device``/``dtype``,
    so a given ``torch.manual_seed`` gives the same weights on every device and dtype. ``norm_eps`` and
    ``rope_theta`` default to :data:`LAYERNORM_EPS`/:data:`RMSNORM_EPS` and :data:`ROPE_THETA`.
    """
    blocks = make_blocks(spec, "meta", norm_eps, rope_theta)
    out = []
    for block in blocks:
        block = block.to_empty(device="cpu")
        init_weights(block)
        out.append(block.to(device=device, dtype=dtype))
    return out


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class BlockModel(nn.Module):
    """The blocks chained into one plain model: the PyTorch reference for correctness tests."""

    def __init__(
        self,
        spec: ModelSpec,
        blocks: list[nn.Module] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        norm_eps: float | None = None,
        rope_theta: float | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        if blocks is None:
            blocks = build_blocks(spec, dtype, device, norm_eps=norm_eps, rope_theta=rope_theta)
        if len(blocks) != spec.num_layers + 2:
            raise ValueError(f"expected {spec.num_layers + 2} blocks for {spec.name!r}, got {len(blocks)}")
        self.blocks = nn.ModuleList(blocks)

    @property
    def embedding(self) -> Embedding:
        return self.blocks[0]

    @property
    def head(self) -> Head:
        return self.blocks[-1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks[1:-1]:
            x = block(x)
        tied = self.embedding.wte.weight if self.spec.tied_embeddings else None
        return self.head(x, tied_weight=tied)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(self(tokens), targets)

    def load_block_state_dicts(self, state_dicts: list[Mapping[str, torch.Tensor]]) -> None:
        """Load the output of :func:`hf_state_dict_to_blocks` (strictly)."""
        for block, sd in zip(self.blocks, state_dicts, strict=True):
            block.load_state_dict(sd)


__all__ = ["BlockModel", "build_blocks", "check_supported", "init_weights", "make_blocks", "param_count"]
