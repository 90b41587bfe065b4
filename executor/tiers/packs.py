"""Saved-tensor packs: the tensors autograd saves in the forward of a layer that is not recomputed, captured
with saved_tensors_hooks so that the plan's offload/fetch ops can move them as one flat byte tensor."""

from __future__ import annotations

import torch

PACK_ALIGN = 256  # bytes: alignment of each saved tensor inside a flattened pack


class _InputGrad(torch.autograd.Function):
    """Identity on a layer input that hands the input's gradient to a list (`box`) in backward and saves
    nothing; `anchor` (an empty tensor that requires grad) puts the node into the graph."""

    @staticmethod
    def forward(ctx, x, anchor, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box.append(g)
        return None, None, None


class Pack:
    """The tensors autograd saves in the forward of a layer that is not recomputed, captured explicitly with
    saved_tensors_hooks so that the plan's offload/fetch ops can move them. Views of the layer's weights are
    not captured: they are rebuilt from the weights fetched for the backward.

    Saved tensors are kept per *storage*: several saved views of one storage (q, k and v of one fused
    projection; the attention output and the output projection's input) are moved once, as the byte range of
    the storage they cover, and rebuilt as views of it. The offload copies those byte ranges straight into the
    destination buffers: nothing is made contiguous or joined first."""

    def __init__(self, leaves: list[torch.Tensor], own=None) -> None:
        self.leaves = leaves
        self.leaf_ptrs: dict[int, int] | None = None  # storage data pointer -> its first leaf (pack_hook)
        self.own = own or (lambda t: t)  # DeviceBackend.own: saved tensors that the d2h stream will read
        # per distinct storage: its bytes (uint8, the whole storage)
        self.saved: list[torch.Tensor] | None = []
        self.index: dict[int, int] = {}  # data pointer of the original storage -> index in saved
        self.extent: list[list[int]] = []  # per storage: [lo, hi) bytes covered by its saved views
        # per storage: its [lo, hi) bytes in the fetched flat tensor
        self.restored: list[torch.Tensor] | None = None
        self.desc: list[tuple[int, int, int]] = []  # per storage: (offset in the flat layout, lo, hi)
        self.out: torch.Tensor | None = None
        # with a copying own(): the tensors the keys' addresses are of
        self.originals: list[torch.Tensor] = []
        self.x_grad: list[torch.Tensor] = []  # the gradient of the layer input, after backward (see input())

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input to run the forward on: its gradient arrives in self.x_grad in backward, and nothing
        here keeps `x` alive (an autograd leaf would hold the input's memory until the backward, although the
        plan frees it after the forward: the pack holds what the backward needs)."""
        return _InputGrad.apply(x.detach(), torch.empty(0, device=x.device, requires_grad=True), self.x_grad)

    def pack_hook(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if self.leaf_ptrs is None:  # the first leaf of each storage, found once per forward (not per hook)
            self.leaf_ptrs = {}
            for i, leaf in enumerate(self.leaves):
                self.leaf_ptrs.setdefault(leaf.untyped_storage().data_ptr(), i)
        i = self.leaf_ptrs.get(ptr)
        if i is not None:
            leaf = self.leaves[i]
            return ("w", i, t.storage_offset() - leaf.storage_offset(), tuple(t.shape), tuple(t.stride()))
        # e.g. a CPU scalar (RNG seed) saved by a CUDA kernel: kept as is
        if t.device != self.leaves[0].device:
            return ("c", t)
        i = self.index.get(ptr)
        if i is None:
            i = self.index[ptr] = len(self.saved)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            owned = self.own(whole)
            self.saved.append(owned)
            self.extent.append([st.nbytes(), 0])
            # t stays alive until the forward ends, so no later tensor reuses its address
            if owned is not whole:
                self.originals.append(t)
        size = t.element_size()
        lo = t.storage_offset() * size
        if t.numel():
            span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
            ext = self.extent[i]
            ext[0], ext[1] = min(ext[0], lo), max(ext[1], lo + span * size)
        return ("t", i, lo, tuple(t.shape), tuple(t.stride()), t.dtype)

    def unpack_hook(self, ref):
        if ref[0] == "w":
            leaf = self.leaves[ref[1]]
            return leaf.detach().as_strided(ref[3], ref[4], leaf.storage_offset() + ref[2])
        if ref[0] == "c":
            return ref[1]
        _, i, off_bytes, shape, stride, dtype = ref
        if self.restored is not None:
            base, base_lo = self.restored[i], self.desc[i][1]
        else:
            base, base_lo = self.saved[i], 0
        data = base.view(dtype)
        size = data.element_size()
        return data.as_strided(shape, stride, data.storage_offset() + (off_bytes - base_lo) // size)

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
        segs, self.desc, off_bytes = [], [], 0
        for whole, (lo, hi) in zip(self.saved, self._ranges()):
            self.desc.append((off_bytes, lo, hi))
            segs.append((off_bytes, whole[lo:hi]))
            off_bytes += hi - lo
            off_bytes += -off_bytes % PACK_ALIGN
        return segs, off_bytes

    def release_output(self) -> None:
        """Drop the layer output's memory from the pack: its backward needs the output's autograd node, not
        its values (the next layer's input entry holds them for as long as the plan keeps them). Kept if
        autograd saved the output itself."""
        if self.out.untyped_storage().data_ptr() in self.index:
            return
        self.out.data = torch.empty(0, dtype=self.out.dtype, device=self.out.device)

    def backward(self, grad_out: torch.Tensor) -> None:
        """Backward from the (released) output:
        the engine checks grad_out against the node's recorded shape."""
        torch.autograd.Variable._execution_engine.run_backward(
            (self.out,), (grad_out,), False, False, (), allow_unreachable=True, accumulate_grad=True)

    def saved_bytes(self) -> int:
        """Bytes this pack moves: the byte ranges of the distinct storages autograd saved
        (without padding)."""
        return sum(hi - lo for lo, hi in self._ranges()) if self.saved else 0

    def restore(self, flat: torch.Tensor) -> None:
        """The saved views, from the flat byte layout of segments() (fetched back to the device)."""
        self.restored = [flat[off: off + hi - lo] for off, lo, hi in self.desc]
