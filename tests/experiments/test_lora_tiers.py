"""experiments/lora_tiers.py --cpu --quick (part b): a tiny LLaMA fine-tuned with LoRA on real text in
tierflow (the base on the SSD tier, and in host memory) and in plain PyTorch + PEFT. Structure and quality
only (the validation losses agree): no timing assertion, the step times live in the script's results."""

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
    assert all(float(row[k]) > 0 for k in ("tierflow_ssd_step_s", "tierflow_host_step_s", "peft_step_s"))
