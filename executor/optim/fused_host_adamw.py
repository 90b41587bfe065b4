"""The host optimizer op's AdamW in one pass over memory (host_adamw.py calls `run_step` for CPU fp32
contiguous tensors): per element it reads the gradient, the master and the moments once, adds the gradient's
square to the step's norm, updates the moments and the master, writes the compute copy (bf16 or fp32) and
zeroes the gradient. Compiled with numba where it is installed (the `fast` extra); without numba, or with
TIERFLOW_PURE_ADAMW=1, `kernel()` returns None and host_adamw runs torch's kernels instead.

Numerics: every element takes the operations of the vector path of torch's fused CPU AdamW kernel
(aten/src/ATen/native/cpu/FusedAdamKernel.cpp, adam_math for float in ADAMW mode), in fp32 with the
coefficients rounded to fp32 as it rounds them: the gradient times the clipping factor; the master times
1 - lr * weight_decay (decayed groups only); m = fma(1 - beta1, g - m, m) (its lerp); v = fma((1 - beta2) * g,
g, v * beta2) (how its build contracts `v * beta2 + (1 - beta2) * g * g`: measured, bit for bit); master +
(-lr / bias_correction1 * m) / (sqrt(v) / sqrt(bias_correction2) + eps). torch takes a scalar path without
fused multiply-adds for the last partial vector of each tensor and thread share; this kernel never does, so
an element's result depends on nothing but its own values (tests/test_fused_host_adamw.py: bit for bit
torch's vector path, and the same bits on any cut and thread count). The compute copy: rounded to nearest
even from the fp32 bits, NaN as 0xffff, as torch's vectorized cast.

The step's sum of squares: fp64 per piece (the elements of a CHUNK, counted from the op's first element, in
one decay group and one tensor of each kind; reassociated into the vector lanes of the compiled loop), added
into the chunk's partial in element order, the partials added in chunk order: the same sum on any thread
count; where the host/SSD boundary cuts a chunk, its fp64 sum may differ in its last bits.

Threads: the chunks in torch.get_num_threads() contiguous shares, the caller's thread and a pool's (waiting
on a condition, not spinning: they take no core from torch's OpenMP team between steps).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 4096  # elements per partial sum of squares and per unit of a thread's share: 16 KiB of an fp32 array
NO_DEST, DEST_BF16, DEST_F32 = 0, 1, 2  # what the kernel writes the updated master into

_KERNEL = None
_TRIED = False
_WARM = False
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def kernel():
    """The compiled step (compiled on first use, cached on disk by numba), or None without numba or with
    TIERFLOW_PURE_ADAMW=1."""
    global _KERNEL, _TRIED
    if os.environ.get("TIERFLOW_PURE_ADAMW") == "1":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            import numba  # noqa: F401
        except ImportError:
            return None
        _KERNEL = _compile()
    return _KERNEL


def warm_up() -> None:
    """Compile the kernel (or load it from numba's cache: ~0.3-0.6 s of CPU once per process; compiling it,
    once per installation, ~2 s) and run it once on a few elements, so that a run's first optimizer op does
    not pay it (the executor calls this while it sets up)."""
    global _WARM
    if _WARM or kernel() is None:
        return
    import torch

    n = 3
    t = [torch.zeros(n) for _ in range(4)]
    run_step(coefficients(1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0), [(0, n, True)],
             {"master": [(0, n, t[0])], "adam_m": [(0, n, t[1])], "adam_v": [(0, n, t[2])]}, t[3],
             [(0, n, torch.zeros(n, dtype=torch.bfloat16))], True)
    _WARM = True


def _pool(helpers: int) -> ThreadPoolExecutor:
    """The threads that run shares of chunks beside the caller (at least `helpers` of them)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < helpers:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(helpers, thread_name_prefix="fused-adamw")
            _POOL_SIZE = helpers
        return _POOL


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there; a later step makes a new pool."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def coefficients(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 coef: float) -> np.ndarray:
    """The fp32 constants of a step, rounded as torch's kernel rounds them (its bias corrections in double):
    [decay factor, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, -step size, clipping factor]."""
    bc1 = 1 - math.pow(beta1, step)
    bc2 = 1 - math.pow(beta2, step)
    return np.array([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps, -(lr / bc1),
                     coef], dtype=np.float32)


def sum_of_squares(partials: np.ndarray) -> float:
    """The sum of the chunks' partial sums of squares, in chunk order."""
    return float(_total(partials))


def _compile():
    """Compile the kernel's functions (numba imported): each is rebound to its compiled self by its global
    name first, so that the compiled step calls them compiled."""
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def fma32(typingctx, a, b, c):
        def codegen(context, builder, signature, args):
            return builder.fma(*args)
        return types.float32(types.float32, types.float32, types.float32), codegen

    @intrinsic
    def bf16(typingctx, x):
        def codegen(context, builder, signature, args):
            i32, i16 = ir.IntType(32), ir.IntType(16)
            u = builder.bitcast(args[0], i32)
            lsb = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            r = builder.lshr(builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))
            nan = builder.fcmp_unordered("uno", args[0], args[0])
            return builder.select(nan, ir.Constant(i16, 0xFFFF), builder.trunc(r, i16))
        return types.uint16(types.float32), codegen

    @intrinsic
    def add_square(typingctx, acc, x):
        def codegen(context, builder, signature, args):
            y = builder.fpext(args[1], ir.DoubleType())
            return builder.fadd(args[0], builder.fmul(y, y), flags=("reassoc",))
        return types.float64(types.float64, types.float32), codegen

    g = globals()
    g["_fma32"], g["_bf16"], g["_add_square"] = fma32, bf16, add_square
    for name in ("_adamw", "_update", "_update_bf16", "_update_f32", "_total", "_step"):
        g[name] = numba.njit(cache=True, nogil=True, error_model="numpy")(g[name])
    return _step


def _fma32(a, b, c):  # replaced by llvm.fma.f32 when compiled
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _bf16(x):  # replaced by the same in 32-bit integer operations when compiled
    """x rounded to nearest even as bf16 bits (NaN: 0xffff), as torch's vectorized cast."""
    if x != x:
        return np.uint16(0xFFFF)
    u = int(np.float32(x).view(np.uint32))
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _add_square(acc, x):  # replaced by an fp64 add that may be reassociated (vectorized) when compiled
    return acc + np.float64(x) * np.float64(x)


def _adamw(gi, pi, mi, vi, c, f):
    """One element's update (see the module's docstring): the new master, m and v."""
    gi = gi * c[7]
    mi = _fma32(c[1], gi - mi, mi)
    vi = _fma32(c[3] * gi, gi, vi * c[2])
    return pi * f + (c[6] * mi) / (np.sqrt(vi) / c[4] + c[5]), mi, vi


def _update(g, p, m, v, c, f):
    """The elements of the arrays with the decay factor f; returns the sum of the squares of g."""
    s = 0.0
    for i in range(g.shape[0]):
        s = _add_square(s, g[i])
        p[i], m[i], v[i] = _adamw(g[i], p[i], m[i], v[i], c, f)
        g[i] = np.float32(0.0)
    return s


def _update_bf16(g, p, m, v, d16, c, f):
    """_update, the new master also written to d16 as bf16."""
    s = 0.0
    for i in range(g.shape[0]):
        s = _add_square(s, g[i])
        pi, m[i], v[i] = _adamw(g[i], p[i], m[i], v[i], c, f)
        p[i] = pi
        d16[i] = _bf16(pi)
        g[i] = np.float32(0.0)
    return s


def _update_f32(g, p, m, v, d32, c, f):
    """_update, the new master also written to d32."""
    s = 0.0
    for i in range(g.shape[0]):
        s = _add_square(s, g[i])
        pi, m[i], v[i] = _adamw(g[i], p[i], m[i], v[i], c, f)
        p[i] = pi
        d32[i] = pi
        g[i] = np.float32(0.0)
    return s


def _step(s0, s1, lo, k0, k1, g, p, m, v, d16, d32, dmode, gend, gdecay, c, partials):
    """Chunks k0 to k1 - 1 of elements [s0, s1) of the op's range starting at element lo (chunk 0: the one
    element s0 is in): g, p, m, v, d16 / d32 hold [s0, s1) from index 0; gend / gdecay: the ends of the op's
    decay groups (element numbers) and whether each is decayed; c: the coefficients; partials[chunk]: the
    chunks' sums of squares (chunks counted from lo), added to."""
    c_first = (s0 - lo) // CHUNK
    for ch in range(c_first + k0, c_first + k1):
        cs = lo + ch * CHUNK
        a = max(s0, cs)
        z = min(s1, cs + CHUNK)
        j = 0
        while gend[j] <= a:
            j += 1
        x = a
        while x < z:
            y = min(z, gend[j])
            f = c[0] if gdecay[j] else np.float32(1.0)
            u, w = x - s0, y - s0
            if dmode == DEST_BF16:
                partials[ch] += _update_bf16(g[u:w], p[u:w], m[u:w], v[u:w], d16[u:w], c, f)
            elif dmode == DEST_F32:
                partials[ch] += _update_f32(g[u:w], p[u:w], m[u:w], v[u:w], d32[u:w], c, f)
            else:
                partials[ch] += _update(g[u:w], p[u:w], m[u:w], v[u:w], c, f)
            x = y
            j += 1


def _total(partials):
    s = 0.0
    for ch in range(partials.shape[0]):
        s += partials[ch]
    return s


def run_step(consts: np.ndarray, groups, states, grads, dests, want_squares: bool) -> float | None:
    """The update of the op's adjacent decay groups [(a, z, decayed)] (see host_adamw): one kernel call per
    stretch of elements that lies in one tensor of each kind; returns the sum of the squares of the
    (unclipped) gradients when `want_squares`. fp16 destinations are not written (the caller casts)."""
    import torch

    k = kernel()
    lo, hi = groups[0][0], groups[-1][1]
    gend = np.array([z for _a, z, _d in groups], dtype=np.int64)
    gdecay = np.array([d for _a, _z, d in groups], dtype=np.bool_)
    cuts = {lo, hi}
    for pieces in (*states.values(), dests):
        cuts.update(x for a, z, _t in pieces for x in (a, z) if lo < x < hi)
    cuts = sorted(cuts)
    partials = np.zeros((hi - lo + CHUNK - 1) // CHUNK)
    arrays = {cls: [(a, z, t.numpy()) for a, z, t in states[cls]] for cls in ("master", "adam_m", "adam_v")}
    outs = [(a, z, _dest_array(t)) for a, z, t in dests]
    g = grads.numpy()
    threads = max(1, torch.get_num_threads())
    for s0, s1 in zip(cuts, cuts[1:]):
        p, m, v = (_piece(arrays[cls], s0, s1) for cls in ("master", "adam_m", "adam_v"))
        d = _piece(outs, s0, s1, missing_ok=True)
        d16, d32, dmode = _NO16, _NO32, NO_DEST
        if d is not None and d.dtype == np.uint16:
            d16, dmode = d, DEST_BF16
        elif d is not None and d.dtype == np.float32:
            d32, dmode = d, DEST_F32
        args = (g[s0:s1], p, m, v, d16, d32, dmode, gend, gdecay, consts, partials)
        n_chunks = (s1 - 1 - lo) // CHUNK - (s0 - lo) // CHUNK + 1
        shares = min(threads, n_chunks)
        bounds = [n_chunks * t // shares for t in range(shares + 1)]
        futures = [_pool(shares - 1).submit(k, s0, s1, lo, k0, k1, *args)
                   for k0, k1 in zip(bounds[1:-1], bounds[2:])]
        k(s0, s1, lo, bounds[0], bounds[1], *args)
        for f in futures:
            f.result()
    return sum_of_squares(partials) if want_squares else None


_NO16, _NO32 = np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.float32)


def _dest_array(t):
    """A destination tensor as the kernel writes it: bf16 as its bits (uint16), fp32 as is, else None (fp16:
    the caller casts)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy() if t.dtype == torch.float32 else None


def _piece(pieces, s0: int, s1: int, missing_ok: bool = False):
    """The view of elements [s0, s1) in the one (a, z, array) of `pieces` that holds them."""
    for a, z, t in pieces:
        if a <= s0 and s1 <= z:
            return None if t is None else t[s0 - a: s1 - a]
    assert missing_ok, (s0, s1)
    return None
