"""Optional accelerators: a kernel built once per process, on first use, that the code runs when it can and
falls back from in one line when it cannot (the simulator's event loop, planner/core/simkernel.py; the host
optimizer's one-pass step, executor/optim/fused_host_adamw.py; any later extension), and the registry of
them that `tierflow env` reports from.

`OptionalKernel(name, build, switch=..., needs=..., fallback=...).get()` is None while the environment
variable `switch` is "1" (read at each call, so a test or a benchmark can switch it), where the module
`needs` is not installed (silently: it is an optional extra), or where importing it or `build()` fails
(whatever it raises: one line on stderr naming the kernel, the error, what runs instead and the switch);
otherwise `build()` runs the first time and its result (None: it could not build) is kept. `status()` says
what really runs, after trying to build it (never a guess from what is installed). `NumbaOnce(switch,
build)` is the same for a numba kernel.

An extension (a C++ or numba kernel) plugs in by making one `OptionalKernel` at its module's import (it
registers itself by name in `ACCELERATORS`) and calling `get()` where it would run; `tierflow env` imports
the modules listed in tierflow.executor.env.ACCELERATOR_MODULES and prints each one's `status()`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierflow.extras import install_command


@dataclass(frozen=True)
class KernelStatus:
    """What runs for one accelerator: its name, whether the kernel runs, and a line saying what and why."""

    name: str
    runs: bool
    line: str


def one_line(e: BaseException, limit: int = 200) -> str:
    """`Type: message` of an exception on one line (a compiler's message spans many), at most `limit`
    characters of the message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


ACCELERATORS: dict[str, OptionalKernel] = {}  # every kernel made so far in this process, by name


class OptionalKernel:
    """A kernel built once per process on first use, or None (module docstring)."""

    def __init__(self, name: str, build: Callable[[], Any], *, switch: str, needs: str | None = None,
                 kind: str = "kernel", fallback: str = "the pure-Python code", extra: str = "fast") -> None:
        self.name, self.build, self.switch, self.needs = name, build, switch, needs
        self.kind, self.fallback, self.extra = kind, fallback, extra
        self.kernel: Any = None  # what build() returned, once it ran
        self.tried = False
        self.error = ""  # why it did not build (one line), once tried
        self.lock = threading.Lock()
        ACCELERATORS[name] = self

    def get(self) -> Any:
        if os.environ.get(self.switch) == "1":
            return None
        with self.lock:  # callers on several threads (the executor's) wait for the one build
            if not self.tried:
                self.tried = True
                if self.needs is not None and importlib.util.find_spec(self.needs) is None:
                    return None  # not installed: status() says so, nothing to warn about
                try:
                    if self.needs is not None:
                        importlib.import_module(self.needs)
                    self.kernel = self.build()
                except Exception as e:  # noqa: BLE001 - whatever stops the build, the fallback does the job
                    self.kernel, self.error = None, one_line(e)
                    print(f"tierflow: the {self.name} ({self.kind}) did not build ({self.error}); "
                          f"falling back to {self.fallback} ({self.switch}=1 skips the attempt)",
                          file=sys.stderr, flush=True)
                else:
                    if self.kernel is None:
                        self.error = "its build gave nothing"
        return self.kernel

    def status(self) -> KernelStatus:
        """What runs here, after trying to build the kernel (the one build of this process)."""
        if os.environ.get(self.switch) == "1":
            return KernelStatus(self.name, False, f"{self.fallback} ({self.switch}=1)")
        if self.get() is not None:
            return KernelStatus(self.name, True, self.kind)
        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return KernelStatus(self.name, False, f"{self.fallback} ({self.needs} is not installed: "
                                                  f"{install_command(self.extra)} gives the {self.kind})")
        return KernelStatus(self.name, False,
                            f"{self.fallback} (the {self.kind} did not build: {self.error})")


class NumbaOnce(OptionalKernel):
    """An OptionalKernel compiled with numba (the `fast` extra)."""

    def __init__(self, switch: str, build: Callable[[], Any], name: str | None = None,
                 fallback: str = "the pure-Python code") -> None:
        super().__init__(name or f"{build.__module__}.{build.__qualname__}", build, switch=switch,
                         needs="numba", kind="numba kernel", fallback=fallback)
