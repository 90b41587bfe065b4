"""Training text as tokens: `--data` as text, JSON Lines or Parquet files, or a directory of them, tokenized
with the model's own tokenizer and cached.

- Sources: a `.txt`/`.md`/`.py`/... text file is one document; each line of a `.jsonl`/`.json` file (the
  standard library's json) and each row of a `.parquet` file (pyarrow, the `finetune` extra) is one: its
  `--text-field` (default `text`), or `--prompt-field` + `--response-field`, whose prompt tokens are not
  trained on (their targets are -100, ignored by the loss, as transformers' convention). A directory is every
  such file under it, in sorted order.
- Tokenizer: the Hugging Face tokenizer of `--tokenizer DIR` or else `--init DIR`
  (transformers.AutoTokenizer, which reads tokenizer.json through the `tokenizers` library); with neither,
  byte tokens (ids 0-255, end of text byte 3, ASCII's ETX), said in one line, whatever the data's shape;
  documents are packed back to back, each followed by the end-of-text token.
- Streaming: a text file is read and tokenized PIECE_BYTES at a time (cut after a line end, or at a
  character's boundary in a longer line), a JSON Lines file a line at a time (at most --max-line-mib; a limit
  whose line could not be parsed in the memory left is refused up front), a Parquet file a batch of rows at a
  time (a row group that could not be held is refused up front), and the tokens are appended to the cache
  files as they come: memory is bounded by one piece, line or row group, never by the data's size.
- Cache: the tokens as a file read a window at a time (data.TokenFile: `tokens.u1` for byte tokens,
  `tokens.u16` or `tokens.u32`, plus `mask.u8` with masked
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
from tierflow.executor.data import DataError, TokenFile, not_a_file
from tierflow.extras import install_command
from tierflow.hwprofiles.inputs import InputLimitError, check_affordable, reading, size_text
from tierflow.planner.io.progress import Progress

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json")
CACHE_VERSION = 3  # 2: the manifest records every cache file's size and CRC32; 3: byte tokens, streamed
# text tokenized at a time (a Hugging Face tokenizer's ids of it: a few MiB); TIERFLOW_TEXT_PIECE_BYTES sets
# it smaller, for the tests that check the bound under a small address-space limit
PIECE_BYTES = int(os.environ.get("TIERFLOW_TEXT_PIECE_BYTES") or 256 * 1024)
LINE_COPIES = 3  # a JSON Lines line in memory: its bytes, its text, the field parsed from it
MAX_DATA_FILES = 100_000  # files under a --data directory (each is named in the manifest)
BYTE_EOS = 3  # byte tokens' end of text: ASCII's ETX, which text does not hold


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
    found = sorted(_data_files(p))
    if not found:
        raise DataError(f"--data {p}: no text ({', '.join(TEXT_SUFFIXES)}), JSON Lines or Parquet file "
                        "under it")
    return found


def _data_files(p: Path) -> list[Path]:
    """The data files under directory p (not the token cache), at most MAX_DATA_FILES (DataError beyond)."""
    found: list[Path] = []
    for top, dirs, names in os.walk(p):
        dirs[:] = [d for d in dirs if d != ".tierflow-tokens"]
        for name in names:
            f = Path(top) / name
            if f.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES and f.is_file():
                found.append(f)
                if len(found) > MAX_DATA_FILES:
                    raise DataError(f"--data {p}: more than {MAX_DATA_FILES:,} data files under it (each is "
                                    "named in the token cache's manifest); pack them into JSON Lines or "
                                    "Parquet files")
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


class ByteTokens:
    """Byte tokens, the tokenizer when none is given: every UTF-8 byte its own id, documents ended by
    BYTE_EOS; a text file's raw bytes as they are."""

    eos_token_id = BYTE_EOS
    name = "byte tokens"

    def __len__(self) -> int:
        return 256

    def encode(self, text: str) -> np.ndarray:
        return self.encode_raw(text.encode("utf-8"))

    def encode_raw(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def identity(self) -> dict:
        return {"kind": "bytes", "eos": BYTE_EOS}


class HfTokens:
    """A Hugging Face tokenizer (transformers.AutoTokenizer) behind the same calls as ByteTokens."""

    def __init__(self, tok, directory: str) -> None:
        self.tok, self.directory = tok, directory
        self.eos_token_id = tok.eos_token_id
        self.name = Path(directory).name

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def encode_raw(self, data: bytes) -> np.ndarray:
        return self.encode(data.decode("utf-8", errors="replace"))

    def identity(self) -> dict:
        return _tokenizer_id(self.directory)


def load_tokenizer(directory: str | None, data: str, say=None):
    """The tokenizer of `directory` (HfTokens), or ByteTokens when there is none (said with `say`); one line
    (DataError) when it cannot be loaded."""
    if directory is None:
        if say is not None:
            say(f"--data {data}: no tokenizer given (--tokenizer DIR, or --init DIR that has one): byte "
                f"tokens (vocabulary 256, end of text byte {BYTE_EOS})")
        return ByteTokens()
    d = Path(directory)
    if not has_tokenizer(directory):
        raise DataError(f"--tokenizer {d}: no tokenizer there ({', '.join(TOKENIZER_FILES[:2])}, ...); pass "
                        "the Hugging Face model directory that has one")
    if not (d / "tokenizer.json").is_file() and (d / "tokenizer.model").is_file():
        problem = _tokenizer_model_problem(d / "tokenizer.model")
        if problem:
            raise DataError(f"--tokenizer {d}: its tokenizer.model {problem}")
    tok = _auto_tokenizer(d)
    if tok.eos_token_id is None:
        raise DataError(f"--tokenizer {d}: it has no end-of-text token to separate documents")
    return HfTokens(tok, directory)


def _auto_tokenizer(d: Path):
    """transformers.AutoTokenizer of d, its library's warnings kept quiet (the one line says what failed)."""
    import warnings

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - every way a tokenizer fails to load (KeyError of a JSON of the
        # wrong shape, the tokenizers library's bare Exception for an unknown model type, ...) is bad input
        names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
        why = " ".join(f"{type(e).__name__}: {e}".split())[:120]
        raise DataError(f"--tokenizer {d}: cannot load its {', '.join(names)} ({why}); pass a Hugging Face "
                        "tokenizer directory as transformers saves one") from None
    finally:
        hf_logging.set_verbosity(level)


def _tokenizer_model_problem(f: Path) -> str:
    """What keeps a lone tokenizer.model from loading, '' when nothing is known to: a SentencePiece model (a
    protobuf, first byte 0x0a) needs the sentencepiece package, a tiktoken file (lines of base64 and a rank)
    the tiktoken package, and anything else is neither."""
    import importlib.util
    import re

    with open(f, "rb") as fh:
        head = fh.read(4096)
    lines = head.split(b"\n")[:-1] or [head]
    if all(re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", ln) for ln in lines if ln):
        if importlib.util.find_spec("tiktoken") is None:
            return "is a tiktoken file: reading it needs the tiktoken package (pip install tiktoken)"
        return ""
    if head[:1] == b"\x0a":
        if importlib.util.find_spec("sentencepiece") is None:
            return ("looks like a SentencePiece model: reading it needs the sentencepiece package (pip "
                    "install sentencepiece), or save the tokenizer with transformers (tokenizer.json)")
        return _sentencepiece_problem(f)
    return (f"is neither a SentencePiece model (a protobuf, first byte 0x0a) nor a tiktoken file (its first "
            f"bytes: {head[:8].hex()}); pass the model's own tokenizer directory")


def _sentencepiece_problem(f: Path) -> str:
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(f))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError / RuntimeError for a bad model
        return f"is not a SentencePiece model sentencepiece can read ({' '.join(str(e).split())[:100]})"
    return ""


def _documents(f: Path, fields: Fields, enc):
    """(prompt tokens, trained tokens) of every document of source f, a document's tokens as a list of
    arrays (its pieces: a long text is tokenized PIECE_BYTES at a time)."""
    if f.suffix in TEXT_SUFFIXES:
        yield [], [enc.encode_raw(piece) for piece in _text_pieces(f)]
        return
    if f.suffix in PARQUET_SUFFIXES:
        rows = _parquet_rows(f)
    else:
        rows = _jsonl_rows(f, int(fields.max_line_mib * 2**20))
    for where, row in rows:
        prompt, text = _fields_of(row, fields, f, where)
        del row
        yield ([enc.encode(p) for p in _str_pieces(prompt)] if prompt else [],
               [enc.encode(p) for p in _str_pieces(text)])


def _text_pieces(f: Path, piece_bytes: int | None = None):
    """The bytes of text file f, at most `piece_bytes` (PIECE_BYTES) at a time, each cut after a line end
    (or, in a longer line, before a UTF-8 character's continuation bytes), so that no character and, where a
    line end is near, no token spans two pieces."""
    piece_bytes = piece_bytes or PIECE_BYTES
    with open(f, "rb") as fh:
        rest = b""
        while data := fh.read(piece_bytes - len(rest)):
            data = rest + data
            cut = _line_cut(data) or _char_boundary(data)
            yield data[:cut]
            rest = data[cut:]
        if rest:
            yield rest


def _line_cut(data: bytes) -> int:
    """After the last line end of `data` that a non-space follows (a tokenizer's pre-tokenizer splits
    there: GPT-2's pattern keeps runs of white space together), else after its last line end, else 0."""
    end = len(data)
    while (i := data.rfind(b"\n", 0, end)) >= 0:
        if i + 1 < len(data) and not data[i + 1:i + 2].isspace():
            return i + 1
        end = i
    return data.rfind(b"\n") + 1


def _char_boundary(data: bytes) -> int:
    """Where to cut `data` so that no UTF-8 character is split: before its last character when that one is
    incomplete, else its end (or its end when it is not UTF-8 there)."""
    i = len(data) - 1
    while i > 0 and len(data) - i < 4 and data[i] & 0xC0 == 0x80:  # continuation bytes
        i -= 1
    lead = data[i]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return i if i > 0 and i + need > len(data) else len(data)


def _str_pieces(text: str, piece_chars: int | None = None):
    """`text` in pieces of at most `piece_chars` (PIECE_BYTES) characters, each cut after a line end where
    there is one."""
    piece_chars = piece_chars or PIECE_BYTES
    start = 0
    while start < len(text):
        end = min(start + piece_chars, len(text))
        if end < len(text):
            end = text.rfind("\n", start, end) + 1 or end
        yield text[start:end]
        start = end


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
            del raw
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"--data {f}: line {i} is not JSON ({e.msg}); one JSON object per line") \
                        from None
                del line
                yield f"line {i}", row


def _parquet_rows(f: Path, batch_rows: int = 64):
    """Every row of Parquet file f, read a batch of rows at a time; a row group whose uncompressed size
    could not be held (LINE_COPIES times, as a JSON Lines line) in the memory left is refused first."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--data {f}: reading Parquet needs pyarrow (pip install pyarrow, or "
                        f"{install_command('finetune')})") from None
    try:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        biggest = max((meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)), default=0)
        _check_line_memory(f, LINE_COPIES * biggest, f"its largest row group ({size_text(biggest)} "
                           "uncompressed)", "write it with smaller row groups")
        i = 0
        for batch in pf.iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                yield f"row {i}", row
                i += 1
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        why = " ".join(str(e).split())[:80]
        raise DataError(f"--data {f}: not a readable Parquet file ({why})") from None


def _check_line_memory(f: Path, need_bytes: int, what: str, fix: str) -> None:
    """DataError when `need_bytes` (for `what` of f) exceeds what this process can still allocate."""
    try:
        check_affordable(need_bytes, what)
    except InputLimitError as e:
        raise DataError(f"--data {f}: {e}; {fix}") from None


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


def _manifest(files: list[Path], enc, fields: Fields) -> dict:
    src = [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
           for f in files]
    return {"version": CACHE_VERSION, "sources": src, "tokenizer": enc.identity(),
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
    and its files match the manifest; byte tokens when `tokenizer_dir` is None. `vocab_size` (the model's)
    is checked by the caller (train_loop.load_data) against the largest token id."""
    files = sources(path)
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"--data {f}: empty file (remove it or give it text)")
    enc = load_tokenizer(tokenizer_dir, path, say)
    _check_line_limit(files, fields)
    want = _manifest(files, enc, fields)
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
            have = _write_cache(root, files, enc, fields, want)
        except BaseException:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
    dtype = np.dtype(have["dtype"])
    if have["tokens"] < 2:
        raise DataError(f"--data {path}: only {have['tokens']} tokens after tokenizing")
    tokens = TokenFile(root / f"tokens.{dtype.str[1:]}", dtype)  # read a window at a time (data.py)
    mask = TokenFile(root / "mask.u8", np.uint8) if have["masked"] else None
    what = f"{path} ({len(files)} file(s) tokenized with {enc.name}, {len(tokens):,} tokens"
    return tokens, mask, what + (", prompts masked)" if mask is not None else ")")


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` (itself or a parent) that does not exist yet, None if it exists."""
    missing = None
    for d in [path, *path.parents]:
        if d.exists():
            break
        missing = d
    return missing


def _check_line_limit(files: list[Path], fields: Fields) -> None:
    """Refuse a --max-line-mib whose longest possible line (at most the largest JSON Lines file) could not
    be parsed in the memory left: memory stays bounded by the limit, or the limit is refused."""
    jsonl = [f for f in files if f.suffix in JSONL_SUFFIXES]
    if not jsonl:
        return
    f = max(jsonl, key=lambda x: x.stat().st_size)
    line = min(int(fields.max_line_mib * 2**20), f.stat().st_size)
    _check_line_memory(f, LINE_COPIES * line, f"a line of up to {size_text(line)} (--max-line-mib "
                       f"{fields.max_line_mib:g}, at most the file) read and parsed",
                       "pass a smaller --max-line-mib, or split the long lines")


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


def _write_cache(root: Path, files: list[Path], enc, fields: Fields, manifest: dict) -> dict:
    """Tokenize every document a piece at a time, appending the tokens (and the mask) to the cache files,
    each document followed by end-of-text; the files renamed into place, and the manifest written last (a
    killed run leaves no manifest, so the next one tokenizes again)."""
    n = len(enc)  # every id is below it: one byte a token for byte tokens, two for vocabularies to 65,536
    dtype = np.dtype(np.uint8 if n <= 1 << 8 else np.uint16 if n <= 1 << 16 else np.uint32)
    made = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / "manifest.json").unlink(missing_ok=True)
    except OSError as e:
        raise DataError(f"--data: cannot write the token cache {root} ({e.strerror}); pass --cache-dir DIR, "
                        "a writable directory") from None
    writer = _CacheWriter(root, dtype, masked=fields.prompt is not None)
    try:
        with writer:
            _tokenize_into(writer, files, enc, fields)
        out = {**manifest, "tokens": writer.tokens, "dtype": dtype.str, "masked": writer.any_masked,
               "files": writer.commit()}
        _replace(root / "manifest.json", json.dumps(out, indent=1).encode())
    except BaseException:
        writer.discard()
        if made:
            shutil.rmtree(root, ignore_errors=True)  # a cache that could not be written leaves nothing
        raise
    return out


def _tokenize_into(writer: _CacheWriter, files: list[Path], enc, fields: Fields) -> None:
    eos = np.asarray([enc.eos_token_id], dtype=np.int64)
    prog = Progress(len(files), "tokenizing")
    for f in files:
        with reading(f"--data {f}", f"{size_text(PIECE_BYTES)} of text at a time, a JSON Lines line of at "
                     f"most --max-line-mib {fields.max_line_mib:g} MiB"):
            for prompt, text in _documents(f, fields, enc):
                for ids in prompt:
                    writer.append(ids, 0)
                for ids in text:
                    writer.append(ids, 1)
                writer.append(eos, 1)
        prog.step(f.name)
    prog.finish()


class _CacheWriter:
    """The token file (and mask file) of a cache, appended to under temporary names, their size and CRC32
    kept as they grow; commit() renames them into place, discard() removes them."""

    def __init__(self, root: Path, dtype: np.dtype, masked: bool) -> None:
        self.root, self.dtype, self.masked = root, dtype, masked
        self.names = [f"tokens.{dtype.str[1:]}"] + (["mask.u8"] if masked else [])
        self.tmp = {n: root / f"{n}.{os.getpid()}.tmp" for n in self.names}
        self.crc = dict.fromkeys(self.names, 0)
        self.size = dict.fromkeys(self.names, 0)
        self.fh: dict = {}
        self.tokens, self.any_masked = 0, False

    def __enter__(self) -> _CacheWriter:
        try:
            self.fh = {n: open(t, "wb") for n, t in self.tmp.items()}  # noqa: SIM115 - closed in __exit__
        except OSError as e:
            raise self._error(e) from None
        return self

    def __exit__(self, *exc: object) -> None:
        for fh in self.fh.values():
            fh.close()

    def append(self, ids: np.ndarray, mask_value: int) -> None:
        if not len(ids):
            return
        self._write(self.names[0], np.asarray(ids).astype(self.dtype).tobytes())
        if self.masked:
            self._write("mask.u8", bytes([mask_value]) * len(ids))
            self.any_masked |= mask_value == 0
        self.tokens += len(ids)

    def _write(self, name: str, data: bytes) -> None:
        try:
            self.fh[name].write(data)
        except OSError as e:
            raise self._error(e) from None
        self.crc[name] = zlib.crc32(data, self.crc[name])
        self.size[name] += len(data)

    def _error(self, e: OSError) -> DataError:
        return DataError(f"--data: cannot write the token cache in {self.root} ({e.strerror}); pass "
                         "--cache-dir DIR with room for it")

    def commit(self) -> dict:
        """Rename the files into place (the mask only when a token is masked); their sizes and CRC32s."""
        files = {}
        for name in self.names:
            if name == "mask.u8" and not self.any_masked:
                self.tmp[name].unlink(missing_ok=True)
                (self.root / name).unlink(missing_ok=True)
                continue
            try:
                os.replace(self.tmp[name], self.root / name)
            except OSError as e:
                raise self._error(e) from None
            files[name] = {"bytes": self.size[name], "crc32": self.crc[name]}
        return files

    def discard(self) -> None:
        for t in self.tmp.values():
            t.unlink(missing_ok=True)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"--data: cannot write the token cache file {path} ({e.strerror}); pass --cache-dir "
                        "DIR with room for it") from None
