"""SIGINT and SIGTERM during `tierflow run`: the first one raises `Interrupted` in the main thread, which
stops the round's workers (Executor.run_round joins every one of them before the exception goes on), removes
the run's SSD directory and a half-written checkpoint, and ends the command with 128 + the signal's number
(130, 143). Further signals while it cleans up are ignored, so that a second Ctrl-C cannot leave threads
running at exit."""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, which it replaces
    """A stop signal arrived; not an Exception, so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignals:
    """Context manager (main thread only; elsewhere it does nothing): SIGINT and SIGTERM raise Interrupted
    once; the previous handlers are restored on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # already stopping
        self.signum = signum
        raise Interrupted(signum)

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
