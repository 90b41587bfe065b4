"""--data as text, JSON Lines, Parquet or a directory, tokenized with a Hugging Face tokenizer (a small BPE
trained here with the `tokenizers` library and saved as transformers saves one), packed with end-of-text,
cached beside the data with a manifest (a changed source is tokenized again), prompts masked out of the loss;
one-line errors for a missing tokenizer, an empty file, a missing field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.runs import make_plan, run

from tierflow.executor.corpus import Fields, cache_dir, tokenize
from tierflow.executor.data import DataError, TokenData
from tierflow.executor.options import ModelDataOptions, RunConfig
from tierflow.executor.train_loop import load_data


def test_text_jsonl_parquet_and_a_directory_are_packed_with_end_of_text(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    eos = hf.eos_token_id
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.txt").write_text("def f(x):\n    return x\n")
    lines = [json.dumps({"text": "import os"}), "", json.dumps({"text": "x = 1"})]
    (d / "b.jsonl").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["print(x)"]}), d / "c.parquet")
    tokens, mask, what = tokenize(str(d), tok_dir, Fields(), 256)
    want = []
    for t in ["def f(x):\n    return x\n", "import os", "x = 1", "print(x)"]:
        want += hf(t, add_special_tokens=False)["input_ids"] + [eos]
    assert list(tokens) == want and mask is None
    assert "3 file(s)" in what
    manifest = json.loads((cache_dir(str(d)) / "manifest.json").read_text())
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["a.txt", "b.jsonl", "c.parquet"]
    # a changed source is tokenized again; an unchanged one comes from the cache
    (d / "a.txt").write_text("y = 2\n")
    again, _, _ = tokenize(str(d), tok_dir, Fields(), 256)
    assert list(again[: len(hf("y = 2\n")["input_ids"]) + 1]) == hf("y = 2\n")["input_ids"] + [eos]
    mtime = (cache_dir(str(d)) / "manifest.json").stat().st_mtime_ns
    tokenize(str(d), tok_dir, Fields(), 256)
    assert (cache_dir(str(d)) / "manifest.json").stat().st_mtime_ns == mtime


def test_prompt_tokens_are_masked_out_of_the_loss(tmp_path, tok_dir):
    f = tmp_path / "sft.jsonl"
    rows = [{"q": "what is x?", "a": "x is 1"}, {"q": "and y?", "a": "y is 2"}] * 40
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens, mask, _ = tokenize(str(f), tok_dir, Fields(prompt="q", response="a"), 256)
    data = TokenData(tokens, "sft", mask)
    x, y = data.batch(0, 2, 16)
    assert (y == -100).any() and (y != -100).any()
    # a target is masked exactly where the mask says so
    flat_mask = np.asarray(mask[1:17], dtype=bool)
    assert ((y[0] == -100).numpy() == ~flat_mask).all()
    plan = make_plan("tiny-gpt", "horizontal", "weights_cpu")
    res = run(plan, tmp_path, steps=2, model_data=ModelDataOptions(data=str(f), tokenizer=tok_dir,
                                                                    prompt_field="q", response_field="a"))
    assert all(np.isfinite(res.losses))


def test_one_line_errors(tmp_path, tok_dir):
    opts = RunConfig(steps=1)
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(DataError, match="no text field 'text'.*--text-field"):
        load_data(str(f), opts, 256)  # byte tokens: no tokenizer is needed, the field still is
    with pytest.raises(DataError, match="no text field 'text'.*--text-field"):
        load_data(str(f), RunConfig(steps=1, model_data=ModelDataOptions(tokenizer=tok_dir)), 256)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty file"):
        load_data(str(empty), opts, 256)
    with pytest.raises(DataError, match="empty file"):
        load_data(str(empty), RunConfig(steps=1, model_data=ModelDataOptions(tokenizer=tok_dir)), 256)
    with pytest.raises(DataError, match="no tokenizer there"):
        load_data(str(f), RunConfig(steps=1, model_data=ModelDataOptions(tokenizer=str(tmp_path))), 256)
