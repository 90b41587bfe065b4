"""Every results table in the docs that a script generates equals what that script makes of its results file
today (experiments/expcommon.write_generated_block): no stale number in the docs."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

pytest.importorskip("matplotlib")
import adapt  # noqa: E402
import bench_dispatch  # noqa: E402
import bench_executor  # noqa: E402
import bench_gil  # noqa: E402
import bench_optimizer  # noqa: E402
import bench_simulator  # noqa: E402
import bench_store  # noqa: E402
import closed_loop  # noqa: E402
import compressed_sim  # noqa: E402
import compressed_states  # noqa: E402
import dos_polaris  # noqa: E402
import expcommon  # noqa: E402
import fidelity  # noqa: E402
import finetune  # noqa: E402
import gemini_capacity  # noqa: E402
import h200_run  # noqa: E402
import host_adam_model  # noqa: E402
import lora_tiers  # noqa: E402
import multi_gpu  # noqa: E402
import planner_quality  # noqa: E402
import race_deepspeed  # noqa: E402
import readme_demo  # noqa: E402
import run_all  # noqa: E402


def _rows(name: str) -> list[dict]:
    with open(EXPERIMENTS / "results" / name, newline="") as f:
        return list(csv.DictReader(f))


# every generated table: (doc, block name, results file, the script's render function)
GENERATED = [
    (gemini_capacity.DOC, gemini_capacity.DOC_TABLE, "gemini_capacity.csv", gemini_capacity.capacity_table),
    (fidelity.DOC, fidelity.DOC_TABLE, "fidelity.csv", fidelity.checks_table),
    (fidelity.FIT_DOC, fidelity.FIT_TABLE, "fidelity.csv", fidelity.heldout_table),
    (race_deepspeed.DOC, race_deepspeed.DOC_TABLE, "race.csv", race_deepspeed.race_tables),
    (planner_quality.DOC, planner_quality.DOC_TABLE, "planner_quality.csv", planner_quality.quality_table),
    (bench_simulator.DOC, bench_simulator.DOC_TABLE, "bench_simulator.csv", bench_simulator.bench_table),
    (multi_gpu.DOC, multi_gpu.DOC_TABLE, "multi_gpu.csv", multi_gpu.markdown),
    (closed_loop.DOC, closed_loop.DOC_TABLE, "closed_loop.csv", closed_loop.loop_table),
    (closed_loop.DOC, closed_loop.SWEEP_TABLE, "closed_loop_sweep.csv", closed_loop.sweep_table),
    (adapt.DOC, adapt.DOC_TABLE, "adapt.csv", adapt.adapt_table),
    (finetune.DOC, finetune.DOC_TABLE, "finetune.csv", finetune.finetune_table),
    (run_all.DOC, run_all.DOC_TABLE, "summary.csv", run_all.papers_table),
    (bench_store.DOC, bench_store.DOC_TABLE, "bench_store.csv", bench_store.store_table),
    (bench_optimizer.DOC, bench_optimizer.DOC_TABLE, "bench_optimizer.csv", bench_optimizer.optimizer_table),
    (bench_executor.DOC, bench_executor.DOC_TABLE, "bench_executor.csv", bench_executor.executor_table),
    (bench_executor.DOC, bench_executor.CPU_TABLE, "bench_executor_cpu.csv", bench_executor.cpu_work_table),
    (bench_executor.DOC, bench_executor.KINDS_TABLE, "bench_executor_kinds.csv", bench_executor.kinds_table),
    (bench_dispatch.DOC, bench_dispatch.DOC_TABLE, "bench_dispatch.csv", bench_dispatch.dispatch_table),
    (bench_dispatch.DOC, bench_dispatch.DOC_TABLE_OPS, "bench_dispatch_ops.csv", bench_dispatch.ops_table),
    (bench_gil.DOC, bench_gil.DOC_TABLE, "bench_gil.csv", bench_gil.gil_table),
    (bench_gil.DOC, bench_gil.FUNCTIONS_TABLE, "bench_gil_functions.csv", bench_gil.functions_table),
    (dos_polaris.DOC, dos_polaris.DOC_TABLE, "dos_polaris.csv", dos_polaris.sweep_table),
    (h200_run.DOC, h200_run.DOC_TABLE, "h200_run.csv", h200_run.doc_table),
    (host_adam_model.DOC, host_adam_model.DOC_TABLE, "host_adam_model.csv", host_adam_model.doc_table),
    (compressed_sim.DOC, compressed_sim.DOC_TABLE, "compressed_sim.csv", compressed_sim.sim_table),
    (lora_tiers.DOC, lora_tiers.DOC_TABLE, "lora_tiers.csv", lora_tiers.lora_tables),
    (compressed_states.DOC, compressed_states.QUALITY_TABLE, "compressed_states.csv",
     compressed_states.quality_table),
]


@pytest.mark.parametrize("doc,block,results,render", GENERATED,
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".csv") else "")
def test_generated_doc_tables_equal_their_results_files(doc, block, results, render):
    assert expcommon.generated_block(doc, block) == render(_rows(results))


@pytest.mark.parametrize("doc,block,results,render", GENERATED,
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".csv") else "")
def test_a_render_gives_the_same_table_from_the_scripts_typed_rows(doc, block, results, render):
    """The scripts render their rows as they made them (numbers, booleans, None), the test from the file's
    text: both must give the same table."""
    assert render(expcommon.parsed_rows(_rows(results))) == render(_rows(results))


def test_every_generated_block_in_the_docs_is_checked():
    """A block with markers that no entry of GENERATED names would never be compared with its file."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {(doc.name, m) for doc in docs for m in re.findall(r"<!-- generated: (.+?) -->", doc.read_text())}
    # and those generated from a command's output, which tests/system/test_readme_demo.py checks
    from_commands = {(readme_demo.README.name, b) for b in (readme_demo.DEMO_BLOCK, readme_demo.PROSE_BLOCK)}
    assert found == {(doc.name, block) for doc, block, _, _ in GENERATED} | from_commands


def test_a_generated_block_is_replaced_in_place(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- generated: t -->\nold\n<!-- end generated: t -->\nafter\n")
    expcommon.write_generated_block(doc, "t", "| a |\n|---|\n| 1 |")
    want = "before\n<!-- generated: t -->\n| a |\n|---|\n| 1 |\n<!-- end generated: t -->\nafter\n"
    assert doc.read_text() == want
    assert expcommon.generated_block(doc, "t") == "| a |\n|---|\n| 1 |"


def test_the_fit_band_is_the_rms_with_each_near_optimal_answer():
    # two runs whose errors change sign between the fit's two answers: the bundled one's errors +10% and -10%
    # (RMS 10%), the other's -20% and +30% (RMS 25.5%); the rows keep each run's lower and higher error
    rows = [{"error": "0.1", "error_low": "-0.2", "error_high": "0.1"},
            {"error": "-0.1", "error_low": "-0.1", "error_high": "0.3"}]
    assert len(fidelity.NEAR_OPTIMA) == 1
    assert fidelity._rms_band(rows) == "10.0% .. 25.5%"
    assert fidelity._rms_band([{"error": "0.1", "error_low": "", "error_high": ""}]) == "-"
