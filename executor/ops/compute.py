"""The GPU compute ops: fwd, recompute, head, bwd, computing in the weights' dtype (bf16 on CUDA, fp32 on a
CPU device) and adding the weight gradients into fp32 device buffers (grad_buffers.GradBuffers).

A forward of a recomputed block keeps nothing; one of a block that is not recomputed captures autograd's saved
tensors in a Pack that the plan's offload/fetch ops move (entries.py); a recompute rebuilds the block's graph
right before its backward. The loss of each micro-batch is its mean token cross entropy divided by the number
of micro-batches, so the step equals plain PyTorch training of the whole batch; with W data-parallel ranks
(dist.py) its gradient is divided by W too, so that the ranks' summed gradients equal one rank's of the global
batch.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from tierflow.executor.binding import EntryKey
from tierflow.executor.ops.context import OpContext, RoundState
from tierflow.executor.ops.entries import EntryOps
from tierflow.executor.ops.grad_buffers import GradBuffers
from tierflow.executor.ops.weights import OwnerWeights, WeightOps
from tierflow.executor.tiers.packs import Pack
from tierflow.planner.core.graph import Task


class ComputeOps:
    def __init__(self, cx: OpContext, entries: EntryOps, weights: WeightOps, grads: GradBuffers) -> None:
        self.cx, self.entries, self.weights, self.grads = cx, entries, weights, grads
        self.rec = cx.binding.rec
        self.head_block = cx.spec.num_layers + 1
        self.num_mb = cx.cfg.num_micro_batches  # of this rank
        # with W ranks each rank's gradient is 1/W of its mean, so that the reduce-scatter's sum is the whole
        # batch's
        self.grad_scale = self.num_mb * cx.state.world.ranks
        # where each block's parameters live in its template: the leaves are put there directly (what
        # functional_call does, without its per-call name resolution and tying checks: about half of a tiny
        # op's host time); None for a template that shares one parameter under two names (functional_call)
        self.sites = [param_sites(m, [s.name for s in slots])
                      for m, slots in zip(cx.layout.templates, cx.layout.slots)]

    def _leaves(self, b: int, vecs: list[OwnerWeights]) -> list[torch.Tensor]:
        """One autograd leaf per parameter of block b (a view of its owner's resident or fetched weights), in
        the order of layout.slots[b], then a tied head's embedding matrix. A single leaf per flat vector would
        make the backward of every parameter view scatter its gradient into a zero tensor of the whole vector
        (one pass over the block's bytes per parameter); per-parameter leaves get each gradient written once,
        as in plain PyTorch."""
        own = vecs[0]
        leaves = [own.view(s.offset, s.offset + s.numel).view(s.shape).detach().requires_grad_()
                  for s in self.cx.layout.slots[b]]
        if len(vecs) > 1:  # a tied head: block 0's wte range
            wte = vecs[1]
            matrix = wte.view(wte.lo, wte.hi).view(self.cx.spec.vocab_size, -1)
            leaves.append(matrix.detach().requires_grad_())
        return leaves

    def _repoint(self, b: int, leaves: list[torch.Tensor], vecs: list[OwnerWeights]) -> None:
        """Point the leaves of a forward at the weights fetched for the backward (same layout)."""
        for leaf, view in zip(leaves, self._leaves(b, vecs)):
            leaf.data = view.data

    def _call(self, b: int, leaves: list[torch.Tensor], x: torch.Tensor, **kwargs) -> torch.Tensor:
        slots = self.cx.layout.slots[b]
        module = self.cx.layout.templates[b]
        if len(leaves) > len(slots):
            kwargs["tied_weight"] = leaves[-1]
        sites = self.sites[b]
        if sites is None:
            return functional_call(module, {s.name: leaf for s, leaf in zip(slots, leaves)}, (x,), kwargs)
        return call_with(module, sites, leaves, x, kwargs)

    def fwd(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x_key = EntryKey(it, "x", b, m)
        vecs = self.weights.weights(rs, t)
        pack = None
        if b == 0:
            with torch.no_grad():
                out = self._call(0, self._leaves(0, vecs), rs.batches[it][m][0])
        elif self.rec(b):
            x = self.entries.take(rs, t, x_key)
            with torch.no_grad():
                out = self._call(b, self._leaves(b, vecs), x)
        else:  # keep every activation: autograd's saved tensors go into a Pack the plan's ops move
            x = self.entries.take(rs, t, x_key)
            leaves = self._leaves(b, vecs)
            pack = Pack(leaves, own=self.cx.backend.own)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack.pack_hook, pack.unpack_hook)
            with torch.enable_grad(), hooks:
                pack.out = self._call(b, leaves, pack.input(x))
            pack.originals = []
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
        leaves = self._leaves(b, self.weights.weights(rs, t))
        with torch.enable_grad():
            out = self._call(b, leaves, x)
        rs.graphs[(it, b, m)] = (out, x, leaves)
        self.entries.done_with(rs, t, EntryKey(it, "x", b, m))
        self.weights.release(rs, t)

    def head(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        x = self.entries.take(rs, t, EntryKey(it, "x", b, m)).detach().requires_grad_()
        leaves = self._leaves(b, self.weights.weights(rs, t))
        with torch.enable_grad():
            # the head's chunked loss (executor.models.chunked_lm_loss): never the whole fp32 logits
            loss = self._call(b, leaves, x, targets=rs.batches[it][m][1])
            (loss / self.grad_scale).backward()
        rs.loss_sum[it] += loss.detach() / self.num_mb
        self.entries.done_with(rs, t, EntryKey(it, "x", b, m))
        self._leaf_grads(rs, t, leaves)
        self.entries.put(rs, EntryKey(it, "dx", b, m), x.grad)
        self.weights.release(rs, t)

    def bwd(self, rs: RoundState, t: Task) -> None:
        it, b, m = t.iteration, t.block, t.mb
        gout = self.entries.take(rs, t, EntryKey(it, "dx", b + 1, m))
        if b == 0:
            self._embedding_grads(rs, t, gout, rs.batches[it][m][0])
        elif self.rec(b):
            out, x, leaves = rs.graphs.pop((it, b, m))
            torch.autograd.backward(out, gout)
            self._leaf_grads(rs, t, leaves)
            self.entries.put(rs, EntryKey(it, "dx", b, m), x.grad)
        else:
            pack_key = EntryKey(it, "pack", b, m)
            pack = self.entries.take(rs, t, pack_key)
            self._repoint(b, pack.leaves, self.weights.weights(rs, t))
            pack.backward(gout)
            self._leaf_grads(rs, t, pack.leaves)
            self.entries.put(rs, EntryKey(it, "dx", b, m), pack.x_grad.pop())
            pack.restored = pack.out = None
            self.entries.done_with(rs, t, pack_key)
        self.entries.done_with(rs, t, EntryKey(it, "dx", b + 1, m))
        self.weights.release(rs, t)

    def _embedding_grads(self, rs: RoundState, t: Task, gout: torch.Tensor, tokens: torch.Tensor) -> None:
        hidden = self.cx.spec.hidden
        emb = self.cx.layout.templates[0]
        # Gemma scales the token embedding by sqrt(hidden) (rounded to the activations' dtype, as its forward)
        gtok = (gout if emb.scale is None
                else gout * torch.tensor(emb.scale, dtype=gout.dtype, device=gout.device))
        pieces = []
        for s in self.cx.layout.slots[0]:
            g = torch.zeros(s.shape, dtype=torch.float32, device=self.cx.device)
            if s.name == "wte.weight":
                g.index_add_(0, tokens.reshape(-1), gtok.reshape(-1, hidden).float())
            else:  # learned positions: position p (row p + offset: OPT's 2) gets the batch's gradient at p
                g[emb.offset: emb.offset + gout.size(1)] = gout.float().sum(0)
            pieces.append((s.offset, s.offset + s.numel, g))
        self.grads.accumulate(rs, t, 0, pieces)

    def _leaf_grads(self, rs: RoundState, t: Task, leaves: list[torch.Tensor]) -> None:
        """Each leaf's gradient into its owner's fp32 accumulator, at the leaf's range."""
        (b, lo, _hi), *tied = self.cx.layout.owners(t.block)
        slots = self.cx.layout.slots[b]
        self.grads.accumulate(rs, t, b, [(lo + s.offset, lo + s.offset + s.numel, leaf.grad)
                                         for s, leaf in zip(slots, leaves)])
        for o, tlo, thi in tied:
            self.grads.accumulate(rs, t, o, [(tlo, thi, leaves[-1].grad)])


def param_sites(module: torch.nn.Module, names: list[str]) -> list[tuple[dict, str]] | None:
    """For each parameter name of `module` (dotted), the `_parameters` dict that holds it and its key; None
    where two names share one parameter (tied inside the module: functional_call ties them)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    if len({id(p) for p in params.values()}) != len(params) or set(names) - set(params):
        return None
    out = []
    for name in names:
        prefix, _, attr = name.rpartition(".")
        out.append((module.get_submodule(prefix)._parameters, attr))
    return out


def call_with(module: torch.nn.Module, sites: list[tuple[dict, str]], leaves: list[torch.Tensor],
              x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """module(x, **kwargs) with `leaves` as its parameters (at `sites`, from param_sites), the template's own
    put back afterwards, as functional_call does."""
    originals = [d[k] for d, k in sites]
    try:
        for (d, k), leaf in zip(sites, leaves):
            d[k] = leaf
        return module(x, **kwargs)
    finally:
        for (d, k), orig in zip(sites, originals):
            d[k] = orig
