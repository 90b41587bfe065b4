"""tests/ is laid out like the code: every test file sits in the folder of its subject (the rule and the tool
that moves files: tests/support/layout.py), basenames are unique so the name says the folder, and every
tests/... path the docs and the code mention is where that file is."""

from __future__ import annotations

import pytest
from support import layout


def test_every_test_file_sits_in_the_folder_of_its_subject():
    wrong = layout.misplaced()
    assert not wrong, "\n".join(layout.hint(f, want) for f, want in wrong)


def test_every_test_file_is_placed_by_a_rule():
    assert not layout.unplaced(), "\n".join(layout.unplaced())


def test_test_files_import_shared_code_from_support_only():
    old = {str(f.relative_to(layout.ROOT)): found
           for f in layout.all_test_files() if (found := layout.old_imports(f))}
    assert not old, f"{old}: test modules do not import each other (tests/support/layout.py --fix)"


def test_paths_from_a_test_file_reach_the_repository():
    wrong = [line for f in layout.all_test_files() for line in layout.wrong_roots(f)]
    assert not wrong, "\n".join(wrong)


def test_test_file_names_are_unique():
    seen: dict[str, list[str]] = {}
    for f in layout.all_test_files():
        seen.setdefault(f.name, []).append(str(f.relative_to(layout.ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"one name, two folders (rename one: its name says where it belongs): {twice}"


def test_every_explicit_subject_names_a_test_file_and_a_folder_of_the_layout():
    stems = {f.stem for f in layout.all_test_files()}
    stale = sorted(set(layout.SUBJECTS) - stems)
    assert not stale, f"SUBJECTS in tests/support/layout.py names test files that do not exist: {stale}"
    folders = {f.parent.relative_to(layout.TESTS).as_posix() for f in layout.all_test_files()}
    assert set(layout.SUBJECTS.values()) <= folders


def test_references_to_test_files_are_where_the_files_are():
    stale = layout.stale_refs()
    lines = [f"{f.relative_to(layout.ROOT)}: {ref} is now {want}" for f, ref, want in stale]
    assert not lines, "\n".join([*lines, "(python tests/support/layout.py --fix-refs rewrites them)"])


def test_the_rule_places_by_the_module_of_the_name():
    assert layout.place("test_simulator") == "planner/core"  # planner/core/simulator.py
    assert layout.place("test_quant8") == "executor/optim"  # executor/optim/quant8.py
    assert layout.place("test_slots") == "planner/search"  # the package planner/search/slots/, two levels
    assert layout.place("test_executor") == "executor"  # the package itself
    assert layout.place("test_cli") == "cli"  # tierflow/cli/: tierflow/ dropped
    assert layout.place("test_bench_store") == "experiments"  # no library module: experiments/bench_store.py
    assert layout.place("test_layering") == "system"  # named in SUBJECTS


def test_the_rule_can_fail(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="names no module: add it to SUBJECTS"):
        layout.place("test_no_such_module")
    monkeypatch.delitem(layout.SUBJECTS, "test_compute")
    # planner/core/compute.py and executor/ops/compute.py
    with pytest.raises(ValueError, match="several modules"):
        layout.place("test_compute")
    # a file in the wrong folder gets one line naming where it goes and the command that moves it
    stray = layout.TESTS / "test_simulator.py"
    monkeypatch.setattr(layout, "all_test_files", lambda: [stray])
    [(f, want)] = layout.misplaced()
    line = layout.hint(f, want)
    assert "\n" not in line
    assert line.startswith("tests/test_simulator.py belongs in tests/planner/core/")
    assert "git mv tests/test_simulator.py tests/planner/core/test_simulator.py" in line
    # and a reference to a file that moved is found
    doc = tmp_path / "page.md"
    doc.write_text("see tests/test_simulator.py and tests/planner/core/test_simulator.py\n")
    monkeypatch.setattr(layout, "text_files", lambda: [doc])
    assert layout.stale_refs() == [(doc, "tests/test_simulator.py", "tests/planner/core/test_simulator.py")]


def test_the_import_and_path_checks_can_fail(tmp_path, monkeypatch):
    deep = tmp_path / "tests" / "planner" / "core"
    deep.mkdir(parents=True)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "tests" / "experiments").mkdir()  # not what parents[1] / "experiments" means
    f = deep / "test_x.py"
    f.write_text("import sys\nfrom test_executor import make_plan\nfrom helpers import profile\n"
                 "ROOT = Path(__file__).resolve().parents[1]\n"
                 "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'experiments'))\n"
                 'sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))\n')
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    monkeypatch.setattr(layout, "TESTS", tmp_path / "tests")
    assert layout.old_imports(f) == ["from test_executor import", "from helpers import"]
    wrong = layout.wrong_roots(f)
    assert len(wrong) == 2 and all("parents[3] here" in line for line in wrong)  # ROOT and "experiments"
    assert layout.fix_file(f)
    assert "from support.runs import make_plan\nfrom support.helpers import profile\n" in f.read_text()
    assert "ROOT = Path(__file__).resolve().parents[3]\n" in f.read_text()
    assert "parents[1]" in f.read_text()  # 'experiments' in single quotes: not a path the check reads
    assert not layout.old_imports(f) and not layout.wrong_roots(f)
