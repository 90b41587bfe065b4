"""Training tokens: a nanoGPT-style file of uint16 token ids, a plain-text file (byte-level tokens, vocabulary
256), text / JSON Lines / Parquet tokenized with the model's tokenizer (corpus.py, which hands its cached
tokens and prompt mask here), or, with no file, a fixed pseudo-random stream (for smoke runs and tests).
A target whose mask is 0 (a prompt's token) is -100, which the loss ignores.

Token files (a .bin/.u16 file, a text file's bytes, the token cache) are read through `TokenFile`: a window
of the file at a time with pread, so that memory, address space included, is one batch whatever the file's
size (a memory map would take the file's size of address space: a 4 GiB token file under a 3 GB limit).

Batches are a pure function of the step number, so the data position is just the step: a run resumed from a
checkpoint at step s reads exactly the batches an uninterrupted run would have read from step s on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import torch

from tierflow.errors import TierflowError


class DataError(TierflowError, ValueError):
    """A data file that cannot be used."""


def not_a_file(p: Path) -> str:
    """What `p` is when it is not a regular file: missing, a directory, or the kind of special file."""
    try:
        mode = p.stat().st_mode
    except OSError:
        return "no such file"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    what = next((what for test, what in kinds if test(mode)), "a special file")
    return what if what == "a directory" else f"{what}, not a regular file"


MAX_CHUNK_TOKENS = 1 << 20  # read at a time by TokenFile.max and iteration


class TokenFile:
    """Tokens of `dtype` in a file, from `offset` (in tokens) for `length` tokens, read a window at a time:
    slicing gives a view (no read), np.asarray(view) reads it; `max()` and iteration read a chunk at a
    time. An array-like for TokenData: len, slices, np.asarray, max, iteration."""

    def __init__(self, path: str | Path, dtype: np.dtype | type, offset: int = 0, length: int | None = None
                 ) -> None:
        self.path, self.dtype = str(path), np.dtype(dtype)
        size = os.stat(self.path).st_size // self.dtype.itemsize
        self.offset = offset
        self.length = size - offset if length is None else length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> TokenFile:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenFile: only contiguous slices")
        start, stop, _ = key.indices(self.length)
        return TokenFile(self.path, self.dtype, self.offset + start, max(stop - start, 0))

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) of this view as an array (pread: no file position shared between threads)."""
        stop = self.length if stop is None else min(stop, self.length)
        n = max(stop - start, 0)
        item = self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, n * item, (self.offset + start) * item)
        finally:
            os.close(fd)
        if len(data) != n * item:
            raise DataError(f"--data {self.path}: shorter than when it was opened (changed while training?)")
        return np.frombuffer(data, dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    def chunks(self):
        for start in range(0, self.length, MAX_CHUNK_TOKENS):
            yield self.read(start, start + MAX_CHUNK_TOKENS)

    def __iter__(self):
        for chunk in self.chunks():
            yield from chunk.tolist()

    def max(self) -> int:
        return max((int(c.max()) for c in self.chunks() if len(c)), default=0)


class TokenData:
    def __init__(self, tokens: np.ndarray, source: str, mask: np.ndarray | None = None) -> None:
        self.tokens = tokens
        self.source = source
        self.mask = mask  # 1: train on this token as a target; None: every token

    @classmethod
    def load(cls, path: str | None, vocab_size: int, fmt: str = "auto", seed: int = 0) -> TokenData:
        if path is None:
            rng = np.random.default_rng(seed)
            tokens = rng.integers(0, vocab_size, size=1 << 16, dtype=np.int64)
            return cls(tokens, "synthetic (seeded random tokens)")
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--data {p}: {not_a_file(p)} (pass a uint16 token file (.bin) or a text file)")
        if p.stat().st_size == 0:
            raise DataError(f"--data {p}: empty file (give it tokens or text)")
        if fmt == "auto":
            fmt = "uint16" if p.suffix in (".bin", ".u16") else "text"
        if fmt == "uint16":
            if p.stat().st_size % 2:
                raise DataError(f"--data {p}: {p.stat().st_size} bytes is not a whole number of uint16 "
                                "tokens (pass --data-format text for a text file)")
            tokens = TokenFile(p, np.uint16)
        elif fmt == "text":
            tokens = TokenFile(p, np.uint8)
        else:
            raise DataError(f"--data-format {fmt!r}: use auto, uint16, text or tokenize")
        if len(tokens) < 2:
            raise DataError(f"--data {p}: only {len(tokens)} tokens; a batch needs at least seq + 1")
        top = int(tokens.max())
        if top >= vocab_size:
            hint = "a text file needs a vocabulary of 256" if fmt == "text" else "wrong tokenizer?"
            raise DataError(f"--data {p}: token id {top} is outside the model's vocabulary of {vocab_size} "
                            f"({hint})")
        return cls(tokens, f"{p} ({fmt}, {len(tokens):,} tokens)")

    def split(self, fraction: float) -> tuple[TokenData, TokenData]:
        """(training, held-out) tokens: the last `fraction` of the stream held out (--val-fraction)."""
        n = len(self.tokens)
        cut = n - int(round(n * fraction))
        where = self.source.split(" (")[0]
        if cut < 2 or n - cut < 2:
            raise DataError(f"--val-fraction {fraction}: leaves {cut:,} training and {n - cut:,} held-out "
                            f"tokens of {where}; each needs at least 2 (pass more data or another fraction)")
        pct = f"{fraction:.0%}"
        m = self.mask
        return (TokenData(self.tokens[:cut], f"{self.source}, all but the last {pct}",
                          None if m is None else m[:cut]),
                TokenData(self.tokens[cut:], f"{where}: its last {pct} ({n - cut:,} tokens)",
                          None if m is None else m[cut:]))

    def check_batch(self, batch: int, seq: int) -> None:
        """Refuse data shorter than one batch (batch windows of seq tokens plus the last target), which would
        otherwise train on the same tokens repeated within a batch without a word."""
        need = batch * seq + 1
        if len(self.tokens) < need:
            where = self.source.split(" (")[0]
            raise DataError(f"--data {where}: {len(self.tokens):,} tokens, shorter than one batch of "
                            f"{batch} x {seq} tokens + 1 = {need:,} (pass a longer file, or a plan with a "
                            "smaller batch)")

    def batch(self, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (batch, seq) for training step `step`: consecutive windows of seq+1
        tokens, wrapping around the file."""
        n = len(self.tokens)
        if n < seq + 1:
            raise DataError(f"data {self.source}: {n} tokens, a sequence needs {seq + 1}")
        span = n - seq - 1 + 1
        first = (step * batch * seq) % span
        if self.mask is None and first + (batch - 1) * seq < span:
            # the windows do not wrap: rows i start at first + i * seq, so one read of batch * seq + 1 tokens
            # holds them all (inputs: all but its last token, targets: all but its first)
            window = torch.from_numpy(np.asarray(self.tokens[first: first + batch * seq + 1], dtype=np.int64))
            return window[:-1].view(batch, seq), window[1:].view(batch, seq).clone()
        rows, masked = [], []
        for i in range(batch):
            start = ((step * batch + i) * seq) % span
            row = np.asarray(self.tokens[start: start + seq + 1], dtype=np.int64)
            rows.append(row)
            if self.mask is not None:
                keep = np.asarray(self.mask[start + 1: start + seq + 1], dtype=bool)
                masked.append((i, np.flatnonzero(~keep)))
        x = torch.from_numpy(np.stack(rows))
        y = x[:, 1:].clone()
        for i, cols in masked:
            y[i, torch.from_numpy(cols)] = -100  # a prompt token: not a target (the loss ignores -100)
        return x[:, :-1].contiguous(), y
