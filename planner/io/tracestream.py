"""A Chrome trace read as a stream: the top-level object's `traceEvents` yielded one event at a time, every
other key's value parsed whole but bounded, so that a trace of any size up to its limit costs one chunk of
text plus one event, never the whole document (a 2 GiB trace held as text and then parsed took over 4 GB).

Plain or gzip-compressed by the content (the decompressed bytes counted against the limit as they come), a
regular file or a pipe (read bounded first, as every input: hwprofiles.inputs). Each value is parsed by the
standard library's json (raw_decode on the text buffered so far; a value cut at the buffer's end is parsed
again with more text), at most MAX_VALUE_BYTES of text each (a longer one is refused in one line), so the
memory is bounded by MAX_VALUE_BYTES x inputs.json_parse_bound_bytes' factors plus one chunk.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import IO, Any

from tierflow.hwprofiles.inputs import (
    InputLimitError,
    check_depth,
    check_regular_file,
    read_limited_bytes,
    size_text,
)
from tierflow.planner.core.jsonio import GZIP_MAGIC

CHUNK_BYTES = 1 << 20  # text decoded and buffered at a time
MAX_VALUE_BYTES = 4 << 20  # one event, or one other top-level value (otherData: a run's summary, a few KiB)
EVENTS_KEY = "traceEvents"
_NOT_SPACE = re.compile(r"[^ \t\r\n]")


@contextmanager
def _open_bounded(path: str | os.PathLike[str], max_bytes: int) -> Iterator[IO[bytes]]:
    """The raw bytes of `path` (a pipe read bounded into memory; a regular file checked with stat), gzip
    undone when its magic says so; counted against `max_bytes` by _chunks."""
    with ExitStack() as stack:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            raw: IO[bytes] = io.BytesIO(read_limited_bytes(path, max_bytes))
        else:
            check_regular_file(path, max_bytes)
            raw = stack.enter_context(open(path, "rb"))
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        yield stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb")) if packed else raw


def _chunks(path: str | os.PathLike[str], max_bytes: int) -> Iterator[str]:
    """The UTF-8 text of `path`, CHUNK_BYTES at a time; InputLimitError past `max_bytes` decompressed,
    UnicodeDecodeError (a ValueError) on bytes that are not UTF-8."""
    decode = codecs.getincrementaldecoder("utf-8")()
    n = 0
    with _open_bounded(path, max_bytes) as f:
        while data := f.read(CHUNK_BYTES):
            n += len(data)
            if n > max_bytes:
                raise InputLimitError(f"holds more than {max_bytes:,} bytes once decompressed (the limit)")
            yield decode.decode(data)
    yield decode.decode(b"", final=True)


class _Stream:
    """A cursor over the chunks: skip white space, expect a character, parse one JSON value."""

    def __init__(self, chunks: Iterator[str]) -> None:
        self.chunks, self.buf, self.pos, self.done = chunks, "", 0, False

    def _more(self) -> bool:
        if self.done:
            return False
        nxt = next(self.chunks, None)
        if nxt is None:
            self.done = True
            return False
        self.buf = self.buf[self.pos:] + nxt
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            m = _NOT_SPACE.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self._more():
                return ""

    def expect(self, chars: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise ValueError(f"expected {' or '.join(repr(x) for x in chars)}, found "
                             f"{repr(c) if c else 'the end of the file'}")
        self.pos += 1
        return c

    def value(self, dec: json.JSONDecoder) -> Any:
        """The next JSON value, at most MAX_VALUE_BYTES of text (InputLimitError beyond)."""
        self.peek()
        while True:
            try:
                v, end = dec.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self.done:
                    raise ValueError(f"not JSON: {e.msg}") from None
                v = end = None
            except RecursionError:
                raise InputLimitError("a value nested too deep") from None
            if end is not None and (end < len(self.buf) or self.done):
                self.pos = end
                check_depth(v)
                return v
            if len(self.buf) - self.pos > MAX_VALUE_BYTES:
                raise InputLimitError(f"holds a value longer than {size_text(MAX_VALUE_BYTES)} (one event "
                                      "or one key's value is read at a time, at most that)")
            if not self._more():
                self.done = True


def iter_trace(path: str | os.PathLike[str], max_bytes: int, others: dict[str, Any]) -> Iterator[Any]:
    """Every element of the top-level object's traceEvents list, in order; every other top-level key's value
    goes into `others` as it is met. ValueError (InputLimitError for a bound, UnicodeDecodeError) or OSError
    when the file is not such a trace; a trace without traceEvents yields nothing."""
    s = _Stream(_chunks(path, max_bytes))
    dec = json.JSONDecoder()
    s.expect("{")
    if s.peek() == "}":
        s.expect("}")
        return
    while True:
        key = s.value(dec)
        if not isinstance(key, str):
            raise ValueError("a key of the top-level object is not a string")
        s.expect(":")
        if key == EVENTS_KEY and s.peek() == "[":
            others[key] = []  # streamed: yielded, not kept
            yield from _elements(s, dec)
        else:
            others[key] = s.value(dec)
        if s.expect(",}") == "}":
            break
    if s.peek():
        raise ValueError("text after the top-level object")


def _elements(s: _Stream, dec: json.JSONDecoder) -> Iterator[Any]:
    s.expect("[")
    if s.peek() == "]":
        s.expect("]")
        return
    while True:
        yield s.value(dec)
        if s.expect(",]") == "]":
            return


__all__ = ["CHUNK_BYTES", "MAX_VALUE_BYTES", "iter_trace"]
