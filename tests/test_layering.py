"""Architecture rules: hwprofiles <- planner (core <- search <- io) <- executor, one public API module that nothing
inside imports, the planner never imports torch, and every package folder is installed under `tierflow`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (folder, installed name, rank): a module may import only layers of lower or equal rank
LAYERS = [
    ("hwprofiles", "tierflow.hwprofiles", 0),
    ("planner/core", "tierflow.planner.core", 1),
    ("planner/search", "tierflow.planner.search", 2),
    ("planner/io", "tierflow.planner.io", 3),
    ("executor", "tierflow.executor", 4),
]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer_of(module: str) -> int | None:
    ranks = [rank for _, name, rank in LAYERS if module == name or module.startswith(name + ".")]
    return ranks[0] if ranks else None


def test_imports_only_go_down_the_stack():
    bad = []
    for folder, _, rank in LAYERS:
        for f in (ROOT / folder).rglob("*.py"):
            for mod in imported_modules(f):
                dep = layer_of(mod)
                if dep is not None and dep > rank:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_the_layer_rule_can_fail():
    """layer_of ranks what the rule compares: an executor import inside the planner core would be caught."""
    assert layer_of("tierflow.executor.engine") > layer_of("tierflow.planner.core.graph")
    assert layer_of("tierflow.planner.search.loads") > layer_of("tierflow.planner.core.schedules")
    assert layer_of("numpy") is None


def test_nothing_inside_imports_the_public_api():
    bad = [str(f.relative_to(ROOT)) for folder, _, _ in LAYERS for f in (ROOT / folder).rglob("*.py")
           if any(m == "tierflow.api" or m.startswith("tierflow.api.") for m in imported_modules(f))]
    assert not bad, bad


def test_old_bare_package_names_are_gone():
    """`planner`, `executor` and `hwprofiles` collide with other PyPI distributions: only tierflow.* is imported."""
    bad = []
    for f in list(ROOT.glob("*/**/*.py")):
        if ".venv" in f.parts:
            continue
        for mod in imported_modules(f):
            if mod.split(".")[0] in ("planner", "executor", "hwprofiles"):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_pyproject_installs_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    expected = set()
    for installed, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([installed, *rel.parts]))
    assert set(cfg["packages"]) == expected


def test_planner_and_cli_start_without_torch():
    code = ("import sys, tierflow.cli, tierflow.api, tierflow.planner.core.simulator, "
            "tierflow.planner.core.trace, tierflow.hwprofiles; "
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'networkx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False", "False"]


def test_every_registered_command_loads_without_torch():
    """Every command module of tierflow.cli is imported for every command (tierflow simulate, plan, ...): they
    must not import torch, which takes seconds and slows the planner's garbage collection."""
    code = ("import sys; from tierflow.cli import build_parser; p = build_parser(); "
            "names = sorted(p._subparsers._group_actions[0].choices); "
            "print(','.join(names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    names, has_torch = out.stdout.split()
    assert {"run", "calibrate", "plan", "simulate"} <= set(names.split(","))
    assert has_torch == "False"


def test_version_and_module_entry_point():
    import tierflow

    for cmd in ([sys.executable, "-m", "tierflow", "--version"],):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        assert out.stdout.strip() == f"tierflow {tierflow.__version__}"
