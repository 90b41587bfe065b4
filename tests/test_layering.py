"""Architecture rules: hwprofiles <- planner <- executor, and the planner never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = {"hwprofiles": 0, "planner": 1, "executor": 2}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_imports_only_go_down_the_stack():
    bad = []
    for pkg, rank in ORDER.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for dep in imported_packages(f) & set(ORDER):
                if ORDER[dep] > rank:
                    bad.append(f"{f.relative_to(ROOT)} imports {dep}")
    assert not bad, bad


def test_planner_and_cli_start_without_torch():
    code = ("import sys, planner.cli, planner.api, planner.simulator, planner.trace, hwprofiles; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_every_registered_command_loads_without_torch():
    """The tierflow.commands entry points are loaded for every command (tierflow simulate, plan, ...): they must
    not import torch, which takes seconds and slows the planner's garbage collection."""
    code = ("import sys; from planner.cli import build_parser; p = build_parser(); "
            "names = sorted(p._subparsers._group_actions[0].choices); "
            "print(','.join(names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    names, has_torch = out.stdout.split()
    assert {"run", "calibrate", "plan", "simulate"} <= set(names.split(","))
    assert has_torch == "False"
