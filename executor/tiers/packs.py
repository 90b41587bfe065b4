"""Saved-tensor packs: the tensors autograd saves in the forward of a layer that is not recomputed, captured
with saved_tensors_hooks so that the plan's offload/fetch ops can move them as one flat byte tensor."""

from __future__ import annotations

import torch

PACK_ALIGN = 256  # bytes: alignment of each saved tensor inside a flattened pack

_run_backward = torch.autograd.Variable._execution_engine.run_backward


def grads_of(outputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...],
             inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `inputs` (leaves) from a backward of `outputs` with `grad_outputs`, as
    torch.autograd.grad computes them (the kernels and sums of backward(), which would put them into each
    leaf's `.grad` instead); None for an input the outputs do not depend on."""
    return _run_backward(outputs, grad_outputs, False, False, inputs, allow_unreachable=True,
                         accumulate_grad=False)


class Pack:
    """The tensors autograd saves in the forward of a layer that is not recomputed, captured explicitly with
    saved_tensors_hooks so that the plan's offload/fetch ops can move them. Views of the layer's weights are
    not captured: they are rebuilt from the weights fetched for the backward.

    Saved tensors are kept per *storage*: several saved views of one storage (q, k and v of one fused
    projection; the attention output and the output projection's input) are moved once, as the byte range of
    the storage they cover, and rebuilt as views of it. The offload copies those byte ranges straight into the
    destination buffers: nothing is made contiguous or joined first.

    The hook only lists each saved tensor (its reference is its index); `seal`, once after the forward, sorts
    them into weight views, storages and the rest, in one pass; a fetched pack's views are rebuilt all at once
    (`restore`). The layer input is an autograd leaf whose own memory is dropped at the seal (the pack holds
    what the backward needs, and the plan frees the input after the forward); its gradient is returned by
    `grads`.

    A pack that no op moves (the plan keeps it on the device) and whose weights are resident is `kept`: no
    hooks, autograd keeps its saved tensors itself (they stay where the forward made them, as the moved pack's
    would until its offload)."""

    def __init__(self, leaves: list[torch.Tensor], own=None, kept: bool = False,
                 trainable: list[torch.Tensor] | None = None, layouts: dict | None = None,
                 key: tuple | None = None) -> None:
        self.leaves = leaves
        # the leaves `grads` differentiates: the weights, or (LoRA) the adapters beside frozen weights
        self.trainable = leaves if trainable is None else trainable
        # every weight whose saved views are rebuilt rather than moved ("w" refs index it)
        self.weights = leaves if trainable is None else [*leaves, *trainable]
        self.kept = kept
        self.x: torch.Tensor | None = None  # the layer input (a leaf: input())
        # DeviceBackend.own: saved tensors that the d2h stream will read; None where it is the identity (no
        # call per saved storage)
        self.own = own
        # per saved tensor, in the hooks' order: the tensor until the seal, then its reference (a tuple), a
        # fetched pack's rebuilt view after restore
        self.refs: list = []
        self.sealed = False
        # per distinct storage: its bytes (uint8, the whole storage)
        self.saved: list[torch.Tensor] | None = []
        self.index: dict[int, int] = {}  # data pointer of the original storage -> index in saved
        self.extent: list[list[int]] = []  # per storage: [lo, hi) bytes covered by its saved views
        self.desc: list[tuple[int, int, int]] = []  # per storage: (offset in the flat layout, lo, hi)
        self.out: torch.Tensor | None = None
        # the layouts earlier seals found (PackLayout), shared by the packs of one executor, and this
        # forward's key in them (the block and its input's geometry); None: every seal from scratch
        self.layouts, self.key = layouts, key
        self.layout: PackLayout | None = None  # the one this pack was sealed by
        # saved[k] is storage k's byte range desc[k] [lo, hi) (sealed by a layout that has its flat layout),
        # not the whole storage
        self.ranged = False

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input to run the forward on: a leaf over `x`'s memory, its gradient in `grads`."""
        self.x = x.detach().requires_grad_()
        return self.x

    def pack_hook(self, t: torch.Tensor) -> int:
        self.refs.append(t)
        return len(self.refs) - 1

    def unpack_hook(self, j: int) -> torch.Tensor:
        ref = self.refs[j]
        if not isinstance(ref, tuple):  # rebuilt by restore (or not sealed yet)
            return ref
        if ref[0] == "w":
            leaf = self.weights[ref[1]]
            return leaf.detach().as_strided(ref[3], ref[4], leaf.storage_offset() + ref[2])
        if ref[0] == "c":
            return ref[1]
        return self._view(self.saved[ref[1]], self.desc[ref[1]][1] if self.ranged else 0, ref)

    @staticmethod
    def _view(base: torch.Tensor, base_lo: int, ref: tuple) -> torch.Tensor:
        """Saved view `ref` ("t", storage, byte offset, shape, stride, dtype) of `base`, the storage's bytes
        from byte `base_lo` on."""
        _, _i, off_bytes, shape, stride, dtype = ref
        data = base.view(dtype)
        return data.as_strided(shape, stride, data.storage_offset() + (off_bytes - base_lo) // dtype.itemsize)

    def seal(self) -> None:
        """After the forward (idempotent): each saved tensor's reference, the storages and their extents; the
        input leaf's memory dropped. Views of the weights are not kept (a fetched weight buffer is freed
        after the forward). A forward of the same block on an input of the same geometry with the same
        weight leaves saves the same tensors each time (the same ops on the same shapes): where an earlier
        seal's layout (`layouts[key]`) matches this forward's storages (`PackLayout.apply`), its references
        are taken as they are; otherwise one pass over the saved tensors (~24 per layer, on the op's critical
        path), whose result becomes the key's layout."""
        if self.sealed or self.kept:
            return
        self.sealed = True
        lay = self.layouts.get(self.key) if self.layouts is not None else None
        if lay is None or not lay.apply(self):
            self._seal_refs()
            if self.layouts is not None:
                self.layout = self.layouts[self.key] = PackLayout.of(self)
        if self.x is not None:  # its bytes are in the pack where a saved tensor needs them
            self.x.data = torch.empty(0, dtype=self.x.dtype, device=self.x.device)

    def _seal_refs(self) -> None:
        """Seal's pass over the saved tensors (its lookups bound to locals)."""
        weights = self.weights
        leaf_ptrs: dict[int, int] = {}  # storage data pointer -> its first leaf
        for i, leaf in enumerate(weights):
            leaf_ptrs.setdefault(leaf.untyped_storage().data_ptr(), i)
        device = weights[0].device
        refs, index, extent = self.refs, self.index, self.extent
        for j, t in enumerate(refs):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            i = leaf_ptrs.get(ptr)
            if i is not None:
                refs[j] = ("w", i, t.storage_offset() - weights[i].storage_offset(), t.shape, t.stride())
                continue
            if t.device != device:  # e.g. a CPU scalar (RNG seed) saved by a CUDA kernel: kept as is
                refs[j] = ("c", t)
                continue
            k = index.get(ptr)
            if k is None:
                k = index[ptr] = len(self.saved)
                whole = torch.empty(0, dtype=torch.uint8, device=device).set_(st)
                self.saved.append(whole if self.own is None else self.own(whole))
                extent.append([st.nbytes(), 0])
            dtype = t.dtype
            size = dtype.itemsize
            lo = t.storage_offset() * size
            shape, stride = t.shape, t.stride()
            n = t.numel()
            if n:
                span = n if t.is_contiguous() else 1 + sum((d - 1) * abs(s) for d, s in zip(shape, stride))
                ext = extent[k]
                if lo < ext[0]:
                    ext[0] = lo
                hi = lo + span * size
                if hi > ext[1]:
                    ext[1] = hi
            refs[j] = ("t", k, lo, shape, stride, dtype)

    def _ranges(self) -> list[tuple[int, int]]:
        """Per storage, the byte range [lo, hi) to move: what its saved views cover, widened to 16-byte
        boundaries (so that a view of any dtype stays aligned) within the storage."""
        out = []
        for whole, (lo, hi) in zip(self.saved, self.extent):
            if hi <= lo:
                out.append((0, 0))
                continue
            out.append((lo - lo % 16, min(whole.numel(), hi + (-hi % 16))))
        return out

    def segments(self) -> tuple[list[tuple[int, torch.Tensor]], int]:
        """The saved storages' byte ranges as (byte offset, uint8 view of the device memory) in one flat
        layout (each at a 256-byte aligned offset, as kernels such as fused attention expect of their inputs)
        and its total bytes, without joining or copying them: the offload copies each straight into its slices
        of the destination buffers. Remembers how to rebuild the views (restore)."""
        self.seal()
        lay = self.layout
        if self.ranged:  # the saved ranges of the layout's flat layout
            return [(at, part) for part, (at, _lo, _hi) in zip(self.saved, self.desc)], lay.nbytes
        if lay is not None and lay.desc is not None:  # the layout's (the same storages' sizes and extents)
            self.desc = lay.desc
            return [(at, whole[lo:hi]) for whole, (at, lo, hi) in zip(self.saved, lay.desc)], lay.nbytes
        segs, self.desc, off_bytes = [], [], 0
        for whole, (lo, hi) in zip(self.saved, self._ranges()):
            self.desc.append((off_bytes, lo, hi))
            segs.append((off_bytes, whole[lo:hi]))
            off_bytes += hi - lo
            off_bytes += -off_bytes % PACK_ALIGN
        if lay is not None:
            lay.desc, lay.nbytes = self.desc, off_bytes
            lay.ranges = [(j, lo, hi - lo) for j, (_at, lo, hi) in zip(lay.firsts, self.desc)]
        return segs, off_bytes

    def release_output(self) -> None:
        """Drop the layer output's memory from the pack: its backward needs the output's autograd node, not
        its values (the next layer's input entry holds them for as long as the plan keeps them). Kept if
        autograd saved the output itself."""
        self.seal()
        if self.index and self.out.untyped_storage().data_ptr() in self.index:
            return
        self.out.data = torch.empty(0, dtype=self.out.dtype, device=self.out.device)

    def grads(self, grad_out: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """Backward from the (released) output, without accumulating into `.grad`: the gradients of the
        leaves and of the layer input. The engine checks grad_out against the node's recorded shape."""
        g = grads_of((self.out,), (grad_out,), (*self.trainable, self.x))
        return list(g[:-1]), g[-1]

    def saved_bytes(self) -> int:
        """Bytes this pack moves: the byte ranges of the distinct storages autograd saved
        (without padding)."""
        self.seal()
        if not self.saved:
            return 0
        if self.ranged:
            return sum(part.numel() for part in self.saved)
        return sum(hi - lo for lo, hi in self._ranges())

    def restore(self, flat: torch.Tensor) -> None:
        """The saved views, from the flat byte layout of segments() (fetched back to the device), all rebuilt
        now (the weight views when the backward unpacks them: from its own fetch): each one as_strided of
        `flat` viewed once per dtype (a storage's range starts 256-byte aligned in it and at a 16-byte
        boundary of the storage, so every view's element offset is whole: the views of each range's slice)."""
        # dtype -> (flat as it, its element offset)
        by_dtype: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        refs, desc = self.refs, self.desc
        lay = self.layout
        if lay is not None and lay.views is not None:  # each view's place in the flat layout, found once
            for dtype in lay.dtypes:
                data = flat.view(dtype)
                by_dtype[dtype] = (data, data.storage_offset())
            for j, dtype, shape, stride, at in lay.views:
                data, base = by_dtype[dtype]
                refs[j] = data.as_strided(shape, stride, base + at)
            return
        if lay is not None:
            lay.views = [(j, r[5], r[3], r[4], (desc[r[1]][0] + r[2] - desc[r[1]][1]) // r[5].itemsize)
                         for j, r in enumerate(refs) if isinstance(r, tuple) and r[0] == "t"]
            lay.dtypes = tuple({v[1]: None for v in lay.views})
        for j, ref in enumerate(refs):
            if isinstance(ref, tuple) and ref[0] == "t":
                _, i, off_bytes, shape, stride, dtype = ref
                got = by_dtype.get(dtype)
                if got is None:
                    data = flat.view(dtype)
                    got = by_dtype[dtype] = (data, data.storage_offset())
                at, lo, _hi = desc[i]
                refs[j] = got[0].as_strided(shape, stride, got[1] + (at + off_bytes - lo) // dtype.itemsize)


class PackLayout:
    """What a seal found for one forward (Pack.seal), kept for the next forward with the same key (block,
    input geometry) and the same weight leaves, which saves the same tensors: per saved tensor its storage's
    `pattern` id (a weight leaf's storage: -1 - its first leaf; any other: numbered in order of first
    appearance) and its reference, the first saved tensor of each moved storage (`firsts`) and their
    extents; the flat layout (`desc`, `nbytes`) once segments() has made it and the views' recipe (`views`)
    once restore() has (a pack sealed by a layout with its flat layout keeps only each storage's range to
    move: Pack.ranged). A weight view's reference is the view itself, made once (the resident weights are
    updated in place: it reads their current values, as the view unpack_hook made per backward did)."""

    __slots__ = ("weight_ids", "leaf_ptrs", "pattern", "refs", "cpu_refs", "firsts", "extent", "desc",
                 "nbytes", "views", "dtypes", "ranges", "cuts")

    def __init__(self, weight_ids: tuple[int, ...], leaf_ptrs: dict[int, int], pattern: tuple[int, ...],
                 refs: list, cpu_refs: list[int], firsts: list[int], extent: list[list[int]]) -> None:
        self.weight_ids, self.leaf_ptrs, self.pattern = weight_ids, leaf_ptrs, pattern
        self.refs, self.cpu_refs, self.firsts, self.extent = refs, cpu_refs, firsts, extent
        self.desc: list[tuple[int, int, int]] | None = None
        # per storage (its first saved tensor, lo, bytes): desc's ranges as apply() makes them
        self.ranges: list[tuple[int, int, int]] = []
        self.nbytes = 0
        # (flat buffer bytes) -> the split sizes that cut it into the storages' ranges and the gaps between
        # them, and which piece each range is (entries.scatter, found once per buffer size)
        self.cuts: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
        self.views: list[tuple] | None = None
        self.dtypes: tuple[torch.dtype, ...] = ()

    @staticmethod
    def _pattern(leaf_ptrs: dict[int, int], ptrs: list[int]) -> tuple[int, ...]:
        seen = dict(leaf_ptrs)
        return tuple([seen.setdefault(p, len(seen)) for p in ptrs])

    @classmethod
    def of(cls, pack: Pack) -> PackLayout:
        """The layout of `pack`, sealed by its own pass (its refs are tuples, its storages found)."""
        weights = pack.weights
        leaf_ptrs: dict[int, int] = {}
        for i, leaf in enumerate(weights):
            leaf_ptrs.setdefault(leaf.untyped_storage().data_ptr(), -1 - i)
        firsts, ptrs, refs, cpu_refs = [], [], [], []
        ptr_of = {k: ptr for ptr, k in pack.index.items()}  # storage -> its data pointer
        for j, ref in enumerate(pack.refs):
            kind = ref[0]
            if kind == "w":
                leaf = weights[ref[1]]
                ptrs.append(leaf.untyped_storage().data_ptr())
                refs.append(leaf.detach().as_strided(ref[3], ref[4], leaf.storage_offset() + ref[2]))
            elif kind == "c":
                ptrs.append(ref[1].untyped_storage().data_ptr())
                refs.append(None)
                cpu_refs.append(j)
            else:
                ptr = ptr_of[ref[1]]
                if len(firsts) == ref[1]:
                    firsts.append(j)
                ptrs.append(ptr)
                refs.append(ref)
        return cls(tuple(map(id, weights)), leaf_ptrs, cls._pattern(leaf_ptrs, ptrs), refs, cpu_refs, firsts,
                   pack.extent)

    def apply(self, pack: Pack) -> bool:
        """Seal `pack` by this layout if its saved tensors match it (the same weight leaves, the same number
        of saved tensors, each of the same storage as before relative to the others); False, nothing changed,
        if not."""
        refs = pack.refs
        if len(refs) != len(self.pattern) or tuple(map(id, pack.weights)) != self.weight_ids:
            return False
        ptrs = [t.untyped_storage().data_ptr() for t in refs]
        if self._pattern(self.leaf_ptrs, ptrs) != self.pattern:
            return False
        device, own, u8 = pack.weights[0].device, pack.own, torch.uint8
        empty = torch.empty
        if self.desc is not None:  # each storage's range to move, as segments() moves it
            saved = [empty(0, dtype=u8, device=device).set_(refs[j].untyped_storage(), lo, (n,))
                     for j, lo, n in self.ranges]
            pack.desc, pack.ranged = self.desc, True
        else:
            saved = [empty(0, dtype=u8, device=device).set_(refs[j].untyped_storage()) for j in self.firsts]
        pack.saved = saved if own is None else [own(x) for x in saved]
        pack.index = {ptrs[j]: k for k, j in enumerate(self.firsts)}
        pack.extent = self.extent
        new = list(self.refs)
        for j in self.cpu_refs:
            new[j] = ("c", refs[j])
        pack.refs = new
        pack.layout = self
        return True
