"""Output paths checked before any work, and results written atomically: the one place for every writer of
results (`simulate --out / --write-plan`, `plan -o / --emit-ds-config`, `run --out / --export-hf`, checkpoint
and trace files).

Checks (`check_output_dir`, `check_output_file`) run before a command starts its work, so that an unwritable
place, a file where a directory is wanted or a user's non-empty directory is refused with one line (exit 2)
instead of after minutes of simulation or training. They create nothing: a directory that does not exist
yet is checked through its nearest existing ancestor (which must be a directory this process can write in,
probed by creating and removing a file: `os.access` does not see a read-only mount everywhere).

Writes (`atomic_path`, `atomic_write_bytes`) go to a temporary file in the same directory, which is
flushed, fsynced and renamed over the target (`os.replace`), so that a failure never leaves half a file.
Standard library only; every layer may import it (tests/system/test_layering.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from tierflow.errors import TierflowError


class OutputError(TierflowError):
    """An output path that cannot take the results (exit code 2, one line naming the flag and the path)."""


def _fail(flag: str, path: Path, what: str, fix: str) -> OutputError:
    return OutputError(f"{flag} {path}: {what}; {fix}")


def _probe_writable(directory: Path) -> str | None:
    """None if a file can be created in `directory`, else why not (the errno's text)."""
    name = directory / f".tierflow-probe-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_parent(flag: str, path: Path, fix: str) -> None:
    """The nearest existing ancestor of `path` is a directory this process can create files in."""
    base = _nearest_existing(path.parent if path.name else path)
    if not base.is_dir():
        raise _fail(flag, path, f"{base} is a file, not a directory", fix)
    why = _probe_writable(base)
    if why is not None:
        raise _fail(flag, path, f"cannot write in {base} ({why})", fix)


def check_output_dir(path: str | os.PathLike[str], flag: str, *, overwrite: bool = False,
                     overwrite_flag: str = "--overwrite") -> Path:
    """`path` can take a command's output directory: it is a writable directory that is empty (or non-empty
    with `overwrite`), or it does not exist and could be created. Creates nothing; raises OutputError."""
    p = Path(path)
    fix = "give a writable directory that is new or empty"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        _check_parent(flag, p, fix)
        return p
    except NotADirectoryError:
        raise _fail(flag, p, "a part of the path is a file, not a directory", fix) from None
    except OSError as e:
        raise _fail(flag, p, f"cannot be examined ({e.strerror})", fix) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _fail(flag, p, "exists and is not a directory", fix)
    if not overwrite:
        try:
            entries = sorted(os.listdir(p))
        except OSError as e:
            raise _fail(flag, p, f"cannot be listed ({e.strerror})", fix) from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
            raise _fail(flag, p, f"exists and is not empty ({count}: {shown})",
                        f"give a new or empty directory, or pass {overwrite_flag} to write into it "
                        "(files of the same names are replaced)")
    why = _probe_writable(p)
    if why is not None:
        raise _fail(flag, p, f"is not writable ({why})", fix)
    return p


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """`path` can take an output file: not a directory nor a special file, and its directory exists and is
    writable (a missing directory is an error naming it: a mistyped path must not build a directory tree;
    directories are created only where a flag asks for a directory, check_output_dir). An existing regular
    file is replaced when written. Raises OutputError."""
    p = Path(path)
    fix = "give a file name in a writable directory"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise _fail(flag, p, "a part of the path is a file, not a directory", fix) from None
    except OSError as e:
        raise _fail(flag, p, f"cannot be examined ({e.strerror})", fix) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _fail(flag, p, "is a directory", f"give a file name, e.g. {p / 'out.json'}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _fail(flag, p, "is not a regular file (a device, FIFO or socket)", fix)
    parent = p.absolute().parent
    if not parent.exists() and _nearest_existing(parent).is_dir():
        raise _fail(flag, p, f"its directory {parent} does not exist",
                    "create it first (mkdir -p), or give a file name in an existing directory")
    _check_parent(flag, p, fix)
    return p


def fsync_dir(directory: Path) -> None:
    """fsync a directory (its entries: a rename or a new file in it made durable); a filesystem that
    cannot open or fsync a directory is left as it is."""
    with contextlib.suppress(OSError):  # some filesystems cannot open or fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside `path` (same directory, same suffix, so writers that pick a format by the
    suffix still do) to write the whole file to; when the block ends without an error it is fsynced and
    renamed over `path`, else removed. The directory is created if missing."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp{target.suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically (atomic_path)."""
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


__all__ = ["OutputError", "atomic_path", "atomic_write_bytes", "atomic_write_text", "check_output_dir",
           "check_output_file"]
