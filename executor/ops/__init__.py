"""The plan's ops: one handler per op kind (tierflow.planner.core.opkinds.OP_KINDS), in the table of table.py
(`Ops`), and what they see (context.py: `OpContext`, the executor's fixed context; `RoundState`, one round's).

    entries.py        EntryOps: activations, their gradients and saved-tensor packs (offload, fetch, write,
                      read)
    compute.py        ComputeOps: fwd, recompute, head, bwd
    weights.py        WeightOps: read_weights, fetch_weights, update_weights
    grad_buffers.py   GradBuffers: the device buffers the compute ops add weight gradients into
    grads.py          GradOps: offload_grads, write_grads, read_grads (HostGradAdds: the host fp32 adds)
    optimizer.py      OptimizerOps: adam, adam_deferred, read_opt_states, write_opt_states, adam_gpu
    net.py            NetOps: all_gather_weights, reduce_scatter_grads (several ranks)
"""
