"""The README quotes what `tierflow simulate` prints (the default demo's block, the figures of the paragraph
under it, and its row of "Results at a glance"): each is generated from the commands' output by
experiments/readme_demo.py, and this test fails when the README drifts from what the commands print now. The
commands are simulations: their output is the same on every machine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import readme_demo  # noqa: E402


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    return readme_demo.run_commands()  # the default demo and its two variants, at once


def test_the_readme_quotes_what_the_commands_print_now(outputs):
    bad = readme_demo.drift(outputs)
    assert not bad, (f"README.md: {bad} differ from the commands' output: run python "
                     "experiments/readme_demo.py and commit what it writes")


def test_drift_is_caught_in_each_generated_part(outputs, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(readme_demo.README.read_text())
    assert readme_demo.drift(outputs, readme) == []
    text = readme.read_text()
    for old, new in (("busy ssd_read", "busy ssd-read"), ("fewer from the SSDs", "fewer from SSDs"),
                     ("GPU 99% busy |", "GPU 98% busy |")):
        assert old in text, old
        readme.write_text(text.replace(old, new, 1))
        assert len(readme_demo.drift(outputs, readme)) == 1, old
    readme.write_text(text)
    speedup = re.search(r"fastest: vertical \(([\d.]+x) horizontal\)", outputs["demo"])
    assert speedup, outputs["demo"][-500:]
    readme_demo.write({**outputs, "demo": outputs["demo"].replace(speedup.group(1), "9.99x")}, readme)
    assert "fastest: vertical (9.99x horizontal)" in readme.read_text()
    assert "9.99x horizontal, GPU" in readme_demo.readme_glance_row(readme.read_text())
