"""The GPU compute ops: fwd, recompute, head, bwd, computing in the weights' dtype (bf16 on CUDA, fp32 on a
CPU device) and adding the weight gradients into fp32 device buffers (grad_buffers.GradBuffers).

A forward of a recomputed block keeps nothing; one of a block that is not recomputed captures autograd's
saved tensors in a Pack that the plan's offload/fetch ops move (entries.py), or, where no op moves it and the
weights are resident, leaves them to autograd (Pack.kept); a recompute rebuilds the block's graph right
before its backward. The weights are autograd leaves made once where resident (params.BlockParams); a
backward returns the gradients of the leaves it asks for (packs.grads_of, no `.grad`), and the block's weight
gradients go into their buffer as one flat vector (GradBuffers.add: the first contribution becomes the
buffer). The loss of each micro-batch is its mean token cross entropy divided by the number of
micro-batches, so the step equals plain PyTorch training of the whole batch; with W data-parallel ranks
(dist.py) its gradient is divided by W too, so that the ranks' summed gradients equal one rank's of the global
batch.
"""

from __future__ import annotations

import torch

from tierflow.executor.binding import EntryKey
from tierflow.executor.device.base import DeviceBackend
from tierflow.executor.lora import DropoutKey, attach
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.entries import EntryOps
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.params import BlockParams, adapter_leaves
from tierflow.executor.ops.weights import WeightOps
from tierflow.executor.tiers.packs import Pack, grads_of
from tierflow.planner.core.graph import Task
from tierflow.planner.core.opkinds import ENTRY_KINDS

_set_grad_enabled = torch._C._set_grad_enabled


class _GradMode:
    """torch.no_grad() / enable_grad() as the compute ops use them (a block's forward), without their Python
    layers (no_grad's entry alone costs several microseconds: a class made per use, a scripting check and
    set_grad_enabled, another such class): the same two calls, the mode read and set, then put back."""

    __slots__ = ("on", "prev")

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        _set_grad_enabled(self.on)

    def __exit__(self, *exc) -> None:
        _set_grad_enabled(self.prev)


class ComputeOps:
    def __init__(self, cx: OpContext, entries: EntryOps, weights: WeightOps, grads: GradBuffers) -> None:
        self.cx, self.entries, self.weights, self.grads = cx, entries, weights, grads
        self.rec = cx.binding.rec
        self.head_block = cx.spec.num_layers + 1
        self.num_mb = cx.cfg.num_micro_batches  # of this rank
        # with W ranks each rank's gradient is 1/W of its mean, so that the reduce-scatter's sum is the whole
        # batch's
        self.grad_scale = self.num_mb * cx.state.world.ranks
        layout = cx.layout
        wte_lo, wte_hi = layout.wte
        tied = ((cx.spec.vocab_size, (wte_hi - wte_lo) // cx.spec.vocab_size)
                if len(layout.owners(self.head_block)) > 1 else None)  # a tied head's embedding matrix
        lora = cx.state.lora  # LoRA (executor/lora.py): the base frozen, the adapters the only gradients
        self.params = [BlockParams(m, slots, tied if b == self.head_block else None, trainable=lora is None)
                       for b, (m, slots) in enumerate(zip(layout.templates, layout.slots))]
        # per decoder layer: its adapters' (A, B) leaves, made once over the LoRA state's vectors, and the
        # hooks that add them to the layer's projections; the dropout masks' key (step, layer, micro-batch)
        self.adapters: dict[int, list[torch.Tensor]] = {}
        # (the global index of this rank's first micro-batch: W ranks drop what one rank drops)
        self.dropout_key = DropoutKey(lora.seed if lora is not None else 0, cx.state.world.rank * self.num_mb)
        if lora is not None:
            for b in layout.adapters.blocks():
                pairs = adapter_leaves(lora.master[b], layout.adapters.views(lora.master[b]))
                attach(self.params[b].module, layout.adapters, pairs, self.dropout_key)
                self.adapters[b] = [x for pair in pairs for x in pair]
        # the entries an offload moves: a pack of any other is kept by autograd itself (Pack.kept)
        self.moved = {cx.binding.entry_key(t) for t in cx.binding.tasks if t.kind in ENTRY_KINDS["offload"]}
        # (block, input geometry) -> the saved tensors' layout a seal found (tiers/packs.PackLayout)
        self.pack_layouts: dict[tuple, object] = {}
        # (owner, lo, hi) per block: the owners of the weights it computes with (layout.owners)
        self.owners = [layout.owners(b) for b in range(len(layout.slots))]
        self.recomputed = [self.rec(b) for b in range(len(layout.slots))]  # per block: cfg.recomputes
        # the backend's own() for the packs' saved tensors; None where it is the identity (no call per tensor)
        own = type(cx.backend).own
        self.own = None if own is DeviceBackend.own else cx.backend.own

    def trainable(self, b: int, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves whose gradients block b's backward computes: its weights, or under LoRA its adapters
        (none for the frozen embedding and head)."""
        if self.cx.state.lora is None:
            return leaves
        return self.adapters.get(b, [])

    def _at(self, rs: RoundState, t: Task) -> None:
        """Which (step, layer, micro-batch) the adapters' dropout masks are drawn for."""
        self.dropout_key.at = (rs.step0 + t.iteration, t.block, t.mb)

    def fwd(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x_key = EntryKey(it, "x", b, m)
        p = self.params[b]
        leaves = p.leaves(self.weights.weights(rs, t))
        self._at(rs, t)
        pack = None
        if b == 0:
            with _GradMode(False):
                out = p.call(leaves, rs.batches[it][m][0])
        elif self.recomputed[b]:
            x = self.entries.take(rs, t, x_key)
            with _GradMode(False):
                out = p.call(leaves, x)
        else:  # keep every activation: autograd's saved tensors go into a Pack the plan's ops move
            x = self.entries.take(rs, t, x_key)
            resident = p.is_resident(leaves)
            kept = resident and EntryKey(it, "pack", b, m) not in self.moved
            layouts = key = None
            if resident and not kept:  # saved as the block's last forward on such an input saved (PackLayout)
                layouts = self.pack_layouts
                key = (b, x.shape, x.stride(), x.storage_offset(), x.untyped_storage().nbytes(), x.dtype)
            pack = Pack(leaves, own=self.own, kept=kept, trainable=self.adapters.get(b),
                        layouts=layouts, key=key)
            if kept:
                with _GradMode(True):
                    pack.out = p.call(leaves, pack.input(x))
            else:
                hooks = torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook)
                with _GradMode(True), hooks:
                    pack.out = p.call(leaves, pack.input(x))
                pack.seal()
                if not p.is_resident(leaves):
                    for leaf in leaves:  # the weight buffer is not kept: backward gets its own fetch
                        leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            self.entries.put(rs, EntryKey(it, "pack", b, m), pack=pack)
            out = pack.out
        if b >= 1:
            self.entries.done_with(rs, t, x_key)
        self.entries.put(rs, EntryKey(it, "x", b + 1, m), out.detach())
        if pack is not None:
            # the plan frees it with the next layer's input, not at this layer's backward
            pack.release_output()
        self.weights.release(rs, t)

    def recompute(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x = self.entries.take(rs, t, EntryKey(it, "x", b, m)).detach().requires_grad_()
        p = self.params[b]
        leaves = p.leaves(self.weights.weights(rs, t))
        self._at(rs, t)
        with _GradMode(True):
            out = p.call(leaves, x)
        rs.graphs[(it, b, m)] = (out, x, self.trainable(b, leaves))
        self.entries.done_with(rs, t, EntryKey(it, "x", b, m))
        self.weights.release(rs, t)

    def head(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x = self.entries.take(rs, t, EntryKey(it, "x", b, m)).detach().requires_grad_()
        p = self.params[b]
        leaves = p.leaves(self.weights.weights(rs, t))
        with _GradMode(True):
            # the head's chunked loss (executor.models.chunked_lm_loss): never the whole fp32 logits
            loss = p.call(leaves, x, targets=rs.batches[it][m][1])
            scaled = loss / self.grad_scale
            # backward()'s seed of a scalar loss, made per call: a tensor made once would be one a CUDA graph
            # capture of the head (executor/graphs.py) did not allocate
            wrt = self.trainable(b, leaves)
            *grads, dx = grads_of((scaled,), (torch.ones_like(scaled, memory_format=torch.preserve_format),),
                                  (*wrt, x))
        rs.loss_sum[it] += loss.detach() / self.num_mb
        self.entries.done_with(rs, t, EntryKey(it, "x", b, m))
        if wrt:
            self._weight_grads(rs, t, leaves, grads)
        self.entries.put(rs, EntryKey(it, "dx", b, m), dx)
        self.weights.release(rs, t)

    def bwd(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        gout = self.entries.take(rs, t, EntryKey(it, "dx", b + 1, m))
        if b == 0:
            if self.cx.state.lora is None:  # (LoRA: a frozen embedding)
                self._embedding_grads(rs, t, gout, rs.batches[it][m][0])
        elif self.recomputed[b]:
            out, x, leaves = rs.graphs.pop((it, b, m))
            *grads, dx = grads_of((out,), (gout,), (*leaves, x))
            self._weight_grads(rs, t, leaves, grads)
            self.entries.put(rs, EntryKey(it, "dx", b, m), dx)
        else:
            pack_key = EntryKey(it, "pack", b, m)
            pack = self.entries.take(rs, t, pack_key)
            p = self.params[b]
            if not p.is_resident(pack.leaves):  # the forward's leaves, pointed at the backward's fetch
                for leaf, now in zip(pack.leaves, p.leaves(self.weights.weights(rs, t))):
                    leaf.data = now.data
            grads, dx = pack.grads(gout)
            self._weight_grads(rs, t, pack.leaves, grads)
            self.entries.put(rs, EntryKey(it, "dx", b, m), dx)
            pack.refs = pack.out = pack.x = None
            self.entries.done_with(rs, t, pack_key)
        self.entries.done_with(rs, t, EntryKey(it, "dx", b + 1, m))
        self.weights.release(rs, t)

    def _embedding_grads(self, rs: RoundState, t: Task, gout: torch.Tensor, tokens: torch.Tensor) -> None:
        """The embedding's gradients as one flat fp32 vector of block 0 (its slots in order)."""
        hidden = self.cx.spec.hidden
        emb = self.params[0].module
        # Gemma scales the token embedding by sqrt(hidden) (rounded to the activations' dtype, as its forward)
        gtok = (gout if emb.scale is None
                else gout * torch.tensor(emb.scale, dtype=gout.dtype, device=gout.device))
        _o, lo, hi = self.owners[0][0]
        flat = torch.zeros(hi - lo, dtype=torch.float32, device=self.cx.device)
        for s in self.cx.layout.slots[0]:
            g = flat[s.offset: s.offset + s.numel].view(s.shape)
            if s.name == "wte.weight":
                g.index_add_(0, tokens.reshape(-1), gtok.reshape(-1, hidden).float())
            else:  # learned positions: position p (row p + offset: OPT's 2) gets the batch's gradient at p
                g[emb.offset: emb.offset + gout.size(1)] = gout.float().sum(0)
        self.grads.add(rs, t, 0, lo, hi, flat)

    def _weight_grads(self, rs: RoundState, t: Task, leaves: list[torch.Tensor],
                      grads: list[torch.Tensor | None]) -> None:
        """The weight gradients (one per leaf; None: a parameter the step did not use, a zero gradient) into
        their owners' buffers: the block's own as one flat vector of its slots in order, a tied head's
        embedding matrix into block 0's wte range. (Adding a later micro-batch's gradients into the buffer's
        views with one _foreach_add_ instead of flattening them first was slower on the CPU: 88-109 against
        47-59 us for a tiny-gpt block, a loop of 12 adds against one copy and one add; on CUDA, with bf16
        gradients into fp32 views, it would be 12 kernels, not one fused one.)"""
        if self.cx.state.lora is not None:
            self._adapter_grads(rs, t, grads)
            return
        (b, lo, hi), *tied = self.owners[t.block]
        n = len(self.cx.layout.slots[b])
        own = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads[:n], leaves)]
        self.grads.add(rs, t, b, lo, hi, torch._C._nn.flatten_dense_tensors(own))
        for o, tlo, thi in tied:
            g = grads[n] if grads[n] is not None else torch.zeros_like(leaves[n])
            self.grads.add(rs, t, o, tlo, thi, g.reshape(-1))

    def _adapter_grads(self, rs: RoundState, t: Task, grads: list[torch.Tensor | None]) -> None:
        """LoRA: a decoder layer's adapter gradients, one flat fp32 vector of its adapter layout, into the
        buffer its adam_gpu takes."""
        b = t.block
        own = [(g if g is not None else torch.zeros_like(a)).float()
               for g, a in zip(grads, self.adapters[b])]
        n = self.cx.layout.adapters.numel
        self.grads.add(rs, t, b, 0, n, torch._C._nn.flatten_dense_tensors(own))
