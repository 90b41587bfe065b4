"""Evaluation (executor/evaluate.py) counts what it evaluates, says before the run when the held-out set holds
fewer sequences than the evaluation asks for, never repeats a held-out token, and refuses a held-out set
shorter than one sequence."""

from __future__ import annotations

import re

import pytest
import torch
from support.runs import make_plan, run

from tierflow.cli import main
from tierflow.executor.data import DataError, TokenData
from tierflow.executor.evaluate import check_held_out, held_out_sequences
from tierflow.executor.models import BlockModel, build_blocks
from tierflow.executor.models import loss as lm_loss
from tierflow.executor.options import EvalOptions, OptimizerOptions
from tierflow.planner.core.models import get_model
from tierflow.planner.io.planfile import write_plan

SEQ = 64  # tiny-gpt's


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    path = d / "plan.json"
    write_plan(make_plan("tiny-gpt", "vertical", "mix", 0.25, batch=2, micro=1), path)
    return path


def test_the_eval_line_counts_the_held_out_tokens_it_evaluated_and_the_run_says_it_holds_fewer(
        tiny_plan, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_bytes(bytes(range(32, 127)) * 63)  # 5,985 byte tokens: 5% held out is 299, 4 sequences of 64
    held = round(5985 * 0.05)  # the tail --val-fraction holds out: 299 tokens
    capsys.readouterr()
    rc = main(["run", str(tiny_plan), "--device", "cpu", "--steps", "2", "--data", str(text),
               "--data-format", "text", "--val-fraction", "0.05", "--eval-every", "2", "--eval-batches", "4",
               "--ssd-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    notes = [x for x in err.splitlines() if "--eval-batches 4" in x]
    assert len(notes) == 1, err
    assert "holds 4 sequences of 64 tokens, fewer than the 4 x 2 = 8 asked for" in notes[0]
    line = next(x for x in out.splitlines() if "eval after step 2" in x)
    tokens = int(re.search(r"\(([\d,]+) held-out tokens", line).group(1).replace(",", ""))
    assert tokens == 4 * SEQ <= held, line  # the 299 held-out tokens hold 4 windows: none counted twice
    assert "4 sequences of 64" in line


def test_a_held_out_set_shorter_than_a_sequence_is_refused_before_training(tiny_plan, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_bytes(b"x" * 1000)  # 1% held out: 10 tokens
    rc = main(["run", str(tiny_plan), "--device", "cpu", "--steps", "2", "--data", str(text),
               "--data-format", "text", "--val-fraction", "0.01", "--eval-every", "1",
               "--ssd-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "10 tokens, shorter than one sequence of 64 + 1" in err[0], err
    assert not (tmp_path / "out").exists()


def test_check_held_out_counts_windows_that_share_only_their_boundary():
    val = TokenData(torch.arange(4 * SEQ + 1).numpy(), "v")
    assert held_out_sequences(val, SEQ) == 4
    assert check_held_out(val, SEQ, 2, 2) is None
    assert "holds 4 sequences" in check_held_out(val, SEQ, 2, 3)
    with pytest.raises(DataError):
        check_held_out(TokenData(torch.arange(SEQ).numpy(), "v"), SEQ, 2, 1)


def test_the_validation_loss_is_the_plain_forwards_over_the_distinct_held_out_sequences(tiny_plan, tmp_path):
    """Asked for more than the held-out set holds, the loss is the mean over the sequences it holds, each
    once (not wrapped around)."""
    from tierflow.planner.io.planfile import load_plan

    res = run(load_plan(tiny_plan), tmp_path, optimizer=OptimizerOptions(), steps=2,
              evaluation=EvalOptions(every=2, val_fraction=0.005, batches=8))
    model = get_model("tiny-gpt")
    _, val = TokenData.load(None, model.vocab_size, seed=0).split(0.005)  # 328 tokens: 5 windows
    n = held_out_sequences(val, SEQ)
    assert n == 5 < 8 * 2
    ref = BlockModel(model, build_blocks(model))
    for block, w in zip(ref.blocks, res.final_master):
        torch.nn.utils.vector_to_parameters(w, block.parameters())
    x, y = val.batch(0, n, SEQ)
    with torch.no_grad():
        want = float(lm_loss(ref(x), y))
    assert res.records[-1].val_loss == pytest.approx(want, rel=1e-5)
