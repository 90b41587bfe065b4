"""The device backend for `--device NAME` (`make_backend`): the one module that knows every backend, so that
none of them imports another (device/base.py <- device/cuda.py, device/emulated.py <- this factory).
"""

from __future__ import annotations

import torch

from tierflow.executor.device.base import DeviceBackend, PlainCpuBackend
from tierflow.executor.device.cuda import CudaBackend
from tierflow.executor.device.emulated import AdversarialCpuBackend


def make_backend(name: str, seed: int = 0) -> DeviceBackend:
    """The backend for `--device NAME`; ValueError (one line) for a name it does not know or cannot use."""
    if name == "cpu":
        return PlainCpuBackend()
    if name == "cpu-adversarial" or name.startswith("cpu-adversarial:"):
        idx = name.partition(":")[2] or "0"
        if not idx.isdigit():
            raise ValueError(f"--device {name!r}: the emulated device index must be a number")
        return AdversarialCpuBackend(int(idx), seed=seed)
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available here (use --device cpu)")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
        return CudaBackend(dev)
    raise ValueError(f"--device {name!r}: use cpu, cuda or cuda:N")


def as_backend(device: torch.device | str | DeviceBackend) -> DeviceBackend:
    if isinstance(device, DeviceBackend):
        return device
    return make_backend(str(device))
