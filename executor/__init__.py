"""Executor: replays a tierflow plan file with PyTorch on real hardware.

Its commands (`run`, `calibrate`, `env`) are declared in tierflow.cli, which imports this package only when
one of them runs, so that planning never imports torch. Calibration (measuring this machine for a hardware
profile) is the `calibration` package.
"""
