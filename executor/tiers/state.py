"""The training state, laid out over the tiers as the plan's placement says.

Every block's parameters form one flat vector (in ``named_parameters()`` order of the block's module), and
each tensor class (compute weights, fp32 master, Adam m, Adam v) of a block is split by element ranges:
``[0, g)`` on the device, ``[g, g+c)`` in host memory, ``[g+c, n)`` on the SSD. Host memory is pinned only for
the compute weights, which cross PCIe; the fp32 master, Adam moments and gradient accumulators never leave the
host and stay pageable. The SSD range is stored as one file per optimizer *part* (the ``1 - alpha`` main step
and the ``alpha`` deferred step each cover a contiguous element range), so each part reads and writes exactly
its own files.

With several data-parallel ranks (dist.py) a TrainState holds this rank's shard of every block only: element
range ``shards[b]`` of the block's flat vector, split over the tiers exactly as above (the ranges in
TierVector and the optimizer parts are then relative to the shard).

Checkpoints of this state (writing, verifying, resuming) are in checkpoint.py.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tierflow.errors import TierflowError
from tierflow.executor.device.base import DeviceBackend
from tierflow.executor.device.factory import as_backend
from tierflow.executor.dist import SINGLE, DistWorld
from tierflow.executor.lora import AdapterLayout, LoraState
from tierflow.executor.models import check_block_state_dicts, hf_key_target, init_weights, make_blocks
from tierflow.executor.tiers.qvector import QTierVector, quantized_class, vector_dtype
from tierflow.executor.tiers.ssd_store import SsdPieces, SsdStore, split_counts
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.placement import Placement, Split


class StateError(TierflowError, ValueError):
    """A checkpoint or initial weights that do not match the plan."""


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class BlockLayout:
    """Parameter slots of every block; which (owner block, element range) each block needs on the GPU."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.templates = make_blocks(spec, "meta", None, None)
        self.slots: list[list[Slot]] = []
        for block in self.templates:
            off, slots = 0, []
            for name, p in block.named_parameters():
                slots.append(Slot(name, tuple(p.shape), off, p.numel()))
                off += p.numel()
            self.slots.append(slots)
        self.numel = [sum(s.numel for s in slots) for slots in self.slots]
        self.head = spec.num_layers + 1
        # LoRA: the adapters of a decoder layer (the same for every layer; None without LoRA)
        self.adapters = AdapterLayout(spec) if spec.lora is not None else None
        wte = next(s for s in self.slots[0] if s.name == "wte.weight")
        self.wte = (wte.offset, wte.offset + wte.numel)

    def owners(self, b: int) -> list[tuple[int, int, int]]:
        """(owner block, lo, hi): the parameters block b computes with. A tied head also uses the embedding's
        wte."""
        out = [(b, 0, self.numel[b])]
        if b == self.head and self.spec.tied_embeddings:
            out.append((0, *self.wte))
        return out

    def params(self, b: int, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of block b's parameters in its flat vector."""
        return {s.name: vec[s.offset: s.offset + s.numel].view(s.shape) for s in self.slots[b]}


def part_ranges(n: int, alpha: float) -> list[tuple[int, int]]:
    """Element ranges of the optimizer parts: the main step first, then the deferred alpha fraction."""
    if alpha <= 0:
        return [(0, n)]
    cut = n - int(round(n * alpha))
    return [(0, cut), (cut, n)]


class TierVector(SsdPieces):
    """One tensor class of one block, split over device / host / SSD by element ranges."""

    def __init__(self, cls: str, block: int, n: int, split: Split, dtype: torch.dtype, backend: DeviceBackend,
                 parts: list[tuple[int, int]], pin: bool) -> None:
        self.cls, self.block, self.n, self.dtype = cls, block, n, dtype
        self.backend, self.device = backend, backend.device
        self.g, self.c, self.s = split_counts(n, split.gpu, split.ssd)
        self.parts = parts
        self.pin = pin  # its host range crosses PCIe (compute weights); master and Adam moments stay pageable
        self.dev: torch.Tensor | None = None
        self.host: torch.Tensor | None = None

    def set_full(self, full: torch.Tensor, ssd: SsdStore | None) -> None:
        """Place a full flat vector (any device/dtype) on the tiers."""
        full = full.detach().reshape(-1)
        self.dev = full[: self.g].to(self.device, self.dtype).clone() if self.g else None
        if self.c:
            self.host = self.backend.host_buffer(self.c, self.dtype, pinned=self.pin)
            self.host.copy_(full[self.g: self.g + self.c].to(self.dtype))
        for name, _j, lo, hi in self.ssd_pieces():
            ssd.write(name, full[lo:hi].to("cpu", self.dtype))

    def get_full(self, ssd: SsdStore | None) -> torch.Tensor:
        """The whole vector on the CPU (reads the SSD files)."""
        out = torch.empty(self.n, dtype=self.dtype)
        if self.g:
            out[: self.g].copy_(self.dev.cpu())
        if self.c:
            out[self.g: self.g + self.c].copy_(self.host)
        for name, _j, lo, hi in self.ssd_pieces():
            out[lo:hi].copy_(ssd.read(name, self.dtype, hi - lo))
        return out

    def ssd_bytes(self) -> int:
        return self.s * torch.empty(0, dtype=self.dtype).element_size()


STATE_CLASSES = ("weights", "master", "adam_m", "adam_v")


class TrainState:
    """Weights, master weights, Adam moments and host gradient accumulators of every block (of this rank's
    shard of every block), on their tiers."""

    def __init__(self, spec: ModelSpec, placement: Placement, alpha: float,
                 device: torch.device | DeviceBackend, compute_dtype: torch.dtype, ssd: SsdStore | None,
                 world: DistWorld = SINGLE) -> None:
        self.backend = as_backend(device)
        self.spec, self.placement, self.device, self.compute_dtype, self.ssd = (
            spec, placement, self.backend.device, compute_dtype, ssd)
        self.world = world
        self.layout = BlockLayout(spec)
        self.shards = [world.shard(n) for n in self.layout.numel]  # [lo, hi) of each block this rank owns
        self.shard_numel = [hi - lo for lo, hi in self.shards]
        self.parts = [part_ranges(n, alpha) for n in self.shard_numel]
        self.vec: dict[str, list[TierVector]] = {}
        fmt = spec.optimizer_states  # the optimizer-state format (tiers/qvector.py)
        # LoRA (executor/lora.py): the base is frozen, its compute-dtype weights only (no master, no moments,
        # no gradients); the adapters and their AdamW states live in `lora`, on the device
        self.lora = LoraState(spec, self.device) if spec.lora is not None else None
        self.classes = ("weights",) if self.lora is not None else STATE_CLASSES
        self.base_hash = hashlib.sha256()  # LoRA: of the base's values as set (base_digest)
        for cls in self.classes:
            split = getattr(placement, cls)
            dtype = vector_dtype(fmt, cls, compute_dtype)
            pin = cls == "weights"
            kind = QTierVector if quantized_class(fmt, cls) else TierVector
            self.vec[cls] = [kind(cls, b, n, split, dtype, self.backend, self.parts[b], pin)
                             for b, n in enumerate(self.shard_numel)]
        # host fp32 gradient accumulators (a GPU optimizer keeps its gradients on the device instead)
        self.grads: list[torch.Tensor | None] = [None] * len(self.layout.numel)
        gs = placement.grads
        self.grad_split = [split_counts(n, 0.0, gs.ssd) for n in self.shard_numel]

    # -- initialisation --------------------------------------------------------------------------------------

    def init_random(self, seed: int) -> None:
        """GPT-2 style initialisation (tierflow.executor.models.build_blocks) under `seed`,
        one block at a time (and a LoRA model's adapters, from their own generator: init_adapters)."""
        torch.manual_seed(seed)
        for b, meta in enumerate(make_blocks(self.spec, "meta", None, None)):
            block = meta.to_empty(device="cpu")
            init_weights(block)  # the same draws, in the same order, as build_blocks
            self.set_block(b, torch.cat([p.detach().reshape(-1) for p in block.parameters()]))
        self.init_adapters(seed)

    def init_adapters(self, seed: int) -> None:
        """A LoRA model's adapters as PEFT initialises them, under `seed` (nothing without LoRA)."""
        if self.lora is not None:
            self.lora.init_random(seed)

    def init_hf(self, directory: str | os.PathLike[str], seed: int = 0) -> str:
        """Load a Hugging Face checkpoint directory (*.safetensors) block by block: only one block's tensors
        are in host memory at a time."""
        from safetensors import safe_open

        d = Path(directory)
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise StateError(f"--init {d}: no *.safetensors files (pass a Hugging Face model directory)")
        where: dict[int, list[tuple[Path, str, str, bool]]] = {}
        for f in files:
            with safe_open(f, framework="pt") as sf:
                for key in sf.keys():
                    target = hf_key_target(self.spec, key)
                    if target is None:
                        continue
                    if target is False:
                        raise StateError(f"--init {d}: {f.name} holds {key!r}, which {self.spec.name} does "
                                         "not have (a checkpoint of another model?)")
                    b, name, transpose = target
                    where.setdefault(b, []).append((f, key, name, transpose))
        for b in range(len(self.layout.numel)):
            sd = {}
            for f, key, name, transpose in where.get(b, []):
                with safe_open(f, framework="pt") as sf:
                    t = sf.get_tensor(key)
                sd[name] = t.t().contiguous() if transpose else t
            blocks = [{} for _ in self.layout.numel]
            blocks[b] = sd
            try:
                check_block_state_dicts(self.spec, blocks, only=[b])
            except ValueError as e:
                raise StateError(f"--init {d}: {e}") from None
            flat = torch.cat([sd[s.name].float().reshape(-1) for s in self.layout.slots[b]])
            self.set_block(b, flat)
        self.init_adapters(seed)
        return f"{d} ({len(files)} safetensors file(s))"

    def set_block(self, b: int, master: torch.Tensor, m: torch.Tensor | None = None,
                  v: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        """Block b's state from whole-block vectors (this rank keeps its shard of them). LoRA: the digest of
        the frozen base (base_digest) takes the whole block, the same on every rank."""
        if self.lora is not None:
            self._hash_base(b, master if weights is None else weights)
        lo, hi = self.shards[b]
        if (lo, hi) != (0, self.layout.numel[b]):
            master, m, v, weights = (x.reshape(-1)[lo:hi] if x is not None else None
                                     for x in (master, m, v, weights))
        self.set_shard(b, master, m, v, weights)

    def set_shard(self, b: int, master: torch.Tensor, m: torch.Tensor | None = None,
                  v: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        """This rank's shard of block b's state (vectors of shard_numel[b] elements)."""
        if self.lora is not None:  # the frozen base: its compute weights only, written to its tiers once
            self.vec["weights"][b].set_full(master if weights is None else weights, self.ssd)
            return
        master = master.float()
        self.vec["master"][b].set_full(master, self.ssd)
        self.vec["adam_m"][b].set_full(torch.zeros_like(master) if m is None else m, self.ssd)
        self.vec["adam_v"][b].set_full(torch.zeros_like(master) if v is None else v, self.ssd)
        W, M = self.vec["weights"][b], self.vec["master"][b]
        if self.weights_alias_master(b) and (
                weights is None or torch.equal(weights.to(master.device, master.dtype), master)):
            W.dev = M.dev  # the compute weights ARE the fp32 master: no copy after each step (adam_gpu)
        else:
            W.set_full(master if weights is None else weights, self.ssd)
        self.reset_grads(b)

    def _hash_base(self, b: int, base: torch.Tensor) -> None:
        self.base_hash.update(f"block {b}:".encode())
        self.base_hash.update(base.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy())

    def base_digest(self) -> str:
        """LoRA: a digest of the frozen base's values (fp32, block by block as set): what a checkpoint of the
        adapters names as the base it needs."""
        return self.base_hash.hexdigest()[:16]

    def weights_alias_master(self, b: int) -> bool:
        """Are block b's compute weights the fp32 master itself? When both lie wholly on the device in the
        same dtype (fp32 compute: a CPU device, or a CUDA run in fp32), the compute copy would equal the
        master bit for bit after every step, as in plain PyTorch, whose parameters are what its optimizer
        updates; one tensor then serves both and the optimizer's copy into the compute weights disappears."""
        if self.lora is not None:
            return False
        W, M = self.vec["weights"][b], self.vec["master"][b]
        return W.dtype == M.dtype and W.g == W.n and M.g == M.n and W.n > 0

    def reset_grads(self, b: int) -> None:
        if self.placement.gpu_optimizer or self.lora is not None:
            self.grads[b] = None
        else:
            # host-only (offload_grads sends the compute dtype through pinned buffers): pageable
            self.grads[b] = self.backend.host_buffer(self.shard_numel[b], torch.float32, pinned=False).zero_()

    # -- inspection ------------------------------------------------------------------------------------------

    def owner_ranges(self, b: int) -> list[tuple[int, int, int]]:
        """(owner, lo, hi): the range of each owner's vector held here that compute on block b needs from this
        rank: layout.owners with one rank; with several, each owner's whole shard (ranges relative to it),
        which the all-gather completes (a tied head gathers all of block 0, of which it reads wte)."""
        owners = self.layout.owners(b)
        if self.world.single:
            return owners
        return [(o, 0, self.shard_numel[o]) for o, _lo, _hi in owners]

    def full(self, cls: str, b: int) -> torch.Tensor:
        """This rank's vector of class `cls` of block b on the CPU (the whole block with one rank,
        else its shard)."""
        return self.vec[cls][b].get_full(self.ssd)

    def gathered(self, cls: str, b: int) -> torch.Tensor:
        """The whole block's vector, gathered from every rank's shard (a collective: every rank calls it)."""
        return self.world.gather_vector(self.full(cls, b), self.layout.numel[b])

    def master_blocks(self) -> list[torch.Tensor]:
        """The whole fp32 master weights of every block (gathered from the ranks: call it on every rank); a
        LoRA model's frozen base, in fp32."""
        cls = "weights" if self.lora is not None else "master"
        return [self.gathered(cls, b).float() for b in range(len(self.layout.numel))]

    def ssd_static_bytes(self) -> int:
        n = sum(v.ssd_bytes() for cls in self.classes for v in self.vec[cls])
        return n + sum(s * 4 for _g, _c, s in self.grad_split)
