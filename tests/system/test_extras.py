"""The README's first install (`pip install -e .`: no torch, no extra) and every command: each one works, or
says in one line which extra it needs and the exact command that adds it for how tierflow was installed (exit
code 2, before any work), never a traceback. The missing extras are simulated in a subprocess whose
sys.modules holds None for their modules (`import torch` then fails as when torch is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.cli import COMMANDS, build_parser, main
from tierflow.extras import CPU_TORCH, Install, how_installed, install_command

REPO = Path(__file__).resolve().parents[2]
# what `pip install -e .` does not bring: every optional extra's modules
NOT_IN_BASE = ("torch", "safetensors", "transformers", "tokenizers", "numba", "pyarrow", "tensorboard",
               "zlib_ng", "google_crc32c", "accelerate", "peft")
BASE_ONLY = ("import sys\n"
             f"for m in {NOT_IN_BASE!r}:\n"
             "    sys.modules[m] = None\n"
             "from tierflow.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
EDITABLE = {"url": "file:///src/tierflow", "dir_info": {"editable": True}}
TINY = ["--model", "tiny-gpt", "--hw", "rtx4090-lohan", "--batch", "2"]


def command_names() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return list(sub.choices)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny plan and the trace of one CPU step of it (made here, where torch is installed)."""
    d = tmp_path_factory.mktemp("base-install")
    assert main(["plan", *TINY, "-o", str(d / "plan.json")]) == 0
    plan = str(d / "plan.json")
    assert main(["run", plan, "--device", "cpu", "--steps", "1", "--out", str(d / "run")]) == 0
    return d


def minimal_args(d: Path) -> dict[str, list[str]]:
    """Each command of the table with minimal arguments."""
    plan, trace = str(d / "plan.json"), str(d / "run" / "trace.json")
    return {
        "simulate": [*TINY, "--iterations", "1"],
        "plan": [*TINY, "-o", str(d / "again.json")],
        "capacity": ["--hw", "rtx2060-laptop"],
        "compare": [plan, trace],
        "fit": ["--trace", str(d / "no-such-trace.json"), "--plan", plan],  # fast: its one error line
        "models": [],
        "profiles": [],
        "calibrate": ["-o", str(d / "box.yaml"), "--quick"],
        "env": ["--ssd-dir", str(d)],
        "run": [plan, "--device", "cpu", "--steps", "1", "--out", str(d / "never")],
    }


def test_every_command_of_the_base_install_works_or_names_its_extra_in_one_line(workdir):
    args = minimal_args(workdir)
    assert sorted(args) == sorted(command_names()), "give every command of the table its minimal arguments"
    procs = {name: subprocess.Popen([sys.executable, "-c", BASE_ONLY, name, *argv], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, argv in args.items()}
    extra_of = {c.__name__.rsplit(".", 1)[1]: getattr(c, "EXTRA", None) for c in COMMANDS}
    assert extra_of["run"] == extra_of["calibrate"] == "run"
    for name, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert "Traceback" not in err, f"tierflow {name}: {err}"
        if extra_of[name]:
            lines = err.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, f"tierflow {name}: {err}"
            assert lines[0].startswith(f"tierflow: missing extra: tierflow {name} needs torch"), lines
            assert lines[0].split(": ", 3)[3].startswith(install_command("run", cwd=REPO)), lines
            assert "pip install -e '.[run]'" in lines[0]  # this checkout is installed in editable mode
        elif name == "fit":
            assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
        else:
            assert p.returncode == 0, f"tierflow {name}: {err}"
    assert not (workdir / "never").exists() and not (workdir / "box.yaml").exists()  # nothing done


def test_env_without_torch_says_the_install_command(workdir):
    p = subprocess.run([sys.executable, "-c", BASE_ONLY, "env", "--ssd-dir", str(workdir)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "pip install -e '.[run]'" in p.stdout and "tierflow[run]" not in p.stdout


@pytest.mark.parametrize(("direct_url", "cwd", "expected"), [
    (EDITABLE, "/src/tierflow", "pip install -e '.[run]'"),
    (EDITABLE, "/", "pip install -e '/src/tierflow[run]'"),
    ({"url": "file:///src/my%20tierflow", "dir_info": {}}, "/", "pip install '/src/my tierflow[run]'"),
    ({"url": "https://example.org/tierflow-1.0-py3-none-any.whl", "archive_info": {}}, "/",
     "pip install 'tierflow[run]'"),
    (None, "/", "pip install 'tierflow[run]'"),  # from a package index: no direct_url.json
])
def test_install_command_follows_how_tierflow_was_installed(direct_url, cwd, expected, monkeypatch):
    text = "" if direct_url is None else json.dumps(direct_url)
    install = how_installed(text)
    monkeypatch.setattr("tierflow.extras._same", lambda a, b: str(a) == str(b))
    assert install_command("run", install, cwd=Path(cwd)) == expected


def test_this_checkout_is_seen_as_an_editable_install():
    assert how_installed() == Install(editable=True, path=REPO)


def test_the_readme_says_which_extra_each_workflow_needs_and_how_to_keep_a_cpu_torch():
    head = (REPO / "README.md").read_text().split("## What is inside")[0]
    for extra in ("run", "finetune", "fast", "test"):
        assert f"'.[{extra}]'" in head, extra
    assert CPU_TORCH in head


def test_log_dir_without_tensorboard_gives_this_installs_command(tmp_path, monkeypatch):
    from tierflow.executor.tblog import LogDirError, TbLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(LogDirError) as e:
        TbLog(str(tmp_path / "tb"))
    assert install_command("finetune") in str(e.value) and "'tierflow[finetune]'" not in str(e.value)
