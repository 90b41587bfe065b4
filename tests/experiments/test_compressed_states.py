"""experiments/compressed_states.py --quick (structure only): each optimizer-state format fine-tunes the
finetune experiment's model on real text with its states on the SSD tier; the table for the docs is made
from the rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tierflow.planner.core.optstates import STATE_FORMATS

pytest.importorskip("matplotlib")
pytest.importorskip("tokenizers")


def test_compressed_states_experiment_quick(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import compressed_states

    rows, summary = compressed_states.run(quick=True, out_dir=tmp_path, library=False)
    assert (tmp_path / "compressed_states.csv").is_file() and (tmp_path / "compressed_states.png").is_file()
    assert [s["run"] for s in summary] == [f"tierflow {f}" for f in STATE_FORMATS]
    for fmt in STATE_FORMATS:
        assert rows[-1][f"{fmt}_val"] is not None and rows[-1][f"{fmt}_loss"] < rows[0][f"{fmt}_loss"]
    by = {s["run"]: s for s in summary}
    assert by["tierflow 8bit"]["ssd_mb"] < by["tierflow fp32"]["ssd_mb"]
    assert by["tierflow 8bit-bf16master"]["ssd_mb"] < by["tierflow 8bit"]["ssd_mb"]
    table = compressed_states.quality_table(rows)
    assert table.count("\n") == 1 + len(STATE_FORMATS) and "+0.00%" in table


def test_compressed_sim_experiment_quick(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
    import compressed_sim

    rows = compressed_sim.run(quick=True, out_dir=tmp_path)
    assert [r["format"] for r in rows] == list(STATE_FORMATS)
    assert all(r["iteration_s"] > 0 for r in rows)
    table = compressed_sim.sim_table(rows)
    assert table.count("\n") == 1 + len(STATE_FORMATS) and "1.00x" in table
