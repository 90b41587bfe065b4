"""The SSD tier's store (executor/tiers/ssd_store.py): a CRC per chunk computed by the I/O workers, corruption
and truncation caught by name, the cache of open descriptors, unaligned tensors and tails, reads into the
caller's buffer, the checksum choice (zlib-ng's CRC32, else google-crc32c's CRC32C, else zlib's CRC32 with a
warning)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import tierflow.executor.tiers.ssd_store as ss
from tierflow.executor.tiers.direct_io import ALIGN
from tierflow.executor.tiers.ssd_store import ChecksumError, SsdStore, aligned_empty

CHUNK = 16 * 1024  # small chunks: several per tensor without big tensors


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(ss, "CHUNK_BYTES", CHUNK)
    s = SsdStore(tmp_path, warn=lambda m: None)
    yield s
    s.close()


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, ALIGN + 5, CHUNK, 3 * CHUNK + 7])
def test_roundtrip_of_aligned_and_unaligned_tensors(store, nbytes):
    data = _bytes(nbytes)
    aligned = aligned_empty(nbytes)[:nbytes]
    aligned.copy_(data)
    unaligned = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    unaligned.copy_(data)
    for name, t in (("aligned", aligned), ("unaligned", unaligned)):
        store.write(name, t)
        assert torch.equal(store.read(name, torch.uint8, nbytes), data)
        assert os.path.getsize(store.path(name)) == -(-nbytes // ALIGN) * ALIGN  # padded to whole pages
    assert store.used_bytes() == 2 * nbytes


def test_one_crc_per_chunk(store):
    store.write("t", _bytes(3 * CHUNK + 7))
    rec = store.records["t"]
    assert rec.nbytes == 3 * CHUNK + 7 and len(rec.chunk_crcs) == 4
    assert store.checksum in ("crc32c", "crc32")


def test_chunk_crcs_are_the_crc32_of_each_chunk(store):
    if ss._ZLIB_NG is None:
        pytest.skip("zlib-ng is not installed")
    data = _bytes(3 * CHUNK + 7)
    store.write("t", data)
    raw = data.numpy().tobytes()
    assert store.checksum == "crc32"
    want = tuple(zlib.crc32(raw[lo: lo + CHUNK]) for lo in range(0, len(raw), CHUNK))
    assert store.records["t"].chunk_crcs == want


def test_cpu_seconds_of_the_io_are_counted(store):
    assert store.cpu_s == 0.0
    data = _bytes(64 * CHUNK)
    store.write("t", data)
    after_write = store.cpu_s
    store.read("t", torch.uint8, data.numel())
    assert 0.0 < after_write < store.cpu_s


def test_crc32c_when_zlib_ng_is_missing(tmp_path, monkeypatch):
    if ss._CRC32C is None:
        pytest.skip("google-crc32c is not installed")
    monkeypatch.setattr(ss, "_ZLIB_NG", None)
    monkeypatch.setattr(ss, "CHUNK_BYTES", CHUNK)
    st = SsdStore(tmp_path, warn=pytest.fail)
    assert st.checksum == "crc32c"
    data = _bytes(2 * CHUNK + 5)
    st.write("t", data)
    assert torch.equal(st.read("t", torch.uint8, data.numel()), data)
    with open(st.path("t"), "r+b") as f:
        f.seek(CHUNK + 1)
        f.write(b"\xff")
    with pytest.raises(ChecksumError, match=rf"checksum mismatch in tensor t .*bytes {CHUNK}-"):
        st.read("t", torch.uint8, data.numel())
    st.close()


def test_aligned_memory_is_written_without_a_copy_but_its_tail(store, monkeypatch):
    staged = []
    real = ss.ChunkIo._stage

    def stage(self, nbytes):
        staged.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(ss.ChunkIo, "_stage", stage)
    whole = aligned_empty(2 * CHUNK)
    store.write("whole", whole)
    assert staged == []
    store.write("tail", aligned_empty(CHUNK + 10)[: CHUNK + 10])
    assert staged == [ALIGN]  # only the last partial page


def test_read_lands_in_the_callers_buffer(store):
    data = _bytes(2 * CHUNK + 100).view(torch.uint8)
    store.write("t", data)
    buf = aligned_empty(4 * CHUNK)
    out = store.read("t", torch.uint8, data.numel(), into=lambda n: buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, data)


@pytest.mark.parametrize("where", [10, 2 * CHUNK + 3])
def test_a_corrupted_chunk_is_named(store, where):
    data = _bytes(3 * CHUNK)
    store.write("adam_m_b1_p0", data)
    with open(store.path("adam_m_b1_p0"), "r+b") as f:
        f.seek(where)
        f.write(bytes([data[where].item() ^ 0xFF]))
    lo = where // CHUNK * CHUNK
    with pytest.raises(ChecksumError, match=rf"checksum mismatch in tensor adam_m_b1_p0 .*bytes {lo}-"):
        store.read("adam_m_b1_p0", torch.uint8, data.numel())


def test_truncated_deleted_and_replaced_files(store):
    data = _bytes(2 * CHUNK)
    store.write("t", data)
    os.truncate(store.path("t"), CHUNK)
    with pytest.raises(ChecksumError, match="tensor t is truncated"):
        store.read("t", torch.uint8, data.numel())
    store.write("t", data)
    store.path("t").unlink()  # behind the store's back, with its descriptor still open
    with pytest.raises(ChecksumError, match="tensor t is missing"):
        store.read("t", torch.uint8, data.numel())
    store.write("t", data)  # written again: a new file, not the deleted one's descriptor
    assert torch.equal(store.read("t", torch.uint8, data.numel()), data)
    store.path("t").unlink()
    store.path("t").write_bytes(bytes(data.numpy()))  # replaced by the same bytes: opened again, verified
    assert torch.equal(store.read("t", torch.uint8, data.numel()), data)


def test_descriptors_are_cached_reused_and_bounded(store, monkeypatch):
    monkeypatch.setattr(ss, "FD_CACHE", 3)
    opened = []
    real_open = os.open

    def counting_open(path, flags, *a):
        opened.append(str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", counting_open)
    data = _bytes(CHUNK)
    for _ in range(3):
        store.write("a", data)
        store.read("a", torch.uint8, CHUNK)
    assert len(opened) == 1  # one open for three writes and three reads
    for i in range(5):
        store.write(f"b{i}", data)
    assert len(store.fds) == 3 and "a" not in store.fds
    assert torch.equal(store.read("a", torch.uint8, CHUNK), data)  # evicted: opened again
    fd = store.fds["a"].fd
    store.delete("a")
    assert "a" not in store.fds and not store.path("a").exists()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by delete
    assert "a" not in store.records


def test_zlib_fallback_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ss, "_ZLIB_NG", None)
    monkeypatch.setattr(ss, "_CRC32C", None)
    monkeypatch.setattr(ss, "_warned_crc", False)
    warnings: list[str] = []
    stores = [SsdStore(tmp_path, warn=warnings.append) for _ in range(2)]
    assert [s.checksum for s in stores] == ["crc32", "crc32"]
    assert len(warnings) == 1 and "pip install zlib-ng" in warnings[0]
    data = _bytes(ALIGN + 3)
    stores[0].write("t", data)
    assert torch.equal(stores[0].read("t", torch.uint8, data.numel()), data)
    with open(stores[0].path("t"), "r+b") as f:
        f.write(b"\0\0\0")
    with pytest.raises(ChecksumError, match="checksum mismatch in tensor t"):
        stores[0].read("t", torch.uint8, data.numel())
    for s in stores:
        s.close()


def test_an_asynchronous_write_is_complete_before_anything_claims_it(store):
    data = [_bytes(3 * CHUNK + 7, seed=i) for i in range(3)]
    pending = [store.write(f"t{i}", d, wait=False) for i, d in enumerate(data)]
    assert all(p is not None and p.nbytes == d.numel() for p, d in zip(pending, data))
    assert store.used_bytes() == sum(d.numel() for d in data)  # counted while queued
    assert torch.equal(store.read("t1", torch.uint8, data[1].numel()), data[1])  # the read waits for it
    assert "t1" not in store.pending and pending[1].tensor is None  # its tensor is let go once it is down
    store.flush()
    assert not store.pending and all(p.done() for p in pending)
    assert store.bytes_written == sum(d.numel() for d in data)
    for i, d in enumerate(data):
        assert store.records[f"t{i}"].chunk_crcs == _sync_crcs(store, d)
        assert torch.equal(store.read(f"t{i}", torch.uint8, d.numel()), d)


def _sync_crcs(store, data):
    """The CRCs the store records for `data` written synchronously under another name."""
    store.write("sync-copy", data)
    return store.records["sync-copy"].chunk_crcs


def test_asynchronous_writes_are_bounded_and_a_rewrite_waits_for_the_first(store, monkeypatch):
    monkeypatch.setattr(ss, "MAX_PENDING_WRITES", 2)
    data = [_bytes(2 * CHUNK, seed=i) for i in range(4)]
    for i, d in enumerate(data):
        store.write(f"t{i}", d, wait=False)
        assert len(store.pending) <= 2
    store.write("t3", data[0], wait=False)  # the same name again: the first write of it is waited for
    assert torch.equal(store.read("t3", torch.uint8, 2 * CHUNK), data[0])
    store.delete("t2")  # waits for it, then removes the file
    assert not store.path("t2").exists() and "t2" not in store.records and "t2" not in store.pending


def test_a_failed_asynchronous_write_is_raised_and_leaves_no_record(store, monkeypatch):
    data = _bytes(3 * CHUNK)
    store.write("t", data)
    real = store.io._write_chunk

    def failing(fd, buf, mv, lo, hi, name):
        if lo == CHUNK:
            raise OSError(5, f"short write of {name} at byte {lo}")
        return real(fd, buf, mv, lo, hi, name)

    monkeypatch.setattr(store.io, "_write_chunk", failing)
    p = store.write("t", data, wait=False)
    with pytest.raises(OSError, match="short write of t at byte"):
        store.flush()
    with pytest.raises(OSError, match="short write of t"):
        p.wait()  # the same error again to whoever waits
    assert "t" not in store.records and not store.pending and store.fds["t"].users == 0
    with pytest.raises(ChecksumError, match="expected 49152 bytes, the store wrote None"):
        store.read("t", torch.uint8, data.numel())


def test_a_corrupted_asynchronous_write_is_named_and_close_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(ss, "CHUNK_BYTES", CHUNK)
    st = SsdStore(tmp_path, warn=lambda m: None)
    data = _bytes(3 * CHUNK)
    st.write("a", data, wait=False)
    st.write("b", data, wait=False)
    st.read("a", torch.uint8, data.numel())
    with open(st.path("a"), "r+b") as f:
        f.seek(2 * CHUNK + 1)
        f.write(bytes([data[2 * CHUNK + 1].item() ^ 0xFF]))
    with pytest.raises(ChecksumError, match=rf"checksum mismatch in tensor a .*bytes {2 * CHUNK}-"):
        st.read("a", torch.uint8, data.numel())
    st.close()  # waits for b
    assert not st.pending and "b" in st.records and os.path.getsize(st.path("b")) == data.numel()


def test_a_deleted_file_is_recycled_for_the_next_new_file_of_its_size(store, monkeypatch):
    allocated = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (allocated.append(n), real(fd, off, n)))
    old, new = _bytes(2 * CHUNK, seed=1), _bytes(2 * CHUNK, seed=2)
    store.write("step1", old)
    inode = os.stat(store.path("step1")).st_ino
    store.delete("step1")
    assert not store.path("step1").exists() and "step1" not in store.records and len(store.spares) == 1
    store.write("step2", new)  # the spare renamed: its blocks are written already, no preallocation
    assert os.stat(store.path("step2")).st_ino == inode and allocated == [2 * CHUNK] and not store.spares
    assert torch.equal(store.read("step2", torch.uint8, new.numel()), new)
    with open(store.path("step2"), "r+b") as f:  # a recycled file is checked like any other
        f.seek(CHUNK + 3)
        f.write(bytes([new[CHUNK + 3].item() ^ 0xFF]))
    with pytest.raises(ChecksumError, match=rf"checksum mismatch in tensor step2 .*bytes {CHUNK}-"):
        store.read("step2", torch.uint8, new.numel())
    store.write("odd", _bytes(CHUNK + 5))  # no spare of its size: a new file
    assert allocated == [2 * CHUNK, CHUNK + ALIGN]


def test_spares_stay_within_the_most_bytes_the_tensors_held_and_close_removes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(ss, "CHUNK_BYTES", CHUNK)
    st = SsdStore(tmp_path, warn=lambda m: None)
    for i in range(3):
        st.write(f"a{i}", _bytes(CHUNK, seed=i))
    for i in range(3):
        st.delete(f"a{i}")
    assert sorted(st.spares.values()) == [CHUNK] * 3 and st.peak_bytes == 3 * CHUNK
    st.write("big", _bytes(2 * CHUNK))  # no spare of its size: spares go until the files fit the peak
    on_disk = sum(os.path.getsize(p) for p in tmp_path.iterdir())
    assert on_disk == 3 * CHUNK and list(st.spares.values()) == [CHUNK]
    st.write("c", _bytes(CHUNK))  # takes the last spare
    assert not st.spares and st.peak_bytes == 3 * CHUNK
    st.delete("c")
    st.close()
    assert [p.name for p in tmp_path.iterdir()] == ["big.bin"]  # spares are scratch: removed at close


def test_without_recycling_a_deleted_file_is_removed(tmp_path):
    st = SsdStore(tmp_path, warn=lambda m: None, recycle=False)
    st.write("t", _bytes(ALIGN))
    st.delete("t")
    assert not st.spares and not list(tmp_path.iterdir())
    st.close()


def test_a_file_deleted_while_read_is_not_recycled(store):
    data = _bytes(2 * CHUNK)
    store.write("t", data)
    f = store._acquire("t", create=False)  # a read in progress on another thread holds it
    store.delete("t")
    assert not store.spares and not store.path("t").exists()
    store.write("u", _bytes(2 * CHUNK, seed=5))  # a new file, not the one being read
    buf = aligned_empty(2 * CHUNK)
    assert os.preadv(f.fd, [memoryview(buf.numpy())], 0) == 2 * CHUNK and torch.equal(buf, data)
    store._release(f)


@pytest.mark.parametrize("wait", [True, False])
def test_a_deleted_directory_is_one_line_at_a_write_and_a_read(tmp_path, wait):
    """The SSD directory deleted under the store: the next write (queued or not) and the next read raise the
    same one-line error naming the directory, and the write leaves no file behind."""
    import shutil

    from tierflow.executor.tiers.ssd_store import SsdFileGone

    root = tmp_path / "run"
    root.mkdir()
    s = SsdStore(root, warn=lambda m: None)
    try:
        data = _bytes(2 * CHUNK)
        s.write("a", data)
        shutil.rmtree(root)
        for op in (lambda: s.write("b", data, wait=wait), lambda: s.read("a", torch.uint8, data.numel())):
            with pytest.raises(SsdFileGone, match=f"directory {root} was deleted during the run") as e:
                op()
            assert len(str(e.value).splitlines()) == 1 and "resume from the last checkpoint" in str(e.value)
        assert not root.exists()
    finally:
        s.close()
