"""The tiers the training state lives on, and what moves bytes between them:

    state.py       TrainState: weights, master, Adam moments, gradient accumulators over device / host / SSD
    ssd_store.py   SsdStore: the SSD tier, one file per tensor segment, O_DIRECT, CRC32C per chunk
    arena.py       TransferArena: the pinned host area every transfer buffer is a view of
    packs.py       Pack: the saved tensors of a layer that is not recomputed, moved as one flat byte tensor
    direct_io.py   whether a filesystem takes O_DIRECT (standard library only: `tierflow env` imports it)
    dirlock.py     DirLock: the lock on a checkpoint or SSD directory, and stale run directories

This package imports nothing, so `tierflow env` can import direct_io.py without importing torch.
"""
