"""The host optimizer op's work on flat fp32 tensors (ops/optimizer.py `adam` calls `host_adamw`): the AdamW
update of an element range, its gradient accumulator zeroed and the compute copy of the updated weights
written where it goes, without temporaries. On one thread a large range goes chunk by chunk, so that each
chunk's zeroing and cast find what the update has just left in the cache instead of making two more passes
over memory (`chunk_elems` says when).

Numerics: bit for bit those of one fused AdamW call per decay group (torch._fused_adamw_, as torch.optim.AdamW
with fused=True) followed by the zeroing and the cast. The fused CPU kernel works in units of 16 elements from
a tensor's start and only its last, partial vector takes the scalar path; chunks start at multiples of
CHUNK_ALIGN elements from their group's start and a group's last chunk ends where the group does, so every
element takes the path it takes in one call over the whole group, whatever the chunk size and thread count.
A chunk that the host/SSD boundary cuts is updated in a contiguous copy (and copied back), so that this holds
whatever the placement (a checkpoint resumes bit for bit under another one).
"""

from __future__ import annotations

import torch

from tierflow.executor.adamw import coef_on, fused_adamw_, lr_of
from tierflow.executor.ops.context import Hyper

CHUNK_ALIGN = 64  # elements: a multiple of the fused kernel's 16-element task unit and of every vector width
CHUNK_ELEMS = 1 << 16  # one thread's chunk: 1.1 MiB of state (4 fp32 arrays, a bf16 copy), in a core's L2
WHOLE_ELEMS = 1 << 21  # up to this many elements the op's state stays in the last-level cache anyway

Stretch = tuple[int, int, torch.Tensor]  # (a, z, tensor of the elements [a, z))
STATE_CLASSES = ("master", "adam_m", "adam_v")


def chunk_elems(total: int, threads: int | None = None) -> int:
    """Elements per chunk for an op over `total` elements on `threads` intra-op threads (default: this
    thread's). Chunks only on one thread: with a team of threads every chunk's three calls are three parallel
    regions, each waiting at its barrier for the slowest thread, and on a host whose cores are shared (the
    executor's own compute, gradient adds and I/O threads, other processes) one preempted thread makes each
    region cost a scheduler slice: on the shared 2-core box (load 8) 100M parameters took 5.6 s at 2 threads
    in 256k-element chunks against 0.2 s for fused AdamW. One pass per call over the whole range has as few
    regions as torch's own AdamW step. Small ranges (WHOLE_ELEMS) are one pass as well, cached either way."""
    threads = threads or torch.get_num_threads()
    if threads > 1 or total <= WHOLE_ELEMS:
        return max(total + -total % CHUNK_ALIGN, CHUNK_ALIGN)
    return CHUNK_ELEMS


def host_adamw(h: Hyper, step: int, groups: list[tuple[int, int, bool]], states: dict[str, list[Stretch]],
               grads: torch.Tensor, dests: list[Stretch], coef: torch.Tensor | float | None = None,
               chunk: int | None = None) -> None:
    """AdamW step `step` (1-based) on the adjacent element ranges `groups` [(a, z, decayed)]: `states` has
    the stretches of the master ("master") and the moments ("adam_m", "adam_v") that cover them, `grads` the
    fp32 gradient accumulator indexed by element (zeroed over the groups after their update), `dests` the
    buffers the updated master goes to in the compute dtype; `coef` multiplies the gradients first
    (clipping)."""
    lr = lr_of(h, step)
    step_t = torch.full((), float(step), dtype=torch.float32)
    coef = coef_on(coef, grads.device) if coef is not None else None
    chunk = chunk or chunk_elems(groups[-1][1] - groups[0][0])
    assert chunk % CHUNK_ALIGN == 0, chunk
    for pieces in chunks(groups, chunk):
        ca, cz = pieces[0][0], pieces[-1][1]
        g = grads[ca:cz]
        if coef is not None:  # as clip_grad_norm_: always multiplied, a factor of 1 included
            torch._foreach_mul_([g], coef)
        for decayed in (True, False):
            ranges = [(a, z) for a, z, d in pieces if d == decayed]
            if not ranges:
                continue
            spans = {cls: [_span(states[cls], a, z) for a, z in ranges] for cls in STATE_CLASSES}
            p, m, v = ([t for t, _back in spans[cls]] for cls in STATE_CLASSES)
            fused_adamw_(h, p, [grads[a:z] for a, z in ranges], m, v, step_t, lr, decayed)
            for cls in STATE_CLASSES:
                for whole, back in spans[cls]:
                    _scatter(whole, back)
        g.zero_()
        for sa, sz, master in states["master"]:
            for a, z, buf in dests:
                x, y = max(a, sa, ca), min(z, sz, cz)
                if y > x:
                    buf[x - a: y - a].copy_(master[x - sa: y - sa])  # the cast to the compute dtype


def chunks(groups: list[tuple[int, int, bool]], chunk: int) -> list[list[tuple[int, int, bool]]]:
    """The adjacent `groups` in chunks of about `chunk` elements: a group longer than that cut at multiples
    of `chunk` from its start (its last piece ending with it), shorter ones whole, several to a chunk."""
    out: list[list[tuple[int, int, bool]]] = []
    cur: list[tuple[int, int, bool]] = []
    size = 0
    for ga, gz, d in groups:
        if gz - ga > chunk:
            out += [cur] if cur else []
            cur, size = [], 0
            out += [[(ca, min(ca + chunk, gz), d)] for ca in range(ga, gz, chunk)]
            continue
        if cur and size + gz - ga > chunk:
            out.append(cur)
            cur, size = [], 0
        cur.append((ga, gz, d))
        size += gz - ga
    return out + ([cur] if cur else [])


def _span(stretches: list[Stretch], a: int, z: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The elements [a, z): a view where one stretch holds them all, else a contiguous copy and the views it
    is to be copied back into."""
    views = [t[max(a, sa) - sa: min(z, sz) - sa] for sa, sz, t in stretches if min(z, sz) > max(a, sa)]
    if len(views) == 1:
        return views[0], []
    return torch.cat(views), views


def _scatter(whole: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy the contiguous `whole` back into the views it was concatenated from."""
    at = 0
    for p in pieces:
        p.copy_(whole[at: at + p.numel()])
        at += p.numel()
