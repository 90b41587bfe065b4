"""Every input streamed within a stated bound, a MemoryError anywhere one line, and text data the same
whatever its shape (a file, a directory, JSON Lines: byte tokens when no tokenizer is given).

The hostile files are read in a child process whose address space is limited (RLIMIT_AS) to what it maps
once its modules are imported plus a small headroom: the child measures its own address space after the
imports and sets the limit itself, so the headroom is what reading the input may cost, whatever the
interpreter and its libraries map. The files are small (a few MiB, sparse where they are padding) and the
bounds scaled to them (TIERFLOW_TEXT_PIECE_BYTES), so that each case takes seconds on a busy 2-core box and
still fails on a reader that holds its input whole.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tierflow.cli import main

TINY = ["--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--schedule", "vertical", "--batch", "4",
        "--micro-batch", "2"]

CHILD = r"""
import os, resource, sys
for m in os.environ["PRELOAD"].split(","):
    __import__(m)
exec(os.environ.get("BEFORE_LIMIT", ""))
mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (mapped + int(os.environ["HEADROOM_MIB"]) * 2**20, hard))
exec(os.environ["WORK"])
"""


def limited(work: str, headroom_mib: int, preload: str, before: str = "", **env: str):
    """Run `work` (Python) in a child limited to its address space after importing `preload` (and running
    `before`) + `headroom_mib`; (returncode, stdout, stderr)."""
    full = {**os.environ, "PRELOAD": preload, "WORK": work, "BEFORE_LIMIT": before,
            "HEADROOM_MIB": str(headroom_mib), "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", **env}
    p = subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


CLI = "from tierflow.cli import main; sys.exit(main(sys.argv[1:] or os.environ['ARGV'].split('\\x1f')))"


def cli_limited(argv: list[str], headroom_mib: int, preload: str = "numpy,tierflow.cli,tierflow.planner"):
    return limited(CLI, headroom_mib, preload, ARGV="\x1f".join(argv))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["simulate", *TINY, "--write-plan", str(f)]) == 0
    return f


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> str:
    """A small byte-level BPE saved as transformers saves one (as tests/executor/test_corpus.py's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(json.__file__).read_text(), Path(os.__file__).read_text()[:20000]]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=250, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    return str(d)


# ---------------------------------------------------------------------------------------------------------
# Text data: streamed in pieces into the cache (executor/corpus.py)
# ---------------------------------------------------------------------------------------------------------

DATA_WORK = r"""
import json
from tierflow.executor.data import DataError
from tierflow.executor.options import ModelDataOptions, RunConfig
from tierflow.executor.train_loop import load_data
for path, tok, line_mib in json.loads(os.environ["CASES"]):
    opts = RunConfig(steps=1, model_data=ModelDataOptions(tokenizer=tok, max_line_mib=line_mib,
                                                          cache_dir=os.environ["CACHE"]))
    try:
        data = load_data(path, opts, 50304)
        print("ok", len(data.tokens), flush=True)
    except DataError as e:
        print("refused", e, flush=True)
"""
DATA_PRELOAD = "numpy,torch,tierflow.executor.train_loop,tierflow.executor.corpus"
# the tokenizer's libraries mapped before the limit (their import is not the input's cost)
LOAD_TOKENIZER = "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(os.environ['TOK'])"


def test_text_with_a_tokenizer_is_tokenized_in_pieces_under_an_address_space_limit(tmp_path, bpe_dir):
    """The issue's cases, scaled down: ordinary short lines, and NUL bytes, in one .txt with a tokenizer, read
    whole by `read_text` before (a MemoryError traceback under the limit); now a piece at a time."""
    lines = tmp_path / "corpus.txt"
    lines.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * (2**20 // 44))
    nul = tmp_path / "nul.txt"
    with open(nul, "wb") as f:
        f.truncate(2**18)  # sparse: NUL bytes
    cases = [[str(lines), bpe_dir, 64], [str(nul), bpe_dir, 64]]
    rc, out, err = limited(DATA_WORK, 48, DATA_PRELOAD, LOAD_TOKENIZER, TOK=bpe_dir, CASES=json.dumps(cases),
                           CACHE=str(tmp_path / "cache"), TIERFLOW_TEXT_PIECE_BYTES=str(16 * 1024))
    assert rc == 0, err[-3000:]
    got = out.split("\n")
    assert got[0].startswith("ok ") and int(got[0].split()[1]) > 2**20 // 44 * 9, out
    assert got[1].startswith("ok ") and int(got[1].split()[1]) >= 2**18 // 512, out


def test_a_long_json_lines_line_is_refused_where_the_raised_limit_cannot_hold_it(tmp_path, bpe_dir):
    """--max-line-mib 4096 let a 2 GiB line through to a MemoryError; now the limit is refused up front when
    such a line (at most the file) could not be parsed in the memory left, and short lines stream; a token
    file larger than the address space left is read a window at a time."""
    long = tmp_path / "long.jsonl"
    with open(long, "w") as f:
        f.write('{"text": "')
        f.write("a" * (40 * 2**20))
        f.write('"}\n')
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": f"row {i} of many"}) + "\n" for i in range(20000)))
    tokens = tmp_path / "tokens.bin"  # a uint16 token file of 8 times the headroom (sparse): read a window at
    with open(tokens, "wb") as f:  # a time, not mapped whole
        f.truncate(512 * 2**20)
    cases = [[str(long), bpe_dir, 4096], [str(short), None, 4096], [str(tokens), None, 64]]
    rc, out, err = limited(DATA_WORK, 64, DATA_PRELOAD, LOAD_TOKENIZER, TOK=bpe_dir, CASES=json.dumps(cases),
                           CACHE=str(tmp_path / "c"))
    assert rc == 0, err[-3000:]
    first, second, third = out.split("\n")[:3]
    assert third == f"ok {256 * 2**20}", out
    assert first.startswith("refused") and "--max-line-mib 4096" in first, out
    assert "address-space limit" in first, out
    assert second.startswith("ok ") and int(second.split()[1]) > 20000 * 14, out


def test_text_pieces_give_the_tokens_of_the_whole_text(tmp_path, bpe_dir, monkeypatch):
    """A text tokenized in pieces cut after a line end that a non-space follows has the tokens of the whole
    text (the pre-tokenizer splits there too)."""
    import tierflow.executor.corpus as corpus

    enc = corpus.load_tokenizer(bpe_dir, "x")
    data = Path(os.__file__).read_bytes()[:40000]
    f = tmp_path / "os.txt"
    f.write_bytes(data)
    whole = enc.encode_raw(data)
    for piece in (997, 4096):
        monkeypatch.setattr(corpus, "PIECE_BYTES", piece)
        pieces = list(corpus._text_pieces(f))
        assert max(len(p) for p in pieces) <= piece and b"".join(pieces) == data
        assert np.array_equal(np.concatenate([enc.encode_raw(p) for p in pieces]), whole)
    text = "é" * 5000  # no line end: cut at characters' boundaries
    monkeypatch.setattr(corpus, "PIECE_BYTES", 333)
    f.write_text(text)
    assert b"".join(corpus._text_pieces(f)).decode() == text
    assert all(p.decode() for p in corpus._text_pieces(f))  # every piece whole characters


# ---------------------------------------------------------------------------------------------------------
# Text data the same whatever its shape
# ---------------------------------------------------------------------------------------------------------

def test_text_as_a_file_a_directory_or_json_lines_trains_on_byte_tokens_without_a_tokenizer(tmp_path, capsys):
    from tierflow.executor.corpus import BYTE_EOS
    from tierflow.executor.options import RunConfig
    from tierflow.executor.train_loop import load_data

    docs = ["def f(x):\n    return x\n", "héllo wörld\n" * 40, "print(1)\n" * 30]
    d = tmp_path / "texts"
    d.mkdir()
    for i, t in enumerate(docs):
        (d / f"{i}.txt").write_text(t)
    jl = tmp_path / "texts.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    opts = RunConfig(steps=1)
    want = b"".join(t.encode() + bytes([BYTE_EOS]) for t in docs)
    for path in (d, jl):
        data = load_data(str(path), opts, 256)
        assert bytes(np.asarray(data.tokens)) == want
        err = capsys.readouterr().err
        assert f"--data {path}: no tokenizer given" in err and "byte tokens" in err
    one = load_data(str(d / "1.txt"), opts, 256)  # one file: its bytes, as before
    assert bytes(np.asarray(one.tokens)) == docs[1].encode()


def test_run_trains_on_a_directory_of_text_without_a_tokenizer(tmp_path, plan_file, capsys):
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.md").write_text(f"document {i}: " + "some words of text\n" * 200)
    rc = main(["run", str(plan_file), "--device", "cpu", "--steps", "1", "--data", str(d), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "byte tokens" in err and "needs the model's tokenizer" not in err
    assert np.isfinite(json.loads(out)["steps"][0]["loss"])


def test_a_random_tokenizer_model_is_one_line_naming_the_cause(tmp_path, capsys, plan_file):
    d = tmp_path / "tok"
    d.mkdir()
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    noise[0] = 0x17  # not a protobuf's first field
    (d / "tokenizer.model").write_bytes(noise.tobytes())
    data = tmp_path / "x.txt"
    data.write_text("hello\n" * 100)
    rc = main(["run", str(plan_file), "--device", "cpu", "--steps", "1", "--data", str(data), "--tokenizer",
               str(d)])
    line = one_line(capsys.readouterr().err)
    assert rc == 2 and "tokenizer.model is neither a SentencePiece model" in line, line
    assert "tiktoken" in line and "pip install tiktoken" not in line


# ---------------------------------------------------------------------------------------------------------
# Traces and plans (planner/io/tracestream.py, planner/core/jsonio.py)
# ---------------------------------------------------------------------------------------------------------

def _trace_events(plan_file: Path) -> list[str]:
    ops = len(json.loads(plan_file.read_text())["ops"])
    return [json.dumps({"name": f"op{i}", "ph": "X", "ts": 10.0 * i, "dur": 5.0, "pid": 1, "tid": 0,
                        "args": {"id": i}}) for i in range(ops)]


def _padded_trace(path: Path, plan_file: Path, pad_bytes: int) -> None:
    """A valid trace of the plan's ops with `pad_bytes` of white space among its events, gzip-compressed:
    small on disk, large once decompressed (the issue's 9 MB gzip of 2000 MiB, scaled down)."""
    events = _trace_events(plan_file)
    half = len(events) // 2
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(('{"traceEvents": [' + ", ".join(events[:half]) + ",").encode())
        block = b" " * 2**20
        for _ in range(pad_bytes // len(block)):
            f.write(block)
        tail = '], "otherData": {"measured_device_memory": {"gpu": 7}}}'
        f.write((", ".join(events[half:]) + tail).encode())


def test_a_large_gzip_trace_streams_under_an_address_space_limit(tmp_path, plan_file):
    """fit --trace and compare held the decompressed text and its parse (a MemoryError traceback in
    jsonio.read_text); now the trace is read an event at a time."""
    trace = tmp_path / "trace.json.gz"
    _padded_trace(trace, plan_file, 96 * 2**20)  # decompressed: twice the headroom
    rc, out, err = cli_limited(["compare", str(plan_file), str(trace)], 48)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    rc, out, err = cli_limited(["fit", "--trace", str(trace), "--plan", str(plan_file), "--hw",
                                "rtx3090-desktop"], 48,  # numba's compiler (llvmlite) mapped first
                               "numpy,tierflow.cli,tierflow.planner,tierflow.planner.fit.trace_fit,llvmlite.binding")
    assert rc == 0 and "Traceback" not in err, err[-3000:]


def test_trace_stream_reads_what_json_reads(tmp_path, plan_file):
    from tierflow.planner.io.compare import load_measured_trace

    events = _trace_events(plan_file)
    plain = tmp_path / "t.json"
    plain.write_text(json.dumps({"traceEvents": [json.loads(e) for e in events],
                                 "otherData": {"measured_device_memory": {"gpu": 5}}}, indent=1))
    start, end, meta = load_measured_trace(plain, len(events))
    assert start[3] == pytest.approx(30e-6) and end[3] == pytest.approx(35e-6)
    assert meta["device_memory"] == {"gpu": 5}
    for bad, needle in (('{"traceEvents": [1, 2', "found the end of the file"),
                        ('{"traceEvents": [{"ph": "X", "args": {"id"', "not JSON"),
                        ('[{"ph": "X"}]', "expected '{'"),
                        ('{"traceEvents": [], "x": "' + "a" * (5 * 2**20) + '"}', "longer than 4 MiB"),
                        ('{"otherData": {}}', "no traceEvents list")):
        plain.write_text(bad)
        with pytest.raises(ValueError, match=needle):
            load_measured_trace(plain, len(events))


def test_a_plan_whose_parse_could_not_fit_is_refused_before_it_is_inflated(tmp_path):
    """A small gzip whose JSON would parse to more than the memory left: refused in one line before the
    text is held (json.loads of it was a MemoryError traceback)."""
    bomb = tmp_path / "p.json.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as f:
        f.write(b'{"pad": [')
        f.write(b"{}," * (16 * 2**20))
        f.write(b"{}]}")
    rc, out, err = cli_limited(["simulate", "--plan", str(bomb)], 256)
    line = one_line(err)
    assert rc == 2 and "parsed as JSON needs up to" in line and "address-space limit" in line, line


def test_the_json_parse_bound_holds_for_hostile_shapes():
    """json_parse_bound_bytes is above what json.loads takes (tracemalloc's peak) for the costliest shapes."""
    from tierflow.hwprofiles.inputs import json_parse_bound_bytes

    n = 200_000
    nest = '{"":' * 30 + "0" + "}" * 30
    shapes = ["[" + ",".join(["{}"] * n) + "]", "[" + ",".join(["[]"] * n) + "]",
              "[" + ",".join(["[1]"] * n) + "]", "[" + ",".join([nest] * (n // 30)) + "]",
              "{" + ",".join(f'"{i}":{{}}' for i in range(n)) + "}",
              "[" + ",".join(f'"{i % 100:02d}"' for i in range(n)) + "]",
              "[" + ",".join(["1.5"] * n) + "]"]
    for text in shapes:
        tracemalloc.start()
        try:
            value = json.loads(text)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        del value
        assert peak < json_parse_bound_bytes(len(text), text.count("{"), text.count("[")), text[:20]


# ---------------------------------------------------------------------------------------------------------
# A MemoryError anywhere is one line
# ---------------------------------------------------------------------------------------------------------

def test_a_memory_error_while_reading_names_the_input_and_its_bound():
    from tierflow.hwprofiles.inputs import InputMemoryError, reading

    want = r"--data x.txt: ran out of memory while reading it \(its bound: 1 MiB at a time\)"
    with pytest.raises(InputMemoryError, match=want):
        with reading("--data x.txt", "1 MiB at a time"):
            raise MemoryError


def test_a_memory_error_anywhere_is_one_line_with_exit_code_3(monkeypatch, capsys):
    import tierflow.cli.simulate as simulate

    def boom(args):
        raise MemoryError

    monkeypatch.setattr(simulate, "run", boom)
    rc = main(["simulate", *TINY])
    line = one_line(capsys.readouterr().err)
    assert rc == 3 and line.startswith("tierflow: out of memory: ran out of memory"), line


def test_a_deepspeed_config_for_training_is_read_bounded():
    """run --ds-config's training sections were read with read_text: /dev/zero grew to a MemoryError."""
    work = ("from tierflow.planner.io.deepspeed.train import DsTrainError, ds_training_settings\n"
            "try:\n    ds_training_settings('/dev/zero')\nexcept DsTrainError as e:\n    print(e)\n")
    rc, out, err = limited(work, 64, "numpy,tierflow.planner.io.deepspeed.train")
    assert rc == 0, err[-2000:]
    assert "--ds-config /dev/zero: cannot read it as JSON (is not a regular file" in out, out
