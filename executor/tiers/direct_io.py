"""Whether a directory's filesystem takes O_DIRECT: the one probe of the SSD tier (ssd_store.SsdStore) and of
`tierflow env`. Standard library only, so `tierflow env` can answer without importing torch."""

from __future__ import annotations

import errno
import math
import mmap
import os
from pathlib import Path

# O_DIRECT alignment of buffer addresses, file offsets and lengths (the page size covers every SSD)
ALIGN = 4096


def page_round(nbytes: float, page: int = ALIGN) -> int:
    """`nbytes` rounded up to whole pages (0 for nothing): what an O_DIRECT buffer or request of it spans."""
    return -(-int(math.ceil(nbytes)) // page) * page if nbytes > 0 else 0


def probe_o_direct(directory: str | os.PathLike[str]) -> bool:
    """True when a page-aligned O_DIRECT write to a probe file in `directory` succeeds; False when the OS has
    no O_DIRECT or the filesystem refuses it (EINVAL: tmpfs, some network filesystems). Any other OSError (no
    such directory, not writable) is raised. The probe file is always removed."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / f".tierflow-probe-{os.getpid()}"
    buf = mmap.mmap(-1, ALIGN)  # anonymous mappings are page-aligned
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    finally:
        buf.close()
        probe.unlink(missing_ok=True)
