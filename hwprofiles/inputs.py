"""Bounded reading of input files, shared by every reader of user files (profiles, model configs, plans,
placements, traces, DeepSpeed configs, CSVs of measured runs): the file is checked with stat before it is read
(a regular file of at most a stated size, or a FIFO / pipe such as `<(cat box.yaml)` read to at most that
size, so that /dev/zero is refused instead of read without end), parsed YAML/JSON is checked against a
nesting-depth limit (a document nested hundreds deep is refused with one line instead of a RecursionError) and
CSV against a field-size limit.

Every problem raises :class:`InputLimitError` (a ValueError) whose message says what is wrong without naming
the file; callers prefix the file and turn it into their own error type. Only the standard library and PyYAML.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from tierflow.errors import TierflowError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
# nesting of parsed YAML/JSON: a plan is 4 deep (ops -> op -> mem -> effect), a profile 2, a config 3
MAX_DEPTH = 32
CSV_FIELD_BYTES = 64 * KIB  # one cell of a CSV of measured runs: a name, a number, a placement's JSON


class InputLimitError(TierflowError, ValueError):
    """An input file or document beyond a limit (one line, without the file's name)."""


def _size_text(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def check_regular_file(path: str | os.PathLike[str], max_bytes: int) -> int:
    """The size of `path` after checking, without reading it, that it is a regular file of at most
    `max_bytes`. Raises FileNotFoundError / IsADirectoryError / PermissionError as os.stat does,
    InputLimitError otherwise."""
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", os.fspath(path))
    if not stat.S_ISREG(st.st_mode):
        raise InputLimitError("is not a regular file nor a pipe (a device or a socket cannot be read to its "
                              "end)")
    if st.st_size > max_bytes:
        raise InputLimitError(f"is {_size_text(st.st_size)}, above the limit of {_size_text(max_bytes)}")
    return st.st_size


def _read_pipe(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """A FIFO or pipe (`--hw <(cat box.yaml)`) read to its end, at most `max_bytes`. Opened without blocking,
    so that a named FIFO nobody writes to reads as empty instead of hanging; then read blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise InputLimitError(f"is a pipe that holds more than the limit of {_size_text(max_bytes)}")
    return b"".join(chunks)


def read_limited_bytes(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (checked before and, against a growing file, while
    reading), or of a FIFO / pipe read to its end, at most `max_bytes` (a device such as /dev/zero, or a
    socket, is refused)."""
    st = os.stat(path)
    if stat.S_ISFIFO(st.st_mode):
        return _read_pipe(path, max_bytes)
    check_regular_file(path, max_bytes)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputLimitError(f"grew above the limit of {_size_text(max_bytes)} while being read")
    return data


def read_limited_text(path: str | os.PathLike[str], max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`; UnicodeDecodeError if it is not UTF-8."""
    return read_limited_bytes(path, max_bytes).decode("utf-8")


def csv_rows_limited(text: str, max_field_bytes: int = CSV_FIELD_BYTES) -> list[list[str]]:
    """The rows of CSV `text`, every field at most `max_field_bytes` (csv's own limit, set for this call):
    a longer field, or a CSV syntax error, raises InputLimitError / ValueError (one line) instead of
    `_csv.Error`."""
    import csv
    import io

    old = csv.field_size_limit(max_field_bytes)
    try:
        return list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        if "field larger than field limit" in str(e):
            raise InputLimitError(f"has a CSV field longer than the limit of {_size_text(max_field_bytes)}"
                                  ) from None
        raise ValueError(f"is not valid CSV ({e})") from None
    finally:
        csv.field_size_limit(old)


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise InputLimitError if parsed JSON/YAML `value` nests lists/dicts deeper than `max_depth` (iterative:
    no recursion however deep the value)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if depth > max_depth:
            raise InputLimitError(f"nested deeper than {max_depth} levels")
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))


def check_yaml_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise InputLimitError if the YAML `text` nests deeper than `max_depth`, from its parse events (PyYAML's
    parser is iterative; its composer, which builds the objects, recurses). Syntax errors are left to the
    loader, which reports them with their line."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > max_depth:
                    raise InputLimitError(f"nested deeper than {max_depth} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return


def loads_json_limited(text: str | bytes, max_depth: int = MAX_DEPTH, unchecked: tuple[str, ...] = (),
                       **kw: Any) -> Any:
    """json.loads with the nesting limit: a RecursionError inside the parser becomes InputLimitError too.
    `unchecked` names top-level keys whose values the caller validates field by field instead (a plan's ops:
    walking 100,000 ops would cost half a second)."""
    import json

    try:
        value = json.loads(text, **kw)
    except RecursionError:
        raise InputLimitError(f"nested deeper than {max_depth} levels") from None
    if unchecked and isinstance(value, dict):
        check_depth({k: v for k, v in value.items() if k not in unchecked}, max_depth)
    else:
        check_depth(value, max_depth)
    return value


__all__ = ["CSV_FIELD_BYTES", "GIB", "KIB", "MAX_DEPTH", "MIB", "InputLimitError", "check_depth",
           "check_regular_file", "check_yaml_depth", "csv_rows_limited", "loads_json_limited",
           "read_limited_bytes", "read_limited_text"]
