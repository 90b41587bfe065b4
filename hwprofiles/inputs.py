"""Bounded reading of input files, shared by every reader of user files (profiles, model configs, plans,
placements, traces, DeepSpeed configs, CSVs of measured runs): the file is checked with stat before it is read
(a regular file of at most a stated size, or a FIFO / pipe such as `<(cat box.yaml)` read to at most that
size, so that /dev/zero is refused instead of read without end), parsed YAML/JSON is checked against a
nesting-depth limit (a document nested hundreds deep is refused with one line instead of a RecursionError) and
CSV against a field-size limit.

Memory: `memory_headroom_bytes` is what this process can still allocate (its address-space limit less what it
maps, the memory the kernel says is available, its cgroup's limit less its use); `check_affordable` refuses an
input whose worst-case cost exceeds it, before the input is inflated; `json_parse_bound_bytes` is that worst
case for parsing a JSON text (measured per shape, tests/system/test_streaming_inputs.py); `reading` names
the input and its bound in the one line said when a MemoryError happens while it is read (`InputMemoryError`,
exit 3).

Every problem raises :class:`InputLimitError` (a ValueError) whose message says what is wrong without naming
the file; callers prefix the file and turn it into their own error type. Only the standard library and PyYAML.
"""

from __future__ import annotations

import os
import resource
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml

from tierflow.errors import DoesNotFit, TierflowError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
# nesting of parsed YAML/JSON: a plan is 4 deep (ops -> op -> mem -> effect), a profile 2, a config 3
MAX_DEPTH = 32
CSV_FIELD_BYTES = 64 * KIB  # one cell of a CSV of measured runs: a name, a number, a placement's JSON


class InputLimitError(TierflowError, ValueError):
    """An input file or document beyond a limit (one line, without the file's name)."""


class InputTooCostly(InputLimitError):
    """An input whose worst-case cost exceeds what this process can still allocate (check_affordable): its
    message is whole (what it needs, what is left, which limit says so) and is said as is."""


class InputMemoryError(DoesNotFit, MemoryError):
    """A MemoryError while an input was read or parsed: one line naming the input and its bound (exit 3)."""

    prefix = "out of memory"


def size_text(n: int) -> str:
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
        raise InputLimitError(f"is {size_text(st.st_size)}, above the limit of {size_text(max_bytes)}")
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
        raise InputLimitError(f"is a pipe that holds more than the limit of {size_text(max_bytes)}")
    return b"".join(chunks)


def read_limited_bytes(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (checked before and, against a growing file, while
    reading), or of a FIFO / pipe read to its end, at most `max_bytes` (a device such as /dev/zero, or a
    socket, is refused)."""
    st = os.stat(path)
    if stat.S_ISFIFO(st.st_mode):
        return _read_pipe(path, max_bytes)
    size = check_regular_file(path, max_bytes)
    with open(path, "rb") as f:
        # read(n) reserves n bytes first: ask for stat's size (+1 to see a file that grew), not the limit
        data = f.read(size + 1)
        if len(data) > size:  # it grew: the rest, up to the limit
            data += f.read(max_bytes + 1 - len(data))
    if len(data) > max_bytes:
        raise InputLimitError(f"grew above the limit of {size_text(max_bytes)} while being read")
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
            raise InputLimitError(f"has a CSV field longer than the limit of {size_text(max_field_bytes)}"
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


# Worst-case bytes of Python objects that json.loads builds, per byte of text and per container opened: a
# scalar or a key costs at most 12 bytes per byte of its text (["ab", ...]: a 51-byte str and an 8-byte
# pointer per 5 bytes), a dict at most 184 bytes + its entries, a list 56 + its pointers. The bound below
# exceeds tracemalloc's peak by 1.3-3.3x over 11 hostile shapes ([{}, ...] 24 bytes per byte of text,
# 30-deep nested dicts 36, [[1], ...] 24, a dict of 500k keys 11, 6-key records 7.4;
# tests/system/test_streaming_inputs.py).
JSON_BYTES_PER_TEXT_BYTE = 16
JSON_BYTES_PER_OBJECT = 192
JSON_BYTES_PER_ARRAY = 64


def json_parse_bound_bytes(n_bytes: int, objects: int, arrays: int) -> int:
    """An upper bound on the memory json.loads takes for a text of `n_bytes` bytes holding `objects` '{' and
    `arrays` '[' characters (counted on the raw text: braces inside strings only make the bound larger)."""
    return (JSON_BYTES_PER_TEXT_BYTE * n_bytes + JSON_BYTES_PER_OBJECT * objects
            + JSON_BYTES_PER_ARRAY * arrays)


def _vm_bytes() -> int:
    """This process's address space now (/proc/self/statm's first field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom_bytes() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2); None when unlimited or unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, IndexError):
        return None


def memory_headroom_bytes() -> tuple[int | None, str]:
    """(bytes this process can still allocate, which limit says so): the smallest of its address-space limit
    (RLIMIT_AS) less its address space now, the kernel's MemAvailable and its cgroup's memory.max less
    memory.current; (None, "") when none is known."""
    found: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            found.append((soft - _vm_bytes(), "its address-space limit (ulimit -v)"))
        except (OSError, ValueError):
            pass
    avail = _mem_available_bytes()
    if avail is not None:
        found.append((avail, "the memory available on this machine"))
    cg = _cgroup_headroom_bytes()
    if cg is not None:
        found.append((cg, "its cgroup's memory limit"))
    if not found:
        return None, ""
    n, why = min(found)
    return max(n, 0), why


def check_affordable(need_bytes: int, what: str) -> None:
    """InputLimitError (one line, from `what`: e.g. "parsing its 1.2 GiB of JSON") when `need_bytes` exceeds
    what this process can still allocate (memory_headroom_bytes)."""
    have, why = memory_headroom_bytes()
    if have is not None and need_bytes > have:
        raise InputTooCostly(f"{what} needs up to {size_text(need_bytes)}, more than the "
                              f"{size_text(have)} this process can still allocate ({why}); refused before "
                              "reading it")


_READING: list[tuple[str, str]] = []  # (input, its bound) being read, innermost last (main thread's readers)


@contextmanager
def reading(what: str, bound: str) -> Iterator[None]:
    """Within it, a MemoryError becomes InputMemoryError naming `what` (e.g. "--data corpus.txt") and
    `bound` (e.g. "1 MiB of text at a time")."""
    _READING.append((what, bound))
    try:
        yield
    except MemoryError as e:
        if isinstance(e, InputMemoryError):
            raise
        raise InputMemoryError(memory_error_line(what, bound)) from None
    finally:
        _READING.pop()


def memory_error_line(what: str | None = None, bound: str | None = None) -> str:
    """The one line of a MemoryError: the input being read and its bound when known (`reading`)."""
    if what is None and _READING:
        what, bound = _READING[-1]
    head = f"{what}: ran out of memory while reading it (its bound: {bound})" if what else \
        "ran out of memory"
    try:
        have, why = memory_headroom_bytes()
    except MemoryError:
        have, why = None, ""
    room = f"; {size_text(have)} can still be allocated ({why})" if have is not None else ""
    return f"{head}{room}; raise the memory limit (ulimit -v) or give a smaller input"


__all__ = ["CSV_FIELD_BYTES", "GIB", "KIB", "MAX_DEPTH", "MIB", "InputLimitError", "InputMemoryError",
           "InputTooCostly",
           "check_affordable", "check_depth", "check_regular_file", "check_yaml_depth", "csv_rows_limited",
           "json_parse_bound_bytes", "loads_json_limited", "memory_error_line", "memory_headroom_bytes",
           "read_limited_bytes", "read_limited_text", "reading", "size_text"]
