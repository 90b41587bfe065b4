"""Optional accelerators (tierflow.planner.core.numba_once): a kernel that cannot be built, or whose compiler
(numba) imports but cannot compile, or does not import at all, falls back in one line on stderr, and
`tierflow env` reports what really runs (each kernel built, never guessed from what is installed). The
compiler failures are real processes with a stand-in `numba` package first on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tierflow.executor.env import accelerator_status
from tierflow.extras import install_command
from tierflow.planner.core import numba_once
from tierflow.planner.core.numba_once import ACCELERATORS, OptionalKernel

TIERFLOW = [sys.executable, "-m", "tierflow"]
CANNOT_COMPILE = '''
def njit(*args, **kwargs):
    def decorate(f):
        def compiled(*a, **k):
            raise RuntimeError("LLVM ERROR: no target for this machine\\n(a compiler that does not work)")
        return compiled
    return decorate
'''
CANNOT_IMPORT = 'raise ImportError("Numba needs NumPy 1.26 or less")\n'


@pytest.fixture
def kernel_name(monkeypatch):
    name = "test accelerator"
    monkeypatch.delitem(ACCELERATORS, name, raising=False)
    yield name
    ACCELERATORS.pop(name, None)


def test_a_kernel_that_does_not_build_falls_back_in_one_line(kernel_name, capsys, monkeypatch):
    def build():
        raise RuntimeError("LLVM ERROR: line one\nline two\nline three")

    k = OptionalKernel(kernel_name, build, switch="TIERFLOW_TEST_KERNEL_OFF", fallback="the plain loop")
    assert k.get() is None and k.get() is None  # tried once
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert ("the test accelerator (kernel) did not build (RuntimeError: LLVM ERROR: line one line two line "
            "three); falling back to the plain loop (TIERFLOW_TEST_KERNEL_OFF=1 skips the attempt)") in err[0]
    s = k.status()
    assert not s.runs and s.line.startswith("the plain loop (the kernel did not build: RuntimeError")
    assert accelerator_status()[kernel_name] == s.line  # tierflow env lists every one made
    monkeypatch.setenv("TIERFLOW_TEST_KERNEL_OFF", "1")
    assert k.status().line == "the plain loop (TIERFLOW_TEST_KERNEL_OFF=1)"


def test_a_kernel_that_builds_runs_and_one_whose_package_is_missing_is_silent(kernel_name, capsys):
    k = OptionalKernel(kernel_name, lambda: abs, switch="TIERFLOW_TEST_KERNEL_OFF")
    assert k.get() is abs and k.status().runs and k.status().line == "kernel"
    missing = OptionalKernel(kernel_name, lambda: abs, switch="TIERFLOW_TEST_KERNEL_OFF",
                             needs="tierflow_no_such_package", fallback="the plain loop")
    assert missing.get() is None and capsys.readouterr().err == ""
    assert missing.status().line == ("the plain loop (tierflow_no_such_package is not installed: "
                                     f"{install_command('fast')} gives the kernel)")


def test_one_line_keeps_a_long_message_short():
    line = numba_once.one_line(ValueError("x" * 500), limit=20)
    assert line == "ValueError: " + "x" * 20 + "..."


def _stand_in_numba(tmp_path, source: str) -> dict[str, str]:
    pkg = tmp_path / "fake" / "numba"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(pkg.parent)}
    for switch in ("TIERFLOW_PURE_SIM", "TIERFLOW_PURE_ADAMW"):
        env.pop(switch, None)
    return env


def test_plan_with_a_numba_that_cannot_compile_falls_back_in_one_line(tmp_path):
    """`tierflow plan` plays enough simulations to load the simulator's kernel: the compiler's failure is one
    line, and the plan is made with the pure-Python loop."""
    env = _stand_in_numba(tmp_path, CANNOT_COMPILE)
    p = subprocess.run([*TIERFLOW, "plan", "--model", "tiny-gpt", "--no-baselines", "--no-window"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    err = p.stderr.splitlines()
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "simulator's event loop (numba kernel) did not build (RuntimeError: LLVM ERROR" in err[0]
    assert "falling back to the simulator's pure-Python loop (TIERFLOW_PURE_SIM=1" in err[0]
    assert "verified by simulation" in p.stdout


@pytest.mark.parametrize("source,cause", [(CANNOT_COMPILE, "RuntimeError: LLVM ERROR"),
                                          (CANNOT_IMPORT, "ImportError: Numba needs NumPy")])
def test_env_reports_what_really_runs_with_a_broken_numba(tmp_path, source, cause):
    p = subprocess.run([*TIERFLOW, "env", "--json"], capture_output=True, text=True, timeout=300,
                       env=_stand_in_numba(tmp_path, source), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    acc = json.loads(p.stdout)["accelerators"]
    assert acc["simulator's event loop"].startswith("the simulator's pure-Python loop (the numba kernel did "
                                                    f"not build: {cause}")
    host = json.loads(p.stdout)["host_optimizer"]
    # the host optimizer's kernel is a C++ extension (torch.utils.cpp_extension): a broken numba leaves it be
    assert "numba" not in host and "numba" not in acc["host optimizer's one-pass step"]
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1  # the simulator's kernel's line
