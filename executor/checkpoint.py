"""Checkpoints of the training state: writing them atomically, verifying them, resuming from them.

A checkpoint is one directory per saved step (``step00000012``) holding the full fp32 master, Adam m/v and
compute weights of every block (one safetensors file per block) and ``manifest.json`` (the step, the model,
the run's plan digest, seed, hyper-parameters and data, and the size and CRC32 of every block file). It is
written under a temporary name (``.tmp-step...``) and renamed into place, and ``latest`` is replaced
atomically last, so a run killed at any moment leaves the previous checkpoint intact; a write that fails (a
full disk) removes what it wrote. The last two checkpoints are kept.

On resume every block file's size and CRC32 are checked against the manifest before it is used; a corrupt,
truncated or unreadable file is named in one line, and `resume(..., fallback=True)` goes back to the
previous checkpoint that verifies instead (renaming the bad one to ``corrupt-step...``, kept for inspection).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from tierflow.executor.state import STATE_CLASSES, StateError, TrainState

CHECKPOINT_FORMAT = "tierflow-checkpoint"
CHECKPOINT_VERSION = 2  # 2: per-file sizes and CRC32s in the manifest; version 1 (without them) is still read
READ_VERSIONS = (1, 2)
CHUNK_BYTES = 64 << 20
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class CheckpointError(StateError):
    """A checkpoint that cannot be resumed from: missing, truncated, corrupt or unreadable (one line)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (nothing of it is left behind); `full` when the disk is full."""

    def __init__(self, message: str, full: bool) -> None:
        super().__init__(message)
        self.full = full


class NonFiniteState(ValueError):
    """The state to be saved holds NaN or inf (training diverged): it is not written."""

    def __init__(self, step: int, block: int, classes: list[str]) -> None:
        super().__init__(f"non-finite values (NaN or inf) in {', '.join(classes)} of block {block} after step {step}")
        self.step, self.block, self.classes = step, block, classes


# -- files ----------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Write `tensors` (CPU, contiguous) to `path` in the safetensors format, streaming, and fsync it; returns
    (bytes, CRC32 of the file). Python file I/O so that a full disk raises OSError(ENOSPC)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    crc, nbytes = 0, 0
    with open(path, "wb") as f:
        for chunk in _chunks(len(head).to_bytes(8, "little") + head, tensors):
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            nbytes += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return nbytes, crc


def _chunks(head: bytes, tensors: dict[str, torch.Tensor]):
    yield head
    for t in tensors.values():
        mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for lo in range(0, len(mv), CHUNK_BYTES):
            yield mv[lo: lo + CHUNK_BYTES]


def file_crc32(path: Path) -> tuple[int, int]:
    """(bytes, CRC32) of a file, read in chunks."""
    crc, nbytes = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            nbytes += len(chunk)
    return nbytes, crc


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _point_latest(root: Path, ckpt: Path) -> None:
    """Replace `root`/latest atomically by a pointer to `ckpt`."""
    tmp = root / f".latest-{os.getpid()}"
    _write_text(tmp, ckpt.name + "\n")
    os.replace(tmp, root / "latest")
    _fsync_dir(root)


def block_file(b: int) -> str:
    return f"block{b:04d}.safetensors"


# -- saving ---------------------------------------------------------------------------------------------------


def save_checkpoint(state: TrainState, directory: str | os.PathLike[str], step: int, meta: dict) -> Path:
    """Write a checkpoint of `state` after `step` steps atomically; returns its directory. Raises NonFiniteState
    (nothing written) if the state holds NaN or inf, CheckpointWriteError (nothing left behind) if a write fails."""
    root = Path(directory)
    final = root / f"step{step:08d}"
    tmp = root / f".tmp-step{step:08d}-{os.getpid()}"
    latest_tmp = root / f".latest-{os.getpid()}"
    renamed = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {}
        for b in range(len(state.layout.numel)):
            tensors = {cls: state.full(cls, b).contiguous() for cls in STATE_CLASSES}
            bad = [cls for cls, t in tensors.items() if not bool(torch.isfinite(t).all())]
            if bad:
                raise NonFiniteState(step, b, bad)
            nbytes, crc = write_safetensors(tmp / block_file(b), tensors)
            files[block_file(b)] = {"bytes": nbytes, "crc32": crc}
        manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step,
                    "model": state.spec.name, "numel": state.layout.numel, **meta, "files": files}
        _write_text(tmp / "manifest.json", json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        renamed = True
        _fsync_dir(root)
        _point_latest(root, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        latest_tmp.unlink(missing_ok=True)
        if renamed:  # 'latest' still names the previous checkpoint: do not leave one it does not name
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(e, OSError):
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            why = "the disk is full" if full else (e.strerror or str(e))
            raise CheckpointWriteError(f"--checkpoint-dir {root}: cannot write the checkpoint of step {step} "
                                       f"({why}); nothing of it was left behind and the previous checkpoint is "
                                       f"kept ({'free space or ' if full else ''}pass another --checkpoint-dir)",
                                       full) from None
        raise
    for old in sorted(root.glob("step*"))[:-2]:  # keep the last two
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def remove_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove half-written checkpoints (``.tmp-step*``) and pointers (``.latest-*``) that a killed run left
    (call it holding the directory's lock). Returns what it removed."""
    root = Path(directory)
    gone = sorted([*root.glob(".tmp-step*"), *root.glob(".latest-*")])
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


# -- resuming -------------------------------------------------------------------------------------------------


def read_manifest(ckpt: Path) -> dict:
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise CheckpointError(f"checkpoint {ckpt}: unreadable manifest.json ({why})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT \
            or manifest.get("version") not in READ_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt}: not a tierflow checkpoint of version "
                              f"{' or '.join(map(str, READ_VERSIONS))}")
    return manifest


def verify_file(ckpt: Path, name: str, manifest: dict) -> None:
    """Check one block file's size and CRC32 against the manifest (version 2); CheckpointError naming it."""
    files = manifest.get("files")
    if files is None:  # version 1: no checksums
        return
    want = files.get(name)
    path = ckpt / name
    if not isinstance(want, dict):
        raise CheckpointError(f"checkpoint {ckpt}: {name} is not listed in its manifest.json")
    try:
        nbytes, crc = file_crc32(path)
    except OSError as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {name} ({e.strerror})") from None
    if nbytes != want.get("bytes"):
        raise CheckpointError(f"checkpoint {ckpt}: {name} is truncated or overwritten ({nbytes:,} bytes, written "
                              f"with {want.get('bytes'):,})")
    if crc != want.get("crc32"):
        raise CheckpointError(f"checkpoint {ckpt}: checksum mismatch in {name}: the file changed after it was "
                              "written (disk error or another program)")


def load_checkpoint(state: TrainState, ckpt: Path, manifest: dict) -> None:
    """Restore `state` from checkpoint directory `ckpt`, verifying every block file first."""
    from safetensors.torch import load_file

    if manifest.get("numel") != state.layout.numel or manifest.get("model") != state.spec.name:
        raise StateError(f"checkpoint {ckpt}: it is of model {manifest.get('model')!r}, the plan trains "
                         f"{state.spec.name!r} (use another --checkpoint-dir, or the plan it was made with)")
    for b, n in enumerate(state.layout.numel):
        name = block_file(b)
        verify_file(ckpt, name, manifest)
        try:
            t = load_file(ckpt / name)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError), OSError
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"checkpoint {ckpt}: {name} is unreadable ({why})") from None
        bad = [cls for cls in STATE_CLASSES if cls not in t or t[cls].numel() != n]
        if bad:
            raise CheckpointError(f"checkpoint {ckpt}: {name} lacks {', '.join(bad)} of {n:,} elements")
        state.set_block(b, t["master"], t["adam_m"], t["adam_v"], t["weights"])


def candidates(directory: str | os.PathLike[str]) -> tuple[Path | None, list[Path], str | None]:
    """(the checkpoint 'latest' names or None, every step directory newest first, why 'latest' is unusable)."""
    root = Path(directory)
    steps = sorted((p for p in root.glob("step*") if p.is_dir()), reverse=True)
    pointer = root / "latest"
    if not pointer.is_file():
        return None, steps, ("it has checkpoints but no 'latest' file" if steps else None)
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, steps, f"its 'latest' file is unreadable ({e})"
    ckpt = root / name
    if not name.startswith("step") or "/" in name or not ckpt.is_dir():
        return None, steps, f"its 'latest' file names {name[:40]!r}, which is missing"
    return ckpt, steps, None


def resume(state: TrainState, directory: str | os.PathLike[str], *, fallback: bool,
           check: Callable[[Path, dict], None], log: Callable[[str], None]) -> tuple[Path, dict] | None:
    """Load the latest checkpoint under `directory` into `state`; None if there is none. `check(ckpt,
    manifest)` refuses one of another plan or settings (its error is raised as is). A corrupt, truncated or
    unreadable checkpoint raises CheckpointError, or with `fallback` the previous one that verifies is used
    (one line per checkpoint skipped)."""
    root = Path(directory)
    latest, steps, problem = candidates(root)
    if latest is None and problem is None:
        return None
    order = ([latest] if latest is not None else []) + [p for p in steps if p != latest]
    if problem is not None and not fallback:
        raise CheckpointError(f"--checkpoint-dir {root}: {problem}; pass --resume-fallback to resume from the "
                              "newest checkpoint that verifies, or use another directory")
    for i, ckpt in enumerate(order):
        try:
            manifest = read_manifest(ckpt)
            check(ckpt, manifest)
            load_checkpoint(state, ckpt, manifest)
        except CheckpointError as e:
            rest = order[i + 1:]
            if not fallback:
                hint = (f"pass --resume-fallback to resume from the previous checkpoint ({rest[0].name})" if rest
                        else "no earlier checkpoint is left: delete the directory to start over")
                raise CheckpointError(f"{e}; {hint}") from None
            # renamed out of the way, so that keeping the last two checkpoints keeps good ones
            aside = ckpt.with_name(f"corrupt-{ckpt.name}")
            try:
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(ckpt, aside)
                moved = f"moved it to {aside.name} (delete it when done)"
            except OSError as err:
                moved = f"could not move it aside ({err.strerror})"
            log(f"skipping a bad checkpoint: {e}; {moved}")
            continue
        if ckpt != latest:
            _point_latest(root, ckpt)
        return ckpt, manifest
    raise CheckpointError(f"--checkpoint-dir {root}: none of its {len(order)} checkpoint(s) verifies; delete it to "
                          "start over, or pass another --checkpoint-dir")
