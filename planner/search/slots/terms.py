"""The rate terms of a window's need in the slot model: the linear terms, one per resource (`window_terms`), a
shared link's direction against the other direction running eagerly beside it (`eager_terms`), a serial chain
stretched by the other direction of its links and by the shared host pools (`chain_needs`), and one channel's
due work slowed by an oversubscribed host pool (`dram_needs`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.costmodel import link_rates
from tierflow.planner.core.dsruntime import as_runtime_steps
from tierflow.planner.search.loads import duplex_coefficient
from tierflow.planner.search.slots.layout import CHANNELS, SlotModel


class LinkPair(NamedTuple):
    """One direction of a shared link (PCIe, or an SSD array) against the other direction."""

    channel: str  # this direction (a name in CHANNELS)
    other: str  # the other direction
    solo_bytes_per_s: float  # this direction's rate alone
    shared_bytes_per_s: float  # this direction's rate while the other runs
    other_shared_bytes_per_s: float  # the other's rate while this one runs
    other_solo_bytes_per_s: float  # the other's rate alone


class EagerTerm(NamedTuple):
    """A window's need for one direction of a shared link with the other running eagerly beside it
    (`eager_terms`): due_bytes * (s_per_byte + extra_s_per_byte), or, when the other direction stops first,
    due_bytes * s_per_byte + other_released_bytes * other_extra_s_per_byte; the smaller of the two."""

    channel: int  # index in CHANNELS of the direction whose due work the window must finish
    other: int  # index in CHANNELS of the other direction, running its released work beside it
    s_per_byte: float  # 1 / solo rate
    extra_s_per_byte: float  # k / shared rate of this direction
    other_extra_s_per_byte: float  # k / shared rate of the other direction


def eager_terms(hw: HardwareProfile) -> list[EagerTerm]:
    """The shared links, each direction A against the other B: (channel A, channel B, 1/solo_A, k, ...) such
    that finishing A's due work while B's released work runs eagerly beside it takes
        A/solo_A + k * min(A/shared_A, B/shared_B),   k = 1 - shared_A/solo_A
    (both directions at their shared rates while both run, A alone after: the fluid sharing the simulator
    plays). Returns (a, b, 1/solo_a, k/shared_a, k/shared_b) per ordered pair with k > 0."""
    idx = {k: i for i, k in enumerate(CHANNELS)}
    out = []
    for pair in _link_pairs(hw):
        solo, shared = pair.solo_bytes_per_s, pair.shared_bytes_per_s
        other_shared = pair.other_shared_bytes_per_s
        if solo <= 0 or shared <= 0 or other_shared <= 0:
            continue
        slowdown = 1.0 - shared / solo
        if slowdown > 1e-12:
            out.append(EagerTerm(idx[pair.channel], idx[pair.other], 1.0 / solo, slowdown / shared,
                                 slowdown / other_shared))
    return out


def _link_pairs(hw: HardwareProfile) -> list[LinkPair]:
    """Each direction A of a shared link against the other, B: (A, B, solo_A, shared_A, shared_B, solo_B)."""
    r = link_rates(hw)
    pairs = [LinkPair("h2d", "d2h", r.h2d, r.h2d_duplex, r.d2h_duplex, r.d2h),
             LinkPair("d2h", "h2d", r.d2h, r.d2h_duplex, r.h2d_duplex, r.h2d)]
    if hw.ssd.count > 0:
        pairs += [LinkPair("ssd_read", "ssd_write", r.ssd_read, r.ssd_read_mixed, r.ssd_write_mixed,
                           r.ssd_write),
                  LinkPair("ssd_write", "ssd_read", r.ssd_write, r.ssd_write_mixed, r.ssd_read_mixed,
                           r.ssd_read)]
    return pairs


class _ChainLinkTerm(NamedTuple):
    """A shared link direction A on the serial chains, against the other direction B (`chain_needs`)."""

    chain_solo_s: np.ndarray  # (W,) seconds of A's transfers on each window's chain, at A's solo rate
    other_released_s: np.ndarray  # (W,) seconds of B's work released in each window, at B's solo rate
    slowdown: float  # k = 1 - shared_A / solo_A


def runtime_box(sm: SlotModel, hw: HardwareProfile) -> HardwareProfile:
    """The box as the slot model's runtime steps CPU Adam on it (dsruntime.as_runtime_steps, from
    build_slot_model's meta["runtime"]): its rate sets how many DRAM bytes a second of CPU Adam moves, which
    the host-memory terms count. The task graph's CPU seconds are already at that rate (build_graph)."""
    return as_runtime_steps(hw, sm.meta.get("runtime"))


def chain_needs(sm: SlotModel, hw: HardwareProfile, rounds: int = 40) -> np.ndarray:
    """Seconds each serial chain's window needs: the chain at the links' solo rates, each transfer on it
    slowed where the other direction of its link runs beside it. That direction runs the work released in the
    window (eagerly, at its solo rate: B seconds) spread over the window's length X, so it runs beside the
    transfer a fraction f = min(1, B / X) of the transfer's time, and the transfer of A solo seconds takes A /
    (1 - k f), k = 1 - shared_A / solo_A. X is the least length that holds the chain so stretched (found by
    bisection: the stretched chain shrinks as X grows). Windows that are not chains: 0."""
    hw = runtime_box(sm, hw)
    chain_s = sm.work[:, CHANNELS.index("chain"), 0]
    terms: list[_ChainLinkTerm] = []
    for pair in _link_pairs(hw):
        solo, shared, other_solo = pair.solo_bytes_per_s, pair.shared_bytes_per_s, pair.other_solo_bytes_per_s
        if solo <= 0 or shared <= 0 or other_solo <= 0 or shared >= solo:
            continue
        ia, ib = CHANNELS.index(pair.channel), CHANNELS.index(pair.other)
        terms.append(_ChainLinkTerm(sm.links[:, ia] / solo, sm.released[:, ib, 0] / other_solo,
                                    1.0 - shared / solo))

    pools = _chain_pool_terms(sm, hw)

    def stretched(window_s: np.ndarray) -> np.ndarray:
        out = chain_s.copy()
        for term in terms:
            beside = np.minimum(1.0, term.other_released_s / np.maximum(window_s, 1e-12))
            out += term.chain_solo_s * (1.0 / (1.0 - term.slowdown * beside) - 1.0)
        # host pools: the chain's transfers and Adam slow while the window oversubscribes one
        for pool in pools:
            background = pool.background_use(window_s)
            for chain_solo_s, demand in pool.items:
                scale = np.minimum(1.0, pool.capacity / (demand + background))
                out += chain_solo_s * (1.0 / scale - 1.0)
        return out

    lo, hi = chain_s.copy(), stretched(chain_s)  # stretched(lo) <= hi: the answer lies in [lo, hi]
    for _ in range(rounds):
        mid = (lo + hi) / 2
        ok = stretched(mid) <= mid
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return np.where(chain_s > 0, hi, 0.0)


class _ChainPool(NamedTuple):
    """One shared host pool on the serial chains (`chain_needs`)."""

    # per channel: (W,) chain seconds at solo speed, its use of the pool
    items: list[tuple[np.ndarray, float]]
    background: list[tuple[np.ndarray, float, float]]  # per channel: (W,) released work beside the chain, its
    #   solo rate (work/s: no channel moves faster than that) and its use of the pool per unit of work
    capacity: float

    def background_use(self, window_s: np.ndarray) -> np.ndarray:
        """What the work released beside the chain uses of the pool per second, spread over the window, each
        channel at most at its solo rate."""
        out = np.zeros_like(window_s)
        for released, rate, unit in self.background:
            out += np.minimum(released / np.maximum(window_s, 1e-12), rate) * unit
        return out


def _chain_pool_terms(sm: SlotModel, hw: HardwareProfile) -> list[_ChainPool]:
    """Each chain's transfers and CPU Adam steps against the rest of its window's released work on each shared
    host pool (host memory; on a host device, its cores), spread evenly over the window: while together they
    ask for more than the pool holds, the chain's items run at capacity / (their demand + the background) of
    their solo speed, as the simulator slows every user of a pool in proportion."""
    r = link_rates(hw)
    solo = {"h2d": r.h2d, "d2h": r.d2h, "ssd_read": r.ssd_read, "ssd_write": r.ssd_write, "cpu": 1.0}
    out = []
    for _, cap_s, use in r.pools():
        items, background = [], []
        for ch, unit in use.items():
            if ch not in solo or solo[ch] <= 0:
                continue
            i = CHANNELS.index(ch)
            background.append((np.maximum(sm.released[:, i, 0] - sm.links[:, i], 0.0), solo[ch], unit))
            if sm.links[:, i].any():
                items.append((sm.links[:, i] / solo[ch], solo[ch] * unit))
        out.append(_ChainPool(items, background, cap_s))
    return out


class WindowTerms(NamedTuple):
    """The linear terms of a window's need (`window_terms`)."""

    per_channel: np.ndarray  # (K, C) seconds per unit of each channel's work (bytes on links, seconds else)
    names: list[str]  # (K,) the resource each term stands for


def window_terms(hw: HardwareProfile) -> WindowTerms:
    """Seconds a window needs per unit of each channel's work, one row per resource (each link alone, the PCIe
    link both ways, each SSD direction and a shared array, the CPU, a serial chain), and their names."""
    r = link_rates(hw)
    idx = {k: i for i, k in enumerate(CHANNELS)}
    rows, names = [], []

    def row(label: str, **per: float) -> None:
        v = np.zeros(len(CHANNELS))
        for k, s in per.items():
            v[idx[k]] = s
        rows.append(v)
        names.append(label)

    row("cpu", cpu=1.0)
    row("chain", chain=1.0)
    row("h2d", h2d=1.0 / r.h2d)
    row("d2h", d2h=1.0 / r.d2h)
    def duplex_rows(label: str, a: str, b: str, a_rate: float, b_rate: float, a_mixed: float,
                    b_mixed: float) -> None:
        """Both directions of one link: a/A + b/B + c min(a/Am, b/Bm) (loads.duplex_time_s), a max of two
        linear terms when c < 0."""
        c = duplex_coefficient(a_rate, b_rate, a_mixed, b_mixed)
        if c < 0:
            row(label, **{a: 1.0 / a_rate + c / a_mixed, b: 1.0 / b_rate})
            row(label, **{a: 1.0 / a_rate, b: 1.0 / b_rate + c / b_mixed})
        else:
            row(label, **{a: 1.0 / a_rate, b: 1.0 / b_rate})

    duplex_rows("pcie", "h2d", "d2h", r.h2d, r.d2h, r.h2d_duplex, r.d2h_duplex)
    if hw.ssd.count > 0:
        row("ssd_read", ssd_read=1.0 / r.ssd_read)
        row("ssd_write", ssd_write=1.0 / r.ssd_write)
        duplex_rows("ssd", "ssd_read", "ssd_write", r.ssd_read, r.ssd_write, r.ssd_read_mixed,
                    r.ssd_write_mixed)
    # host memory and, on a host device, its cores (loads.pool_times_s); the GPU's own share of the cores
    # is left out: its seconds are the slot durations, not a channel's work
    for name, cap_s, use in r.pools():
        row(name, **{k: u / cap_s for k, u in use.items() if k in idx})
    return WindowTerms(np.array(rows), names)


def dram_needs(sm: SlotModel, hw: HardwareProfile, rounds: int = 40) -> np.ndarray:
    """Seconds each window needs for one channel's due work (a link's bytes, CPU Adam's seconds) while the
    other channels run their released work eagerly beside it and together oversubscribe a shared host pool
    (host memory; on a host device, its cores): the channel runs at capacity / (its demand + the others') of
    its solo speed, as the simulator slows every user of a pool in proportion. The others' demand over a
    window of X seconds is each one's released work / X, at most its solo rate; X is the least length that
    holds the slowed work (bisection: the slowdown shrinks as X grows). 0 without a shared pool."""
    hw = runtime_box(sm, hw)
    r = link_rates(hw)
    W = len(sm.work)
    out = np.zeros(W)
    solo = {"h2d": r.h2d, "d2h": r.d2h, "ssd_read": r.ssd_read, "ssd_write": r.ssd_write, "cpu": 1.0}
    for _, cap_s, use in r.pools():
        chans = [c for c in use if c in solo and solo[c] > 0]
        for a in chans:
            alone_s = sm.work[:, CHANNELS.index(a), 0] / solo[a]
            if not alone_s.any():
                continue
            others = [(sm.released[:, CHANNELS.index(c), 0], solo[c], use[c]) for c in chans if c != a]

            def slowed(window_s: np.ndarray, alone_s=alone_s, others=others, a=a, cap_s=cap_s, use=use):
                demand = np.full(W, solo[a] * use[a])
                for released, rate, u in others:
                    demand += np.minimum(released / np.maximum(window_s, 1e-12), rate) * u
                return alone_s * np.maximum(1.0, demand / cap_s)

            lo, hi = alone_s.copy(), slowed(alone_s)  # slowed(lo) <= hi: the answer lies in [lo, hi]
            for _ in range(rounds):
                mid = (lo + hi) / 2
                ok = slowed(mid) <= mid
                hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
            out = np.maximum(out, np.where(alone_s > 0, hi, 0.0))
    return out
