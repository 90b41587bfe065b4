"""SIGINT and SIGTERM during `tierflow run`: the first one raises `Interrupted` in the main thread, which
stops the round's workers (Executor.run_round joins every one of them before the exception goes on), removes
the run's SSD directory and a half-written checkpoint, and ends the command with 128 + the signal's number
(130, 143). Further signals while it cleans up are ignored, so that a second Ctrl-C cannot leave threads
running at exit. A rank of several (`hold_on_error`) keeps ignoring them once an error has left the training:
it is saying why it stops (another rank died: torchrun's SIGTERM to the ranks left comes a moment later) and
ends at once after (launch.leave_world, then tierflow/cli/run.py `_end`), and a signal's default action would
end it without that line.

While training with a checkpoint directory (`deferred_stop`), the first signal is only noted: the round under
way finishes, its last step is saved, and then the run stops with the same exit code; a second signal stops
at once (the directory keeps the checkpoint before it, and the run says which step that is)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


_ACTIVE: StopOnSignals | None = None  # the handlers installed now (main thread), for deferred_stop


class StopOnSignals:
    """Context manager (main thread only; elsewhere it does nothing): SIGINT and SIGTERM raise Interrupted
    once; the previous handlers are restored on exit, or, with `hold_on_error` and an exception leaving the
    context, replaced by SIG_IGN for the rest of the process (which must then end by itself)."""

    def __init__(self, hold_on_error: bool = False) -> None:
        self.hold_on_error = hold_on_error
        self.signum: int | None = None  # the first stop signal
        self.raised = False  # Interrupted raised: later signals are ignored
        self.deferring = False  # deferred_stop: the first signal is noted, not raised
        self.stop_at_once: Callable[[], bool] = lambda: False  # ... unless this says the round cannot end
        self._old: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.raised:
            return  # already stopping
        if self.deferring and self.signum is None and not self.stop_at_once():
            self.signum = signum
            name = signal.Signals(signum).name
            print(f"tierflow run: {name}: stopping at the end of this round to save its last step (send it "
                  "again to stop now)", file=sys.stderr, flush=True)
            return
        self.signum = self.signum or signum
        self.raised = True
        raise Interrupted(self.signum)

    def __enter__(self) -> StopOnSignals:
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
            _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        hold = self.hold_on_error and exc[0] is not None
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_IGN if hold else old)
        if self._old:
            _ACTIVE = None
        self._old.clear()


@contextmanager
def deferred_stop(stop_at_once: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """While inside, the first stop signal is noted (`pending_signal`) instead of raised; a second one raises,
    and so does the first when `stop_at_once()` says the round cannot end (another rank died). Without
    StopOnSignals installed (a program calling run_plan), nothing changes."""
    s = _ACTIVE
    if s is None:
        yield
        return
    s.deferring, s.stop_at_once = True, stop_at_once
    try:
        yield
    finally:
        s.deferring, s.stop_at_once = False, lambda: False


def pending_signal() -> int | None:
    """The stop signal noted under deferred_stop and not raised yet, else None."""
    s = _ACTIVE
    return s.signum if s is not None and not s.raised else None


def stop_now(signum: int) -> Interrupted:
    """The Interrupted of a deferred signal, acted on now: later signals are ignored while the run stops."""
    if _ACTIVE is not None:
        _ACTIVE.signum, _ACTIVE.raised = _ACTIVE.signum or signum, True
    return Interrupted(signum)
