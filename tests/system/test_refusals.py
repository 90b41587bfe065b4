"""Refusals that name their cause: a checkpoint resumed under another optimizer-state format names both
formats and how to go on; --accept-states without --optimizer-states auto is refused; a trace measured under
one format is not fitted (nor compared) to a plan of another; a token cache that cannot be written leaves no
directory behind. Real runs of tiny-gpt on the CPU."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from support.runs import make_plan

from tierflow.cli import main
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.io.planfile import plan_from_graph, write_plan


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _in_format(plan, states: str):
    """`plan` with its model's optimizer states in `states` (the same schedule, rebuilt)."""
    model = get_model(plan.model.name).with_optimizer_states(states)
    return plan_from_graph(model, plan.hardware, plan.config, build_graph(model, plan.hardware, plan.config))


@pytest.fixture(scope="module")
def two_formats(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("formats")
    fp32 = make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1)
    out = {"fp32": d / "fp32.json", "8bit": d / "8bit.json"}
    write_plan(fp32, out["fp32"])
    write_plan(_in_format(fp32, "8bit"), out["8bit"])
    return out


def test_resume_under_another_state_format_names_both_and_how_to_go_on(two_formats, tmp_path, capsys):
    ck = tmp_path / "ck"
    base = ["--device", "cpu", "--checkpoint-dir", str(ck)]
    assert main(["run", str(two_formats["fp32"]), "--steps", "1", *base]) == 0
    capsys.readouterr()
    assert main(["run", str(two_formats["8bit"]), "--steps", "2", *base]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "holds the optimizer states in fp32, but this plan keeps them in 8bit" in line
    assert "--optimizer-states fp32" in line and "--export-hf DIR" in line and "--init DIR" in line
    assert "another training" not in line


def test_accept_states_without_auto_is_refused(capsys):
    for extra in ([], ["--optimizer-states", "8bit"]):
        assert main(["plan", "--model", "tiny-gpt", "--accept-states", "fp32,8bit", *extra]) == 2
        line = _one_line(capsys.readouterr().err)
        assert "--accept-states fp32,8bit" in line and "has no effect" in line
        assert "--optimizer-states auto" in line


def test_a_trace_of_one_format_is_not_fitted_to_a_plan_of_another(two_formats, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(two_formats["fp32"]), "--device", "cpu", "--steps", "2", "--out", str(out)]) == 0
    trace = out / "trace.json"
    assert json.loads(trace.read_text())["otherData"]["optimizer_states"] == "fp32"
    capsys.readouterr()
    assert main(["fit", "--trace", str(trace), "--plan", str(two_formats["fp32"])]) == 0  # its own: fitted
    capsys.readouterr()
    for cmd in (["fit", "--trace", str(trace), "--plan", str(two_formats["8bit"])],
                ["compare", str(two_formats["8bit"]), str(trace)]):
        assert main(cmd) == 2, cmd
        line = _one_line(capsys.readouterr().err)
        assert "a trace of a run with fp32 optimizer states, but the plan keeps them in 8bit" in line, cmd


def test_a_token_cache_that_fills_the_disk_leaves_no_directory(tmp_path, tok_dir, capsys,
                                                              monkeypatch):
    data = tmp_path / "corpus.txt"
    data.write_text("a few short lines of text\n" * 200)
    plan = tmp_path / "plan.json"
    write_plan(make_plan("tiny-gpt", "vertical", "weights_cpu", iterations=1), plan)
    real = Path.write_bytes

    def full(self, data):
        if ".tierflow" in str(self) or "cache" in str(self):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    cache = tmp_path / "cache"
    rc = main(["run", str(plan), "--device", "cpu", "--steps", "1", "--data", str(data), "--tokenizer",
               tok_dir, "--cache-dir", str(cache)])
    assert rc == 2
    line = _one_line(capsys.readouterr().err)
    assert "No space left on device" in line and "--cache-dir" in line
    assert not cache.exists()
