"""Executor: replays a tierflow plan file with PyTorch on real hardware. Its rooms, each a package of one file
per main class:

    ops/       the plan's ops: one handler per op kind (tierflow.planner.core.opkinds), the dispatch table
               (ops/table.py) and what an op sees (ops/context.py: OpContext, RoundState)
    tiers/     the training state on device / host / SSD and what moves it: TrainState, the SSD store, the
               pinned transfer arena, saved-tensor packs, O_DIRECT probing, directory locks
    device/    the device behind one interface (DeviceBackend): plain CPU, CUDA, the adversarial CPU emulation
               of CUDA (tests), and the factory that picks one for `--device` (device/factory.py)
    optim/     the optimizer's numerics, below the ops: AdamW, decay groups, clipping, the LR schedule

and, beside them, the engine that runs a plan's rounds (engine.py), how ops bind to tensors (binding.py), the
models (models/: one module per family and a registry), data (data.py), checkpoints (checkpoint.py),
several ranks (dist.py), signals (signals.py) and `tierflow run` as a library (run.py, its entry points: the
options it takes, options.py; the plan file's checks and the ranks, launch.py; the training loop,
train_loop.py, and its checks before the first step, preflight.py; what it writes, export.py; --adapt,
adapt.py). The executor never sees the command line: tierflow/cli/run.py builds its options and maps its
errors to exit codes.

Measuring a machine for a hardware profile is the `calibration` package. The commands that use the
executor (`run`, `calibrate`, `env`) are declared in tierflow.cli, which imports this package only when one of
them runs, so that planning never imports torch.
"""
