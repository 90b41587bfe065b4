"""Saved-tensor packs: the tensors autograd saves in the forward of a layer that is not recomputed, captured with
saved_tensors_hooks so that the plan's offload/fetch ops can move them as one flat byte tensor."""

from __future__ import annotations

import torch

PACK_ALIGN = 256  # bytes: alignment of each saved tensor inside a flattened pack


class Pack:
    """The tensors autograd saves in the forward of a layer that is not recomputed, captured explicitly with
    saved_tensors_hooks so that the plan's offload/fetch ops can move them. Views of the layer's weights are
    not captured: they are rebuilt from the weights fetched for the backward."""

    def __init__(self, leaves: list[torch.Tensor], own=None) -> None:
        self.leaves = leaves
        self.own = own or (lambda t: t)  # DeviceBackend.own: saved tensors that the d2h stream will read
        self.saved: list[torch.Tensor] | None = []
        self.index: dict[tuple, int] = {}
        self.restored: list[torch.Tensor] | None = None
        self.desc: list[tuple] = []  # per saved tensor: (shape, stride, perm, dtype, off_bytes, nbytes) in the flat
        self.out: torch.Tensor | None = None
        self.originals: list[torch.Tensor] = []  # with a copying own(): the tensors the keys' addresses are of
        self.x_leaf: torch.Tensor | None = None

    def pack_hook(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        for i, leaf in enumerate(self.leaves):
            if leaf.untyped_storage().data_ptr() == ptr:
                return ("w", i, t.storage_offset() - leaf.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.device != self.leaves[0].device:  # e.g. a CPU scalar (RNG seed) saved by a CUDA kernel: kept as is
            return ("c", t)
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in self.index:
            self.index[key] = len(self.saved)
            owned = self.own(t)
            self.saved.append(owned)
            if owned is not t:  # t stays alive until the forward ends, so no later tensor reuses its address
                self.originals.append(t)
        return ("t", self.index[key])

    def unpack_hook(self, ref):
        if ref[0] == "w":
            leaf = self.leaves[ref[1]]
            return leaf.detach().as_strided(ref[3], ref[4], leaf.storage_offset() + ref[2])
        if ref[0] == "c":
            return ref[1]
        return (self.restored if self.restored is not None else self.saved)[ref[1]]

    def segments(self) -> tuple[list[tuple[int, torch.Tensor]], int]:
        """The captured tensors as (byte offset, flat uint8 view) in one flat byte layout (each at a 256-byte
        aligned offset, as kernels such as fused attention expect of their inputs) and its total bytes, without
        joining them: the offload copies each straight into its slices of the destination buffers. Remembers
        how to rebuild them (restore)."""
        segs, self.desc, off_bytes = [], [], 0
        for t in self.saved:
            dense = _dense_strides(t)
            data = (t.permute(*dense[0]) if dense else t).contiguous().reshape(-1).view(torch.uint8)
            self.desc.append((tuple(t.shape), tuple(t.stride()) if dense else None, dense[0] if dense else None,
                              t.dtype, off_bytes, data.numel()))
            segs.append((off_bytes, data))
            off_bytes += data.numel()
            off_bytes += -off_bytes % PACK_ALIGN
        return segs, off_bytes

    def release_output(self) -> None:
        """Drop the layer output's memory from the pack: its backward needs the output's autograd node, not its
        values (the next layer's input entry holds them for as long as the plan keeps them). Kept if autograd
        saved the output itself."""
        ptr = self.out.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == ptr for t in self.saved or []):
            return
        self.out.data = torch.empty(0, dtype=self.out.dtype, device=self.out.device)

    def backward(self, grad_out: torch.Tensor) -> None:
        """Backward from the (released) output: the engine checks grad_out against the node's recorded shape."""
        torch.autograd.Variable._execution_engine.run_backward(
            (self.out,), (grad_out,), False, False, (), allow_unreachable=True, accumulate_grad=True)

    def saved_bytes(self) -> int:
        """Bytes autograd saved for this layer (the captured tensors, without padding)."""
        return sum(t.numel() * t.element_size() for t in self.saved or [])

    def restore(self, flat: torch.Tensor) -> None:
        out = []
        for shape, stride, perm, dtype, off_bytes, nbytes in self.desc:
            data = flat[off_bytes: off_bytes + nbytes].view(dtype)
            if stride is None:
                out.append(data.view(shape))
            else:  # a permuted dense tensor: same memory layout as when it was saved
                permuted_shape = [shape[i] for i in perm]
                t = data.view(permuted_shape)
                inv = [perm.index(i) for i in range(len(perm))]
                out.append(t.permute(*inv))
        self.restored = out


def _dense_strides(t: torch.Tensor) -> tuple[list[int]] | None:
    """For a non-contiguous tensor whose memory is a permutation of a contiguous one: (dims by stride)."""
    if t.is_contiguous() or t.dim() == 0:
        return None
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    expect = 1
    for d in reversed(perm):
        if t.size(d) != 1 and t.stride(d) != expect:
            return None
        expect *= t.size(d)
    return (perm,)
