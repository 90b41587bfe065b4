"""Text files that may be gzip-compressed: the one place that decides, for plan files and traces.

Writing: a name ending in `.gz` is written gzip-compressed, any other name as plain text. Reading: the content
decides, not the name (gzip's two magic bytes), so every reader accepts a plain or a compressed file under any
name. Standard library only (the planner never imports torch); it lives in planner.core because the trace
writers (planner/core/trace.py) use it, and planner.io and the executor import down the stack.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from pathlib import Path
from typing import IO, Any

from tierflow.hwprofiles.inputs import (
    InputLimitError,
    check_affordable,
    json_parse_bound_bytes,
    read_limited_bytes,
    reading,
    size_text,
)
from tierflow.outputs import atomic_path

GZIP_MAGIC = b"\x1f\x8b"
GZIP_LEVEL = 6  # gzip's default: a 13B plan 4.2 MB -> 0.27 MB in 0.05 s; 9 is ~3x slower for a few % less


def is_gzip_name(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is written compressed (its name ends in .gz)."""
    return os.fspath(path).endswith(".gz")


def is_gzip_file(path: str | os.PathLike[str]) -> bool:
    """Whether the file at `path` starts with gzip's magic bytes (OSError if it cannot be read)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_text(path: str | os.PathLike[str], mode: str = "r") -> IO[str]:
    """A UTF-8 text stream on `path`. Mode "r": gzip-compressed or plain, by the content; "w" / "x":
    compressed when the name ends in .gz. Raises OSError (FileNotFoundError, IsADirectoryError, ...) as open()
    does; a damaged gzip file raises OSError (gzip.BadGzipFile) or EOFError when read."""
    if mode not in ("r", "w", "x"):
        raise ValueError(f"open_text: mode {mode!r} (use r, w or x)")
    if mode == "r":
        compressed = is_gzip_file(path)
    else:
        compressed = is_gzip_name(path)
    if compressed:
        return gzip.open(path, mode + "t", encoding="utf-8", compresslevel=GZIP_LEVEL)
    return open(path, mode, encoding="utf-8")


def read_text(path: str | os.PathLike[str], max_bytes: int | None = None, *, json_cost: bool = False,
              what: str | None = None) -> str:
    """The whole text of a plain or gzip-compressed file. A damaged gzip file raises OSError (gzip raises
    EOFError when it is truncated and zlib.error when its data is corrupt; both become OSError here). With
    `max_bytes`, the file must be a regular file of at most that size, and its text at most that many
    characters once decompressed (InputLimitError, a ValueError, otherwise: /dev/zero or a gzip bomb is
    refused, not read); the decompressed size is counted a chunk at a time before the text is held, and
    the text (plus, with `json_cost`, the worst case of parsing it as JSON: inputs.json_parse_bound_bytes)
    must fit in what this process can still allocate, else InputLimitError before it is inflated. Memory:
    the file's bytes (compressed or plain) + twice its decompressed size (bytes, then str) + the parse bound.
    A MemoryError on the way is one line naming `what` (default: the path) and `max_bytes`
    (inputs.InputMemoryError)."""
    if max_bytes is None:
        try:
            with open_text(path, "r") as f:
                return f.read()
        except EOFError as exc:
            raise OSError(f"truncated gzip file ({exc})") from exc
        except zlib.error as exc:
            raise OSError(f"corrupt gzip data ({exc})") from exc
    with reading(what or os.fspath(path), f"{size_text(max_bytes)} of text"):
        return _read_bounded(path, max_bytes, json_cost)


def _read_bounded(path: str | os.PathLike[str], max_bytes: int, json_cost: bool) -> str:
    try:  # read once (a pipe can be), bounded, then decompressed in memory, bounded
        data = read_limited_bytes(path, max_bytes)
        packed = data[:2] == GZIP_MAGIC
        n, objects, arrays = _scan(data, max_bytes) if packed else \
            (len(data), data.count(b"{"), data.count(b"["))
        need = (len(data) if packed else 0) + 2 * n
        if json_cost:
            need += json_parse_bound_bytes(n, objects, arrays)
        check_affordable(need, f"its {size_text(n)} of text" + (" parsed as JSON" if json_cost else ""))
        if packed:
            with gzip.open(io.BytesIO(data), "rb") as f:
                data = f.read(max_bytes + 1)
        text = data.decode("utf-8")
    except EOFError as exc:
        raise OSError(f"truncated gzip file ({exc})") from exc
    except zlib.error as exc:
        raise OSError(f"corrupt gzip data ({exc})") from exc
    if len(text) > max_bytes:
        raise InputLimitError(f"holds more than {max_bytes:,} characters once decompressed (the limit)")
    return text


EXPAND_CHUNK_BYTES = 1 << 20


def _scan(data: bytes, max_bytes: int) -> tuple[int, int, int]:
    """(bytes, '{' count, '[' count) of gzip `data` once decompressed, counted a chunk at a time, holding one
    chunk; InputLimitError past `max_bytes`, so that what the limit refuses never reaches memory."""
    n = objects = arrays = 0
    with gzip.open(io.BytesIO(data), "rb") as f:
        while chunk := f.read(EXPAND_CHUNK_BYTES):
            n += len(chunk)
            objects += chunk.count(b"{")
            arrays += chunk.count(b"[")
            if n > max_bytes:
                raise InputLimitError(f"holds more than {max_bytes:,} bytes once decompressed (the limit)")
    return n, objects, arrays


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` (gzip when the name ends in .gz), atomically (tierflow.outputs)."""
    with atomic_path(path) as tmp, open_text(tmp, "w") as f:
        f.write(text)


def read_json(path: str | os.PathLike[str]) -> Any:
    """JSON from a plain or gzip-compressed file."""
    return json.loads(read_text(path))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """`data` as compact JSON (gzip when the name ends in .gz)."""
    write_text(path, json.dumps(data))


def gzip_bytes(text: str) -> bytes:
    """`text` as gzip bytes (for a writer that picks the name after seeing the size)."""
    return gzip.compress(text.encode("utf-8"), compresslevel=GZIP_LEVEL, mtime=0)


def gz_name(path: str | os.PathLike[str]) -> Path:
    """`path` with .gz appended (unchanged if it already ends in .gz)."""
    p = Path(path)
    return p if is_gzip_name(p) else p.with_name(p.name + ".gz")
