"""Directories one run owns: a lock file per checkpoint directory and per SSD directory, so that two runs
never write the same files, and the removal of SSD run directories (``tierflow-run-<pid>``) left by a run that
died without cleaning up (SIGKILL, power loss).

The lock is ``flock`` on ``<dir>/.tierflow-lock`` (the holder's pid is written inside for the message): the
kernel releases it when its process dies however it dies, so a lock file left by a killed run is simply taken
over. Where the filesystem has no ``flock`` (some network filesystems) the pid inside decides: a lock whose
process is gone is taken over.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from tierflow.errors import TierflowError

LOCK_NAME = ".tierflow-lock"
RUN_DIR_PREFIX = "tierflow-run-"


class LockError(TierflowError, RuntimeError):
    """Another live run holds the directory."""


def pid_alive(pid: int) -> bool:
    """Is there a process with this pid (of any user)?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class DirLock:
    """An exclusive lock on a directory for the life of one run. `what` names the directory in messages
    (e.g. "--checkpoint-dir")."""

    def __init__(self, directory: str | os.PathLike[str], what: str) -> None:
        self.dir = Path(directory)
        self.what = what
        self.path = self.dir / LOCK_NAME
        self.fd: int | None = None
        self.previous_pid: int | None = None  # the pid of a dead holder whose lock was taken over

    def acquire(self) -> DirLock:
        for _ in range(10):  # a release may unlink the file between our open and flock: retry on a fresh file
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise LockError(f"{self.what} {self.dir}: cannot create its lock file {self.path.name} "
                                f"({e.strerror}); pass a writable directory") from None
            try:
                self._flock(fd)
                st, now = os.fstat(fd), self._stat()
                if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue  # locked a file that was unlinked meanwhile
                old = _read_pid(self.path)
                if old is not None and old != os.getpid():
                    self.previous_pid = old
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd, fd = fd, None
                return self
            finally:
                if fd is not None:
                    os.close(fd)
        raise LockError(f"{self.what} {self.dir}: could not take its lock {self.path} (it keeps changing); "
                        "is another tierflow run starting there?")

    def _stat(self) -> os.stat_result | None:
        try:
            return os.stat(self.path)
        except FileNotFoundError:
            return None

    def _flock(self, fd: int) -> None:
        """Lock fd, or raise LockError naming the holder."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._busy(_read_pid(self.path))
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # no flock here: the pid inside decides
            pid = _read_pid(self.path)
            if pid is not None and pid != os.getpid() and pid_alive(pid):
                self._busy(pid)

    def _busy(self, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "another process"
        raise LockError(f"{self.what} {self.dir} is in use by another tierflow run ({who}, lock "
                        f"{self.path}); wait for it to finish or pass another directory")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing releases the flock
            self.fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_stale_run_dirs(root: Path, log: Callable[[str], None]) -> list[Path]:
    """Remove ``tierflow-run-<pid>`` directories under the SSD directory `root` whose process is gone (call it
    while holding root's lock); says so in one line per directory. Returns what it removed."""
    removed = []
    for d in sorted(root.glob(f"{RUN_DIR_PREFIX}*")):
        try:
            pid = int(d.name[len(RUN_DIR_PREFIX):])
        except ValueError:
            continue
        if pid == os.getpid() or pid_alive(pid) or not d.is_dir():
            continue
        nbytes = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
        log(f"removed {d} ({nbytes / 1e9:.3f} GB), left by tierflow run pid {pid}, which is gone")
    return removed
