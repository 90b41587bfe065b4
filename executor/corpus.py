"""Training text as tokens: `--data` as text, JSON Lines or Parquet files, or a directory of them, tokenized
with the model's own tokenizer and cached.

- Sources: a `.txt`/`.md`/`.py`/... text file is one document; each line of a `.jsonl`/`.json` file (the
  standard library's json) and each row of a `.parquet` file (pyarrow, the `finetune` extra) is one: its
  `--text-field` (default `text`), or `--prompt-field` + `--response-field`, whose prompt tokens are not
  trained on (their targets are -100, ignored by the loss, as transformers' convention). A directory is every
  such file under it, in sorted order.
- Tokenizer: the Hugging Face tokenizer of `--tokenizer DIR` or else `--init DIR`
  (transformers.AutoTokenizer, which reads tokenizer.json through the `tokenizers` library); documents are
  packed back to back, each followed by the tokenizer's end-of-text token.
- Cache: the tokens as a memory-mapped file (`tokens.u16` or `tokens.u32`, plus `mask.u8` with masked
  prompts) in `<data>.tierflow-tokens/` (a directory's: `<dir>/.tierflow-tokens/`) beside `manifest.json`
  naming every source (path, size, mtime), the tokenizer (directory and the SHA-256 of its files), the
  fields, and the size and CRC32 of every cache file; a run whose sources or tokenizer differ tokenizes again,
  and so does one whose cache files do not match their manifest (truncated, emptied, overwritten: one line
  says so). `--cache-dir DIR` puts the cache under DIR (`<DIR>/<data name>-<hash of its path>/`); when the
  data's folder is not writable the default is the user's cache directory (`$XDG_CACHE_HOME/tierflow/tokens`,
  else `~/.cache/tierflow/tokens`), said in one line. A progress bar shows on a terminal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tierflow.executor.checkpoint import file_crc32
from tierflow.executor.data import DataError, not_a_file
from tierflow.planner.io.progress import Progress

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json")
CACHE_VERSION = 2  # 2: the manifest records every cache file's size and CRC32


MAX_LINE_MIB = 64  # --max-line-mib's default: the longest JSON Lines line read (memory stays bounded by it)


@dataclass(frozen=True)
class Fields:
    """Which fields of a JSON Lines / Parquet record are trained on, and the longest line read."""

    text: str = "text"
    prompt: str | None = None  # with response: the prompt's tokens are masked out of the loss
    response: str | None = None
    max_line_mib: float = MAX_LINE_MIB  # a longer JSON Lines line is refused in one line


def is_corpus(path: str, fmt: str) -> bool:
    """Whether --data needs the tokenizer: a directory, JSON Lines or Parquet, or text with --data-format
    tokenize."""
    p = Path(path)
    structured = p.is_dir() or p.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES
    return fmt == "tokenize" or (fmt == "auto" and structured)


def sources(path: str) -> list[Path]:
    """The files of --data (a file, or every readable file under a directory)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        what = not_a_file(p)
        what = "no such file or directory" if what == "no such file" else what
        raise DataError(f"--data {p}: {what} (pass a text, JSON Lines or Parquet file, or a directory of "
                        "them)")
    found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES
                   + PARQUET_SUFFIXES and ".tierflow-tokens" not in f.parts)
    if not found:
        raise DataError(f"--data {p}: no text ({', '.join(TEXT_SUFFIXES)}), JSON Lines or Parquet file "
                        "under it")
    return found


def has_tokenizer(directory: str) -> bool:
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def copy_tokenizer(directory: str, to: str | Path) -> list[str]:
    """The tokenizer files of `directory` copied beside an exported model (so that transformers loads model
    and tokenizer from one folder); returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(directory) / name).is_file():
            shutil.copyfile(Path(directory) / name, Path(to) / name)
            copied.append(name)
    return copied


def load_tokenizer(directory: str | None, data: str):
    """transformers.AutoTokenizer of `directory`; one line (DataError) when there is none."""
    if directory is None:
        raise DataError(f"--data {data}: tokenizing it needs the model's tokenizer: pass --tokenizer DIR (or "
                        "--init DIR) with a Hugging Face tokenizer (tokenizer.json, or vocab.json + "
                        "merges.txt)")
    d = Path(directory)
    if not has_tokenizer(directory):
        raise DataError(f"--tokenizer {d}: no tokenizer there ({', '.join(TOKENIZER_FILES[:2])}, ...); pass "
                        "the Hugging Face model directory that has one")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - every way a tokenizer fails to load (KeyError of a JSON of the
        # wrong shape, the tokenizers library's bare Exception for an unknown model type, ...) is bad input
        names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
        why = " ".join(f"{type(e).__name__}: {e}".split())[:120]
        raise DataError(f"--tokenizer {d}: cannot load its {', '.join(names)} ({why}); pass a Hugging Face "
                        "tokenizer directory as transformers saves one") from None
    if tok.eos_token_id is None:
        raise DataError(f"--tokenizer {d}: it has no end-of-text token to separate documents")
    return tok


def _documents(f: Path, fields: Fields):
    """(prompt text, trained text) of every document of source f."""
    if f.suffix in TEXT_SUFFIXES:
        yield "", f.read_text(errors="replace")
        return
    if f.suffix in PARQUET_SUFFIXES:
        rows = _parquet_rows(f)
    else:
        rows = _jsonl_rows(f, int(fields.max_line_mib * 2**20))
    for where, row in rows:
        yield _fields_of(row, fields, f, where)


def _jsonl_rows(f: Path, max_line_bytes: int):
    """Every non-blank line's JSON, read a line at a time and never more than `max_line_bytes` of one."""
    with open(f, "rb") as fh:
        i = 0
        while raw := fh.readline(max_line_bytes + 1):
            i += 1
            if len(raw) > max_line_bytes and not (len(raw) == max_line_bytes + 1 and raw.endswith(b"\n")):
                raise DataError(f"--data {f}: line {i} is longer than --max-line-mib "
                                f"{max_line_bytes / 2**20:g} MiB (one JSON object per line; pass a larger "
                                "--max-line-mib if it is meant to be)")
            line = raw.decode("utf-8", errors="replace")
            if line.strip():
                try:
                    yield f"line {i}", json.loads(line)
                except ValueError as e:
                    raise DataError(f"--data {f}: line {i} is not JSON ({e.msg}); one JSON object per line") \
                        from None


def _parquet_rows(f: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--data {f}: reading Parquet needs pyarrow (pip install pyarrow, or pip install "
                        "'tierflow[finetune]')") from None
    try:
        table = pq.read_table(f)
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())[:80]
        raise DataError(f"--data {f}: not a readable Parquet file ({why})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _fields_of(row: object, fields: Fields, f: Path, where: str) -> tuple[str, str]:
    if not isinstance(row, dict):
        raise DataError(f"--data {f}: {where} is not an object with fields")
    names = [fields.prompt, fields.response] if fields.prompt else [fields.text]
    for n in names:
        if not isinstance(row.get(n), str):
            have = ", ".join(sorted(row)[:6])
            flag = "--prompt-field/--response-field" if fields.prompt else "--text-field"
            raise DataError(f"--data {f}: {where} has no text field {n!r} (it has: {have}); pass {flag}")
    if fields.prompt:
        return row[fields.prompt], row[fields.response]
    return "", row[fields.text]


def _tokenizer_id(directory: str) -> dict:
    d = Path(directory)
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            h.update(name.encode() + (d / name).read_bytes())
    return {"dir": str(d.resolve()), "sha256": h.hexdigest()[:16]}


def _manifest(files: list[Path], tokenizer_dir: str, fields: Fields) -> dict:
    src = [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
           for f in files]
    return {"version": CACHE_VERSION, "sources": src, "tokenizer": _tokenizer_id(tokenizer_dir),
            "fields": {k: v for k, v in asdict(fields).items() if k != "max_line_mib"}}


def cache_dir(path: str, under: str | None = None, say=None) -> Path:
    """Where --data's token cache lives: under --cache-dir when given; else beside the data, or, when the
    data's folder is not writable, in the user's cache directory (said with `say`)."""
    p = Path(path)
    named = f"{p.resolve().name}-{hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:12]}"
    if under is not None:
        return Path(under) / named
    beside = p / ".tierflow-tokens" if p.is_dir() else p.with_name(p.name + ".tierflow-tokens")
    if _writable(beside):
        return beside
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierflow" / "tokens" / named
    if say is not None:
        say(f"--data {p}: its folder is not writable; the token cache is in {user} (pass --cache-dir DIR to "
            "put it elsewhere)")
    return user


def _writable(cache: Path) -> bool:
    """Whether the cache directory exists writable, or can be made in its (writable) parent."""
    if cache.is_dir():
        return os.access(cache, os.W_OK | os.X_OK)
    return os.access(cache.parent, os.W_OK | os.X_OK)


def _say(msg: str) -> None:
    print(f"tierflow run: {msg}", file=sys.stderr)


def tokenize(path: str, tokenizer_dir: str | None, fields: Fields, vocab_size: int,
             cache_under: str | None = None, say=_say):
    """(tokens, mask or None, description) of --data, from the cache when its manifest matches the sources
    and its files match the manifest."""
    files = sources(path)
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"--data {f}: empty file (remove it or give it text)")
    tok = load_tokenizer(tokenizer_dir, path)
    want = _manifest(files, tokenizer_dir, fields)
    root = cache_dir(path, cache_under, say)
    have = _read_manifest(root)
    if have is not None and _same_sources(have, want):
        bad = _damaged(root, have)
        if bad:
            say(f"--data {path}: the token cache {root} does not match its manifest ({bad}); tokenizing "
                "again")
            have = None
    if have is None or not _same_sources(have, want):
        made = _first_missing(root)  # what this run creates, removed again if the cache cannot be written
        try:
            have = _write_cache(root, files, tok, fields, want, vocab_size)
        except BaseException:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
    dtype = np.dtype(have["dtype"])
    if have["tokens"] < 2:
        raise DataError(f"--data {path}: only {have['tokens']} tokens after tokenizing")
    tokens = np.memmap(root / f"tokens.{dtype.str[1:]}", dtype=dtype, mode="r")
    mask = np.memmap(root / "mask.u8", dtype=np.uint8, mode="r") if have["masked"] else None
    what = f"{path} ({len(files)} file(s) tokenized with {Path(tokenizer_dir).name}, {len(tokens):,} tokens"
    return tokens, mask, what + (", prompts masked)" if mask is not None else ")")


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` (itself or a parent) that does not exist yet, None if it exists."""
    missing = None
    for d in [path, *path.parents]:
        if d.exists():
            break
        missing = d
    return missing


def _read_manifest(root: Path) -> dict | None:
    try:
        got = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("files"), dict) else None


def _same_sources(have: dict, want: dict) -> bool:
    return {k: v for k, v in have.items() if k not in ("tokens", "dtype", "masked", "files")} == want


def _damaged(root: Path, manifest: dict) -> str:
    """'' when every cache file the manifest names has its size and CRC32, else what differs (the first)."""
    for name, want in manifest["files"].items():
        f = root / name
        try:
            size = f.stat().st_size
            if size != want.get("bytes"):
                return f"{name}: {size:,} bytes, the manifest says {want.get('bytes')}"
            if file_crc32(f)[1] != want.get("crc32"):
                return f"{name}: its checksum differs"
        except OSError as e:
            return f"{name}: {e.strerror}"
    return ""


def _write_cache(root: Path, files: list[Path], tok, fields: Fields, manifest: dict, vocab_size: int) -> dict:
    """Tokenize every document, pack them with end-of-text, write the token (and mask) files and, last, the
    manifest (a killed run leaves no manifest, so the next one tokenizes again)."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    eos = tok.eos_token_id
    prog = Progress(len(files), "tokenizing")
    for f in files:
        for prompt, text in _documents(f, fields):
            p = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
            r = tok(text, add_special_tokens=False)["input_ids"]
            ids.append(np.asarray([*p, *r, eos], dtype=np.int64))
            masks.append(np.asarray([0] * len(p) + [1] * (len(r) + 1), dtype=np.uint8))
        prog.step(f.name)
    prog.finish()
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    dtype = np.dtype(np.uint16 if max(vocab_size, len(tok)) <= 1 << 16 else np.uint32)
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / "manifest.json").unlink(missing_ok=True)
    except OSError as e:
        raise DataError(f"--data: cannot write the token cache {root} ({e.strerror}); pass --cache-dir DIR, "
                        "a writable directory") from None
    masked = bool(len(mask)) and not bool(mask.all())
    out = {**manifest, "tokens": int(len(tokens)), "dtype": dtype.str, "masked": masked, "files": {}}
    # each file written whole under a temporary name, then renamed: a reader never maps a half-written one
    blobs = {f"tokens.{dtype.str[1:]}": tokens.astype(dtype).tobytes()}
    if masked:
        blobs["mask.u8"] = mask.tobytes()
    for name, data in blobs.items():
        _replace(root / name, data)
        out["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    _replace(root / "manifest.json", json.dumps(out, indent=1).encode())
    return out


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"--data: cannot write the token cache file {path} ({e.strerror}); pass --cache-dir "
                        "DIR with room for it") from None
