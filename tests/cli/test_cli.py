"""The `tierflow` command: default demo, JSON output, output files, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tierflow.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierflow.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_default_demo_compares_all_schedules_on_175b():
    p = run_cli("simulate")
    assert p.returncode == 0, p.stderr
    assert "gpt3-175b" in p.stdout and "rtx4090-lohan" in p.stdout
    header = [line for line in p.stdout.splitlines()
              if "horizontal" in line and "vertical" in line and "fuyou" in line]
    assert header, p.stdout
    assert "fastest:" in p.stdout


def test_json_has_required_keys(capsys):
    rc = main(["simulate", "--model", "gpt3-1.3b", "--hw", "rtx3090-desktop", "--schedule", "vertical",
               "--batch", "8", "--micro-batch", "2", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("params", "iteration_s", "tokens_per_s", "model_tflops", "hw_tflops", "busy", "link_bytes",
                "peak_bytes"):
        assert key in d, key
    assert set(d["peak_bytes"]) == {"gpu", "cpu", "ssd"}
    assert set(d["busy"]) >= {"gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu"}
    assert d["params"] == 1_315_723_264
    assert d["tokens_per_s"] == pytest.approx(8 * 2048 / d["iteration_s"])
    assert d["hw_tflops"] > d["model_tflops"] > 0


def test_out_writes_perfetto_trace_csv_and_png(tmp_path):
    rc = main(["simulate", "--model", "gpt3-125m", "--hw", "rtx3090-desktop", "--schedule", "horizontal",
               "--batch", "4", "--micro-batch", "2", "--out", str(tmp_path)])
    assert rc == 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {"gpu", "h2d", "d2h", "ssd_read", "ssd_write", "cpu"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and set(counters[0]["args"]) == {"gpu", "cpu", "ssd"}
    import pandas as pd

    df = pd.read_csv(tmp_path / "timeline.csv")
    assert len(df) == len(spans)
    assert (df["end_s"] >= df["start_s"]).all()
    assert (tmp_path / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "gpt-9000"], "gpt-9000"),
        (["--hw", "no-such-box"], "no-such-box"),
        (["--batch", "10", "--micro-batch", "4"], "not divisible"),
        (["--set", "ssd.count"], "section.key=value"),
        (["--set", "gpu.peak_tflops=-1"], "peak_tflops"),
        (["--placement", "{not json"], "--placement"),
    ],
)
def test_bad_input_gives_one_line_and_nonzero_exit(args, needle):
    base = [] if "--model" in args else ["--model", "gpt3-125m"]
    p = run_cli("simulate", *base, *args, "--schedule", "vertical")
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err


def test_malformed_yaml_profile(tmp_path):
    bad = tmp_path / "box.yaml"
    bad.write_text("gpu: [unclosed\n")
    p = run_cli("simulate", "--hw", str(bad), "--model", "gpt3-125m")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "box.yaml" in p.stderr


def test_model_that_fits_nowhere_names_the_tier():
    p = run_cli("simulate", "--model", "gpt3-175b", "--hw", "rtx2060-laptop", "--set", "ssd.count=0",
                "--schedule", "vertical", "--batch", "4", "--micro-batch", "1")
    assert p.returncode == 3
    err = p.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert "cpu memory exceeded" in err
