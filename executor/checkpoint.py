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

With several data-parallel ranks (dist.py) a checkpoint is sharded: ``stepN/rank-<r>/`` holds rank r's shard
of every block (the same block files, of its element range, and its own manifest.json with their sizes and
CRC32s), and ``stepN/manifest.json`` (version 3) the world size and the size and CRC32 of every rank's
manifest. All ranks write their shards into one temporary directory; rank 0 checks that every shard is there,
renames it into place and moves ``latest`` only after all of them have been written (the ranks agree on each
phase, so a failure on one rank is a failure on all and nothing half-written is named). The checkpoint
directory must be one directory that every rank sees (on several boxes: a shared filesystem). On resume every
rank verifies and loads its own shard, rank 0 also checks that every rank's shard is present, and the ranks
agree on the checkpoint to use, so a kill -9 of one rank (torchrun then stops the others) resumes from the
last complete checkpoint.

The state is stored per block, whatever the plan put where, so a checkpoint resumes under another plan of the
same training (`training_digest`: the model, the global batch and the sequence length; another schedule,
placement, micro-batch or alpha is fine): loading puts every tensor class on the tiers the new plan names.
`check_same_training` refuses, in one line, a checkpoint of another model or batch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from tierflow.errors import TierflowError
from tierflow.executor.dist import SINGLE, DistWorld
from tierflow.executor.lora import LoraError, load_lora_state_dict, lora_state_dict
from tierflow.executor.tiers.state import STATE_CLASSES, StateError, TrainState
from tierflow.hwprofiles.inputs import MIB, loads_json_limited, read_limited_text
from tierflow.outputs import fsync_dir
from tierflow.planner.core.models import model_dict

CHECKPOINT_FORMAT = "tierflow-checkpoint"
CHECKPOINT_VERSION = 2  # 2: per-file sizes and CRC32s in the manifest; version 1 (without them) is still read
# the top manifest of a checkpoint of several ranks (rank-<r>/ shards, each a version 2 manifest)
SHARDED_VERSION = 3
READ_VERSIONS = (1, 2, SHARDED_VERSION)
CHUNK_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 64 * MIB  # a manifest lists a few files per block and rank


class OtherTraining(StateError):
    """A checkpoint of another model, batch or sequence length than the plan's (cannot be resumed)."""


def training_digest(model: object, batch: int, seq: int) -> str:
    """What a checkpoint can be resumed under: the model's every field (a dataclass), the global batch and the
    sequence length, hashed; the schedule, placement and micro-batch are not part of it."""
    import hashlib

    d = {"model": model_dict(model), "batch": batch, "seq": seq}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_same_training(ckpt: Path, manifest: dict, settings: dict, where: str) -> bool:
    """Whether the checkpoint was written under another plan (True: resumed across plans, the state moves to
    this plan's tiers). OtherTraining, one line, when its model, batch or sequence length differ (a checkpoint
    written before the training digest existed must come from the same plan)."""
    if manifest.get("plan") == settings["plan"]:
        return False
    if manifest.get("training") is not None and manifest.get("training") == settings.get("training"):
        return True
    was = manifest.get("shape") or {}
    now = settings.get("shape") or {}
    states = was.get("optimizer_states"), now.get("optimizer_states")
    if states[0] is not None and states[0] != states[1]:
        old, new = states
        raise OtherTraining(f"{where}: its checkpoint {ckpt.name} holds the optimizer states in {old}, but "
                            f"this plan keeps them in {new} (a checkpoint resumes in its own format only): "
                            f"resume with a plan of {old} states (tierflow plan ... --optimizer-states "
                            f"{old}), or start this plan from its weights with fresh moments (run the old "
                            "plan on this directory with --export-hf DIR, then this one with --init DIR and "
                            "another --checkpoint-dir)")
    raise OtherTraining(f"{where}: its checkpoint {ckpt.name} was written with another plan of another "
                        f"training (model {manifest.get('model')!r}, batch {was.get('batch', '?')} x seq "
                        f"{was.get('seq', '?')}; this plan: model {now.get('model')!r}, batch "
                        f"{now.get('batch', '?')} x seq {now.get('seq', '?')}; or another optimizer-state "
                        "format or precision): resume with a plan of the same model, batch, sequence length "
                        "and optimizer states, or use another directory")


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class CheckpointError(StateError):
    """A checkpoint that cannot be resumed from: missing, truncated, corrupt or unreadable (one line)."""


class CheckpointWriteError(TierflowError, RuntimeError):
    """A checkpoint could not be written (nothing of it is left behind); `full` when the disk is full."""

    def __init__(self, message: str, full: bool) -> None:
        super().__init__(message)
        self.full = full


class NonFiniteState(TierflowError, ValueError):
    """The state to be saved holds NaN or inf (training diverged): it is not written."""

    def __init__(self, step: int, block: int, classes: list[str], rank: int | None = None) -> None:
        where = "" if rank is None else f" (rank {rank}'s shard)"
        super().__init__(f"non-finite values (NaN or inf) in {', '.join(classes)} of block {block}{where} "
                         f"after step {step}")
        self.step, self.block, self.classes, self.rank = step, block, classes, rank


# -- files ---------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Write `tensors` (CPU, contiguous) to `path` in the safetensors format, streaming, and fsync it; returns
    (bytes, CRC32 of the file). Python file I/O so that a full disk raises OSError(ENOSPC)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
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


def _point_latest(root: Path, ckpt: Path) -> None:
    """Replace `root`/latest atomically by a pointer to `ckpt`."""
    tmp = root / f".latest-{os.getpid()}"
    _write_text(tmp, ckpt.name + "\n")
    os.replace(tmp, root / "latest")
    fsync_dir(root)


def _names(root: Path, ckpt: Path) -> bool:
    """Whether `root`/latest names `ckpt`: once it does, `ckpt` is the checkpoint a resume takes, even if
    what follows its replacement (the directory's fsync) is interrupted by a signal or fails."""
    try:
        return (root / "latest").read_text().strip() == ckpt.name
    except OSError:
        return False


@contextmanager
def one_thread():
    """torch's intra-op parallelism off for the block: a checkpoint is written and read at a step boundary,
    where nothing else computes, and its copies of the state (MBs each) pay for an OpenMP team's wake-ups
    more than they gain from it (tiny-gpt's checkpoint on a loaded 2-core box: 0.27 s of copies with 2
    threads, 0.03 s with 1; docs/adapting.md)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def block_file(b: int) -> str:
    return f"block{b:04d}.safetensors"


# -- saving --------------------------------------------------------------------------------------------------


@one_thread()
def _write_blocks(state: TrainState, directory: Path, step: int) -> dict[str, dict]:
    """One safetensors file per block of this rank's state (the whole blocks with one rank);
    {file: size, CRC32}."""
    files = {}
    rank = None if state.world.single else state.world.rank
    if state.lora is not None:  # LoRA: the adapters and their moments only; the frozen base is named
        return _write_adapters(state, directory, step)
    for b in range(len(state.layout.numel)):
        tensors = {cls: state.full(cls, b).contiguous() for cls in STATE_CLASSES}
        bad = [cls for cls, t in tensors.items() if not all_finite(t)]
        if bad:
            raise NonFiniteState(step, b, bad, rank)
        nbytes, crc = write_safetensors(directory / block_file(b), tensors)
        files[block_file(b)] = {"bytes": nbytes, "crc32": crc}
    return files


ADAPTERS_FILE = "adapters.safetensors"
MOMENT_PREFIX = {"master": "", "adam_m": "adam_m.", "adam_v": "adam_v."}


def _write_adapters(state: TrainState, directory: Path, step: int) -> dict[str, dict]:
    """LoRA: one file of the adapters (canonical names, executor/lora.py) and their Adam moments (prefixed
    adam_m. / adam_v.); {file: size, CRC32}."""
    tensors, bad = {}, []
    for cls, prefix in MOMENT_PREFIX.items():
        part = lora_state_dict(state.lora, cls)
        if not all(all_finite(v) for v in part.values()):
            bad.append(cls)
        tensors.update({prefix + k: v for k, v in part.items()})
    if bad:
        raise NonFiniteState(step, 0, bad)
    nbytes, crc = write_safetensors(directory / ADAPTERS_FILE, tensors)
    return {ADAPTERS_FILE: {"bytes": nbytes, "crc32": crc}}


def lora_manifest(state: TrainState) -> dict:
    """What a LoRA checkpoint records beside its adapters: the adapters' settings and the base it needs
    (model name and the digest of its values, TrainState.base_digest)."""
    if state.lora is None:
        return {}
    base = {"model": state.spec.name, "digest": state.base_digest()}
    return {"lora": state.spec.lora.to_dict(), "base": base}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`. On a CPU tensor numpy's check (one thread): torch's runs an OpenMP team, whose
    wake-ups cost 10-70 ms per call on a loaded 2-core box beside the executor's threads (36 ms per block
    tensor, 0.9 s for a tiny-gpt checkpoint, against 1 ms for numpy: docs/adapting.md)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def _write_error(root: Path, step: int, e: OSError) -> CheckpointWriteError:
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "the disk is full" if full else (e.strerror or str(e))
    return CheckpointWriteError(f"--checkpoint-dir {root}: cannot write the checkpoint of step {step} "
                                f"({why}); nothing of it was left behind and the previous checkpoint is kept "
                                f"({'free space or ' if full else ''}pass another --checkpoint-dir)", full)


def save_checkpoint(state: TrainState, directory: str | os.PathLike[str], step: int, meta: dict,
                    world: DistWorld = SINGLE) -> Path:
    """Write a checkpoint of `state` after `step` steps atomically; returns its directory. Raises
    NonFiniteState (nothing written) if the state holds NaN or inf, CheckpointWriteError (nothing left behind)
    if a write fails. With several ranks every rank calls it and every rank gets the same outcome (the sharded
    layout above)."""
    if not world.single:
        return _save_sharded(state, Path(directory), step, meta, world)
    root = Path(directory)
    final = root / f"step{step:08d}"
    tmp = root / f".tmp-step{step:08d}-{os.getpid()}"
    latest_tmp = root / f".latest-{os.getpid()}"
    renamed = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = _write_blocks(state, tmp, step)
        manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step,
                    "model": state.spec.name, "numel": state.layout.numel, **meta, **lora_manifest(state),
                    "files": files}
        _write_text(tmp / "manifest.json", json.dumps(manifest, indent=1))
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        renamed = True
        fsync_dir(root)
        _point_latest(root, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        latest_tmp.unlink(missing_ok=True)
        if renamed and not _names(root, final):  # 'latest' names the previous one: leave none it does not
            shutil.rmtree(final, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_error(root, step, e) from None
        raise
    _prune(root, final)
    return final


def _prune(root: Path, final: Path) -> None:
    for old in sorted(root.glob("step*"))[:-2]:  # keep the last two
        if old != final:
            shutil.rmtree(old, ignore_errors=True)


def _failure(e: BaseException) -> tuple | None:
    """What a rank tells the others about its failure in a phase of a sharded checkpoint (picklable)."""
    if isinstance(e, NonFiniteState):
        return ("nonfinite", e.step, e.block, e.classes, e.rank)
    if isinstance(e, CheckpointWriteError):
        return ("write", str(e), e.full)
    return None


def _agree(world: DistWorld, failure: tuple | None, cleanup=None) -> None:
    """Every rank's outcome of a phase; the first failure (lowest rank) is raised on every rank,
    after `cleanup`."""
    failures = [f for f in world.gather_objects(failure) if f is not None]
    if not failures:
        return
    if cleanup is not None:
        cleanup()
    f = failures[0]
    if f[0] == "nonfinite":
        raise NonFiniteState(*f[1:])
    raise CheckpointWriteError(f[1], f[2])


def _save_sharded(state: TrainState, root: Path, step: int, meta: dict, world: DistWorld) -> Path:
    final = root / f"step{step:08d}"
    tmp = root / f".tmp-step{step:08d}"  # one name for all ranks (rank 0's pid is not theirs)
    lead = world.rank == 0

    def remove_tmp() -> None:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)

    def attempt(fn) -> tuple | None:
        try:
            fn()
        except (OSError, NonFiniteState, CheckpointWriteError) as e:
            return _failure(e if not isinstance(e, OSError) else _write_error(root, step, e))
        return None

    def prepare() -> None:
        if lead:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

    def write_shard() -> None:
        d = tmp / f"rank-{world.rank}"
        d.mkdir()
        files = _write_blocks(state, d, step)
        manifest = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step,
                    "model": state.spec.name, "rank": world.rank, "ranks": world.ranks,
                    "shards": [list(s) for s in state.shards], "files": files}
        _write_text(d / "manifest.json", json.dumps(manifest, indent=1))
        fsync_dir(d)

    def publish() -> None:
        if not lead:
            return
        shards = {}
        for k in range(world.ranks):
            m = tmp / f"rank-{k}" / "manifest.json"
            if not m.is_file():
                raise CheckpointWriteError(f"--checkpoint-dir {root}: rank {k}'s shard is not in {tmp.name}: "
                                           "every rank must see the same checkpoint directory (on several "
                                           "boxes, a shared filesystem)", False)
            nbytes, crc = file_crc32(m)
            shards[f"rank-{k}"] = {"bytes": nbytes, "crc32": crc}
        manifest = {"format": CHECKPOINT_FORMAT, "version": SHARDED_VERSION, "step": step,
                    "model": state.spec.name, "numel": state.layout.numel, "world": {"ranks": world.ranks},
                    **meta, **lora_manifest(state), "shards": shards}
        _write_text(tmp / "manifest.json", json.dumps(manifest, indent=1))
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        try:
            fsync_dir(root)
            _point_latest(root, final)
        except BaseException:
            if not _names(root, final):  # 'latest' still names the previous checkpoint
                shutil.rmtree(final, ignore_errors=True)
            raise

    try:
        _agree(world, attempt(prepare), remove_tmp)
        _agree(world, attempt(write_shard), remove_tmp)  # every shard written before rank 0 publishes
        _agree(world, attempt(publish), remove_tmp)  # 'latest' moved, or the failure, on every rank
    except BaseException:
        remove_tmp()
        raise
    if lead:
        _prune(root, final)
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


# -- resuming ------------------------------------------------------------------------------------------------


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint (or shard) directory `ckpt`, read bounded (hwprofiles.inputs), of this
    format, and of the step its directory is named after."""
    try:
        manifest = loads_json_limited(read_limited_text(ckpt / "manifest.json", MAX_MANIFEST_BYTES))
    except (OSError, ValueError) as e:  # InputLimitError and UnicodeDecodeError are ValueErrors
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise CheckpointError(f"checkpoint {ckpt}: unreadable manifest.json ({why})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT \
            or manifest.get("version") not in READ_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt}: not a tierflow checkpoint of version "
                              f"{' or '.join(map(str, READ_VERSIONS))}")
    _check_manifest_step(ckpt, manifest)
    return manifest


def _check_manifest_step(ckpt: Path, manifest: dict) -> None:
    """The manifest's step is the one in its directory's name (stepNNNNNNNN, or its rank-K shard): a manifest
    edited to another step would resume at a step its files were not written at (or train 0 steps)."""
    shard = re.fullmatch(r"rank-\d+", ckpt.name) is not None
    named = re.fullmatch(r"step(\d+)", ckpt.parent.name if shard else ckpt.name)
    step = manifest.get("step")
    if named is None or (shard and step is None):
        return
    if isinstance(step, bool) or not isinstance(step, int) or step != int(named.group(1)):
        raise CheckpointError(f"checkpoint {ckpt}: its manifest.json says step {str(step)[:20]}, but its "
                              f"files are those of step {int(named.group(1))} (manifest edited after "
                              "writing?)")


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
        raise CheckpointError(f"checkpoint {ckpt}: {name} is truncated or overwritten ({nbytes:,} bytes, "
                              f"written with {want.get('bytes'):,})")
    if crc != want.get("crc32"):
        raise CheckpointError(f"checkpoint {ckpt}: checksum mismatch in {name}: the file changed after it "
                              "was written (disk error or another program)")


def check_world(ckpt: Path, manifest: dict, ranks: int) -> None:
    """StateError unless the checkpoint was written by `ranks` ranks (shards are not re-split)."""
    wrote = int((manifest.get("world") or {}).get("ranks", 1))
    if wrote != ranks:
        raise StateError(f"checkpoint {ckpt}: written by {wrote} rank(s), this run has {ranks}; resume it "
                         f"with the plan and world size it was written with ({wrote} rank(s)), or use "
                         "another --checkpoint-dir")


def load_checkpoint(state: TrainState, ckpt: Path, manifest: dict) -> None:
    """Restore `state` from checkpoint directory `ckpt` (this rank's shard with several ranks),
    verifying every block file first."""
    if manifest.get("numel") != state.layout.numel or manifest.get("model") != state.spec.name:
        raise StateError(f"checkpoint {ckpt}: it is of model {manifest.get('model')!r}, the plan trains "
                         f"{state.spec.name!r} (use another --checkpoint-dir, or the plan it was made with)")
    if state.lora is not None or manifest.get("lora") is not None:
        _load_adapters(state, ckpt, manifest)
        return
    if state.world.single:
        _load_blocks(state, ckpt, manifest, state.layout.numel, state.set_block)
        return
    d, shard = _shard_manifest(ckpt, manifest, state.world.rank)
    if shard.get("shards") != [list(x) for x in state.shards]:
        raise CheckpointError(f"checkpoint {ckpt}: rank-{state.world.rank}/ holds other element ranges than "
                              "this rank's shard (written by another world size?)")
    _load_blocks(state, d, shard, state.shard_numel, state.set_shard)


def _load_adapters(state: TrainState, ckpt: Path, manifest: dict) -> None:
    """LoRA: the adapters and their moments from `ckpt`, onto this run's base, which must be the one the
    checkpoint names (StateError, one line, otherwise)."""

    if state.lora is None:
        raise StateError(f"checkpoint {ckpt}: it holds LoRA adapters ({manifest['lora'].get('rank')} rank), "
                         "this plan trains every weight (resume with the LoRA plan, or use another "
                         "--checkpoint-dir)")
    if manifest.get("lora") is None:
        raise StateError(f"checkpoint {ckpt}: it is of full fine-tuning, this plan trains LoRA adapters (use "
                         "another --checkpoint-dir)")
    base = manifest.get("base") or {}
    if base.get("digest") != state.base_digest():
        raise StateError(f"checkpoint {ckpt}: its adapters were trained on another base "
                         f"({base.get('model')!r} with digest {base.get('digest')}; this run's base has "
                         f"{state.base_digest()}): resume with the --init directory or --seed it started "
                         "from, or use another --checkpoint-dir")
    # several ranks: each rank wrote its copy of the (identical) adapters into its shard directory
    d, files = (ckpt, manifest) if state.world.single else _shard_manifest(ckpt, manifest, state.world.rank)
    t = _load_verified(d, ADAPTERS_FILE, files)
    try:
        for cls in ("adam_m", "adam_v", "master"):
            prefix = MOMENT_PREFIX[cls]
            part = {k[len(prefix):]: v for k, v in t.items()
                    if (k.startswith(prefix) if prefix else not k.startswith(("adam_m.", "adam_v.")))}
            load_lora_state_dict(state.lora, part, cls)
    except LoraError as e:
        raise CheckpointError(f"checkpoint {ckpt}: {ADAPTERS_FILE}: {e}") from None


def _shard_manifest(ckpt: Path, manifest: dict, rank: int) -> tuple[Path, dict]:
    """(directory, manifest) of rank `rank`'s shard, its manifest verified against the top manifest."""
    d = ckpt / f"rank-{rank}"
    if not (d / "manifest.json").is_file():
        raise CheckpointError(
            f"checkpoint {ckpt}: rank {rank}'s shard (rank-{rank}/manifest.json) is missing")
    entry = (manifest.get("shards") or {}).get(f"rank-{rank}")
    verify_file(ckpt, f"rank-{rank}/manifest.json", {"files": {f"rank-{rank}/manifest.json": entry}})
    return d, read_manifest(d)


def _load_verified(d: Path, name: str, manifest: dict) -> dict:
    """The tensors of safetensors file `name` under `d`, its checksum verified against `manifest` first; an
    unreadable file is one line (CheckpointError)."""
    from safetensors.torch import load_file

    verify_file(d, name, manifest)
    try:
        return load_file(d / name)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError), OSError
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"checkpoint {d}: {name} is unreadable ({why})") from None


@one_thread()
def _load_blocks(state: TrainState, d: Path, manifest: dict, numel: list[int], put) -> None:

    for b, n in enumerate(numel):
        name = block_file(b)
        t = _load_verified(d, name, manifest)
        bad = [cls for cls in STATE_CLASSES if cls not in t or t[cls].numel() != n]
        if bad:
            raise CheckpointError(f"checkpoint {d}: {name} lacks {', '.join(bad)} of {n:,} elements")
        put(b, t["master"], t["adam_m"], t["adam_v"], t["weights"])


def candidates(directory: str | os.PathLike[str]) -> tuple[Path | None, list[Path], str | None]:
    """(the checkpoint 'latest' names or None, every step directory newest first,
    why 'latest' is unusable)."""
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
    (one line per checkpoint skipped). With several ranks every rank calls it and they agree (see the module
    docstring)."""
    if not state.world.single:
        return _resume_sharded(state, Path(directory), fallback=fallback, check=check, log=log)
    root = Path(directory)
    latest, steps, problem = candidates(root)
    if latest is None and problem is None:
        return None
    order = ([latest] if latest is not None else []) + [p for p in steps if p != latest]
    if problem is not None and not fallback:
        raise CheckpointError(f"--checkpoint-dir {root}: {problem}; pass --resume-fallback to resume from "
                              "the newest checkpoint that verifies, or use another directory")
    for i, ckpt in enumerate(order):
        try:
            manifest = read_manifest(ckpt)
            check_world(ckpt, manifest, 1)
            check(ckpt, manifest)
            load_checkpoint(state, ckpt, manifest)
        except CheckpointError as e:
            _bad_checkpoint(e, ckpt, order[i + 1:], fallback, log)
            continue
        if ckpt != latest:
            _point_latest(root, ckpt)
        return ckpt, manifest
    raise CheckpointError(f"--checkpoint-dir {root}: none of its {len(order)} checkpoint(s) verifies; delete "
                          "it to start over, or pass another --checkpoint-dir")


def _bad_checkpoint(e: CheckpointError | str, ckpt: Path, rest: list[Path], fallback: bool, log,
                    move: bool = True) -> None:
    """Without fallback: raise CheckpointError naming the way on. With it: move `ckpt` aside (when `move`: one
    rank does it) and log the skip."""
    if not fallback:
        hint = (f"pass --resume-fallback to resume from the previous checkpoint ({rest[0].name})" if rest
                else "no earlier checkpoint is left: delete the directory to start over")
        raise CheckpointError(f"{e}; {hint}") from None
    # renamed out of the way, so that keeping the last two checkpoints keeps good ones
    if move:
        try:
            aside = _move_aside(ckpt)
            moved = f"moved it to {aside.name} (delete it when done)"
        except OSError as err:
            moved = f"could not move it aside ({err.strerror}); it is left as {ckpt.name}"
        log(f"skipping a bad checkpoint: {e}; {moved}")


def _move_aside(ckpt: Path) -> Path:
    """Rename `ckpt` to the first free corrupt-<name>-N (N = 1, 2, ...): a bad checkpoint kept for inspection
    is never replaced by a later one of the same step."""
    for n in range(1, 1_000_000):
        aside = ckpt.with_name(f"corrupt-{ckpt.name}-{n}")
        if not os.path.lexists(aside):
            os.rename(ckpt, aside)
            return aside
    raise OSError(errno.EEXIST, f"corrupt-{ckpt.name}-N: every number is taken")


def _resume_sharded(state: TrainState, root: Path, *, fallback: bool, check: Callable[[Path, dict], None],
                    log: Callable[[str], None]) -> tuple[Path, dict] | None:
    """resume() for several ranks: rank 0 lists the checkpoints; for each candidate every rank verifies and
    loads its shard (rank 0 also checks that every shard is present) and all agree before it is used or
    skipped."""
    world = state.world
    lead = world.rank == 0
    listed = None
    if lead:
        latest, steps, problem = candidates(root)
        listed = (latest.name if latest is not None else None, [p.name for p in steps], problem)
    latest_name, step_names, problem = world.broadcast(listed)
    if latest_name is None and problem is None:
        return None
    latest = root / latest_name if latest_name is not None else None
    order = ([latest] if latest is not None else []) + [root / n for n in step_names if n != latest_name]
    if problem is not None and not fallback:
        raise CheckpointError(f"--checkpoint-dir {root}: {problem}; pass --resume-fallback to resume from "
                              "the newest checkpoint that verifies, or use another directory")
    for i, ckpt in enumerate(order):
        err = None
        try:
            manifest = read_manifest(ckpt)
            check_world(ckpt, manifest, world.ranks)
            check(ckpt, manifest)
            if lead:  # every shard there and as written, before any rank trains from it
                for k in range(world.ranks):
                    _shard_manifest(ckpt, manifest, k)
            load_checkpoint(state, ckpt, manifest)
        except CheckpointError as e:
            err = str(e)
        errors = [x for x in world.gather_objects(err) if x is not None]
        if errors:
            world.barrier()  # every rank is done reading it before rank 0 moves it aside
            try:
                _bad_checkpoint(errors[0], ckpt, order[i + 1:], fallback, log, move=lead)
            except CheckpointError as e:
                e.agreed = True  # every rank raises it: rank 0 says it
                raise
            world.barrier()
            continue
        if ckpt != latest and lead:
            _point_latest(root, ckpt)
        world.barrier()
        return ckpt, manifest
    raise CheckpointError(f"--checkpoint-dir {root}: none of its {len(order)} checkpoint(s) verifies; delete "
                          "it to start over, or pass another --checkpoint-dir")
