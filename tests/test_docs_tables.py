"""Every results table in the docs that a script generates equals what that script makes of its results file
today (experiments/expcommon.write_generated_block): no stale number in the docs."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

pytest.importorskip("matplotlib")
import bench_executor  # noqa: E402
import expcommon  # noqa: E402
import fidelity  # noqa: E402
import gemini_capacity  # noqa: E402
import race_deepspeed  # noqa: E402


def _rows(name: str) -> list[dict]:
    with open(EXPERIMENTS / "results" / name, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("module,results,render", [
    (gemini_capacity, "gemini_capacity.csv", gemini_capacity.capacity_table),
    (fidelity, "fidelity.csv", fidelity.checks_table),
    (race_deepspeed, "race.csv", race_deepspeed.race_tables),
    (bench_executor, "bench_executor.csv", bench_executor.executor_table),
    (SimpleNamespace(DOC=bench_executor.DOC, DOC_TABLE=bench_executor.CPU_TABLE), "bench_executor_cpu.csv",
     bench_executor.cpu_work_table),
    (SimpleNamespace(DOC=bench_executor.DOC, DOC_TABLE=bench_executor.KINDS_TABLE),
     "bench_executor_kinds.csv", bench_executor.kinds_table),
])
def test_generated_doc_tables_equal_their_results_files(module, results, render):
    assert expcommon.generated_block(module.DOC, module.DOC_TABLE) == render(_rows(results))


def test_a_generated_block_is_replaced_in_place(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- generated: t -->\nold\n<!-- end generated: t -->\nafter\n")
    expcommon.write_generated_block(doc, "t", "| a |\n|---|\n| 1 |")
    want = "before\n<!-- generated: t -->\n| a |\n|---|\n| 1 |\n<!-- end generated: t -->\nafter\n"
    assert doc.read_text() == want
    assert expcommon.generated_block(doc, "t") == "| a |\n|---|\n| 1 |"
