"""A kernel compiled with numba once per process, on first use: the simulator's event loop
(planner/core/simkernel.py). (The host optimizer's one-pass step is a C++ extension now:
executor/optim/fused_host_adamw.py.)

`NumbaOnce(switch, build).get()` is None where numba is not installed or while the environment variable
`switch` is "1" (read at each call, so a test or a benchmark can switch it); otherwise `build()` runs the
first time and its result (None where it could not build) is kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class NumbaOnce:
    def __init__(self, switch: str, build: Callable[[], Any]) -> None:
        self.switch, self.build = switch, build
        self.kernel: Any = None  # what build() returned, once it ran
        self.tried = False

    def get(self) -> Any:
        if os.environ.get(self.switch) == "1":
            return None
        if not self.tried:
            self.tried = True
            try:
                import numba  # noqa: F401
            except ImportError:
                return None
            self.kernel = self.build()
        return self.kernel
