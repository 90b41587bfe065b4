"""calibration/cpu.py's host facts (cpu.microarchitecture, physical_cores, clock_ghz) and the profile
calibrate builds from them: detected on the box, never the base's."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tierflow.executor.calibration import cpu as cal_cpu  # noqa: E402
from tierflow.executor.calibration import profile_builder as cal_profile  # noqa: E402
from tierflow.hwprofiles import load_profile  # noqa: E402


def cpuinfo(vendor: str, family: int, model: int, name: str, cores: list[tuple[int, int]]) -> str:
    blocks = []
    for i, (phys, core) in enumerate(cores):
        blocks.append(f"processor\t: {i}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                      f"model name\t: {name}\nphysical id\t: {phys}\ncore id\t\t: {core}\n")
    return "\n".join(blocks)


@pytest.mark.parametrize("vendor, family, model, arch", [
    ("AuthenticAMD", 25, 1, "zen3"),  # EPYC 7003 (Milan), as this dev VM reports it
    ("AuthenticAMD", 25, 0x21, "zen3"),  # Ryzen 5000 (Vermeer)
    ("AuthenticAMD", 25, 0x11, "zen4"),  # EPYC 9004 (Genoa)
    ("AuthenticAMD", 23, 0x31, "zen2"),  # EPYC 7002 (Rome)
    ("GenuineIntel", 6, 0x55, "skylake-sp"),
    ("GenuineIntel", 6, 0x6a, "icelake-sp"),
    ("GenuineIntel", 6, 0x8f, "sapphirerapids"),
    ("GenuineIntel", 6, 0xa5, "cometlake"),
    ("AuthenticAMD", 23, 0x01, "unknown"),  # Zen 1: a generation the model does not name
    ("GenuineIntel", 6, 0xcf, "unknown"),  # Emerald Rapids: not in the table, not guessed
])
def test_microarchitecture_from_vendor_family_and_model(vendor, family, model, arch):
    got, how = cal_cpu.microarchitecture(cpuinfo(vendor, family, model, "x", [(0, 0)]))
    assert got == arch
    assert f"model {model:#x}" in how


def test_an_unreadable_cpuinfo_says_unknown_and_why():
    assert cal_cpu.microarchitecture("") == ("unknown", "no x86 vendor, family and model in /proc/cpuinfo")


def test_physical_cores_count_core_ids_per_socket_not_hardware_threads():
    text = cpuinfo("GenuineIntel", 6, 0x6a, "Intel(R) Xeon(R) Gold 5320 CPU @ 2.20GHz",
                   [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)])
    assert cal_cpu.physical_cores(text) == 4  # 2 sockets x 2 cores, 2 threads each
    assert cal_cpu.physical_cores("processor\t: 0\n") is None


def test_the_clock_is_the_base_clock_never_the_current_one(tmp_path):
    text = cpuinfo("GenuineIntel", 6, 0x6a, "Intel(R) Xeon(R) Gold 5320 CPU @ 2.20GHz", [(0, 0)])
    missing = str(tmp_path / "none")
    assert cal_cpu.base_clock_ghz(text, missing)[0] == pytest.approx(2.2)
    sysfs = tmp_path / "base_frequency"
    sysfs.write_text("2450000\n")
    assert cal_cpu.base_clock_ghz(text, str(sysfs)) == (pytest.approx(2.45), str(sysfs))
    amd = cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC", [(0, 0)]) + "cpu MHz\t\t: 2445.406\n"
    assert cal_cpu.base_clock_ghz(amd, missing)[0] is None


def _measurements(facts: dict | None) -> dict:
    cpu = {"model": "test CPU", "memory_gib": 64.0, "memory_gbps": 40.0, "adam_gparams_per_s": 1.0,
           "adam_impl": "fused"}
    if facts is not None:
        cpu["facts"] = facts
    return {"host": "box", "cpu_threads": 2, "gpu": None, "pcie": None, "cpu": cpu, "ssd": None, "errors": []}


def test_calibrate_writes_the_detected_facts_and_never_the_bases():
    base = load_profile("h100-80g")  # sapphirerapids, 112 cores, 2.0 GHz, 16 channels: another box
    facts = {"microarchitecture": "zen3", "microarchitecture_how": "/proc/cpuinfo: ... zen3",
             "physical_cores": 2, "clock_ghz": None, "clock_how": "no clock"}
    c = cal_profile.build_profile(_measurements(facts), base)
    cpu = c.profile.cpu
    got = (cpu.microarchitecture, cpu.physical_cores, cpu.clock_ghz, cpu.memory_channels)
    assert got == ("zen3", 2, None, None)
    info = {f.key: f for f in c.fields}
    assert info["cpu.microarchitecture"].source == "measured"
    assert info["cpu.clock_ghz"].source == "not measured"
    old = cal_profile.build_profile(_measurements(None), base).profile.cpu  # a file without the facts
    assert (old.microarchitecture, old.physical_cores) == ("unknown", None)
