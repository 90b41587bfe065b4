"""`tierflow env`: versions, CUDA, O_DIRECT of --ssd-dir (the SSD tier's own probe), pinned-memory limits,
cores and what calibrate would measure; it starts without torch and reports a broken torch instead of
failing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata

import pytest

from tierflow import __version__
from tierflow.executor.env import collect, format_report, meminfo
from tierflow.executor.tiers.direct_io import probe_o_direct

TIERFLOW = [sys.executable, "-m", "tierflow"]


def _env(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*TIERFLOW, "env", *args], capture_output=True, text=True, timeout=120, **kw)


def test_env_json_reports_this_machine(tmp_path):
    # what --json prints (the CLI: the broken-torch test)
    r = json.loads(json.dumps(collect(tmp_path).to_dict()))
    v = r["versions"]
    assert v["python"] == platform.python_version() and v["tierflow"] == __version__
    assert v["ortools"] == metadata.version("ortools") and v["numpy"] == metadata.version("numpy")
    assert r["ssd_dir"]["path"] == str(tmp_path.resolve())
    assert r["ssd_dir"]["o_direct"] is probe_o_direct(tmp_path) and r["ssd_dir"]["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert r["cores_online"] == os.cpu_count() and 1 <= r["cores_usable"] <= r["cores_online"]
    if os.path.exists("/proc/meminfo"):
        assert r["memory_bytes"] == meminfo()["MemTotal"]
        assert r["pinned"]["mem_total_bytes"] == r["memory_bytes"]
        assert r["pinned"]["mem_available_bytes"] <= r["memory_bytes"]
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert r["pinned"]["memlock_soft_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    torch = pytest.importorskip("torch")
    assert v["torch"] == torch.__version__ and r["torch_error"] == ""
    from tierflow.executor.calibration import FULL, measurement_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert r["calibrate_device"] == device
    assert r["calibrate_measures"] == measurement_plan(device, FULL, ssd=True)
    from tierflow.executor.optim.fused_host_adamw import unsupported

    tried = not unsupported() and os.environ.get("TIERFLOW_PURE_ADAMW") != "1"  # (a compiler, ninja, AVX2)
    assert r["host_optimizer"].startswith("one-pass kernel" if tried else "torch's kernels")
    if device == "cuda":
        g = r["gpus"][0]
        props = torch.cuda.get_device_properties(0)
        assert g["name"] == props.name and g["memory_bytes"] == props.total_memory
        assert g["capability"] == f"{props.major}.{props.minor}"
    else:
        assert r["gpus"] == [] and r["cuda"].startswith("not available")


def test_env_text_names_every_section(tmp_path):
    text = format_report(collect(tmp_path))
    for heading in ("versions", "CUDA:", f"SSD directory {tmp_path.resolve()}", "O_DIRECT", "pinned host "
                                                                                            "memory",
                    "ulimit -l", "meminfo", "CPU:", "cores", "tierflow calibrate here measures"):
        assert heading in text, heading


def test_env_survives_a_broken_torch_and_starts_without_torch(tmp_path):
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open shared object "
                                      "file')\n")
    environ = {**os.environ, "PYTHONPATH": str(fake.parent)}
    p = _env("--json", env=environ)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["versions"]["torch"] == "not importable" and "libcudart" in r["torch_error"]
    assert r["gpus"] == [] and r["calibrate_measures"] == []
    text = _env(env=environ)
    assert text.returncode == 0 and "torch import failed: ImportError: libcudart" in text.stdout
    # registering the command (and importing its module) pulls in no torch
    probe = subprocess.run([sys.executable, "-c", "import sys, tierflow.executor.env, tierflow.cli as c; "
                            "c.build_parser(); print('torch' in "
                            "sys.modules)"], capture_output=True, text=True,
                           timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_bad_ssd_dir_is_one_line_rc_2(tmp_path):
    p = _env("--ssd-dir", str(tmp_path / "missing"))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"tierflow: error: --ssd-dir {tmp_path / 'missing'}: no such directory (give an existing directory "
        "on the SSD to probe, or leave it out for the current one)"]


def test_o_direct_probe_refusal_and_errors(tmp_path, monkeypatch):
    import errno

    from tierflow.executor.tiers import direct_io

    real_open = os.open

    def refuse(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", refuse)
    assert probe_o_direct(tmp_path) is False  # tmpfs and friends: EINVAL means "no O_DIRECT"
    monkeypatch.setattr(direct_io.os, "open", real_open)
    with pytest.raises(FileNotFoundError):
        probe_o_direct(tmp_path / "missing")  # anything else is an error, not a "no"
    assert list(tmp_path.iterdir()) == []


def test_measurement_plan_is_what_calibrate_measures(tmp_path):
    """The steps `tierflow env` lists are the progress steps a CPU calibration really takes (tiny sizes)."""
    pytest.importorskip("torch")
    from tierflow.executor import calibration as cal
    from tierflow.planner.io.progress import Progress

    class Recorder(Progress):
        def __init__(self) -> None:
            super().__init__(0, "calibrate", enabled=False)
            self.labels: list[str] = []

        def step(self, what: str = "") -> None:
            self.labels.append(what)

    mib = 2**20
    sizes = cal.Sizes(dram_bytes=8 * mib, adam_params=200_000, adam_steps=1, ssd_file_bytes=2 * mib,
                      ssd_block_bytes=mib, ssd_min_s=0.0, ssd_mixed_s=0.1, gpu_target_s=0.002,
                      hbm_bytes=8 * mib, pcie_bytes=8 * mib)
    rec = Recorder()
    cal.run_measurements(sizes, tmp_path, rec, gpu=False, device="cpu")
    assert rec.labels == cal.measurement_plan("cpu", sizes, ssd=True)
    # without --ssd-dir: no SSD steps, then the executor's fixed costs
    no_ssd = cal.measurement_plan("cpu", sizes)
    # (DeepSpeed's CPU Adam is timed after the executor's own where DeepSpeed is installed)
    adam = [i for i, step in enumerate(no_ssd) if step.startswith("CPU AdamW")]
    assert adam and no_ssd[adam[0] + 1:-2] in ([], [s for s in no_ssd if s.startswith("DeepSpeedCPUAdam")])
    assert no_ssd[-2].startswith("compute beside the host's I/O")
    assert no_ssd[-1].startswith("the executor's fixed cost")
    assert not any("SSD" in step for step in no_ssd)
    cuda = cal.measurement_plan("cuda", sizes, ssd=True)
    ds = sum(step.startswith("DeepSpeedCPUAdam") for step in cuda)  # 1 where DeepSpeed is installed
    # GPU, host memory and Adam, launches beside Adam, SSD, executor
    assert len(cuda) == 7 + 2 + ds + 1 + 3 + 1
    assert cuda.index("GPU launches beside the host optimizer") == 9 + ds
    assert cuda[-1].startswith("the executor's fixed cost")  # the tiny plan runs on CUDA too


def test_env_says_when_the_host_optimizer_is_switched_to_torchs_kernels(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("TIERFLOW_PURE_ADAMW", "1")
    assert "TIERFLOW_PURE_ADAMW=1" in collect(".").host_optimizer
