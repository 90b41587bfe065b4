"""The one mapping of errors to exit codes (tierflow/cli/exits.py): each kind of error's code and its one
line, as every command (and `tierflow run` before a rank ends) says it."""

from __future__ import annotations

import pytest

from tierflow.cli.exits import exit_code
from tierflow.errors import DoesNotFit, TierflowError, UsageError


class _Whole(TierflowError):
    prefix = ""  # the message says it
    exit_code = 1


class _Agreed(TierflowError):
    agreed = True


class _Stop(Exception):  # noqa: N818 - a stop with its own code, as the executor's RunStopped
    exit_code = 143
    agreed = True


def said(capsys, e: BaseException, who: str = "tierflow") -> tuple[int, str]:
    code = exit_code(e, who)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("error", "code", "line"), [
    (UsageError("--steps 0: must be >= 1"), 2, "tierflow run: error: --steps 0: must be >= 1\n"),
    (DoesNotFit("gpu over by 3 GB"), 3, "tierflow run: does not fit: gpu over by 3 GB\n"),
    (_Whole("gpu out of memory in op 3"), 1, "tierflow run: gpu out of memory in op 3\n"),
    (_Stop("interrupted by SIGTERM"), 143, "tierflow run: interrupted by SIGTERM\n"),
    (ValueError("bad"), 2, "tierflow run: error: bad\n"),
    (FileNotFoundError("no such file"), 2, "tierflow run: error: no such file\n"),
    (KeyboardInterrupt(), 130, "tierflow run: interrupted\n"),
])
def test_each_error_has_its_code_and_one_line(capsys, error, code, line):
    assert said(capsys, error, "tierflow run") == (code, line)


def test_an_error_that_names_its_rank_is_said_with_it(capsys):
    e = _Whole("rank 1 (pid 7) died; this rank stopped")
    e.rank = 0
    line = "tierflow run [rank 0]: rank 1 (pid 7) died; this rank stopped\n"
    assert said(capsys, e, "tierflow run")[1] == line


def test_an_agreed_error_is_said_by_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert said(capsys, _Agreed("plan is for 2 ranks")) == (2, "")
    assert said(capsys, _Stop("stopped")) == (143, "")
    assert said(capsys, UsageError("this rank's own")) == (2, "tierflow: error: this rank's own\n")
    monkeypatch.setenv("RANK", "0")
    assert said(capsys, _Agreed("plan is for 2 ranks")) == (2, "tierflow: error: plan is for 2 ranks\n")


def test_a_bug_is_not_mapped():
    with pytest.raises(KeyError):
        exit_code(KeyError("a bug"))
