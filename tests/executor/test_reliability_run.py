"""Reliability of `tierflow run`, the run-time side: divergence stops with exit 4 and keeps the last good
checkpoint and the results so far; checkpoints carry checksums, settings and locks, resume falls back when
asked, a full disk leaves nothing behind; SIGINT / SIGTERM stop every worker and remove the SSD directory, and
a later run removes what a killed one left. Real runs of tiny-gpt on the CPU with real files."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from support.runs import make_plan

from tierflow.cli import main
from tierflow.executor import checkpoint
from tierflow.executor.checkpoint import file_crc32, read_manifest, verify_file, write_safetensors
from tierflow.executor.dist import DistWorld
from tierflow.executor.run import CheckpointOptions, OptimizerOptions, RunConfig, RunError, run_plan
from tierflow.executor.tiers.dirlock import LOCK_NAME, DirLock
from tierflow.executor.tiers.state import TrainState
from tierflow.planner.io.planfile import write_plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """one: a step per round, optimizer states on the SSD; three: three steps per round (the brief's
    `tiny`)."""
    d = tmp_path_factory.mktemp("plans")
    out = {"one": d / "one.json", "three": d / "three.json"}
    write_plan(make_plan("tiny-gpt", "vertical", "states_ssd", 0.25, iterations=1), out["one"])
    write_plan(make_plan("tiny-gpt", "vertical", "states_ssd", 0.25, iterations=3), out["three"])
    return out


def tierflow_run(capsys, plan: Path, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    ssd = tmp_path / "ssd"
    ssd.mkdir(exist_ok=True)
    capsys.readouterr()
    rc = main(["run", str(plan), "--device", "cpu", "--ssd-dir", str(ssd), *args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def leftovers(tmp_path: Path) -> list[str]:
    """What a run must not leave: SSD run directories, half-written checkpoints, lock files."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p.name.startswith(("tierflow-run-", ".tmp-step", ".latest-", LOCK_NAME)))


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    return int(p.stdout)


# -- 1. divergence -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,optimizer", [
    ("--lr", OptimizerOptions(lr=0.0)), ("--lr", OptimizerOptions(lr=-1e-3)),
    ("--lr", OptimizerOptions(lr=math.nan)), ("--lr", OptimizerOptions(lr=math.inf)),
    ("--weight-decay", OptimizerOptions(weight_decay=-0.1)),
    ("--weight-decay", OptimizerOptions(weight_decay=math.nan))])
def test_bad_lr_or_weight_decay_is_refused_up_front(plans, tmp_path, flag, optimizer):
    """The command line refuses them in argparse (tests/cli/test_reliability_inputs.py); run_plan too."""
    (tmp_path / "ssd").mkdir()
    opts = RunConfig(steps=2, device="cpu", ssd_dir=str(tmp_path / "ssd"),
                     checkpoint=CheckpointOptions(str(tmp_path / "ck")), optimizer=optimizer)
    with pytest.raises(RunError, match=f"^{flag} .*: must be a finite number"):
        run_plan(plan_from(plans["one"]), opts)
    # refused before anything
    assert not (tmp_path / "ck").exists() and not list((tmp_path / "ssd").iterdir())


def test_divergence_mid_round_stops_at_the_first_nonfinite_loss(plans, tmp_path, capsys):
    """lr 1000 on the 3-step round: loss 5.6, 4.9e7, then nan inside the round: the workers stop there."""
    rc, out, err = tierflow_run(capsys, plans["three"], tmp_path, "--steps", "6", "--lr", "1000", "--json",
                                "--out", str(tmp_path / "out"))
    assert rc == 4
    line = one_line(err)
    assert "training diverged: loss nan at step 3" in line and "no --checkpoint-dir" in line
    res = json.loads(out)  # the results so far, as JSON
    assert [s["step"] for s in res["steps"]] == [1, 2] and all(math.isfinite(s["loss"]) for s in res["steps"])
    assert res["stopped"]["exit_code"] == 4
    rows = (tmp_path / "out" / "steps.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss") and len(rows) == 3
    assert leftovers(tmp_path) == []


def test_divergence_keeps_the_last_good_checkpoint(plans, tmp_path, capsys):
    """After step 2 at lr 1000 the weights are NaN: that state is not saved over step 1's checkpoint."""
    ck = tmp_path / "ck"
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "6", "--lr", "1000", "--json",
                                "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                                "--out", str(tmp_path / "o"))
    assert rc == 4
    line = one_line(err)
    assert "training diverged" in line and "after step 2" in line and f"{ck / 'step00000001'} is kept" in line
    res = json.loads(out)
    assert [s["step"] for s in res["steps"]] == [1, 2] and res["checkpoint"] == str(ck / "step00000001")
    assert (ck / "latest").read_text().strip() == "step00000001"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step00000001"]
    manifest = read_manifest(ck / "step00000001")
    for name in manifest["files"]:
        verify_file(ck / "step00000001", name, manifest)
    from safetensors.torch import load_file

    assert all(bool(torch.isfinite(t).all())
               for t in load_file(ck / "step00000001" / "block0001.safetensors").values())
    assert (tmp_path / "o" / "steps.csv").is_file() and leftovers(tmp_path) == []


def test_nan_in_the_initial_weights_stops_at_step_1(plans, tmp_path, capsys, monkeypatch):
    real = TrainState.init_random

    def with_nan(self, seed):
        real(self, seed)
        master = self.full("master", 2)
        master[7] = float("nan")
        self.set_block(2, master)

    monkeypatch.setattr(TrainState, "init_random", with_nan)
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "3", "--json")
    assert rc == 4
    assert "training diverged: loss nan at step 1" in one_line(err)
    assert json.loads(out)["steps"] == []


# -- 2. checkpoints ------------------------------------------------------------------------------------------


def train_with_checkpoints(capsys, plan: Path, tmp_path: Path, steps: int = 3) -> dict[int, float]:
    rc, out, err = tierflow_run(capsys, plan, tmp_path, "--steps", str(steps), "--json",
                                "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1")
    assert rc == 0, err
    return {s["step"]: s["loss"] for s in json.loads(out)["steps"]}


@pytest.mark.parametrize("damage", ["one bit", "64 bytes"])
def test_a_corrupted_checkpoint_is_named_and_resume_falls_back_when_asked(plans, tmp_path, capsys, damage):
    ck = tmp_path / "ck"
    want = train_with_checkpoints(capsys, plans["one"], tmp_path, steps=4)
    assert sorted(p.name for p in ck.glob("step*")) == ["step00000003", "step00000004"]
    block = ck / "step00000004" / "block0001.safetensors"
    data = bytearray(block.read_bytes())
    if damage == "one bit":
        data[len(data) // 2] ^= 0x01
    else:
        data[5000:5064] = bytes(64)
    block.write_bytes(bytes(data))

    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "5", "--checkpoint-dir", str(ck))
    assert rc == 2
    line = one_line(err)
    assert "checksum mismatch in block0001.safetensors" in line and "step00000004" in line
    assert "--resume-fallback" in line and "step00000003" in line

    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "5", "--checkpoint-dir", str(ck),
                                "--resume-fallback", "--json")
    assert rc == 0, err
    assert "skipping a bad checkpoint" in err and "corrupt-step00000004-1" in err
    res = json.loads(out)
    assert res["first_step"] == 3
    # step 4 again, bit-identical to the first run's
    assert [s["loss"] for s in res["steps"]][:1] == [want[4]]
    assert (ck / "latest").read_text().strip() == "step00000005"
    assert sorted(p.name for p in ck.iterdir()) == ["corrupt-step00000004-1", "latest", "step00000004",
                                                    "step00000005"]


def test_truncated_or_unreadable_checkpoint_gives_one_line(plans, tmp_path, capsys):
    ck = tmp_path / "ck"
    train_with_checkpoints(capsys, plans["one"], tmp_path, steps=2)
    block = ck / "step00000002" / "block0003.safetensors"
    full = block.read_bytes()
    block.write_bytes(full[:1000])
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "3", "--checkpoint-dir", str(ck))
    assert rc == 2
    line = one_line(err)
    assert "block0003.safetensors is truncated" in line and "1,000 bytes" in line

    # a version-1 checkpoint (no checksums) with a garbage block: safetensors' own error, as one line
    manifest = json.loads((ck / "step00000002" / "manifest.json").read_text())
    del manifest["files"]
    manifest["version"] = 1
    (ck / "step00000002" / "manifest.json").write_text(json.dumps(manifest))
    block.write_bytes(b"\xff" * len(full))
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "3", "--checkpoint-dir", str(ck))
    assert rc == 2
    assert "block0003.safetensors is unreadable" in one_line(err)

    # --resume-fallback goes back to step 1
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "3", "--checkpoint-dir", str(ck),
                                "--resume-fallback", "--json")
    assert rc == 0, err
    assert json.loads(out)["first_step"] == 1
    assert leftovers(tmp_path) == []


def test_a_full_disk_while_checkpointing_leaves_nothing_behind(plans, tmp_path, capsys, monkeypatch):
    """The second checkpoint's third block write fails with ENOSPC after writing part of its file."""
    real = checkpoint.write_safetensors
    calls = []
    blocks = make_plan("tiny-gpt", "vertical", "states_ssd", 0.25, iterations=1).model.num_layers + 2

    def filling_up(path, tensors):
        calls.append(path)
        if len(calls) == blocks + 3:
            path.write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(checkpoint, "write_safetensors", filling_up)
    ck = tmp_path / "ck"
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "4", "--json",
                                "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert rc == 3
    line = one_line(err)
    assert ("cannot write the checkpoint of step 2 (the disk is full)" in line
            and "previous checkpoint is kept" in line)
    res = json.loads(out)
    assert [s["step"] for s in res["steps"]] == [1, 2] and res["stopped"]["exit_code"] == 3
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step00000001"]
    assert (ck / "latest").read_text().strip() == "step00000001"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("which", ["--checkpoint-dir", "--ssd-dir"])
def test_a_second_run_on_a_locked_directory_is_refused(plans, tmp_path, capsys, which):
    ck, ssd = tmp_path / "ck", tmp_path / "ssd"
    ck.mkdir()
    ssd.mkdir()
    with DirLock(ck if which == "--checkpoint-dir" else ssd, which):  # another run holds it
        rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "1",
                                    "--checkpoint-dir", str(ck))
    assert rc == 2
    line = one_line(err)
    assert f"error: {which} " in line and f"in use by another tierflow run (pid {os.getpid()}" in line
    assert not list(ssd.glob("tierflow-run-*")) and not list(ck.glob("step*"))
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "1", "--checkpoint-dir", str(ck))
    assert rc == 0, err  # once released
    assert leftovers(tmp_path) == []


def test_what_a_dead_run_left_is_taken_over_and_removed(plans, tmp_path, capsys):
    pid = dead_pid()
    ck, ssd = tmp_path / "ck", tmp_path / "ssd"
    (ssd / f"tierflow-run-{pid}").mkdir(parents=True)
    (ssd / f"tierflow-run-{pid}" / "adam_m_b1_p0.bin").write_bytes(b"\0" * 8192)
    (ck / f".tmp-step00000009-{pid}").mkdir(parents=True)
    (ck / f".tmp-step00000009-{pid}" / "block0000.safetensors").write_bytes(b"\0" * 100)
    for d in (ck, ssd):
        (d / LOCK_NAME).write_text(f"{pid}\n")
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "1", "--checkpoint-dir", str(ck))
    assert rc == 0, err
    assert f"took over the lock of --checkpoint-dir {ck} from tierflow run pid {pid}, which is gone" in err
    assert f"took over the lock of --ssd-dir {ssd} from tierflow run pid {pid}" in err
    assert (f"removed {ssd / f'tierflow-run-{pid}'} (0.000 GB), "
            f"left by tierflow run pid {pid}, which is gone") in err
    assert "removed 1 half-written checkpoint file(s)" in err
    assert leftovers(tmp_path) == []


def test_resume_with_other_settings_is_refused_unless_allowed(plans, tmp_path, capsys):
    ck = tmp_path / "ck"
    train_with_checkpoints(capsys, plans["one"], tmp_path, steps=1)
    for args, names in [(["--seed", "1"], "--seed 0 -> 1"), (["--lr", "0.002"], "--lr 0.001 -> 0.002"),
                        (["--weight-decay", "0"], "--weight-decay 0.1 -> 0.0")]:
        rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "2",
                                    "--checkpoint-dir", str(ck), *args)
        assert rc == 2, args
        line = one_line(err)
        assert "step00000001 was written with other settings" in line and names in line
        assert "--allow-changed-hyper" in line
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "2", "--checkpoint-dir", str(ck),
                                "--lr", "0.002", "--allow-changed-hyper", "--json")
    assert rc == 0, err
    assert json.loads(out)["first_step"] == 1 and "changed settings (--lr 0.001 -> 0.002)" in err
    assert read_manifest(ck / "step00000002")["hyper"]["lr"] == 0.002  # the new checkpoint records the new lr


def test_checkpoint_files_are_standard_safetensors_with_their_crc(tmp_path):
    from safetensors.torch import load_file

    tensors = {"master": torch.randn(3000), "weights": torch.randn(3000).bfloat16(),
               "adam_v": torch.rand(17, 5)}
    nbytes, crc = write_safetensors(tmp_path / "b.safetensors", tensors)
    assert (nbytes, crc) == file_crc32(tmp_path / "b.safetensors") == (
        os.path.getsize(tmp_path / "b.safetensors"), crc)
    back = load_file(tmp_path / "b.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


# -- 4. signals ----------------------------------------------------------------------------------------------


def start_run(plan: Path, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`python -m tierflow run` for many steps; returns once its first step line has appeared."""
    (tmp_path / "ssd").mkdir(exist_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "tierflow", "run", str(plan), "--steps", "100000",
                          "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step"):
            return p, seen
    p.wait()
    raise AssertionError(f"no step line: {''.join(seen)} {p.stderr.read()}")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_stops_the_workers_and_removes_the_ssd_directory(plans, tmp_path, sig, code):
    ck = tmp_path / "ck"
    p, _ = start_run(plans["one"], tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                     "--out", str(tmp_path / "out"))
    assert list((tmp_path / "ssd").glob(f"tierflow-run-{p.pid}"))
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    notice, line = err.strip().splitlines()  # the round under way ends, its step is saved, then the stop
    assert notice.startswith(f"tierflow run: {sig.name}: stopping at the end of this round")
    assert line.startswith(f"tierflow run: interrupted by {sig.name}: workers stopped after ")
    assert "the checkpoint of its last step is saved in" in line
    assert "terminate called" not in err and "Traceback" not in err
    assert leftovers(tmp_path) == []
    assert (tmp_path / "out" / "steps.csv").is_file()


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_mid_round_saves_the_round_s_last_step(plans, tmp_path, sig, code):
    """Three steps a round, a checkpoint interval far beyond them: the signal after the first step line lets
    the round end, saves its last step (not a multiple of the interval), and stops with the signal's code."""
    ck = tmp_path / "ck"
    p, seen = start_run(plans["three"], tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "1000")
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    done = [x for x in seen + out.splitlines() if x.startswith("step")]
    latest = (ck / "latest").read_text().strip()
    assert latest == f"step{len(done):08d}" and len(done) % 3 == 0, (latest, done)
    assert read_manifest(ck / latest)["step"] == len(done)
    assert f"saved in {ck / latest}" in err.strip().splitlines()[-1]
    assert leftovers(tmp_path) == []


def test_a_second_stop_signal_stops_at_once(monkeypatch):
    """Under deferred_stop the first signal is noted (the round goes on), the second raises Interrupted; with
    stop_at_once (a rank died) the first raises."""
    from tierflow.executor import signals

    with signals.StopOnSignals():
        with signals.deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.pending_signal() == signal.SIGTERM
            with pytest.raises(signals.Interrupted) as e:
                os.kill(os.getpid(), signal.SIGINT)
                signal.sigtimedwait([], 0.01)  # the handler runs here at the latest
            assert e.value.exit_code == 143  # the first signal's code
            os.kill(os.getpid(), signal.SIGINT)  # once stopping, further signals are ignored
            assert signals.pending_signal() is None
    with signals.StopOnSignals():
        with signals.deferred_stop(stop_at_once=lambda: True):
            with pytest.raises(signals.Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                signal.sigtimedwait([], 0.01)
    with signals.StopOnSignals():  # outside deferred_stop: the first signal raises
        with pytest.raises(signals.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.01)


def test_a_rank_that_meets_an_error_keeps_ignoring_stop_signals():
    """hold_on_error (a rank of several): an exception leaving the training leaves SIGINT and SIGTERM ignored,
    so that torchrun's SIGTERM cannot end the rank before it says why it stops; a clean exit, or one rank,
    restores the handlers."""
    from tierflow.executor import signals

    before = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    try:
        with signals.StopOnSignals(hold_on_error=True):
            pass
        assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before
        with pytest.raises(RuntimeError), signals.StopOnSignals():
            raise RuntimeError("a collective broke")
        assert {s: signal.getsignal(s) for s in signals.STOP_SIGNALS} == before
        with pytest.raises(RuntimeError), signals.StopOnSignals(hold_on_error=True):
            raise RuntimeError("a collective broke")
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in signals.STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test process lives on
        signal.sigtimedwait([], 0.01)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.parametrize("steps,every", [("4", None), ("7", "5"), ("2", "100")])
def test_every_run_with_a_checkpoint_dir_saves_its_last_step(plans, tmp_path, capsys, steps, every):
    """Three steps a round: --steps 4 (not a multiple of the round), 7 with an interval of 5, 2 with an
    interval beyond --steps: each ends with the checkpoint of its last step, optimizer state included, and
    says where."""
    ck = tmp_path / "ck"
    flags = ["--checkpoint-every", every] if every else []
    rc, out, err = tierflow_run(capsys, plans["three"], tmp_path, "--steps", steps,
                                "--checkpoint-dir", str(ck), *flags)
    assert rc == 0, err
    latest = ck / (ck / "latest").read_text().strip()
    assert latest.name == f"step{int(steps):08d}" and read_manifest(latest)["step"] == int(steps)
    from safetensors.torch import load_file

    first = latest / sorted(read_manifest(latest)["files"])[0]
    assert {"adam_m", "adam_v"} <= set(load_file(first))  # the optimizer state too, not only the weights
    assert f"checkpoint {latest} (the last step)" in out


def test_the_last_step_s_checkpoint_resumes_like_an_uninterrupted_run(plans, tmp_path, capsys):
    """4 steps saved at step 4 (a round is 3), then resumed to 6: the losses of steps 5 and 6 are those of
    one 6-step run."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rc, out, err = tierflow_run(capsys, plans["three"], tmp_path / "a", "--steps", "6", "--json")
    assert rc == 0, err
    want = [s["loss"] for s in json.loads(out)["steps"]][4:]
    ck = tmp_path / "ck"
    for steps in ("4", "6"):
        rc, out, err = tierflow_run(capsys, plans["three"], tmp_path / "b", "--steps", steps, "--json",
                                    "--checkpoint-dir", str(ck), "--checkpoint-every", "100")
        assert rc == 0, err
    got = json.loads(out)
    assert got["first_step"] == 4 and [s["loss"] for s in got["steps"]] == want


def test_a_killed_runs_ssd_directory_is_removed_by_the_next_run(plans, tmp_path, capsys):
    p, _ = start_run(plans["one"], tmp_path)
    p.kill()
    p.communicate(timeout=60)
    left = tmp_path / "ssd" / f"tierflow-run-{p.pid}"
    assert left.is_dir() and list(left.iterdir())  # SIGKILL cannot be cleaned up after by the run itself
    rc, out, err = tierflow_run(capsys, plans["one"], tmp_path, "--steps", "1", "--json")
    assert rc == 0, err
    assert f"removed {left} (" in err and f"left by tierflow run pid {p.pid}, which is gone" in err
    assert leftovers(tmp_path) == []


def test_an_ssd_directory_deleted_mid_run_is_one_line_and_exit_2(plans, tmp_path):
    """The run's SSD directory removed while it trains: whichever op meets it first, a read or a write, the
    run stops with one line naming the directory (exit 2), and leaves no SSD file behind."""
    import shutil

    p, _ = start_run(plans["one"], tmp_path)
    run_dir = tmp_path / "ssd" / f"tierflow-run-{p.pid}"
    assert run_dir.is_dir()
    for _ in range(100):  # the run may create a file while it is removed (rmtree: directory not empty)
        shutil.rmtree(run_dir, ignore_errors=True)
        if not run_dir.exists():
            break
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err[-2000:]
    lines = [x for x in err.splitlines() if "error" in x]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("tierflow run: error: ssd tier: tensor") and "is missing at its" in lines[0]
    # the op names the directory when it met it gone, or its file when rmtree had emptied the directory
    # but not yet removed it (the message is built at that moment)
    assert (f"directory {run_dir} was deleted during the run" in lines[0]
            or re.search(rf"\({re.escape(str(run_dir))}/\S+\.bin was deleted\)", lines[0])), lines[0]
    assert not run_dir.exists()


def test_an_exception_in_the_main_thread_joins_every_worker_first(plans, tmp_path):
    """What Ctrl-C does in the middle of a round (here from Python, SIGUSR1): every tierflow thread has ended
    when the exception leaves run_plan, so none runs torch ops at interpreter exit."""

    class Stop(BaseException):
        pass

    def raise_stop(signum, frame):
        raise Stop()

    def log(msg, **kw):
        if msg.startswith("step"):  # from the reporter thread, mid-round (3 steps per round)
            os.kill(os.getpid(), signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, raise_stop)
    (tmp_path / "ssd").mkdir()
    before = {th.ident for th in threading.enumerate()}  # other tests' executors' idle threads may linger
    try:
        with pytest.raises(Stop):
            run_plan(plan_from(plans["three"]),
                     RunConfig(steps=1000, device="cpu", ssd_dir=str(tmp_path / "ssd")), log=log)
    finally:
        signal.signal(signal.SIGUSR1, old)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("tierflow") and t.ident not in before]
    assert alive == []
    assert leftovers(tmp_path) == []


def plan_from(path: Path):
    from tierflow.planner.io.planfile import load_plan

    return load_plan(path)


class _AloneSharded(DistWorld):
    """One rank taking the sharded checkpoint's path (its collectives are local), to reach its code here."""

    @property
    def single(self) -> bool:
        return False

    def gather_objects(self, obj: object) -> list[object]:
        return [obj]

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: object, src: int = 0) -> object:
        return obj


@pytest.mark.parametrize("sharded", [False, True])
def test_a_signal_after_latest_moved_keeps_the_checkpoint_it_names(tmp_path, monkeypatch, sharded):
    """A stop signal that lands after 'latest' was replaced (in the directory's fsync) must not remove the
    checkpoint 'latest' now names: the launcher-killed-at-a-checkpoint case under load left 'latest' naming
    a deleted step."""
    from tierflow.executor.signals import Interrupted

    plan = make_plan("tiny-gpt", "vertical", "device", 0.0, iterations=1)
    world = _AloneSharded() if sharded else DistWorld()
    state = TrainState(plan.model, plan.config.placement, plan.config.alpha, torch.device("cpu"),
                       torch.float32, None, world)
    state.init_random(0)
    ck = tmp_path / "ck"
    checkpoint.save_checkpoint(state, ck, 1, {}, world=world)
    real = checkpoint.fsync_dir

    def interrupted_once_latest_moved(d):
        real(d)
        if d == ck and (ck / "latest").read_text().strip() == "step00000002":
            raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(checkpoint, "fsync_dir", interrupted_once_latest_moved)
    with pytest.raises(Interrupted):
        checkpoint.save_checkpoint(state, ck, 2, {}, world=world)
    named = ck / (ck / "latest").read_text().strip()
    assert named.name == "step00000002" and read_manifest(named)["step"] == 2
    if sharded:
        assert (named / "rank-0" / "manifest.json").is_file()
