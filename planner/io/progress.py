"""Progress of a long command on stderr, the one helper of the CLI, `tierflow calibrate` and the experiments.

On a terminal it is one line rewritten in place, `label [#####-----] 5/10 what  12s`. Anywhere else (a pipe,
a log file, CI) a command shows no progress unless `--verbose` asks for it (or tierflow is used as a library
whose logger nobody configured, or `enabled=True`): then the same text is printed as whole lines at a bounded
rate: the first step at once, then at most one line every `interval_s` (5 s) with the step reached by then,
and always the last step, so that a long command is not silent and a short one does not flood the log. Only
stderr is written, so what a command prints on stdout (tables, JSON) stays clean. `--quiet` (the `tierflow`
logger above INFO, logs.py) turns it off; messages still print. Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tierflow.logs import VERBOSE, logger, progress_enabled

BAR_WIDTH = 20  # characters of the bar
LINE_INTERVAL_S = 5.0  # off a terminal: at most one progress line per this many seconds (plus the last)
_DEFAULT_COLUMNS = 120  # line width when the terminal's cannot be read


def bar(count: int, total: int, fill: str = "-") -> str:
    """The bar of a progress line, `[#####-----]`, for `count` of `total` steps (also used by `tierflow run`'s
    per-step lines, which keep a line per step as a training log)."""
    filled = min(BAR_WIDTH, BAR_WIDTH * count // max(1, total))
    return "[" + "#" * filled + fill * (BAR_WIDTH - filled) + "]"


def _lines_off_terminal() -> bool:
    """Whether progress lines go to a stderr that is not a terminal: only with --verbose, or when nobody
    configured the `tierflow` logger (tierflow used as a library); a command's plain run keeps a redirected
    stderr for its messages."""
    level = logger().level
    return level == logging.NOTSET or level <= VERBOSE


class Progress:
    """`total` steps of `label`. Call `step(what)` once per step (before or after its work, as long as a
    command does it one way), `finish()` at the end (or `clear()` to erase the bar), `message(text)` for a
    line of its own (a warning) between steps. `enabled=False` shows no progress (messages still print); the
    default, None, follows the `tierflow` logger's level (off with --quiet, logs.progress_enabled)."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 interval_s: float = LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = max(1, total)
        self.label = label
        self.count = 0  # steps reported so far
        self.stream = sys.stderr if stream is None else stream
        pipe_lines = enabled
        if enabled is None:
            enabled = progress_enabled()
            pipe_lines = _lines_off_terminal()
        isatty = getattr(self.stream, "isatty", None)
        self.tty = enabled and bool(isatty and isatty())
        self.lines = enabled and not self.tty and bool(pipe_lines)  # whole lines at a bounded rate
        self.interval_s = interval_s
        self.clock = clock
        self.t0_s = clock()
        self._last_line_s: float | None = None  # when the last progress line was printed (lines mode)
        self._pending = ""  # lines mode: the newest step's line, not printed yet because of the rate limit
        self._drawn_chars = 0  # terminal mode: length of the bar line on screen (0 = none)

    # ---- reporting ----

    def step(self, what: str = "") -> None:
        """One more step (`what` says which)."""
        self.update(self.count + 1, what=what)

    def update(self, count: int, total: int | None = None, what: str = "") -> None:
        """Set the steps done (and the total, for work whose size is learnt on the way) and show them."""
        if total is not None:
            self.total = max(1, total)
        self.count = count
        self.total = max(self.total, self.count)
        self._show(self.text(what), last=self.count >= self.total)

    def message(self, text: str) -> None:
        """A line of its own on stderr (shown even when progress is disabled), e.g. a warning."""
        self._flush_pending()
        self._erase()
        print(text, file=self.stream, flush=True)

    def finish(self, what: str = "") -> None:
        """The end: with `what`, a final line at total/total saying it; the bar's line is kept on a terminal
        and, off one, the newest step is printed if the rate limit held it back."""
        if what:
            self.count = self.total
            self._show(self.text(what), last=True)
        self._flush_pending()
        if self.tty and self._drawn_chars:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn_chars = 0

    def clear(self) -> None:
        """The end, with the bar erased from a terminal (off one, the newest step is printed if held back)."""
        self._flush_pending()
        self._erase()

    def text(self, what: str = "") -> str:
        """The progress line: `label [#####-----] 5/10 what 12s`."""
        parts = [self.label, bar(self.count, self.total), f"{self.count}/{self.total}", what,
                 f"{self.clock() - self.t0_s:.0f}s"]
        return " ".join(p for p in parts if p)

    # ---- output ----

    def _show(self, line: str, last: bool) -> None:
        if self.tty:
            line = line[: self._columns() - 1]  # a wrapped line could not be rewritten in place
            self.stream.write("\r" + line.ljust(self._drawn_chars))
            self.stream.flush()
            self._drawn_chars = len(line)
        elif self.lines:
            now_s = self.clock()
            if last or self._last_line_s is None or now_s - self._last_line_s >= self.interval_s:
                self._pending = ""
                self._last_line_s = now_s
                print(line, file=self.stream, flush=True)
            else:
                self._pending = line

    def _flush_pending(self) -> None:
        if self._pending:
            print(self._pending, file=self.stream, flush=True)
            self._pending = ""
            self._last_line_s = self.clock()

    def _erase(self) -> None:
        if self.tty and self._drawn_chars:
            self.stream.write("\r" + " " * self._drawn_chars + "\r")
            self.stream.flush()
            self._drawn_chars = 0

    def _columns(self) -> int:
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns if columns > 0 else _DEFAULT_COLUMNS  # a pseudo-terminal may report 0
