"""The simulator's event loop over arrays, compiled with numba where it is installed (the `fast` extra).

The same play as tierflow.planner.core.simulator._Run.play, step for step and in the same floating-point
operations, so its times, peaks and memory traces are identical (tests/planner/core/test_simkernel.py
compares both on every schedule family, several ranks, a host device and memory that blocks). The graph is
passed as arrays: queues, successors and memory deltas in compressed rows (an index array `*_ptr` of where
each row starts).
Without numba `kernel()` returns None and the simulator plays its pure-Python loop; set TIERFLOW_PURE_SIM=1 to
force that loop.
"""

from __future__ import annotations

import math

import numpy as np

from tierflow.planner.core.numba_once import NumbaOnce

# graphs smaller than this play in pure Python until the process has played MANY_SIMULATIONS graphs (a fit, a
# search) or loaded the kernel: importing numba and loading the compiled loop from its cache cost ~0.55 s of
# CPU once per process (measured: 0.25 s + 0.30 s), and the compiled loop saves ~4.5 us a task (GPT-3 175B,
# one iteration: 0.38 s pure, 0.10 s compiled), so one graph breaks even at ~120,000 tasks
MIN_KERNEL_TASKS = 100_000
MANY_SIMULATIONS = 20

_PLAYED = 0


def kernel_for(num_tasks: int):
    """The kernel to play a graph of `num_tasks` tasks with, or None for the pure-Python loop (see
    MIN_KERNEL_TASKS)."""
    global _PLAYED
    _PLAYED += 1
    if _ONCE.kernel is None and num_tasks < MIN_KERNEL_TASKS and _PLAYED <= MANY_SIMULATIONS:
        return None
    return kernel()


def kernel():
    """The compiled kernel (compiled on first use, cached on disk by numba), or None without numba, with
    TIERFLOW_PURE_SIM=1, or where numba cannot compile it (one line on stderr: numba_once)."""
    return _ONCE.get()


def _build():
    import numba

    # the loop calls _rerate by its global name: compiled first, so that the compiled loop calls it compiled
    globals()["_rerate"] = numba.njit(cache=True, nogil=True)(_rerate)
    k = numba.njit(cache=True, nogil=True)(play_arrays)
    _warm_up(k)
    return k


_ONCE = NumbaOnce("TIERFLOW_PURE_SIM", _build, name="simulator's event loop",
                  fallback="the simulator's pure-Python loop")


def _warm_up(k) -> None:
    """Compile `k` (or load it from numba's cache) now, for the argument types the simulator passes, by
    playing an empty graph: the caller does it outside the collector's pause (compiling makes cyclic
    garbage)."""
    R = 7
    i64, f64, one = np.zeros(0, np.int64), np.zeros(0), np.zeros(1, np.int64)
    flags = np.zeros(R, np.bool_)
    k(np.zeros(R + 1, np.int64), i64, i64, one, i64, i64, f64, one, i64, f64, one, i64, f64,
      np.zeros(1, np.bool_), flags, np.full(R, -1, np.int64), np.ones(R), np.ones(R), np.zeros(R), np.ones(R),
      flags, f64, np.zeros((0, R)), 1.0, False, 0.0, 0, 5, np.zeros(3), np.ones(3), np.zeros(3), f64, f64,
      np.zeros((1, 4)), np.zeros(R, np.int64), np.zeros(R, np.bool_))


def play_arrays(qptr, qidx, ndeps, sptr, sidx, res_of, work, nptr, ntier, nval, eptr, etier, evals, host_opt,
                fluid, partner, solo, duplex, latency, beside, is_host_link, pool_cap, pool_use, slow_gpu,
                contention, extra, gpu_r, cpu_r, mem, cap_eps, peak, start, end, trace, ptr, mem_blocked):
    """Play the graph (see _Run.play); returns (now, tasks done, rows of `trace` written). Mutates ndeps, mem,
    peak, start, end, trace, ptr and mem_blocked."""
    R = len(qptr) - 1
    P = len(pool_cap)
    inf = math.inf
    running = np.full(R, -1, np.int64)
    flowing = np.ones(R, np.bool_)
    remaining = np.zeros(R)
    rate = np.zeros(R)
    since = np.zeros(R)
    ev_t = np.full(R, inf)
    ev_seq = np.zeros(R, np.int64)
    pending = np.zeros(R, np.bool_)
    base = np.zeros(R)
    scale = np.ones(R)
    active = np.zeros(R, np.int64)
    wake = np.zeros(R, np.bool_)
    seq = 0
    now = 0.0
    ntrace = 1
    done = 0
    # the initial pass tries every resource in order; then each event's finish wakes resources
    for r0 in range(R):
        wake[r0] = True
    pending_begin = -1  # a resource whose work begins now (its fixed cost paid), else -1
    while True:
        # --- try to start the woken resources, in resource order -------------------------------------------
        rerate_needed = False
        if pending_begin >= 0:
            r = pending_begin
            pending_begin = -1
            flowing[r] = True
            tid = running[r]
            if fluid[r]:
                remaining[r] = work[tid]
                since[r] = now
                rate[r] = -1.0
                rerate_needed = True
            else:
                seq += 1
                ev_t[r] = now + work[tid]
                ev_seq[r] = seq
                pending[r] = True
        if rerate_needed:
            seq = _rerate(R, P, now, seq, running, flowing, remaining, rate, since, ev_t, ev_seq, pending,
                          base, scale, active, fluid, partner, solo, duplex, beside, is_host_link, pool_cap,
                          pool_use, slow_gpu, contention, extra, gpu_r, cpu_r, host_opt)
        for w in range(R):
            if not wake[w]:
                continue
            wake[w] = False
            if running[w] >= 0 or ptr[w] >= qptr[w + 1] - qptr[w]:
                continue
            tid = qidx[qptr[w] + ptr[w]]
            if ndeps[tid]:
                continue
            a, b = nptr[tid], nptr[tid + 1]
            if b > a:
                fits = True
                for j in range(a, b):
                    x = nval[j]
                    i = ntier[j]
                    if x > 0 and mem[i] + x > cap_eps[i]:
                        fits = False
                        break
                if not fits:
                    mem_blocked[w] = True
                    continue
                for j in range(a, b):
                    i = ntier[j]
                    m = mem[i] + nval[j]
                    mem[i] = m
                    if m > peak[i]:
                        peak[i] = m
                trace[ntrace, 0] = now
                trace[ntrace, 1] = mem[0]
                trace[ntrace, 2] = mem[1]
                trace[ntrace, 3] = mem[2]
                ntrace += 1
            mem_blocked[w] = False
            ptr[w] += 1
            running[w] = tid
            start[tid] = now
            lat = latency[w]
            if lat > 0:
                flowing[w] = False
                seq += 1
                ev_t[w] = now + lat
                ev_seq[w] = seq
                pending[w] = True
            else:
                flowing[w] = True
                if fluid[w]:
                    remaining[w] = work[tid]
                    since[w] = now
                    rate[w] = -1.0
                    seq = _rerate(R, P, now, seq, running, flowing, remaining, rate, since, ev_t, ev_seq,
                                  pending, base, scale, active, fluid, partner, solo, duplex, beside,
                                  is_host_link, pool_cap, pool_use, slow_gpu, contention, extra, gpu_r, cpu_r,
                                  host_opt)
                else:
                    seq += 1
                    ev_t[w] = now + work[tid]
                    ev_seq[w] = seq
                    pending[w] = True
        # --- the next event ---------------------------------------------------------------------------------
        while True:
            r = -1
            bt = inf
            bs = 0
            for i in range(R):
                if pending[i] and (r < 0 or ev_t[i] < bt or (ev_t[i] == bt and ev_seq[i] < bs)):
                    r, bt, bs = i, ev_t[i], ev_seq[i]
            if r < 0:
                break
            ev_t[r] = inf
            pending[r] = False
            if running[r] >= 0:
                break
        if r < 0:
            break
        now = bt
        tid = running[r]
        if not flowing[r]:  # its fixed cost is paid: its work begins (no resource is woken)
            pending_begin = r
            continue
        running[r] = -1
        end[tid] = now
        done += 1
        freed = False
        a, b = eptr[tid], eptr[tid + 1]
        if b > a:
            for j in range(a, b):
                i = etier[j]
                x = evals[j]
                m = mem[i] + x
                mem[i] = m
                if x < 0:
                    freed = True
                elif m > peak[i]:
                    peak[i] = m
            trace[ntrace, 0] = now
            trace[ntrace, 1] = mem[0]
            trace[ntrace, 2] = mem[1]
            trace[ntrace, 3] = mem[2]
            ntrace += 1
        if fluid[r]:
            rate[r] = 0.0
            seq = _rerate(R, P, now, seq, running, flowing, remaining, rate, since, ev_t, ev_seq, pending,
                          base, scale, active, fluid, partner, solo, duplex, beside, is_host_link, pool_cap,
                          pool_use, slow_gpu, contention, extra, gpu_r, cpu_r, host_opt)
        wake[r] = True
        for j in range(sptr[tid], sptr[tid + 1]):
            s = sidx[j]
            k = ndeps[s] - 1
            ndeps[s] = k
            if k == 0:
                wake[res_of[s]] = True
        if freed:
            for i in range(R):
                if mem_blocked[i]:
                    wake[i] = True
    return now, done, ntrace


def _rerate(R, P, now, seq, running, flowing, remaining, rate, since, ev_t, ev_seq, pending, base, scale,
            active, fluid, partner, solo, duplex, beside, is_host_link, pool_cap, pool_use, slow_gpu,
            contention, extra, gpu_r, cpu_r, host_opt):
    """_Run.play's rerate over arrays; returns the sequence number."""
    na = 0
    for r in range(R):
        if fluid[r] and running[r] >= 0 and flowing[r]:
            active[na] = r
            na += 1
    gpu_active = False
    for k in range(na):
        r = active[k]
        p = partner[r]
        base[r] = duplex[r] if p >= 0 and running[p] >= 0 and flowing[p] else solo[r]
        scale[r] = 1.0
        if r == gpu_r:
            gpu_active = True
    for q in range(P):
        demand = 0.0
        for k in range(na):
            r = active[k]
            demand += base[r] * pool_use[q, r]
        if demand > pool_cap[q]:
            f = pool_cap[q] / demand
            for k in range(na):
                r = active[k]
                if pool_use[q, r] > 0 and f < scale[r]:
                    scale[r] = f
    if gpu_active and slow_gpu > 1:
        t = running[cpu_r]
        if t >= 0 and flowing[cpu_r] and host_opt[t]:
            f = 1.0 / slow_gpu
            if f < scale[gpu_r]:
                scale[gpu_r] = f
    if contention and gpu_active:
        nio = 0
        for k in range(na):
            if is_host_link[active[k]]:
                nio += 1
        if nio:
            f = 1.0 / (1.0 + extra * nio)
            if f < scale[gpu_r]:
                scale[gpu_r] = f
            for k in range(na):
                r = active[k]
                if is_host_link[r]:
                    f = 1.0 / beside[r]
                    if f < scale[r]:
                        scale[r] = f
    for k in range(na):
        r = active[k]
        new = base[r] * scale[r]
        old = rate[r]
        if new == old:
            continue
        rem = remaining[r] - old * (now - since[r])
        remaining[r] = rem
        since[r] = now
        rate[r] = new
        if 0.0 > rem:
            rem = 0.0
        seq += 1
        ev_t[r] = now + (rem / new if new > 0 else math.inf)
        ev_seq[r] = seq
        pending[r] = True
    return seq
