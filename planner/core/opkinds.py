"""The op vocabulary: every op kind a plan may contain, defined once. The schedule builders emit these kinds,
plan-file validation accepts exactly these, and the executor's dispatch table maps each to one handler.

Entry ops move a tensor class that lives per micro-batch (activation checkpoints, kept activations and their
gradients): their kind is `<verb>_<tensor>`, e.g. `offload_checkpoint` (GPU -> host), `write_act` (host ->
SSD).
"""

from __future__ import annotations

import functools

# compute on the GPU
FWD = "fwd"
RECOMPUTE = "recompute"
HEAD = "head"
BWD = "bwd"
# weights
READ_WEIGHTS = "read_weights"  # SSD -> host
FETCH_WEIGHTS = "fetch_weights"  # host -> GPU
UPDATE_WEIGHTS = "update_weights"  # the optimizer's new 16-bit weights back to their tier
# gradients
OFFLOAD_GRADS = "offload_grads"  # GPU -> host
WRITE_GRADS = "write_grads"  # host -> SSD
READ_GRADS = "read_grads"  # SSD -> host
# the optimizer
READ_OPT_STATES = "read_opt_states"
WRITE_OPT_STATES = "write_opt_states"
ADAM = "adam"  # CPU AdamW, main part
ADAM_DEFERRED = "adam_deferred"  # CPU AdamW, the part deferred into the next iteration's forward (alpha)
ADAM_GPU = "adam_gpu"
# collectives of several ranks (resource net)
ALL_GATHER_WEIGHTS = "all_gather_weights"
REDUCE_SCATTER_GRADS = "reduce_scatter_grads"
ALL_REDUCE_GRADS = "all_reduce_grads"  # LoRA: the adapters' whole gradient summed on every rank

COMPUTE_KINDS = frozenset({FWD, RECOMPUTE, BWD, HEAD})
CPU_ADAM_KINDS = frozenset({ADAM, ADAM_DEFERRED})

# entry ops: <verb>_<tensor>
ENTRY_TENSORS = ("checkpoint", "act", "act_grad")  # tensor classes moved as entries
ENTRY_VERBS = ("offload", "fetch", "write", "read")  # GPU -> host, host -> GPU, host -> SSD, SSD -> host


@functools.cache  # one string per kind, not one per op: a 175B graph has ~100,000 entry ops
def entry_kind(verb: str, tensor: str) -> str:
    """The op kind that moves entry tensor class `tensor` by `verb`, e.g. entry_kind("offload", "act")."""
    return f"{verb}_{tensor}"


ENTRY_KINDS = {verb: frozenset(entry_kind(verb, x) for x in ENTRY_TENSORS) for verb in ENTRY_VERBS}

STATE_KINDS = frozenset({
    READ_WEIGHTS, FETCH_WEIGHTS, UPDATE_WEIGHTS, OFFLOAD_GRADS, WRITE_GRADS, READ_GRADS, READ_OPT_STATES,
    WRITE_OPT_STATES, ADAM, ADAM_DEFERRED, ADAM_GPU, ALL_GATHER_WEIGHTS, REDUCE_SCATTER_GRADS,
    ALL_REDUCE_GRADS,
})
OP_KINDS = COMPUTE_KINDS | STATE_KINDS | frozenset(k for kinds in ENTRY_KINDS.values() for k in kinds)
