"""The optional parts of tierflow (pyproject's extras) and the one line that says how to add one: `pip install
-e '.[run]'` for a checkout installed in editable mode, `pip install 'tierflow[run]'` for a package, as this
copy of tierflow was installed (its distribution's direct_url.json, PEP 610). `require` is called before a
command does any work: a missing module is one line and exit code 2, never a traceback."""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from tierflow.errors import TierflowError

# the modules each extra must bring for the commands that need it (the extra's optional ones, e.g. zlib-ng,
# are not listed: without them the command runs and says what it misses)
MODULES = {"run": ("torch", "safetensors"), "finetune": ("transformers", "tokenizers"),
           "fast": ("numba",)}
# a CPU-only PyTorch for a machine without a GPU (PyPI's Linux wheels bring CUDA's libraries, gigabytes)
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


class MissingExtra(TierflowError):
    """A command needs an optional part of tierflow that is not installed: exit code 2."""

    prefix = "missing extra"


@dataclass(frozen=True)
class Install:
    """How this copy of tierflow was installed: `editable` from the checkout `path`, from a local directory
    `path` (not editable), or as a package (path None)."""

    editable: bool
    path: Path | None


def _tierflow_source() -> Path | None:
    """The checkout this module runs from, when it is one (a pyproject.toml naming tierflow beside the
    package), e.g. run with PYTHONPATH and no install."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        return root if 'name = "tierflow"' in pyproject.read_text() else None
    except OSError:
        return None


def how_installed(direct_url: str | None = None) -> Install:
    """How tierflow was installed, from its distribution's direct_url.json (pass its text to test); without a
    distribution (run from a checkout on PYTHONPATH), the checkout."""
    if direct_url is None:
        try:
            direct_url = metadata.distribution("tierflow").read_text("direct_url.json")
        except metadata.PackageNotFoundError:
            direct_url = None
        if direct_url is None:  # no distribution, or a checkout's own egg-info (first on sys.path from it)
            source = _tierflow_source()
            return Install(editable=source is not None, path=source)
    if not direct_url:
        return Install(editable=False, path=None)  # from a package index
    try:
        info = json.loads(direct_url)
    except ValueError:
        return Install(editable=False, path=None)
    url = urlparse(info.get("url", ""))
    if url.scheme != "file" or "dir_info" not in info:
        return Install(editable=False, path=None)  # a wheel, an archive or a VCS URL
    return Install(editable=bool(info["dir_info"].get("editable")), path=Path(unquote(url.path)))


def install_command(extra: str, install: Install | None = None, cwd: Path | None = None) -> str:
    """The exact command that adds `extra` to this install: ``pip install -e '.[run]'`` in the checkout (its
    path when the current directory is elsewhere), ``pip install 'tierflow[run]'`` for a package."""
    install = how_installed() if install is None else install
    if install.path is None:
        return f"pip install 'tierflow[{extra}]'"
    here = Path.cwd() if cwd is None else cwd
    target = "." if _same(install.path, here) else str(install.path)
    return f"pip install {'-e ' if install.editable else ''}'{target}[{extra}]'"


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def missing_modules(extra: str) -> list[tuple[str, str]]:
    """(module, why) for each module of `extra` that does not import here; why is "" when it is not
    installed, else the import's error."""
    missing = []
    for name in MODULES[extra]:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing.append((name, "" if e.name == name else str(e)))
        except ImportError as e:
            missing.append((name, str(e)))
    return missing


def cpu_torch_hint() -> str:
    """On Linux without an NVIDIA driver, the CPU-only PyTorch to install first ("" elsewhere)."""
    if sys.platform != "linux" or Path("/proc/driver/nvidia/version").exists():
        return ""
    return f" (no NVIDIA GPU here: first {CPU_TORCH}, the CPU-only build)"


def require(extra: str, who: str) -> None:
    """Raise MissingExtra (one line: what is missing and the command that installs it) unless every module of
    `extra` imports."""
    missing = missing_modules(extra)
    if not missing:
        return
    names = " and ".join(name for name, _ in missing)
    errors = "; ".join(why for _, why in missing if why)
    verb = "does" if len(missing) == 1 else "do"
    state = f"which {verb} not import ({errors})" if errors else "not installed"
    hint = install_command(extra)
    if any(name == "torch" for name, _ in missing):
        hint += cpu_torch_hint()
    raise MissingExtra(f"{who} needs {names} (the '{extra}' extra), {state}: {hint}")
