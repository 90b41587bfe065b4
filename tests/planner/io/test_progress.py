"""The one progress helper (tierflow.planner.io.progress): a bar on a terminal; off one, lines at a bounded
rate with the first and the last step always printed, so a long command is never silent in a pipe."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tierflow.logs import logger
from tierflow.planner.io.progress import Progress


@pytest.fixture(autouse=True)
def library_level():
    """As a library uses tierflow (no command set the logger's level): a command run by an earlier test
    leaves its level behind, which would silence the pipe lines."""
    log = logger()
    level = log.level
    log.setLevel(0)
    yield
    log.setLevel(level)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("step_s", [0.01, 0.7, 3.0, 12.0])
def test_pipe_lines_are_bounded_and_the_last_is_printed(step_s):
    clock, out = FakeClock(), io.StringIO()
    n = 200
    p = Progress(n, "work", stream=out, clock=clock)
    for k in range(n):
        clock.now_s += step_s
        p.step(f"item {k}")
    p.finish()
    lines = out.getvalue().splitlines()
    total_s = n * step_s
    assert len(lines) <= 1 + total_s / 5.0 + 1  # the first, at most one per 5 s, the last
    assert lines[0].startswith("work [") and "1/200 item 0" in lines[0]
    assert "200/200 item 199" in lines[-1] and lines[-1].startswith("work [####################]")
    if step_s >= 5.0:
        assert len(lines) == n  # slow steps: every one has its line
    assert "\r" not in out.getvalue()


def test_pipe_is_never_silent_for_more_than_the_interval():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(1000, "long", stream=out, clock=clock)
    printed_at = []
    for _ in range(999):
        clock.now_s += 0.3
        before = out.getvalue().count("\n")
        p.step()
        if out.getvalue().count("\n") > before:
            printed_at.append(clock.now_s)
    gaps = [b - a for a, b in zip(printed_at, printed_at[1:])]
    assert gaps and all(5.0 <= g < 5.0 + 0.3 + 1e-9 for g in gaps)
    p.finish()  # the held-back step 999/1000 comes out at the end
    assert out.getvalue().splitlines()[-1].startswith("long [") \
        and " 999/1000 " in out.getvalue().splitlines()[-1]


def test_finish_with_a_message_and_clear():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(5, "study", stream=out, clock=clock)
    p.step("a")
    clock.now_s += 1
    p.step("b")  # held back: within 5 s of the first line
    p.finish("done in 2 s")
    assert out.getvalue().splitlines() == ["study [####----------------] 1/5 a 0s",
                                           "study [####################] 5/5 done in 2 s 1s"]
    out2 = io.StringIO()
    q = Progress(3, "calibrate", stream=out2, clock=clock)
    q.step("x")
    q.step("y")
    q.message("warning: slow disk")  # the held-back step first, then the message
    q.clear()
    assert out2.getvalue().splitlines() == ["calibrate [######--------------] 1/3 x 0s",
                                            "calibrate [#############-------] 2/3 y 0s", "warning: slow disk"]


def test_update_sets_count_and_total():
    out = io.StringIO()
    p = Progress(1, "planning", stream=out, interval_s=0.0)
    p.update(3, 10, "candidate 3")
    p.update(10, 10, "done")
    p.step("extra")  # more steps than announced: the total grows with them
    assert [line.split()[2] for line in out.getvalue().splitlines()] == ["3/10", "10/10", "11/11"]


def test_terminal_bar_is_rewritten_in_place():
    out = Terminal()
    p = Progress(4, "simulating", stream=out)
    assert p.tty
    p.step("horizontal")
    p.step("v")
    assert "\n" not in out.getvalue() and out.getvalue().count("\r") == 2
    # the shorter line is padded over the longer one it replaces
    first, second = out.getvalue().split("\r")[1:]
    assert len(second) >= len(first)
    p.finish()
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1
    out2 = Terminal()
    q = Progress(2, "calibrate", stream=out2)
    q.step("CPU memory bandwidth")
    q.message("warn")
    q.step("CPU AdamW")
    q.clear()
    text = out2.getvalue()
    last = "calibrate [####################] 2/2 CPU AdamW 0s"
    # erased at the end
    assert "\rwarn\n" in text and text.endswith("\r" + last + "\r" + " " * len(last) + "\r")


def test_disabled_shows_no_progress_but_messages():
    out = io.StringIO()
    p = Progress(0, "calibrate", stream=out, enabled=False)
    p.step("a")
    p.message("note")
    p.finish("done")
    assert out.getvalue() == "note\n"


def test_cli_prints_progress_lines_into_a_pipe_only_when_verbose():
    quiet_pipe = subprocess.run([sys.executable, "-m", "tierflow.cli", "capacity", "--hw", "rtx3090-desktop"],
                                capture_output=True, text=True, timeout=300)
    assert quiet_pipe.returncode == 0 and quiet_pipe.stderr == "", quiet_pipe.stderr  # no terminal: no bars
    p = subprocess.run([sys.executable, "-m", "tierflow.cli", "capacity", "--hw", "rtx3090-desktop", "-v"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("capacity [")]
    assert lines and all(line.startswith("capacity [") for line in lines)
    assert lines[0].split()[2] == "1/4" and lines[-1].split()[2] == "4/4"
    assert "capacity [" not in p.stdout


# ---- --quiet / --verbose (tierflow.logs): one level on the `tierflow` logger --------------------

CAPACITY = ["capacity", "--hw", "rtx3090-desktop"]
SIMULATE = ["simulate", "--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--batch", "8",
            "--micro-batch", "2"]
PLAN = ["plan", "--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--batch", "4", "--time-limit", "5",
        "--no-window", "--no-baselines"]


@pytest.fixture
def tierflow_level():
    """Restore the `tierflow` logger's level after a test sets it (cli.main sets it in this process)."""
    from tierflow.logs import logger

    level = logger().level
    yield
    logger().setLevel(level)


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from tierflow.cli import main

    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_quiet_suppresses_progress_but_not_the_result(capsys, tierflow_level):
    rc, normal_out, normal_err = _main(capsys, *SIMULATE, "-v")  # off a terminal, progress needs -v
    assert rc == 0 and "simulating [" in normal_err
    for argv in (["--quiet", *SIMULATE], [*SIMULATE, "-q"]):  # before or after the subcommand
        rc, out, err = _main(capsys, *argv)
        assert rc == 0 and err == "", argv
        assert out == normal_out and "tokens/s" in out
    # its progress lines: test_cli_prints_progress_lines_into_a_pipe_only_when_verbose
    rc, out, err = _main(capsys, *CAPACITY, "--quiet")
    assert rc == 0 and err == "" and "largest model" in out


def test_verbose_shows_the_solver_status_of_every_candidate(capsys, tierflow_level):
    rc, normal_out, normal_err = _main(capsys, *PLAN)
    assert rc == 0 and "planning [" not in normal_err  # not a terminal: no progress without -v
    assert not any(line.startswith("candidate ") for line in normal_err.splitlines())
    for argv in (["-v", *PLAN], [*PLAN, "--verbose"]):
        rc, out, err = _main(capsys, *argv)
        assert rc == 0, (argv, err[-500:])
        debug = [line for line in err.splitlines() if line.startswith("candidate ")]
        assert debug and all(": CP-SAT " in line or "pruned" in line or "skipped" in line for line in debug)
        assert any("OPTIMAL" in line and "verified" in line for line in debug)
        assert "planning [" in err  # verbose keeps the progress display
        assert out.splitlines()[:2] == normal_out.splitlines()[:2]


def test_quiet_and_verbose_together_are_refused(capsys, tierflow_level):
    rc, out, err = _main(capsys, "-q", *PLAN, "-v")
    assert rc == 2 and out == "" \
        and err.splitlines() == ["tierflow: error: --quiet and --verbose: give one of them"]
    with pytest.raises(SystemExit) as e:  # both before the subcommand: argparse's own refusal
        _main(capsys, "-q", "-v", "models")
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_progress_follows_the_logger_level(tierflow_level):
    from tierflow.logs import NORMAL, QUIET, VERBOSE, configure, logger

    logger().setLevel(0)  # NOTSET: tierflow used as a library, nobody configured it: progress as before
    out = io.StringIO()
    Progress(2, "lib", stream=out, interval_s=0).step("a")
    assert out.getvalue().startswith("lib [")
    for level, shown in ((QUIET, False), (NORMAL, False), (VERBOSE, True)):  # off a terminal: -v only
        configure(level)
        out = io.StringIO()
        p = Progress(2, "work", stream=out, interval_s=0)
        p.step("a")
        p.message("a warning")
        p.finish("done")
        assert ("work [" in out.getvalue()) == shown, level
        assert "a warning" in out.getvalue()  # messages are not progress: always shown
    assert Progress(2, "forced", stream=io.StringIO(), enabled=True).lines  # an explicit choice wins


def test_experiment_scripts_take_quiet_and_verbose(tierflow_level, monkeypatch):
    from pathlib import Path

    from tierflow.logs import NORMAL, QUIET, VERBOSE, logger

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "experiments"))
    import expcommon

    for argv, level in (([], NORMAL), (["-q"], QUIET), (["--verbose"], VERBOSE)):
        args = expcommon.arg_parser("a study\nmore").parse_args(["--quick", *argv])
        assert args.quick and logger().level == level
    out = io.StringIO()
    expcommon.arg_parser("a study").parse_args(["--quiet"])
    expcommon.Progress(3, "study", stream=out, interval_s=0).step("x")
    assert out.getvalue() == ""


def test_run_quiet_prints_nothing(tmp_path, capsys, tierflow_level):
    pytest.importorskip("torch")
    plan = tmp_path / "plan.json"
    rc, _, err = _main(capsys, "simulate", "--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--schedule",
                       "vertical", "--batch", "2", "--micro-batch", "1", "--iterations", "1", "--write-plan",
                       str(plan), "-q")
    assert rc == 0 and err == "", err
    rc, out, err = _main(capsys, "-q", "run", str(plan), "--steps", "1", "--device", "cpu", "--out",
                         str(tmp_path / "run"))
    assert rc == 0 and out == "" and err == "", err
    assert (tmp_path / "run" / "steps.csv").read_text().count("\n") == 2  # the work was done: header + 1 step
    rc, out, _ = _main(capsys, "run", str(plan), "--steps", "1", "--device", "cpu")
    assert rc == 0 and "step     1/1 [####################] loss" in out  # the bar from progress.bar
