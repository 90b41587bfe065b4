"""The working memory of every compute op kind as the executor's own op code allocates it, against the
planner's per-op figure (tierflow.planner.core.workload: fwd_working_bytes, bwd_working_bytes).

    python experiments/device_memory.py [--quick] [--out DIR]

Each case builds one block of a zoo model (the executor's module, executor.models, its parameters views of one
flat vector as ComputeOps._leaves makes them) in bf16 on this machine's CPU, at micro-batch 1, and runs one op
kind the way executor/ops/compute.py runs it:

- **embed_fwd** / **fwd** (a recomputed layer: no autograd graph kept) / **fwd_swap** (a layer that keeps its
  activations: autograd's saved tensors stay, as the Pack the plan offloads) under ``torch.no_grad`` or
  ``enable_grad`` as ComputeOps.fwd;
- **recompute_bwd**: ComputeOps.recompute then ComputeOps.bwd (the plan allocates the layer's working memory
  at the recompute and frees it after the backward, so the pair is one figure);
- **bwd_swap**: the backward of a layer whose saved tensors are already there (ComputeOps.bwd, Pack branch);
- **embed_bwd**: ComputeOps._embedding_grads (an fp32 gradient per embedding matrix, index_add_);
- **head**: ComputeOps.head: the final norm and the chunked cross-entropy forward and backward
  (executor.models.chunked_lm_loss) with a tied head's embedding matrix.

The weight gradients a layer's or the head's backward leaves on its autograd leaves are counted (they stay
until GradBuffers.accumulate adds them into the plan's fp32 gradient buffer); that add itself runs after the
measurement: on CUDA an fp32 += bf16 add allocates nothing (the kernel casts as it reads), while a CPU kernel
would first copy the bf16 operand to fp32, which is no device memory. The embedding's fp32 gradients are
added inside it (fp32 into fp32).

Two measurements of the bytes the op allocates beyond what existed before it (its peak; the op's outputs
count, as the plan's working figure covers them):

- **tensors**: the peak of the live bytes of the storages that aten ops return (a TorchDispatchMode): the
  tensors the op code creates, which a CUDA run creates alike, plus the one temporary a kernel of these ops
  allocates on every device: torch.logsumexp's copy of its input less the maximum (ATen's
  logsumexp_out_impl materialises self - max before the exp and sum), counted while it runs;
- **allocator**: the peak of the CPU allocator's live bytes (torch.profiler, profile_memory=True: every
  allocation and free in time order), which adds what CPU kernels allocate inside themselves: the CPU's
  flash attention keeps per-thread blocks of scores and outputs, oneDNN's bf16 GEMMs scratch buffers (a CUDA
  flash-attention forward tiles in shared memory; cuBLAS uses its workspace, counted by
  tierflow.planner.core.devicemem).

The measured figure (measured_bytes) is the tensors' peak: what a CUDA run allocates; the allocator's is
reported beside it (its count can also fall below, when a block that existed before the profile, such as a
swapped layer's saved activations, is freed). The planner's figure (planned) is the op's working bytes as the
task graph allocates them (tierflow.planner.core.schedules): fwd_working_bytes for a forward (+ the saved
activations of a swapped layer, which the forward's offload allocates), bwd_working_bytes for recompute +
backward (less the saved activations for a swapped layer: they arrive by fetch), bwd_working_bytes for the
head. The ratio planned / measured is the margin (tests/planner/core/test_device_memory.py checks that planned
covers tensors and is not absurdly above it on quick cases).
Writes device_memory.csv under --out (default experiments/results).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from expcommon import script_main
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tierflow.executor import models as exec_models
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.workload import embed_cost, head_cost, layer_cost

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("embed_fwd", "fwd", "fwd_swap", "recompute_bwd", "bwd_swap", "embed_bwd", "head")
LAYER_KINDS = ("fwd", "fwd_swap", "recompute_bwd", "bwd_swap")
GRAD_SCALE = 8  # the loss is divided by the micro-batches (ComputeOps.grad_scale): any value, same bytes


@dataclass(frozen=True)
class Case:
    model: str
    seq: int
    kind: str
    vocab: int = 0  # 0: the model's
    micro_batch: int = 1

    def spec(self) -> ModelSpec:
        m = replace(get_model(self.model), num_layers=1)
        if self.vocab:
            m = replace(m, vocab_size=self.vocab)
        if m.max_positions and self.seq > m.max_positions:
            m = replace(m, max_positions=self.seq)
        return m


# the full sweep: every op kind at the zoo's shapes (vocabularies 32k-152k, sequences 2k-8k), micro-batch 1
FULL = ([Case("gpt3-1.3b", 2048, k) for k in KINDS]
        + [Case("llama2-7b", s, k) for s in (2048, 4096) for k in LAYER_KINDS + ("head",)]
        + [Case("llama2-7b", 8192, k) for k in ("fwd", "recompute_bwd")]
        + [Case("llama2-7b", 2048, "head", vocab=v) for v in (128256, 152064)]
        + [Case("gpt3-350m", s, k) for s in (4096, 8192) for k in KINDS])
# seconds on two cores: every op kind at small shapes, the loss's chunking on (a chunk smaller than the
# micro-batch's tokens: vocabulary 50257 at 1024 tokens)
QUICK = ([Case("tiny-gpt", 512, k, vocab=50257) for k in KINDS]
         + [Case("tiny-llama", 512, k, vocab=32000) for k in KINDS])


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes of the storages aten ops return while the mode is on (views and in-place
    results of an existing storage are no new memory), each counted until it is freed (a weak reference to
    the storage, swept before every op)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def _sweep(self) -> None:
        for ptr in [p for p, (ref, _n) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(ptr)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        if func is torch.ops.aten.logsumexp.default:  # its kernel's temporary (module doc)
            x = args[0]
            self.peak = max(self.peak, self.now + x.numel() * x.element_size())
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info for r in func._schema.returns):  # a view, an in-place or out= result
            return out
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n and ptr not in self.live:
                self.live[ptr] = (StorageWeakRef(st), n)
                self.now += n
                self.peak = max(self.peak, self.now)
        return out


def _allocator_peak(prof) -> int:
    """The peak of the CPU allocator's live bytes over the profiled region (its memory events in time
    order)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    now = peak = 0
    for _t, n in events:
        now += n
        peak = max(peak, now)
    return peak


def measure(fn) -> tuple[int, int, object]:
    """(tensors peak, allocator peak, fn's result) of one call of fn, its result kept alive to the end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, LiveTensorBytes() as live:
        out = fn()
    return live.peak, _allocator_peak(prof), out


# ---- the ops, as executor/ops/compute.py runs them ------------------------------------------------------


class Block:
    """One block's module and its parameters: views of one flat bf16 vector, one autograd leaf each
    (ComputeOps._leaves), and the fp32 gradient buffer (GradBuffers) the embedding's gradients go into."""

    def __init__(self, spec: ModelSpec, b: int, dtype: torch.dtype) -> None:
        self.spec, self.b, self.dtype = spec, b, dtype
        self.module = exec_models.make_blocks(spec, "meta", None, None)[b]
        named = list(self.module.named_parameters())
        numel = sum(p.numel() for _, p in named)
        g = torch.Generator().manual_seed(b)
        self.flat = torch.randn(numel, generator=g, dtype=dtype).mul_(0.02)
        self.slots, at = [], 0
        for name, p in named:
            self.slots.append((name, at, p.numel(), tuple(p.shape)))
            at += p.numel()
        self.acc = torch.zeros(numel, dtype=torch.float32)
        self.tied = None
        if b == spec.num_layers + 1 and spec.tied_embeddings:
            self.tied = torch.randn(spec.vocab_size, spec.hidden, generator=g, dtype=dtype).mul_(0.02)

    def leaves(self) -> dict[str, torch.Tensor]:
        return {name: self.flat[lo: lo + n].view(shape).detach().requires_grad_()
                for name, lo, n, shape in self.slots}

    def call(self, leaves: dict, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return functional_call(self.module, leaves, (x,), kwargs)


def _inputs(c: Case, spec: ModelSpec, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(c.micro_batch, c.seq, spec.hidden, generator=g, dtype=dtype)
    tokens = torch.randint(0, spec.vocab_size, (c.micro_batch, c.seq), generator=g)
    return x, tokens


def run_case(c: Case, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Measure one case: its op's bytes (tensors, allocator) and the planner's figure."""
    torch.manual_seed(0)
    spec = c.spec()
    x, tokens = _inputs(c, spec, dtype)
    t0 = time.perf_counter()
    tensors, alloc = _run_kind(c.kind, spec, x, tokens, dtype)
    planned = planned_bytes(c.kind, spec, c.micro_batch, c.seq)
    measured = tensors
    return {"model": c.model, "vocab": spec.vocab_size, "hidden": spec.hidden, "seq": c.seq,
            "micro_batch": c.micro_batch, "kind": c.kind, "tensors_bytes": tensors, "allocator_bytes": alloc,
            "measured_bytes": measured, "planned_bytes": int(planned),
            "margin": round(planned / max(measured, 1), 3), "seconds": round(time.perf_counter() - t0, 1)}


def _run_kind(kind: str, spec: ModelSpec, x, tokens, dtype) -> tuple[int, int]:
    L = spec.num_layers
    if kind == "embed_fwd":
        blk = Block(spec, 0, dtype)
        with torch.no_grad():
            tens, alloc, _ = measure(lambda: blk.call(blk.leaves(), tokens))
        return tens, alloc
    if kind == "embed_bwd":
        blk = Block(spec, 0, dtype)
        gout = x.clone()
        tens, alloc, _ = measure(lambda: _embedding_grads(blk, gout, tokens))
        return tens, alloc
    if kind == "head":
        blk = Block(spec, L + 1, dtype)
        targets = tokens.clone()
        tens, alloc, _ = measure(lambda: _head(blk, x, targets))
        return tens, alloc
    blk = Block(spec, 1, dtype)
    gout = x.clone()
    if kind == "fwd":
        with torch.no_grad():
            tens, alloc, _ = measure(lambda: blk.call(blk.leaves(), x))
        return tens, alloc
    if kind == "fwd_swap":
        tens, alloc, _ = measure(lambda: _forward_keep(blk, x))
        return tens, alloc
    if kind == "recompute_bwd":
        tens, alloc, _ = measure(lambda: _recompute_backward(blk, x, gout))
        return tens, alloc
    if kind == "bwd_swap":
        kept = _forward_keep(blk, x)  # the saved activations exist before the backward (fetched)
        tens, alloc, _ = measure(lambda: _backward_kept(blk, kept, gout))
        return tens, alloc
    raise ValueError(f"unknown op kind {kind!r}; one of {', '.join(KINDS)}")


def _forward_keep(blk: Block, x):
    """ComputeOps.fwd of a layer that is not recomputed: the graph and its saved tensors stay."""
    leaves = blk.leaves()
    xi = x.detach().requires_grad_()
    with torch.enable_grad():
        out = blk.call(leaves, xi)
    return out, xi, leaves


def _recompute_backward(blk: Block, x, gout):
    """ComputeOps.recompute then ComputeOps.bwd: the layer's graph rebuilt, its backward, the weight
    gradients added into the buffer; the input gradient handed on."""
    return _backward_kept(blk, _forward_keep(blk, x), gout)


def _backward_kept(blk: Block, kept, gout):
    out, xi, leaves = kept
    torch.autograd.backward(out, gout)
    return xi.grad, leaves  # the weight gradients: added into the buffer after the measurement (module doc)


def _head(blk: Block, x, targets):
    """ComputeOps.head: the loss's forward and backward under autograd, the weight gradients added."""
    xi = x.detach().requires_grad_()
    leaves = blk.leaves()
    tied = blk.tied.detach().requires_grad_() if blk.tied is not None else None
    with torch.enable_grad():
        loss = blk.call(leaves, xi, targets=targets, **({"tied_weight": tied} if tied is not None else {}))
        (loss / GRAD_SCALE).backward()
    return xi.grad, leaves, tied  # the weight gradients: added into the buffer after the measurement


def _embedding_grads(blk: Block, gout, tokens):
    """ComputeOps._embedding_grads: an fp32 gradient per embedding matrix, added into the buffer."""
    hidden = blk.spec.hidden
    emb = blk.module
    gtok = (gout if emb.scale is None
            else gout * torch.tensor(emb.scale, dtype=gout.dtype, device=gout.device))
    pieces = []
    for name, lo, n, shape in blk.slots:
        g = torch.zeros(shape, dtype=torch.float32)
        if name == "wte.weight":
            g.index_add_(0, tokens.reshape(-1), gtok.reshape(-1, hidden).float())
        else:
            g[emb.offset: emb.offset + gout.size(1)] = gout.float().sum(0)
        pieces.append((lo, n, g))
    for lo, n, g in pieces:  # fp32 into fp32: no cast
        blk.acc[lo: lo + n] += g.reshape(-1)


# ---- the planner's figure ---------------------------------------------------------------------------------


def planned_bytes(kind: str, spec: ModelSpec, micro_batch: int, seq: int) -> float:
    """The working bytes the task graph allocates for this op kind (module doc)."""
    if kind.startswith("embed"):
        e = embed_cost(spec, micro_batch, seq)
        return e.fwd_working_bytes if kind == "embed_fwd" else e.bwd_working_bytes
    if kind == "head":
        return head_cost(spec, micro_batch, seq).bwd_working_bytes
    lay = layer_cost(spec, micro_batch, seq)
    return {"fwd": lay.fwd_working_bytes,
            "fwd_swap": lay.fwd_working_bytes + lay.full_activation_bytes,
            "recompute_bwd": lay.bwd_working_bytes,
            "bwd_swap": lay.bwd_working_bytes - lay.full_activation_bytes}[kind]


# ---- the script -------------------------------------------------------------------------------------------


FIELDS = ["model", "vocab", "hidden", "seq", "micro_batch", "kind", "tensors_bytes", "allocator_bytes",
          "measured_bytes", "planned_bytes", "margin", "seconds"]


def run(quick: bool = False, out_dir: Path = RESULTS, cases: list[Case] | None = None) -> list[dict]:
    rows = []
    for c in cases or (QUICK if quick else FULL):
        r = run_case(c)
        rows.append(r)
        print(f"{r['model']:>10} V={r['vocab']:>6} T={r['seq']:>5} {r['kind']:>13}: tensors "
              f"{r['tensors_bytes'] / 2**20:8.1f} MiB, allocator {r['allocator_bytes'] / 2**20:8.1f} MiB, "
              f"planned {r['planned_bytes'] / 2**20:8.1f} MiB ({r['margin']:.2f}x; {r['seconds']} s)",
              flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "device_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, every op kind (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for device_memory.csv")
    args = ap.parse_args(argv)
    try:
        run(args.quick, args.out)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"device_memory: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
