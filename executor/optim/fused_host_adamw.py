"""The host optimizer op's AdamW in one pass over memory (host_adamw.py calls `run_step` for CPU fp32
contiguous tensors): per element it reads the gradient, the master and the moments once, adds the gradient's
square to the step's norm, updates the moments and the master, writes the compute copy (bf16 or fp32) and,
if asked, zeroes the gradient (the executor's adam op does not: the step's first gradient write overwrites
the accumulator, ops/grads.py). The loop is C++ on ATen's vectors (`at::vec::Vectorized<float>`) and threads
(`at::parallel_for`): fused_host_adamw.cpp, under 300 lines, compiled on first use by
torch.utils.cpp_extension (g++ or clang and ninja; once per install and source version, ~25 s of CPU, cached
in torch's extensions folder: $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). Where it cannot build (not
x86-64 with AVX2, no compiler or ninja, TIERFLOW_PURE_ADAMW=1) `kernel()` is None, one line on stderr says
why, and host_adamw runs torch's kernels instead.

How it keeps up with torch's fused AdamW, which moves 28 bytes per element where the executor's op moves 30
(the compute copy written too, with non-temporal stores; 34 when it also zeroes the gradient, which the
executor's op no longer asks for): 16 fp32 elements per iteration, the compute copy cast from the master
just written (in L1), the streams left to the hardware's prefetchers (software prefetches 512 elements ahead
ran 1-3% slower at 1M-100M on this C++ loop). Measured in experiments/bench_optimizer.py (docs/executor.md).

Numerics: every element takes the operations of the vector path of torch's fused CPU AdamW kernel
(aten/src/ATen/native/cpu/FusedAdamKernel.cpp, adam_math for float in ADAMW mode), in fp32 with the
coefficients rounded to fp32 as it rounds them (`coefficients`): the gradient times the clipping factor
(not multiplied where the factor is 1, as torch without one: the same values); the master times
1 - lr * weight_decay (decayed groups only); m = fma(1 - beta1, g - m, m) (its lerp);
v = fma((1 - beta2) * g, g, v * beta2) (how its build contracts `v * beta2 + (1 - beta2) * g * g`: measured);
master + (-lr / bias_correction1 * m) / (sqrt(v) / sqrt(bias_correction2) + eps). The file is compiled with
-ffp-contract=off, so the vector loop and the scalar loop (the elements before the first whole vector and
after the last) do the same correctly rounded operations and an element's result depends on nothing but its
own values. torch takes a scalar path without fused multiply-adds for the last partial vector of each tensor
and thread share; this kernel never does (bit for bit torch's vector path:
tests/executor/optim/test_fused_host_adamw.py).
The compute copy: rounded to nearest even from the fp32 bits, NaN as 0xffff, as torch's vectorized cast.

The step's sum of squares (of the unclipped gradients): per CHUNK of elements counted from the op's first
element, LANES fp32 partial sums, element e in lane (e - first) % LANES, each lane added in element order;
a chunk's lanes are then summed in fp64 in lane order and the chunks in chunk order. Alignment, cuts (the
host/SSD boundary, decay groups) and threads change no addition, so the sum has the same bits on any of them;
its rounding is that of an fp32 sum of 1024 terms per lane (1M random values: 3e-8 from the exact sum, where
torch's fp32 vector_norm, which the torch path uses, is 2e-5 off).

Threads: torch.get_num_threads() of them, torch's own intra-op team (at::parallel_for: OpenMP or torch's
native pool, whichever torch was built with), one unit per thread, each taking the next chunk until none is
left (a preempted thread holds up one chunk, not a fixed share); the module's `last_threads()` says how
many distinct threads ran the last call's units (tests/executor/optim/test_fused_host_adamw.py checks that
it is torch's setting, not 1). The call releases the GIL.

One call per op (`run_step`): the whole range, however its states and destinations are cut into tensors
(the host/SSD boundary, the device range of the weights), each tensor given whole with the offset of the
stretch in it, so the op makes no view and no tensor per call; how the range lies in its tensors depends
only on the plan's static ranges and is worked out once per range (`_cutting`, cached). The arguments are
checked before the loop (TORCH_CHECK: devices, dtypes, contiguity, every stretch's offset and length against
its tensor's size, the cuts, the groups' ends), so a wrong call raises instead of writing outside a tensor.
"""

from __future__ import annotations

import array
import functools
import hashlib
import math
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from tierflow.extras import install_command
from tierflow.planner.core.numba_once import OptionalKernel

LANES = 16  # fp32 partial sums of squares per chunk (the C++ file's LANES)
STATES = ("master", "adam_m", "adam_v")
CHUNK = 16384  # elements per chunk: per set of partial sums and per unit of a thread's work (64 KiB of fp32)
SWITCH = "TIERFLOW_PURE_ADAMW"  # "1": torch's kernels, the kernel not even built
SOURCE = Path(__file__).with_suffix(".cpp")
NAME = "tierflow_fused_host_adamw"  # the extension's module name (torch's cache folder: NAME-<digest>)
BUILD_LOCK = "tierflow-build.lock"  # flock'd around a build in its folder (torch's own lock does not free)
# the file's only fused multiply-adds are the ones written as such; the vector code for AVX2 (AVX-512 CPUs
# run it too), as torch's own AVX2 kernels
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]


class _Once(OptionalKernel):
    """The extension, built or loaded once per process on first use (OptionalKernel's lock: the
    executor's threads may ask at once), registered with tierflow env's accelerators
    (planner/core/numba_once.py); `error` says why not where it did not build."""

    def __init__(self) -> None:
        super().__init__("host optimizer's one-pass step", _build, switch=SWITCH, kind="C++ extension",
                         fallback="torch's kernels")


def unsupported() -> str:
    """Why the kernel cannot be built here ("" where it can be tried), without building anything."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the one-pass kernel is built for x86-64 only, this is {platform.machine()}"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"the one-pass kernel needs AVX2, torch runs {cap} here"
    if sys.platform == "win32":
        return "the one-pass kernel is built with GCC or Clang flags, not MSVC's"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler to build the one-pass kernel (install g++)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return f"no ninja to build the one-pass kernel ({install_command('fast')})"
    return ""


def _build():
    """Build (or load from torch's extensions cache) the C++ file; what stops it (this platform, no compiler,
    a failed build) raises, and _Once says so in one line on stderr: torch's kernels run instead."""
    why = unsupported()
    if why:
        raise RuntimeError(why)
    import fcntl

    from torch.utils.cpp_extension import load

    flags = _flags()
    build_dir = build_directory(flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies mid-build
        # torch's own lock file (its FileBaton) outlives a build that was killed, and every later load would
        # wait for it forever; holding ours, no other build of this directory is under way
        (build_dir / "lock").unlink(missing_ok=True)
        return load(name=NAME, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(build_dir),
                    verbose=False)


def _flags() -> list[str]:
    return FLAGS + _openmp_flags()


def build_directory(flags: list[str] | None = None) -> Path:
    """torch's extensions cache folder for this source, these flags (default: `_flags()`, computed once by the
    caller that also builds with them), this torch and this Python (checkouts of other versions, and other
    environments, do not rebuild over each other)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    flags = _flags() if flags is None else flags
    built_for = " ".join([*flags, torch.__version__, sys.version, platform.machine()])
    digest = hashlib.sha256(SOURCE.read_bytes() + built_for.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's own choice
    return Path(root) / f"{NAME}-{digest}"


def _openmp_flags() -> list[str]:
    """-fopenmp where torch's intra-op threads are OpenMP's: at::parallel_for is inline there (ATen's
    ParallelOpenMP.h, a `#pragma omp parallel`), so without it the kernel would run on one thread. Only
    compiled with it, not linked: the OpenMP calls resolve to the runtime torch already loaded (its own
    libgomp), one thread team for both."""
    import torch

    return ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []


def kernel():
    """The built extension (its `step` and `total`), or None: TIERFLOW_PURE_ADAMW=1, or it cannot be built
    here (`status()` says why)."""
    return _ONCE.get()


def available() -> bool:
    """Whether the one-pass kernel runs here (builds or loads it: seconds the first time per install)."""
    return kernel() is not None


def status(min_elements: int) -> str:
    """Which way the host optimizer op runs here, in one line, after building or loading the kernel (what
    really runs; `min_elements`: the fewest elements host_adamw hands to the kernel)."""
    if os.environ.get(SWITCH) == "1":
        return f"torch's kernels ({SWITCH}=1)"
    if kernel() is None:
        return f"torch's kernels ({unsupported() or 'the one-pass kernel did not build: ' + _ONCE.error})"
    return f"one-pass kernel (C++ extension, loaded), {_threads()}, from {min_elements:,} elements per op"


def _threads() -> str:
    import torch

    backend = "OpenMP" if "OpenMP" in torch.__config__.parallel_info().split("backend:")[-1] else "native"
    return f"on torch's intra-op threads ({backend})"


def warm_up() -> None:
    """Build or load the kernel and run it once on a few elements, so that a run's first optimizer op does
    not pay it (the executor calls this while it sets up, when a host optimizer part is large enough to take
    the kernel: host_adamw.MIN_KERNEL_ELEMENTS)."""
    import torch

    if kernel() is None:
        return
    n = 2 * LANES + 3
    t = [torch.zeros(n) for _ in range(4)]
    run_step(coefficients(1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0), [(0, n, True)],
             {"master": [(0, n, t[0])], "adam_m": [(0, n, t[1])], "adam_v": [(0, n, t[2])]}, t[3],
             [(0, n, torch.zeros(n, dtype=torch.bfloat16))], True)


def coefficients(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 coef: float) -> list[float]:
    """The fp32 constants of a step, rounded as torch's kernel rounds them (its bias corrections in double):
    [decay factor, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, -step size, clipping factor]
    (Python floats holding fp32 values exactly)."""
    bc1 = 1 - math.pow(beta1, step)
    bc2 = 1 - math.pow(beta2, step)
    return array.array("f", [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps,
                             -(lr / bc1), coef]).tolist()  # each rounded to fp32 as a C cast (numpy's too)


def run_step(consts: list[float], groups, states, grads, dests, want_squares: bool,
             zero_grads: bool = True) -> float | None:
    """The update of the op's adjacent decay groups [(a, z, decayed)] (see host_adamw) in one kernel call:
    `states` and `dests` are (a, z, tensor) pieces (a tensor holding elements [a, z) from index 0; a piece
    may reach beyond the op's range), `grads` the accumulator indexed by element. Returns the sum of the
    squares of the (unclipped) gradients when `want_squares`. fp16 destinations are not written (the caller
    casts). With `zero_grads` the gradients are zeroed after their use, else left as they were (read only)."""
    s = run_cut(kernel(), cutting(groups, states, dests), consts, states, grads, dests, zero_grads)
    return s if want_squares else None


def run_cut(k, cut: Cutting, consts: list[float], states, grads, dests, zero_grads: bool) -> float:
    """run_step by the kernel `k` with the Cutting `cut` of these pieces' spans (`cutting`, made once for the
    range); returns the sum of the squares."""
    pieces = (states["master"], states["adam_m"], states["adam_v"], dests)
    p, m, v, d = ([ps[i][2] if i >= 0 else None for i in at] for ps, at in zip(pieces, cut.pieces))
    return k.step(grads, cut.cuts, p, m, v, d, cut.offsets, consts, cut.ends, cut.decayed, zero_grads)


def cutting(groups, states, dests) -> Cutting:
    """How the range of `groups` lies in the pieces of `states` and `dests` (cached by their spans)."""
    import torch

    out = (torch.bfloat16, torch.float32)  # the kernel's destinations
    return _cutting(tuple(groups), tuple(tuple((a, z) for a, z, _t in states[c]) for c in STATES),
                    tuple((a, z, t.dtype in out) for a, z, t in dests))


@dataclass(frozen=True)
class Cutting:
    """How one op's range lies in its tensors (`_cutting`): the stretches [cuts[k], cuts[k + 1]), for each of
    the four kinds (master, adam_m, adam_v, compute copy) the index of the piece holding stretch k (-1: no
    compute copy written), each stretch's four offsets in those pieces, the decay groups' ends and flags."""

    cuts: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    ends: tuple[int, ...]
    decayed: tuple[bool, ...]


@functools.lru_cache(maxsize=4096)
def _cutting(groups: tuple, state_spans: tuple, dest_spans: tuple) -> Cutting:
    """The Cutting of the range of `groups` over the pieces' spans ((a, z) per piece of master, adam_m,
    adam_v; (a, z, written by the kernel) per destination): a function of the plan's static ranges, so
    computed once per op range and placement, not per step."""
    lo, hi = groups[0][0], groups[-1][1]
    cuts = {lo, hi}
    for spans in (*state_spans, dest_spans):
        cuts.update(x for a, z, *_w in spans for x in (a, z) if lo < x < hi)
    cuts = sorted(cuts)
    outs = [(i, a, z) for i, (a, z, written) in enumerate(dest_spans) if written]
    index: tuple[list[int], ...] = ([], [], [], [])
    offsets = []
    for s0, s1 in zip(cuts, cuts[1:]):
        for kind, spans in enumerate(state_spans):
            i, a = _holder([(i, a, z) for i, (a, z) in enumerate(spans)], s0, s1)
            index[kind].append(i)
            offsets.append(s0 - a)
        i, a = _holder(outs, s0, s1, missing_ok=True)
        index[3].append(i)
        offsets.append(s0 - a)
    return Cutting(tuple(cuts), tuple(map(tuple, index)), tuple(offsets), tuple(z for _a, z, _d in groups),
                   tuple(bool(d) for _a, _z, d in groups))


def _holder(spans: list[tuple[int, int, int]], s0: int, s1: int, missing_ok: bool = False) -> tuple[int, int]:
    """(index, first element) of the one (index, a, z) of `spans` that holds elements [s0, s1); (-1, s0) if
    none does and `missing_ok`."""
    for i, a, z in spans:
        if a <= s0 and s1 <= z:
            return i, a
    if not missing_ok:
        raise ValueError(f"no piece holds elements [{s0}, {s1})")
    return -1, s0


_ONCE = _Once()
