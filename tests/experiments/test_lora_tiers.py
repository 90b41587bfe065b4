"""experiments/lora_tiers.py --cpu --quick (part b): a tiny LLaMA fine-tuned with LoRA on real text in
tierflow (the planner's plan; the base on the SSD tier, and in host memory), in plain PyTorch + PEFT, and in
DeepSpeed ZeRO-3 + PEFT where DeepSpeed is installed (else its one-line reason). Structure and quality only
(the validation losses agree): no timing assertion, the step times live in the script's results."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_lora_cpu_quick(tmp_path):
    pytest.importorskip("peft", reason="PEFT is not installed (pip install peft)")
    pytest.importorskip("tokenizers")
    out = subprocess.run([sys.executable, str(ROOT / "experiments" / "lora_tiers.py"), "--cpu", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "lora_cpu.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    ssd, host, peft = (float(row[k]) for k in ("tierflow_ssd_val", "tierflow_host_val", "peft_val"))
    assert abs(ssd - peft) <= 1e-4 * peft and abs(host - peft) <= 1e-4 * peft
    assert all(float(row[k]) > 0 for k in ("tierflow_ssd_step_s", "tierflow_host_step_s", "peft_step_s",
                                           "tierflow_host_cpu_s", "peft_cpu_s", "tierflow_host_predicted_s"))
    assert int(row["micro_batch"]) >= 1 and "base 0% device / 100% host" in row["plan"]  # the planner's plan
    try:  # DeepSpeed ZeRO-3 + PEFT: its validation loss where it runs, else the one line saying why not
        import deepspeed  # noqa: F401
    except ImportError:
        assert "DeepSpeed is not installed" in row["ds_cpu_note"] and not row["ds_cpu_val"]
        assert out.stderr.count("DeepSpeed ZeRO-3 + PEFT did not run") == 1
    else:
        assert not row["ds_cpu_note"], row["ds_cpu_note"]
        assert abs(float(row["ds_cpu_val"]) - peft) <= 1e-3 * peft
