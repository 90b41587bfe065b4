"""The optimizer's numerics, below the ops (tierflow.executor.ops imports this package; it imports no op):

    adamw.py          the AdamW update with the run's settings (`Hyper`, `TrainHyper`), as torch.optim.AdamW
    host_adamw.py     the host optimizer op's fused AdamW over flat fp32 element ranges
    host_threads.py   the intra-op threads the host optimizer ops run on
    decay.py          which parameters are weight-decayed (biases and norm weights are not)
    clipping.py       gradient clipping by global L2 norm (`GradNorms`: exact or delayed)
    lr_schedule.py    the learning-rate schedules (Hugging Face's names and formulas)

The optimizer ops themselves (what an op reads and writes, the clipping norm over the round's gradient
accumulators) are ops/optimizer.py.
"""
