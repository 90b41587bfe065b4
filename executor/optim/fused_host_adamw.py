"""The host optimizer op's AdamW in one pass over memory (host_adamw.py calls `run_step` for CPU fp32
contiguous tensors): per element it reads the gradient, the master and the moments once, adds the gradient's
square to the step's norm, updates the moments and the master, writes the compute copy (bf16 or fp32) and
zeroes the gradient. Compiled with numba where it is installed (the `fast` and `test` extras); without numba,
or with TIERFLOW_PURE_ADAMW=1, `kernel()` returns None and host_adamw runs torch's kernels instead.

How it keeps up with torch's fused AdamW, which moves 28 bytes per element where this op moves 34 (the
zeroed gradient and the compute copy written too): the loop is written as LLVM vector code (LANES fp32
elements per iteration; `_vector_loop`), it prefetches the four fp32 streams PREFETCH elements ahead, and it
writes the compute copy with non-temporal stores where its address is aligned to a whole vector (no read for
ownership of a line that is only written). Measured in experiments/bench_optimizer.py (docs/executor.md).

Numerics: every element takes the operations of the vector path of torch's fused CPU AdamW kernel
(aten/src/ATen/native/cpu/FusedAdamKernel.cpp, adam_math for float in ADAMW mode), in fp32 with the
coefficients rounded to fp32 as it rounds them: the gradient times the clipping factor; the master times
1 - lr * weight_decay (decayed groups only); m = fma(1 - beta1, g - m, m) (its lerp); v = fma((1 - beta2) * g,
g, v * beta2) (how its build contracts `v * beta2 + (1 - beta2) * g * g`: measured, bit for bit); master +
(-lr / bias_correction1 * m) / (sqrt(v) / sqrt(bias_correction2) + eps). The vector loop and the scalar loop
(the elements before the first whole vector and after the last) do the same correctly rounded operations,
so an element's result depends on nothing but its own values. torch takes a scalar path without fused
multiply-adds for the last partial vector of each tensor and thread share; this kernel never does
(tests/test_fused_host_adamw.py: bit for bit torch's vector path). The compute copy: rounded to nearest even
from the fp32 bits, NaN as 0xffff, as torch's vectorized cast.

The step's sum of squares (of the unclipped gradients): per CHUNK of elements counted from the op's first
element, LANES fp32 partial sums, element e in lane (e - first) % LANES, each lane added in element order;
a chunk's lanes are then summed in fp64 in lane order and the chunks in chunk order. Alignment, cuts (the
host/SSD boundary, decay groups) and threads change no addition, so the sum has the same bits on any of them;
its rounding is that of an fp32 sum of 1024 terms per lane (1M random values: 3e-8 from the exact sum, where
torch's fp32 vector_norm, which the torch path uses, is 2e-5 off).

One file for the kernel and the LLVM code it inlines: numba's disk cache checks only the file of the
function it caches, so code of another file could change under a stale cache.

Threads: torch.get_num_threads() of them, torch's own OpenMP team (`_on_team`: GOMP_parallel of the runtime
torch loaded; the calling thread is one of them), each taking the next chunk until none is left. A pool of
Python threads with one contiguous share each was slower by half on two cores: torch's OpenMP workers keep
spinning for work after each torch op, and the pool's thread waited for the core one of them held. The pool
remains where no OpenMP runtime is found, and in a forked child.
"""

from __future__ import annotations

import math
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierflow.planner.core.numba_once import NumbaOnce

LANES = 16  # fp32 elements per vector of the loop (one AVX-512 register; two AVX2 ones)
CHUNK = 16384  # elements per set of partial sums of squares and per unit of a thread's share (64 KiB of fp32)
PREFETCH = 512  # elements ahead that the vector loop prefetches in each fp32 stream (2 KiB)
NO_DEST, DEST_BF16, DEST_F32 = 0, 1, 2  # what the kernel writes the updated master into
# non-temporal stores of the compute copy (and an sfence after them): x86 only, elsewhere plain stores
NT_STORES = platform.machine().lower() in ("x86_64", "amd64")

SWITCH = "TIERFLOW_PURE_ADAMW"  # "1": torch's kernels, the kernel not even built
_WARM = False
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()
_TEAM = None  # GOMP_parallel of torch's OpenMP runtime (_team_runtime), once compiled
_TEAM_ENTRY = 0  # the address of the compiled _team_entry
_TEAM_ADDR = 0  # the address of GOMP_parallel
_FORKED = False  # this process is a forked child (of a process that may have run OpenMP): no team


def kernel():
    """The compiled step (compiled on first use, cached on disk by numba), or None without numba, with
    TIERFLOW_PURE_ADAMW=1, or where it did not build."""
    return _ONCE.get()


def _build():
    """_compile; where numba or LLVM cannot build it, numba_once says so in one line on stderr and torch's
    kernels run instead."""
    return _compile()


def describe(min_elements: int) -> str:
    """Which way the host optimizer op runs here, in one line (`tierflow env`; `min_elements`: the fewest
    elements host_adamw hands to the kernel), after building it (numba_once: what really runs)."""
    status = _ONCE.status()
    if not status.runs:
        return status.line
    team = _team_runtime()
    threads = (f"on torch's OpenMP team ({os.path.basename(team._lib_path)})" if team is not None else
               "on a thread pool of its own (no OpenMP runtime found)")
    return f"one-pass kernel (numba), {threads}, from {min_elements:,} elements per op"


def warm_up() -> None:
    """Compile the kernel (or load it from numba's cache: ~0.5 s of CPU once per process; compiling it,
    once per installation, ~2 s) and run it on a few elements, whole and cut in two (the two ways run_step
    calls it), so that a run's first optimizer op does not pay it (the executor calls this while it sets up,
    when a host optimizer part is large enough to take the kernel: host_adamw.MIN_KERNEL_ELEMENTS)."""
    global _WARM
    if _WARM or kernel() is None:
        return
    import torch

    n, cut = 2 * LANES + 3, LANES + 1
    t = [torch.zeros(n) for _ in range(4)]
    consts = coefficients(1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0)
    dests = [(0, n, torch.zeros(n, dtype=torch.bfloat16))]
    run_step(consts, [(0, n, True)], {"master": [(0, n, t[0])], "adam_m": [(0, n, t[1])],
                                      "adam_v": [(0, n, t[2])]}, t[3], dests, True)
    names = ("master", "adam_m", "adam_v")
    halves = {cls: [(0, cut, x[:cut]), (cut, n, x[cut:])] for cls, x in zip(names, t)}
    run_step(consts, [(0, n, True)], halves, t[3], dests, True)
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
    """In a forked child: the parent's pool threads do not exist there, a later step makes a new pool; nor
    does the parent's OpenMP team, which a forked child cannot use safely (torch's DataLoader workers run
    on one thread for it): the child's steps take the pool."""
    global _POOL, _POOL_SIZE, _POOL_LOCK, _TEAM, _FORKED
    _POOL, _POOL_SIZE, _POOL_LOCK, _TEAM, _FORKED = None, 0, threading.Lock(), None, True


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


def _compile():
    """Compile the kernel's functions (numba imported): each is rebound to its compiled self by its global
    name first, so that the compiled step calls them compiled."""
    import numba

    g = globals()
    g["_fma32"], g["_bf16"] = _ir_intrinsics()
    for mode in (NO_DEST, DEST_BF16, DEST_F32):
        for nt in (False, True):
            g[f"_vec_{mode}_{int(nt)}"] = _vector_loop(mode, nt)
    import torch

    _DEST_MODE.update({torch.bfloat16: DEST_BF16, torch.float32: DEST_F32})
    g["numba_carray"] = numba.carray
    (g["_i64_at"], g["_f32_at"], g["_u16_at"], g["_u8_at"], g["_next"],
     g["_gomp_parallel"]) = _pointer_intrinsics()
    for name in ("_adamw", "_scalar", "_piece", "_step", "_total", "_team_run", "_run_at"):
        g[name] = numba.njit(cache=True, nogil=True, error_model="numpy")(g[name])
    import ctypes

    global _TEAM, _TEAM_ENTRY, _TEAM_ADDR
    _TEAM = None if _FORKED else _team_runtime()
    if _TEAM is not None:
        entry = numba.cfunc(numba.types.void(numba.types.int64), cache=True, nogil=True,
                            error_model="numpy")(_team_entry)
        g["_team_entry_cfunc"] = entry  # kept alive: the team calls its address
        _TEAM_ENTRY = entry.address
        _TEAM_ADDR = ctypes.cast(_TEAM, ctypes.c_void_p).value
    return _step


def _ir_intrinsics():
    """fma32 and bf16 as numba intrinsics (llvm.fma.f32; the cast in 32-bit integer operations)."""
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
            return _bf16_ir(builder, ir, args[0], ir.IntType(32), ir.IntType(16), 1)
        return types.uint16(types.float32), codegen

    return fma32, bf16


def _bf16_ir(builder, ir, x, i32, i16, width: int):
    """LLVM IR of the bf16 bits of fp32 `x` (a scalar, or a vector of `width`): rounded to nearest even,
    NaN as 0xffff."""
    vi32 = i32 if width == 1 else ir.VectorType(i32, width)
    vi16 = i16 if width == 1 else ir.VectorType(i16, width)

    def const(ty, value):
        return ir.Constant(ty, value if width == 1 else [value] * width)

    u = builder.bitcast(x, vi32)
    lsb = builder.and_(builder.lshr(u, const(vi32, 16)), const(vi32, 1))
    r = builder.lshr(builder.add(builder.add(u, const(vi32, 0x7FFF)), lsb), const(vi32, 16))
    nan = builder.fcmp_unordered("uno", x, x)
    return builder.select(nan, const(vi16, 0xFFFF), builder.trunc(r, vi16))


def _vector_loop(dmode: int, nt: bool):
    """A numba intrinsic: `(g, p, m, v, d, c, f, start, stop, lanes)` updates elements [start, stop) (a
    multiple of LANES of them) LANES at a time, as `_scalar` does one at a time; lanes (LANES fp32) holds
    the sums of squares per lane, read first and written last; with `nt` the compute copy d is written with
    non-temporal stores (its address at `start` must be aligned to a whole vector)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32, i32, i16, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(64)
    vf = ir.VectorType(f32, LANES)
    vd = ir.VectorType(i16 if dmode == DEST_BF16 else f32, LANES)

    def splat(builder, x):
        one = builder.insert_element(ir.Constant(vf, ir.Undefined), x, ir.Constant(i32, 0))
        zeros = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
        return builder.shuffle_vector(one, ir.Constant(vf, ir.Undefined), zeros)

    def body(builder, mod, i, acc, ptr, consts, f):
        fma = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{LANES}f32")
        sqrt = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf]), f"llvm.sqrt.v{LANES}f32")
        pf = cgutils.get_or_insert_function(mod, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(),
                                                                               i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        at = {k: builder.bitcast(builder.gep(ptr[k], [i]), vf.as_pointer()) for k in "gpmv"}
        ahead = builder.add(i, ir.Constant(i.type, PREFETCH))
        for k in "gpmv":
            builder.call(pf, [builder.bitcast(builder.gep(ptr[k], [ahead]), ir.IntType(8).as_pointer()),
                              ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        g, p, m, v = (builder.load(at[k], align=4) for k in "gpmv")
        acc = builder.fadd(acc, builder.fmul(g, g))
        c = consts
        g = builder.fmul(g, c[7])
        m = builder.call(fma, [c[1], builder.fsub(g, m), m])
        v = builder.call(fma, [builder.fmul(c[3], g), g, builder.fmul(v, c[2])])
        den = builder.fadd(builder.fdiv(builder.call(sqrt, [v]), c[4]), c[5])
        p = builder.fadd(builder.fmul(p, f), builder.fdiv(builder.fmul(c[6], m), den))
        for k, x in (("p", p), ("m", m), ("v", v), ("g", ir.Constant(vf, [0.0] * LANES))):
            builder.store(x, at[k], align=4)
        if dmode != NO_DEST:
            out = _bf16_ir(builder, ir, p, i32, i16, LANES) if dmode == DEST_BF16 else p
            dst = builder.bitcast(builder.gep(ptr["d"], [i]), vd.as_pointer())
            st = builder.store(out, dst, align=(2 if dmode == DEST_BF16 else 4) * (LANES if nt else 1))
            if nt and NT_STORES:
                st.set_metadata("nontemporal", mod.add_metadata([ir.Constant(i32, 1)]))
        return acc

    @intrinsic
    def vector_loop(typingctx, g, p, m, v, d, c, f, start, stop, lanes):
        sig = types.none(g, p, m, v, d, c, types.float32, types.intp, types.intp, lanes)

        def codegen(context, builder, signature, args):
            mod = builder.module
            data = [context.make_array(t)(context, builder, a).data
                    for t, a in zip(signature.args, args) if isinstance(t, types.Array)]
            ptr = dict(zip("gpmvdcl", data))
            consts = [splat(builder, builder.load(builder.gep(ptr["c"], [ir.Constant(i64, k)])))
                      for k in range(8)]
            f = splat(builder, args[6])
            lane_ptr = builder.bitcast(ptr["l"], vf.as_pointer())
            acc0 = builder.load(lane_ptr, align=4)
            lo, hi = args[7], args[8]
            entry = builder.block
            loop, done = builder.append_basic_block("vloop"), builder.append_basic_block("vdone")
            builder.cbranch(builder.icmp_signed("<", lo, hi), loop, done)
            builder.position_at_end(loop)
            i, acc = builder.phi(lo.type), builder.phi(vf)
            i.add_incoming(lo, entry)
            acc.add_incoming(acc0, entry)
            acc2 = body(builder, mod, i, acc, ptr, consts, f)
            i2 = builder.add(i, ir.Constant(i.type, LANES))
            i.add_incoming(i2, builder.block)
            acc.add_incoming(acc2, builder.block)
            builder.cbranch(builder.icmp_signed("<", i2, hi), loop, done)
            builder.position_at_end(done)
            final = builder.phi(vf)
            final.add_incoming(acc0, entry)
            final.add_incoming(acc2, loop)
            builder.store(final, lane_ptr, align=4)
            if nt and NT_STORES:  # the streaming stores ordered before whatever the caller does next
                builder.call(cgutils.get_or_insert_function(mod, ir.FunctionType(ir.VoidType(), []),
                                                            "llvm.x86.sse.sfence"), [])
            return context.get_dummy_value()

        return sig, codegen

    return vector_loop


def _team_runtime():
    """GOMP_parallel of the OpenMP runtime that torch's intra-op threads belong to (libgomp, or a runtime with
    its interface: Intel's, LLVM's), as a ctypes function; None where there is none to be found."""
    import ctypes

    import torch  # noqa: F401 - its OpenMP runtime loaded

    try:
        with open("/proc/self/maps") as f:
            paths = dict.fromkeys(line.split()[-1] for line in f if "/" in line)
    except OSError:
        return None
    omp = [q for q in paths if os.path.basename(q).startswith(("libgomp", "libiomp5", "libomp"))]
    for path in sorted(omp, key=lambda q: "torch" not in q):  # torch's own copy first
        try:
            fn = ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
        fn._lib_path = path
        return fn
    return None


def _on_team(threads: int, s0, s1, lo, n_chunks, g, p, m, v, d16, d32, dmode, gend, gdecay, c,
             partials) -> None:
    """The chunks of [s0, s1) on `threads` threads of torch's OpenMP team (GOMP_parallel, the calling
    thread one of them, called from compiled code without the GIL): each takes the next chunk until none is
    left. Its threads are the ones torch's own kernels have just run on, still spinning for work, so no
    thread of this op waits for a core that one of them holds."""
    _team_run(_TEAM_ADDR, _TEAM_ENTRY, threads, s0, s1, lo, n_chunks, g, p, m, v, d16, d32, dmode, gend,
              gdecay, c, partials)


def _team_run(gomp, entry, threads, s0, s1, lo, n_chunks, g, p, m, v, d16, d32, dmode, gend, gdecay, c,
              partials):
    """_on_team compiled: the descriptor that _team_entry reads, then GOMP_parallel at address `gomp`."""
    d = np.empty(20, dtype=np.int64)
    d[0], d[1], d[2], d[3], d[4], d[5] = 0, n_chunks, s0, s1, lo, dmode
    d[6], d[7], d[8], d[9] = g.ctypes.data, p.ctypes.data, m.ctypes.data, v.ctypes.data
    d[10], d[11], d[12], d[13] = d16.ctypes.data, d16.shape[0], d32.ctypes.data, d32.shape[0]
    d[14], d[15], d[16], d[17] = gend.ctypes.data, gend.shape[0], gdecay.ctypes.data, c.ctypes.data
    d[18], d[19] = partials.ctypes.data, partials.shape[0]
    _gomp_parallel(gomp, entry, d.ctypes.data, threads)
    return d[0]  # (read after the call: the descriptor lives until the team is done with it)


def _team_entry(addr):
    """What each thread of the team runs (a C callback; `addr`: the descriptor that _on_team made)."""
    d = numba_carray(_i64_at(addr), 20)
    s0, s1, lo, dmode = d[2], d[3], d[4], d[5]
    n = s1 - s0
    g, p, m, v = (numba_carray(_f32_at(d[6]), n), numba_carray(_f32_at(d[7]), n),
                  numba_carray(_f32_at(d[8]), n), numba_carray(_f32_at(d[9]), n))
    d16, d32 = numba_carray(_u16_at(d[10]), d[11]), numba_carray(_f32_at(d[12]), d[13])
    gend, gdecay = numba_carray(_i64_at(d[14]), d[15]), numba_carray(_u8_at(d[16]), d[15])
    c, partials = numba_carray(_f32_at(d[17]), 8), numba_carray(_f32_at(d[18]), (d[19], LANES))
    while True:
        k = _next(addr)  # the descriptor's first word: the next chunk
        if k >= d[1]:
            break
        _step(s0, s1, lo, k, k + 1, g, p, m, v, d16, d32, dmode, gend, gdecay, c, partials)


def numba_carray(*a): ...  # noqa: E704 - numba.carray, bound when compiled
def _i64_at(*a): ...  # noqa: E704 - pointers from addresses and the atomic counter, made by _pointer_intrinsics
def _f32_at(*a): ...  # noqa: E704
def _u16_at(*a): ...  # noqa: E704
def _u8_at(*a): ...  # noqa: E704
def _next(*a): ...  # noqa: E704
def _gomp_parallel(*a): ...  # noqa: E704


def _pointer_intrinsics():
    """Numba intrinsics: a typed pointer from an integer address, per element type, and `next(addr)`: the
    int64 at addr, incremented atomically (the old value returned)."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    def pointer(ty):
        @intrinsic
        def at(typingctx, addr):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_data_type(ty).as_pointer())
            return types.CPointer(ty)(types.int64), codegen
        return at

    @intrinsic
    def next_of(typingctx, addr):
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            return builder.atomic_rmw("add", builder.inttoptr(args[0], i64.as_pointer()), ir.Constant(i64, 1),
                                      "monotonic")
        return types.int64(types.int64), codegen

    @intrinsic
    def gomp_parallel(typingctx, fn, entry, data, threads):
        def codegen(context, builder, signature, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            cb = ir.FunctionType(ir.VoidType(), [i8p]).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [cb, i8p, i32, i32])
            target = builder.inttoptr(args[0], fnty.as_pointer())
            builder.call(target, [builder.inttoptr(args[1], cb), builder.inttoptr(args[2], i8p),
                                  builder.trunc(args[3], i32), ir.Constant(i32, 0)])
            return context.get_dummy_value()
        return types.none(types.int64, types.int64, types.int64, types.int64), codegen

    return (pointer(types.int64), pointer(types.float32), pointer(types.uint16), pointer(types.uint8),
            next_of, gomp_parallel)


def _fma32(a, b, c):  # replaced by llvm.fma.f32 when compiled
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _bf16(x):  # replaced by the same in 32-bit integer operations when compiled
    """x rounded to nearest even as bf16 bits (NaN: 0xffff), as torch's vectorized cast."""
    if x != x:
        return np.uint16(0xFFFF)
    u = int(np.float32(x).view(np.uint32))
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def _vec_0_0(*a): ...  # noqa: E704 - the vector loops, made by _vector_loop when compiled
def _vec_0_1(*a): ...  # noqa: E704
def _vec_1_0(*a): ...  # noqa: E704
def _vec_1_1(*a): ...  # noqa: E704
def _vec_2_0(*a): ...  # noqa: E704
def _vec_2_1(*a): ...  # noqa: E704


def _adamw(gi, pi, mi, vi, c, f):
    """One element's update (see the module's docstring): the new master, m and v."""
    gi = gi * c[7]
    mi = _fma32(c[1], gi - mi, mi)
    vi = _fma32(c[3] * gi, gi, vi * c[2])
    return pi * f + (c[6] * mi) / (np.sqrt(vi) / c[4] + c[5]), mi, vi


def _scalar(i0, i1, g, p, m, v, d16, d32, dmode, c, f, lanes, lane0):
    """Elements i0 to i1 - 1 one at a time; element i's square added to lanes[(lane0 + i) % LANES]."""
    for i in range(i0, i1):
        gi = g[i]
        k = (lane0 + i) % LANES
        lanes[k] = lanes[k] + gi * gi
        pi, m[i], v[i] = _adamw(gi, p[i], m[i], v[i], c, f)
        p[i] = pi
        if dmode == DEST_BF16:
            d16[i] = _bf16(pi)
        elif dmode == DEST_F32:
            d32[i] = pi
        g[i] = np.float32(0.0)


def _piece(g, p, m, v, d16, d32, dmode, c, f, lanes, lane0):
    """The elements of the arrays (one decay factor f, inside one chunk; element 0 in lane lane0): the
    elements up to the first whole vector of lanes one at a time, then whole vectors, then the rest."""
    n = g.shape[0]
    head = min(n, (LANES - lane0 % LANES) % LANES)
    _scalar(0, head, g, p, m, v, d16, d32, dmode, c, f, lanes, lane0)
    body = head + (n - head) // LANES * LANES
    if body > head:
        if dmode == DEST_BF16:
            if (d16[head:].ctypes.data % (2 * LANES)) == 0:
                _vec_1_1(g, p, m, v, d16, c, f, head, body, lanes)
            else:
                _vec_1_0(g, p, m, v, d16, c, f, head, body, lanes)
        elif dmode == DEST_F32:
            if (d32[head:].ctypes.data % (4 * LANES)) == 0:
                _vec_2_1(g, p, m, v, d32, c, f, head, body, lanes)
            else:
                _vec_2_0(g, p, m, v, d32, c, f, head, body, lanes)
        else:
            _vec_0_0(g, p, m, v, d32, c, f, head, body, lanes)
    _scalar(body, n, g, p, m, v, d16, d32, dmode, c, f, lanes, lane0)


def _step(s0, s1, lo, k0, k1, g, p, m, v, d16, d32, dmode, gend, gdecay, c, partials):
    """Chunks k0 to k1 - 1 of elements [s0, s1) of the op's range starting at element lo (chunk 0: the one
    element s0 is in): g, p, m, v, d16 / d32 hold [s0, s1) from index 0; gend / gdecay: the ends of the op's
    decay groups (element numbers) and whether each is decayed; c: the coefficients; partials[chunk]: the
    chunks' lanes of sums of squares (chunks counted from lo), added to."""
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
            d16u = d16[u:w] if dmode == DEST_BF16 else d16
            d32u = d32[u:w] if dmode == DEST_F32 else d32
            _piece(g[u:w], p[u:w], m[u:w], v[u:w], d16u, d32u, dmode, c, f, partials[ch], (x - lo) % LANES)
            x = y
            j += 1


def _total(partials):
    """The sum of squares: each chunk's lanes in fp64 in lane order, the chunks in order."""
    s = 0.0
    for ch in range(partials.shape[0]):
        t = 0.0
        for k in range(partials.shape[1]):
            t += np.float64(partials[ch, k])
        s += t
    return s


def run_step(consts: np.ndarray, groups, states, grads, dests, want_squares: bool) -> float | None:
    """The update of the op's adjacent decay groups [(a, z, decayed)] (see host_adamw): one kernel call per
    stretch of elements that lies in one tensor of each kind; returns the sum of the squares of the
    (unclipped) gradients when `want_squares`. fp16 destinations are not written (the caller casts)."""
    import torch

    k = kernel()
    lo, hi = groups[0][0], groups[-1][1]
    if len(groups) == 1:  # (the arrays of one group, made once)
        gend, gdecay = _ONE_GROUP[bool(groups[0][2])]
    else:
        gend = np.array([z for _a, z, _d in groups], dtype=np.int64)
        gdecay = np.array([d for _a, _z, d in groups], dtype=np.uint8)
    threads = max(1, torch.get_num_threads())
    ps, ms, vs = states["master"], states["adam_m"], states["adam_v"]
    one = len(ps) == len(ms) == len(vs) == 1 and (not dests or len(dests) == 1 and dests[0][0] <= lo
                                                   and dests[0][1] >= hi)
    if one and (threads == 1 or _TEAM is not None):  # the common op: one compiled call, from the addresses
        dmode, daddr = NO_DEST, 0
        if dests:
            a, _z, t = dests[0]
            dmode = _DEST_MODE.get(t.dtype, NO_DEST)
            daddr = t.data_ptr() + (lo - a) * t.element_size()
        total = _run_at(grads.data_ptr() + 4 * lo, _addr(ps[0], lo), _addr(ms[0], lo), _addr(vs[0], lo),
                        daddr, dmode, lo, hi, gend, gdecay, consts, threads, _TEAM_ADDR, _TEAM_ENTRY)
        return total if want_squares else None
    partials = np.zeros(((hi - lo + CHUNK - 1) // CHUNK, LANES), dtype=np.float32)
    g = grads.numpy()
    if one:
        d = None if not dests else _dest_array(_within(*dests[0], lo, hi))
        stretches = [(lo, hi, _within(*ps[0], lo, hi).numpy(), _within(*ms[0], lo, hi).numpy(),
                      _within(*vs[0], lo, hi).numpy(), d)]
    else:
        stretches = _stretches(states, dests, lo, hi)
    for s0, s1, p, m, v, d in stretches:
        d16, d32, dmode = _NO16, _NO32, NO_DEST
        if d is not None and d.dtype == np.uint16:
            d16, dmode = d, DEST_BF16
        elif d is not None and d.dtype == np.float32:
            d32, dmode = d, DEST_F32
        args = (g[s0:s1], p, m, v, d16, d32, dmode, gend, gdecay, consts, partials)
        n_chunks = (s1 - 1 - lo) // CHUNK - (s0 - lo) // CHUNK + 1
        shares = min(threads, n_chunks)
        if shares == 1:
            k(s0, s1, lo, 0, n_chunks, *args)
        elif _TEAM is not None:
            _on_team(shares, s0, s1, lo, n_chunks, *args)
        else:
            bounds = [n_chunks * t // shares for t in range(shares + 1)]
            futures = [_pool(shares - 1).submit(k, s0, s1, lo, k0, k1, *args)
                       for k0, k1 in zip(bounds[1:-1], bounds[2:])]
            k(s0, s1, lo, bounds[0], bounds[1], *args)
            for fut in futures:
                fut.result()
    return float(_total(partials)) if want_squares else None


_NO16, _NO32 = np.zeros(0, dtype=np.uint16), np.zeros(0, dtype=np.float32)
_ONE_GROUP = {d: (np.array([1 << 62], dtype=np.int64), np.array([d], dtype=np.uint8)) for d in (False, True)}
_DEST_MODE: dict = {}  # torch dtype -> NO_DEST / DEST_BF16 / DEST_F32 (filled when compiled)


def _addr(piece, lo: int) -> int:
    """The address of element `lo` in the fp32 stretch `piece` (a, z, tensor)."""
    return piece[2].data_ptr() + 4 * (lo - piece[0])


def _run_at(ga, pa, ma, va, da, dmode, lo, hi, gend, gdecay, c, threads, gomp, entry):
    """run_step of one stretch [lo, hi) whose arrays start at the addresses ga, pa, ma, va (fp32) and da (the
    destination: bf16 bits or fp32 by dmode), compiled (no array objects made in Python: after a step that
    has streamed megabytes through the caches each Python call costs microseconds); on the team (`gomp`,
    `entry`) with more than one thread. Returns the sum of squares."""
    n = hi - lo
    g, p = numba_carray(_f32_at(ga), n), numba_carray(_f32_at(pa), n)
    m, v = numba_carray(_f32_at(ma), n), numba_carray(_f32_at(va), n)
    d16 = numba_carray(_u16_at(da), n if dmode == DEST_BF16 else 0)
    d32 = numba_carray(_f32_at(da), n if dmode == DEST_F32 else 0)
    n_chunks = (n + CHUNK - 1) // CHUNK
    partials = np.zeros((n_chunks, LANES), dtype=np.float32)
    if threads == 1 or n_chunks == 1:
        _step(lo, hi, lo, 0, n_chunks, g, p, m, v, d16, d32, dmode, gend, gdecay, c, partials)
    else:
        _team_run(gomp, entry, min(threads, n_chunks), lo, hi, lo, n_chunks, g, p, m, v, d16, d32, dmode,
                  gend, gdecay, c, partials)
    return _total(partials)


def _within(a: int, z: int, t, lo: int, hi: int):
    """Elements [lo, hi) of the tensor `t` that holds elements [a, z)."""
    return t if a == lo and z == hi else t[lo - a: hi - a]


def _stretches(states, dests, lo: int, hi: int) -> list[tuple]:
    """(s0, s1, master, m, v, destination) per stretch of [lo, hi) that lies in one tensor of each kind."""
    cuts = {lo, hi}
    for pieces in (*states.values(), dests):
        cuts.update(x for a, z, _t in pieces for x in (a, z) if lo < x < hi)
    cuts = sorted(cuts)
    arrays = {cls: [(a, z, t.numpy()) for a, z, t in states[cls]] for cls in ("master", "adam_m", "adam_v")}
    outs = [(a, z, _dest_array(t)) for a, z, t in dests]
    return [(s0, s1, *(_piece_of(arrays[cls], s0, s1) for cls in ("master", "adam_m", "adam_v")),
             _piece_of(outs, s0, s1, missing_ok=True)) for s0, s1 in zip(cuts, cuts[1:])]


def _dest_array(t):
    """A destination tensor as the kernel writes it: bf16 as its bits (uint16), fp32 as is, else None (fp16:
    the caller casts)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy() if t.dtype == torch.float32 else None


def _piece_of(pieces, s0: int, s1: int, missing_ok: bool = False):
    """The view of elements [s0, s1) in the one (a, z, array) of `pieces` that holds them."""
    for a, z, t in pieces:
        if a <= s0 and s1 <= z:
            return None if t is None else t[s0 - a: s1 - a]
    assert missing_ok, (s0, s1)
    return None


_ONCE = NumbaOnce(SWITCH, _build, name="host optimizer's one-pass step", fallback="torch's kernels")
