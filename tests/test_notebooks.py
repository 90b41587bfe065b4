"""Every notebook in notebooks/ runs from top to bottom without an error, and is committed with the outputs of
such a run (so that a reader sees the figures without running it), each file under MAX_NOTEBOOK_BYTES.

The notebooks run in a fresh kernel of this interpreter (so in the same environment as the tests, whatever
kernels are installed for the user or the system), with notebooks/ as the working directory and matplotlib's
Agg backend. Their wall time is reported, not asserted: performance targets live in benchmark scripts, never
in timed tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# the kernel runs this interpreter: ipykernel must be installed next to the tests
import ipykernel  # noqa: F401
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
MAX_NOTEBOOK_BYTES = 1 << 20  # stored outputs included (PNG figures): lower the figures' dpi to stay under it


def test_the_notebooks_are_found():
    # an empty list would make the parametrized tests below pass without running anything
    assert len(NOTEBOOKS) >= 2, f"expected the notebooks in {ROOT / 'notebooks'}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs_of_one_run(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    how = (f"run it and save its outputs: jupyter nbconvert --to notebook --execute --inplace "
           f"notebooks/{path.name} (or nbclient, as the test below does)")
    assert counts == list(range(1, len(code) + 1)), \
        f"{path.name}: cells not run once from top to bottom; {how}"
    errors = [i for i, cell in enumerate(code) for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: code cells {errors} stored an error; {how}"
    assert any(out.get("data", {}).get("image/png") for cell in code for out in cell.outputs), \
        f"{path.name}: no figure among the stored outputs; {how}"
    size = path.stat().st_size
    assert size <= MAX_NOTEBOOK_BYTES, (f"{path.name}: {size:,} bytes with its outputs, "
                                        f"over {MAX_NOTEBOOK_BYTES:,}; lower the figures' dpi")


@pytest.fixture
def this_interpreter_kernel(tmp_path, monkeypatch):
    """A 'python3' kernel spec that runs sys.executable. JUPYTER_PATH comes first in Jupyter's search path, so
    this spec wins over one installed with `ipykernel install --user` for another Python."""
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3",
                                                  "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the working tree's packages, also when tierflow is not installed in editable mode
    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_without_error(path, this_interpreter_kernel, record_property, capsys):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name=this_interpreter_kernel, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    wall_s = time.perf_counter() - t0
    record_property("wall_s", round(wall_s, 1))
    with capsys.disabled():
        print(f"\n{path.name}: ran in {wall_s:.1f} s (target: under 120 s on a 2-core CPU machine)")
