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
import subprocess
import sys
import time
from pathlib import Path

# the kernel runs this interpreter: ipykernel must be installed next to the tests
import ipykernel  # noqa: F401
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
MAX_NOTEBOOK_BYTES = 1 << 20  # stored outputs included (PNG figures): lower the figures' dpi to stay under it
# runs a notebook and saves its outputs in place with what the [test] extra installs (nbclient's `jupyter
# execute`; nbconvert, which `jupyter nbconvert --execute` needs, is not in it)
SAVE_OUTPUTS = "jupyter execute --inplace"


def test_the_notebooks_are_found():
    # an empty list would make the parametrized tests below pass without running anything
    assert len(NOTEBOOKS) >= 2, f"expected the notebooks in {ROOT / 'notebooks'}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs_of_one_run(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    how = (f"run it and save its outputs: {SAVE_OUTPUTS} notebooks/{path.name} (nbclient, as the test below "
           "does; from the [test] install)")
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


def test_the_hints_command_saves_a_notebooks_outputs_with_the_test_install(tmp_path, this_interpreter_kernel):
    """The command the hint above gives (SAVE_OUTPUTS) runs with what `pip install -e '.[test]'` brings and
    leaves the notebook as test_committed_with_outputs_of_one_run wants it: run once, top to bottom."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)"),
                                         nbformat.v4.new_code_cell("x = 1")])
    nb.metadata["kernelspec"] = {"name": this_interpreter_kernel, "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    program, *args = SAVE_OUTPUTS.split()
    done = subprocess.run([sys.executable, "-m", program, *args, str(path)], capture_output=True, text=True,
                          timeout=CELL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    ran = nbformat.read(path, as_version=4)
    assert [c.execution_count for c in ran.cells] == [1, 2]
    assert ran.cells[0].outputs[0]["text"] == "42\n"
