"""Executor: replays a tierflow plan file with PyTorch on real hardware (see issue "Executor").

Its commands (`run` in tierflow.executor.commands, `calibrate` in tierflow.executor.calibrate) register through the
`tierflow.commands` entry-point group without importing torch, so that planning never imports it.
"""
