"""The host optimizer op's one-pass AdamW (executor/optim/fused_host_adamw.py and .cpp, through host_adamw)
against torch: every element bit for bit as the vector path of torch's fused AdamW kernel (the reference runs
each group padded to whole vectors, on one thread, so that torch takes no scalar path), the compute copy's
bits as torch's cast, the squares within 1e-6 of the exact sum, the same bits on any thread count, cut and
alignment, a wrong call refused before the loop, and torch's kernels when switched off or not built."""

from __future__ import annotations

import math
import platform

import pytest
import torch

from tierflow.executor.optim import fused_host_adamw
from tierflow.executor.optim import host_adamw as host_adamw_module
from tierflow.executor.optim.adamw import TrainHyper
from tierflow.executor.optim.host_adamw import host_adamw

# adjacent decay groups of odd lengths (biases and norms between matrices), none a multiple of a vector; the
# op's range starts at element LO of the accumulator, not at a chunk's or a vector's boundary
LO = 37
GROUPS = [(LO, LO + 1001, True), (LO + 1001, LO + 1038, False), (LO + 1038, LO + 9021, True),
          (LO + 9021, LO + 9024, False), (LO + 9024, LO + 13000, True)]
HI = GROUPS[-1][1]
N = HI - LO
H = TrainHyper(lr=3e-3, weight_decay=0.1, schedule="cosine", warmup_steps=2, total_steps=10)
STATES = ("master", "adam_m", "adam_v")


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TIERFLOW_PURE_ADAMW", raising=False)
    monkeypatch.setattr(host_adamw_module, "MIN_KERNEL_ELEMENTS", 0)  # these ranges are smaller
    if fused_host_adamw.unsupported():
        pytest.skip(fused_host_adamw.unsupported())
    assert fused_host_adamw.available(), fused_host_adamw.status(0)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(N, generator=g), "adam_m": torch.randn(N, generator=g) * 1e-3,
            "adam_v": torch.rand(N, generator=g) * 1e-6,
            "grads": torch.cat([torch.full((LO,), 7.0), torch.randn(N, generator=g) * 1e-2,
                                torch.full((5,), 7.0)])}


def _vector_path(s: dict[str, torch.Tensor], step: int, coef: float | None) -> None:
    """torch's fused AdamW on each group, padded to a multiple of 64 elements on one thread: every element in
    its vector path."""
    torch.set_num_threads(1)
    g = s["grads"][LO:HI] * coef if coef is not None else s["grads"][LO:HI].clone()
    for a, z, decayed in GROUPS:
        pad = -(z - a) % 64
        p, m, v, gr = (torch.cat([t[a - LO: z - LO], torch.ones(pad)])
                       for t in (s["master"], s["adam_m"], s["adam_v"], g))
        torch._fused_adamw_([p], [gr], [m], [v], [], [torch.tensor(float(step))], lr=H.lr_at(step),
                            beta1=H.beta1, beta2=H.beta2, weight_decay=H.weight_decay if decayed else 0.0,
                            eps=H.eps, amsgrad=False, maximize=False)
        for t, new in ((s["master"], p), (s["adam_m"], m), (s["adam_v"], v)):
            t[a - LO: z - LO] = new[: z - a]
    s["grads"][LO:HI] = 0


def _stretches(t: torch.Tensor, cuts: list[int]) -> list[tuple[int, int, torch.Tensor]]:
    """`t` (elements LO..HI) as the op sees it: separate tensors between the element numbers `cuts`."""
    ends = [LO, *cuts, HI]
    return [(a, z, t[a - LO: z - LO].clone()) for a, z in zip(ends, ends[1:])]


def _run(s, step, coef, cuts, dests, threads, zero_grads=True):
    """host_adamw on `s` with its states cut at `cuts`; the states put back together; the squares."""
    torch.set_num_threads(threads)
    st = {k: _stretches(s[k], cuts) for k in STATES}
    sq = host_adamw(H, step, GROUPS, st, s["grads"], dests, coef, squares=True, zero_grads=zero_grads)
    for k in STATES:
        s[k] = torch.cat([t for _a, _z, t in st[k]])
    return sq


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="torch's kernels without AVX2 / AVX-512 (ATEN_CPU_CAPABILITY=default) use no "
                    "fused multiply-add; the one-pass kernel computes as its AVX2 and AVX-512 builds")
@pytest.mark.parametrize("threads,cuts", [(1, []), (2, []), (2, [LO + 4096 - 37, LO + 9022]), (1, [LO + 5])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bit_for_bit_torch_vector_path(threads, cuts, dtype):
    ref, got = _state(0), _state(0)
    for step, coef in ((1, None), (2, 0.5), (7, torch.tensor(0.25))):
        grads_before = got["grads"][LO:HI].clone()
        _vector_path(ref, step, None if coef is None else float(coef))
        wire, host = torch.empty(100, dtype=dtype), torch.empty(N - 100, dtype=dtype)
        sq = _run(got, step, coef, cuts, [(LO, LO + 100, wire), (LO + 100, HI, host)], threads)
        for k in STATES:
            assert torch.equal(got[k], ref[k]), (k, step)
        assert torch.equal(got["grads"][LO:HI], torch.zeros(N))
        assert torch.equal(got["grads"][:LO], torch.full((LO,), 7.0))  # outside the range: untouched
        assert torch.equal(got["grads"][HI:], torch.full((5,), 7.0))
        assert torch.equal(torch.cat([wire, host]), ref["master"].to(dtype))
        exact = math.fsum(float(x) ** 2 for x in grads_before.double())
        assert isinstance(sq, float) and abs(sq - exact) <= 1e-6 * exact


@pytest.mark.parametrize("threads,cuts", [(1, []), (2, [LO + 4096 - 37, LO + 9022])])
def test_without_zeroing_the_gradients_are_only_read(threads, cuts):
    """zero_grads=False (the executor's adam op: the next step's first gradient write overwrites): the same
    update, compute copy and squares, bit for bit, and the gradients as they were, in the vector and the
    scalar loop (the groups' odd lengths)."""
    zeroed, kept = _state(2), _state(2)
    before = kept["grads"].clone()
    outs = [torch.empty(N, dtype=torch.bfloat16) for _ in range(2)]
    sq0 = _run(zeroed, 3, 0.5, cuts, [(LO, HI, outs[0])], threads)
    sq1 = _run(kept, 3, 0.5, cuts, [(LO, HI, outs[1])], threads, zero_grads=False)
    assert all(torch.equal(zeroed[k], kept[k]) for k in STATES)
    assert torch.equal(outs[0], outs[1]) and sq0 == sq1
    assert torch.equal(zeroed["grads"][LO:HI], torch.zeros(N))
    assert torch.equal(kept["grads"], before)


def test_the_same_bits_on_any_thread_count_and_cut():
    """Threads, where the states are cut and where the compute copy lies in memory (aligned to a whole
    vector or not: non-temporal stores or not) change nothing: not the update, not the squares."""
    out = []
    for threads, cuts, shift in [(1, [], 0), (2, [], 1), (2, [LO + 4096, LO + 8192], 3), (1, [LO + 8195], 0),
                                 (2, [LO + 5, LO + 4099, LO + 9000], 7), (1, [LO + 17, LO + 6001], 16)]:
        s = _state(1)
        dest = torch.empty(N + shift, dtype=torch.bfloat16)[shift:]
        sq = _run(s, 3, None, cuts, [(LO, HI, dest)], threads)
        out.append((s, dest.clone(), float(sq)))
    for s, dest, sq in out[1:]:
        assert all(torch.equal(s[k], out[0][0][k]) for k in STATES)
        assert torch.equal(dest, out[0][1]) and sq == out[0][2]


@pytest.mark.parametrize("pure", [False, True])
def test_pieces_reaching_beyond_the_range(pure, monkeypatch):
    """The adam op hands over whole host buffers (ops/optimizer.py `_pieces`): a state piece or a destination
    that holds more than the op's range is read and written only inside it, with the bits of pieces of
    exactly the range, by the kernel and by torch's kernels (pure)."""
    if pure:
        monkeypatch.setenv("TIERFLOW_PURE_ADAMW", "1")
    exact, wide = _state(6), _state(6)
    mid = LO + 4000
    outs = [torch.empty(N, dtype=torch.bfloat16), torch.full((HI + 3,), 9.0, dtype=torch.bfloat16)]
    sq0 = _run(exact, 2, 0.5, [mid], [(LO, HI, outs[0])], 2)
    torch.set_num_threads(2)
    st = {k: [(0, mid, torch.cat([torch.full((LO,), 9.0), wide[k][: mid - LO]])),
              (mid, HI + 7, torch.cat([wide[k][mid - LO:], torch.full((7,), 9.0)]))] for k in STATES}
    sq1 = host_adamw(H, 2, GROUPS, st, wide["grads"], [(0, HI + 3, outs[1])], 0.5, squares=True,
                     zero_grads=True)
    for k in STATES:
        (_a, _m, head), (_m2, _z, tail) = st[k]
        assert torch.equal(torch.cat([head[LO:], tail[:-7]]), exact[k]), k
        assert (head[:LO] == 9.0).all() and (tail[-7:] == 9.0).all(), k
    assert torch.equal(outs[1][LO:HI], outs[0])
    assert (outs[1][:LO] == 9.0).all() and (outs[1][HI:] == 9.0).all()
    assert torch.equal(wide["grads"], exact["grads"]) and float(sq0) == float(sq1)


def test_it_runs_on_torchs_team_of_threads():
    """With torch on two threads the kernel's units run on two distinct threads, with one on one: the kernel
    is built where at::parallel_for's region really forks (with -fopenmp where torch's threads are OpenMP's;
    built without it the region is dropped and the kernel ran on one thread, 0.56-0.79x fused AdamW at two
    threads), whatever the load: the count is the team's members, not the threads that found a chunk."""
    k, f = fused_host_adamw.kernel(), fused_host_adamw
    n = 4 * f.CHUNK + 5
    for threads in (2, 1, 2):
        torch.set_num_threads(threads)
        t = [torch.randn(n) for _ in range(4)]
        k.step(t[0], [0, n], [t[1]], [t[2]], [t[3]], [None], [0] * 4,
               f.coefficients(1e-3, 0.9, 0.95, 1e-8, 0.0, 1, 1.0), [n], [True], True)
        assert k.last_threads() == threads, (threads, k.last_threads())


def test_cast_bits_as_torch():
    """The compute copy rounded to nearest even from the fp32 bits, on random values, ties, subnormals,
    infinities, NaN, in the vector loop and the scalar one (a step with lr 0 leaves the master as it is)."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_8001, 0x7F7F_FFFF, 0x0000_8000, 0x8001_8000,
                         0x0000_0001, 0x807F_FFFF, 0x7F80_0000, 0xFF80_0000, 0x7F7F_8000, 0x0, 0x8000_0000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([torch.randn(10_000) * 10.0 ** torch.randint(-30, 30, (10_000,)), ties,
                   torch.tensor([float("nan"), -float("nan")])])
    n = len(x)
    master, zeros = x.clone(), [torch.zeros(n) for _ in range(3)]
    out = torch.empty(n + 1, dtype=torch.bfloat16)[1:]  # not aligned: no streaming stores
    consts = fused_host_adamw.coefficients(0.0, 0.9, 0.95, 1e-8, 0.0, 1, 1.0)
    states = {"master": [(0, n, master)], "adam_m": [(0, n, zeros[0])], "adam_v": [(0, n, zeros[1])]}
    fused_host_adamw.run_step(consts, [(0, n, False)], states, zeros[2], [(0, n, out)], False)
    assert torch.equal(master[:-2].view(torch.int32), x[:-2].view(torch.int32))
    assert torch.equal(out[:-2].view(torch.int16), x[:-2].to(torch.bfloat16).view(torch.int16))
    assert out[-2:].isnan().all() and (out[-2:].view(torch.int16) == -1).all()  # 0xffff


def test_a_wrong_call_is_refused_before_the_loop():
    """Sizes, offsets, dtypes, the cuts and the groups' ends are checked before any element is written: a
    call that would read or write outside a tensor raises and leaves the tensors as they were."""
    k = fused_host_adamw.kernel()
    n = 1000
    g, p, m, v = (torch.full((n,), 0.5) for _ in range(4))
    c = fused_host_adamw.coefficients(1e-3, 0.9, 0.95, 1e-8, 0.1, 1, 1.0)

    def call(g=g, cuts=(0, n), p=p, m=m, v=v, d=None, offsets=(0, 0, 0, 0), c=c, ends=(n,), decayed=(True,)):
        return k.step(g, list(cuts), [p], [m], [v], [d], list(offsets), c, list(ends), list(decayed), True)

    bad = [(dict(m=m[:-1]), "adam_m of stretch 0 holds 999 elements"),
           (dict(d=torch.empty(n - 1, dtype=torch.bfloat16)), "compute copy of stretch 0 holds"),
           (dict(d=torch.empty(n, dtype=torch.float16)), "compute copy of stretch 0 must be"),
           (dict(p=p.double()), "the master of stretch 0 must be"),
           (dict(offsets=(0, 1, 0, 0)), "adam_m of stretch 0 holds 1000 elements, not \\[1, 1001\\)"),
           (dict(offsets=(-1, 0, 0, 0)), "the master of stretch 0 holds"),
           (dict(g=g[:-1]), "gradient"),
           (dict(cuts=(0, n + 1), ends=(n + 1,), g=torch.zeros(n + 1)), "the master of stretch 0 holds"),
           (dict(cuts=(5, 5)), "cuts must increase"),
           (dict(cuts=(-1, n)), "cuts must hold"),
           (dict(ends=(n - 1,)), "decay groups"),
           (dict(ends=(500, 400, n), decayed=(True, False, True)), "decay groups' ends must increase"),
           (dict(ends=(n,), decayed=(True, False)), "decay groups"),
           (dict(c=c[:7]), "coefficients"),
           (dict(offsets=(0, 0, 0)), "offsets"),
           (dict(g=g[::2], p=p[::2], m=m[::2], v=v[::2], cuts=(0, n // 2)), "contiguous")]
    for args, what in bad:
        with pytest.raises(RuntimeError, match=what):
            call(**args)
    assert all(torch.equal(t, torch.full((n,), 0.5)) for t in (g, p, m, v))
    call()  # the same call, right: it runs
    assert torch.equal(g, torch.zeros(n)) and not torch.equal(p, torch.full((n,), 0.5))


def test_switched_off_it_runs_torchs_kernels(monkeypatch):
    """TIERFLOW_PURE_ADAMW=1: host_adamw takes torch's kernels, whose scalar path (no fused multiply-add)
    for a group's last partial vector differs from the kernel's in some last bits."""
    monkeypatch.setenv("TIERFLOW_PURE_ADAMW", "1")
    assert fused_host_adamw.kernel() is None
    fast, pure = _state(2), _state(2)
    sq_pure = _run(pure, 1, None, [], [(LO, HI, torch.empty(N))], 1)
    monkeypatch.delenv("TIERFLOW_PURE_ADAMW")
    sq_fast = _run(fast, 1, None, [], [(LO, HI, torch.empty(N))], 1)
    assert torch.equal(pure["grads"], fast["grads"])
    for k in STATES:  # a rounding apart: within a few ulps of the tensor's largest element
        assert torch.allclose(pure[k], fast[k], rtol=0, atol=2.0 ** -21 * float(fast[k].abs().max())), k
    assert not all(torch.equal(pure[k], fast[k]) for k in STATES)  # the last vector of each group
    assert abs(float(sq_pure) - float(sq_fast)) <= 1e-5 * float(sq_fast)


def test_a_small_range_takes_torchs_kernels(monkeypatch):
    """Below MIN_KERNEL_ELEMENTS the op runs torch's kernels (a tiny model's run never loads numba): its
    squares come back as a tensor, the kernel's as a float."""
    small = _state(3)
    sq = _run(small, 1, None, [], [(LO, HI, torch.empty(N))], 1)
    assert isinstance(sq, float)
    monkeypatch.setattr(host_adamw_module, "MIN_KERNEL_ELEMENTS", N + 1)
    sq = _run(small, 2, None, [], [(LO, HI, torch.empty(N))], 1)
    assert isinstance(sq, torch.Tensor)


def test_a_kernel_that_does_not_build_leaves_torchs_kernels(monkeypatch, capsys):
    """A compiler that cannot build the kernel: one line on stderr, status() says why, torch's kernels run."""
    def broken(**_kw):
        raise RuntimeError("Error building extension 'x'\nno such target")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.setattr(fused_host_adamw, "_ONCE", fused_host_adamw._Once())  # not built yet in this process
    assert fused_host_adamw.kernel() is None and not fused_host_adamw.available()
    err = capsys.readouterr().err
    assert "did not build (RuntimeError: Error building extension 'x'" in err and len(err.splitlines()) == 1
    assert "did not build" in fused_host_adamw.status(0)
    sq = _run(_state(4), 1, None, [], [(LO, HI, torch.empty(N))], 1)
    assert isinstance(sq, torch.Tensor)  # torch's kernels' squares


def test_elsewhere_torchs_kernels_with_one_line(monkeypatch, capsys):
    """On a platform the kernel is not built for (here: an Arm CPU, pretended) nothing is compiled: one
    line says why, `tierflow env`'s line says the same, and torch's kernels run."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(fused_host_adamw, "_ONCE", fused_host_adamw._Once())
    assert fused_host_adamw.kernel() is None
    err = capsys.readouterr().err
    assert "x86-64 only, this is aarch64" in err and len(err.splitlines()) == 1
    # tierflow env's line (executor/env.py: status) names the same cause
    assert fused_host_adamw.status(0) == f"torch's kernels ({fused_host_adamw.unsupported()})"
    assert "x86-64 only, this is aarch64" in fused_host_adamw.status(0)
    sq = _run(_state(5), 1, None, [], [(LO, HI, torch.empty(N))], 1)
    assert isinstance(sq, torch.Tensor)


def test_a_build_killed_before_leaves_no_lock_that_hangs_the_next(tmp_path):
    """torch's own build lock (a file, its FileBaton) outlives a build killed mid-way, and torch's load then
    waits for it forever: the kernel's build removes it under its own flock (freed when a process dies). A
    fresh process with a stale lock in the build folder loads the kernel within the bound. (In a cache folder
    of its own, a copy of the built one: another process here may be building in the shared one.)"""
    import os
    import shutil
    import subprocess
    import sys

    built = fused_host_adamw.build_directory()
    root = tmp_path / "extensions"
    build = root / built.name
    shutil.copytree(built, build, ignore=shutil.ignore_patterns("lock", fused_host_adamw.BUILD_LOCK))
    (build / "lock").write_text("")  # as a killed build leaves it
    code = ("from tierflow.executor.optim import fused_host_adamw as f; "
            "assert f.build_directory().parent.name == 'extensions', f.build_directory(); "
            "assert f.kernel() is not None, f.status(0)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    assert not (build / "lock").exists()
