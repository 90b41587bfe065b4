"""Tests for hwprofiles: bundled profiles, validation errors, overrides, saving and loading user files."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from tierflow import hwprofiles
from tierflow.hwprofiles import (
    HardwareProfile,
    ProfileError,
    list_profiles,
    load_profile,
    profile_from_dict,
    save_profile,
)

BUNDLED = [
    "a100-80g-nvme",
    "dgx-a100-8gpu",
    "h100-80g",
    "h200-lent",
    "polaris-a100-40g",
    "rtx2060-laptop",
    "rtx3090-desktop",
    "rtx4090-lohan",
    "rtx4090-lohan-4gpu",
    "v100-32g",
]
PACKAGE_DIR = Path(hwprofiles.__file__).parent


def lohan_dict() -> dict:
    return load_profile("rtx4090-lohan").to_dict()


def write_yaml(tmp_path: Path, data: object, name: str = "box.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def assert_one_line_error(exc: ProfileError, source: str, key: str | None, *fragments: str) -> None:
    message = str(exc)
    assert "\n" not in message
    assert message.startswith(f"{source}: "), message
    if key is not None:
        assert message.startswith(f"{source}: {key}: "), message
    # "<file>: <key>: <problem> (<how to fix>)"
    assert re.search(r"\(.+\)$", message), message
    for fragment in fragments:
        assert fragment in message, message


# ------------------------------------------------------------------------------------------- bundled profiles


def test_list_profiles_names_the_bundled_files_sorted():
    assert list_profiles() == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profile_loads_and_is_consistent(name):
    profile = load_profile(name)
    assert isinstance(profile, HardwareProfile)
    assert profile.name == name
    assert profile.source == f"hwprofiles/{name}.yaml"
    assert 0 < profile.gpu.capacity_bytes < profile.gpu.memory_gib * 2**30
    assert 0 < profile.cpu.capacity_bytes < profile.cpu.memory_gib * 2**30
    assert profile.pcie.duplex_h2d_gbps <= profile.pcie.h2d_gbps
    assert profile.price.total_usd(profile) > profile.price.gpu_usd
    line = profile.summary()
    assert "\n" not in line and profile.gpu.model in line
    # to_dict round-trips, also through YAML text
    assert profile_from_dict(profile.to_dict()) == profile
    assert profile_from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict()))) == profile


@pytest.mark.parametrize("name", BUNDLED)
def test_every_number_in_a_bundled_file_has_a_source_comment(name):
    commented: set[tuple[str, str]] = set()
    section = ""
    for line in (PACKAGE_DIR / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^([a-z_]+):\s*(#.*)?$", line):
            section = match.group(1)
        elif match := re.match(r"^(\s*)([a-z_0-9]+):\s*([^#]*?)\s*(#\s*(.*))?$", line):
            indent, key, comment = match.group(1), match.group(2), match.group(5) or ""
            if len(comment) > 5:
                commented.add((section if indent else "", key))
    profile = load_profile(name)
    numeric = [("", "schema_version")] + [
        (sec, key)
        for sec, values in profile.to_dict().items()
        if isinstance(values, dict)
        for key, value in values.items()
        if value is None or isinstance(value, (int, float))
    ]
    # every numeric key of the schema, including the nullable ones (+5 with a topology, +2 with a network, +6
    # with a compute section)
    assert len(numeric) == (53 + 5 * (profile.topology is not None) + 2 * (profile.network is not None)
                            + 6 * (profile.compute is not None))
    missing = [f"{sec}.{key}" for sec, key in numeric if (sec, key) not in commented]
    assert not missing, f"{name}: numbers without a source comment: {missing}"


def test_lohan_profile_has_the_paper_box_numbers():
    p = load_profile("rtx4090-lohan")
    assert p.gpu.model == "RTX 4090"
    assert p.gpu.peak_tflops == 165.2
    assert p.gpu.hbm_gbps == 1008
    assert p.gpu.capacity_bytes == int((24 - 1.8) * 2**30)
    assert p.cpu.memory_gib == 768
    assert p.cpu.memory_gbps == pytest.approx(16 * 25.6)
    # the host model (planner/core/hostadam.py): 52 cores outrun the socket, whose sustained 75% of 409.6 GB/s
    # sets the rate of tierflow's kernel (30 B per parameter) and of DeepSpeedCPUAdam's loop (28 B)
    assert p.cpu.adam_gparams_per_s == pytest.approx(409.6 * 0.75 / 30, rel=5e-3)  # 3 digits
    assert p.cpu.deepspeed_adam_gparams_per_s == pytest.approx(409.6 * 0.75 / 28, rel=5e-3)
    assert p.ssd.count == 12
    assert p.ssd.read_gbps == 6.5  # the spec: the fit leaves it on its upper bound
    assert 1 <= p.ssd.write_gbps < 3.4  # fitted below the 3.4 GB/s spec, within the fit's bounds
    # the fitted host path in series with the drives: 1 / (1 / (12 x rate) + 1 / host path), each way
    h = p.ssd.host_path_gbps
    assert 5 <= h <= 200
    assert p.ssd.total_read_gbps == pytest.approx(1 / (1 / (12 * 6.5) + 1 / h))
    assert p.ssd.total_write_gbps == pytest.approx(1 / (1 / (12 * p.ssd.write_gbps) + 1 / h))
    one = p.with_overrides({"ssd.count": "1"}).ssd
    assert one.total_read_gbps == pytest.approx(1 / (1 / 6.5 + 1 / h))  # and with one drive
    assert p.ssd.capacity_bytes == 12 * 3840 * 10**9
    assert p.summary().startswith("RTX 4090 24 GiB (165 TFLOPS), PCIe 4.0 25/25 GB/s, 768 GiB DRAM, 12x "
                                  "D7-P5510")


def test_lohan_profile_fitted_fields_name_their_data_and_reproduce_it():
    """The fitted SSD fields say which data they were fitted on, and the bundled profile predicts that data
    within the fit's residuals (the fit's own check, repeated on the shipped numbers)."""
    from tierflow.planner.fit.profile_fit import load_runs, predict

    text = (PACKAGE_DIR / "rtx4090-lohan.yaml").read_text(encoding="utf-8")
    data = "lohan_fuyou_ssd_count_as_coded.csv"
    for key in ("write_gbps", "host_path_gbps"):
        line = next(x for x in text.splitlines() if x.strip().startswith(key + ":"))
        assert "fit:" in line and data in line, line
    p = load_profile("rtx4090-lohan")
    runs = load_runs(Path(__file__).resolve().parents[2] / "experiments" / "data" / data)
    errors = [predict(r, p).value / r.measured - 1 for r in runs]
    assert len(errors) == 5
    assert max(abs(e) for e in errors) < 0.10, errors
    assert p.price.total_usd(p) == pytest.approx(4500 + 2200 + 768 * 2.34 + 12 * 475)


def test_profiles_differ_where_the_hardware_differs():
    laptop, h100 = load_profile("rtx2060-laptop"), load_profile("h100-80g")
    assert laptop.pcie.generation == 3 and h100.pcie.generation == 5
    assert laptop.gpu.memory_gib == 6 and h100.gpu.memory_gib == 80
    assert laptop.cpu.adam_gparams_per_s < h100.cpu.adam_gparams_per_s


# ------------------------------------------------------------------------------------------ validation errors

BAD_VALUES = [
    # (section, key, bad value, expected fragments)
    ("gpu", "peak_tflops", -3, ["must be > 0, got -3", "fix the value in the file"]),
    ("cpu", "memory_gbps", 0, ["must be > 0, got 0"]),
    ("gpu", "reserved_gib", -1, ["must be >= 0, got -1"]),
    ("gpu", "peak_tflops", "fast", ["expected a number, got string 'fast'"]),
    ("pcie", "h2d_gbps", True, ["expected a number, got boolean True"]),
    ("gpu", "memory_gib", None, ["expected a number, got null"]),
    ("gpu", "model", 4090, ["expected a string, got integer 4090", "quotes"]),
    ("ssd", "count", 2.5, ["expected an integer, got number 2.5"]),
    ("ssd", "count", -1, ["must be >= 0, got -1"]),
    ("pcie", "generation", "4", ["expected an integer, got string '4'"]),
    ("ssd", "capacity_gb", "3.84e3", ["expected a number", "write it as 3840.0"]),
    ("gpu", "hbm_gbps", float("nan"), ["must be a finite number"]),
    ("gpu", "gemm_efficiency", 87, ["must be in (0, 1], got 87", "0.87"]),
    ("gpu", "hbm_efficiency", 0, ["must be in (0, 1], got 0"]),
    ("gpu", "peak_tflops", 1e6, ["absurd value", "TFLOPS"]),
    ("gpu", "memory_gib", 24576, ["absurd value 24576", "GiB"]),
    ("cpu", "memory_gib", 2e5, ["absurd value"]),
    ("cpu", "adam_gparams_per_s", 500, ["absurd value 500"]),
    ("pcie", "h2d_gbps", 5000, ["absurd value 5000", "GB/s"]),
    ("gpu", "hbm_gbps", 2e5, ["absurd value"]),
    ("ssd", "count", 100, ["absurd value 100"]),
    ("ssd", "capacity_gb", 1e6, ["absurd value"]),
    ("ssd", "array_read_gbps", -5, ["must be > 0, got -5"]),
    ("ssd", "array_read_gbps", "fast", ["expected a number or null"]),
    ("ssd", "rw_sharing", "both", ["must be one of 'shared', 'independent', got 'both'"]),
    ("pcie", "duplex_h2d_gbps", 30, ["must be <= pcie.h2d_gbps (25), got 30"]),
    ("pcie", "duplex_d2h_gbps", 26, ["must be <= pcie.d2h_gbps (25), got 26"]),
    ("gpu", "reserved_gib", 24, ["must be < gpu.memory_gib (24), got 24"]),
    ("cpu", "reserved_gib", 800, ["must be < cpu.memory_gib (768), got 800"]),
    ("ssd", "read_gbps", 0, ["must be > 0 when ssd.count > 0, got 0"]),
    ("price", "gpu_usd", -1, ["must be > 0, got -1"]),
]


@pytest.mark.parametrize(("section", "key", "value", "fragments"), BAD_VALUES)
def test_bad_value_in_file_gives_one_line_error(tmp_path, section, key, value, fragments):
    data = lohan_dict()
    data[section][key] = value
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), f"{section}.{key}", *fragments)


def test_unknown_key_suggests_the_close_one(tmp_path):
    data = lohan_dict()
    data["cpu"]["memroy_gib"] = data["cpu"].pop("memory_gib")
    path = write_yaml(tmp_path, data, "my.yaml")
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert str(info.value) == f"{path}: cpu.memroy_gib: unknown key (did you mean 'memory_gib'?)"


def test_unknown_key_without_close_match_lists_the_known_keys(tmp_path):
    data = lohan_dict()
    data["pcie"]["zzz"] = 1
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(
        info.value, str(path), "pcie.zzz", "unknown key", "known keys: generation, h2d_gbps"
    )


def test_unknown_top_level_section(tmp_path):
    data = lohan_dict()
    data["gpus"] = data.pop("gpu")
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), "gpus", "unknown key", "did you mean 'gpu'?")


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("gpu", "hbm_gbps"),
        ("pcie", "duplex_d2h_gbps"),
        ("price", "base_usd"),
        ("ssd", "rw_sharing"),
        ("ssd", "count"),
    ],
)
def test_missing_key(tmp_path, section, key):
    data = lohan_dict()
    del data[section][key]
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(
        info.value, str(path), f"{section}.{key}", "missing key", f"add '{key}:' under '{section}:'"
    )


@pytest.mark.parametrize("key", ["price", "schema_version", "name"])
def test_missing_top_level_key(tmp_path, key):
    data = lohan_dict()
    del data[key]
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), key, "missing key")


def test_section_that_is_not_a_mapping(tmp_path):
    data = lohan_dict()
    data["gpu"] = 5
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), "gpu", "expected a mapping")


def test_wrong_schema_version(tmp_path):
    data = lohan_dict()
    data["schema_version"] = 2
    path = write_yaml(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), "schema_version", "unsupported version 2", "reads version 1")


def test_array_ceilings_are_optional_and_nullable(tmp_path):
    data = lohan_dict()
    del data["ssd"]["array_read_gbps"]
    data["ssd"]["array_write_gbps"] = None
    del data["ssd"]["host_path_gbps"]
    p = load_profile(write_yaml(tmp_path, data))
    assert p.ssd.array_read_gbps is None and p.ssd.host_path_gbps is None
    assert p.ssd.total_read_gbps == pytest.approx(12 * 6.5)  # linear in the drives
    assert p.ssd.total_write_gbps == pytest.approx(12 * p.ssd.write_gbps)
    data["ssd"]["array_read_gbps"] = 50.0
    data["ssd"]["host_path_gbps"] = 100.0
    p = load_profile(write_yaml(tmp_path, data))
    assert p.ssd.total_read_gbps == pytest.approx(1 / (1 / 78 + 1 / 100))  # 43.8: the host path in series
    assert p.ssd.total_write_gbps == pytest.approx(1 / (1 / (12 * p.ssd.write_gbps) + 1 / 100))
    data["ssd"]["host_path_gbps"] = 1000.0
    assert load_profile(write_yaml(tmp_path, data)).ssd.total_read_gbps == 50.0  # then the ceiling


def test_no_ssd_needs_only_count(tmp_path):
    data = lohan_dict()
    data["ssd"] = {"count": 0}
    data["price"]["ssd_usd_each"] = 0
    p = load_profile(write_yaml(tmp_path, data))
    assert p.ssd.count == 0 and p.ssd.model == "none" and p.ssd.rw_sharing == "shared"
    assert p.ssd.array_read_gbps is None
    assert p.ssd.capacity_bytes == 0 and p.ssd.total_read_gbps == 0 and p.ssd.total_write_gbps == 0
    assert p.summary().endswith("768 GiB DRAM, no SSD")
    assert profile_from_dict(p.to_dict()) == p


# -------------------------------------------------------------------------------------------- malformed files


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("schema_version: 1\ngpu:\n  model: [RTX 4090\n  memory_gib: 24\n", encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), None, "malformed YAML", "fix the YAML syntax")
    assert re.match(rf"{re.escape(str(path))}: line \d+ column \d+: ", str(info.value))


def test_tab_indentation_is_malformed_yaml(tmp_path):
    path = tmp_path / "tabs.yaml"
    path.write_text("gpu:\n\tmodel: x\n", encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), None, "malformed YAML")


def test_duplicate_key_is_an_error(tmp_path):
    text = (PACKAGE_DIR / "rtx4090-lohan.yaml").read_text(encoding="utf-8")
    text = text.replace("  hbm_gbps: 1008", "  hbm_gbps: 1008\n  hbm_gbps: 2000", 1)
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), None, "duplicate key 'hbm_gbps'", "keep only one")


@pytest.mark.parametrize(("text", "fragment"), [("", "file is empty"), ("- 1\n- 2\n", "expected a mapping")])
def test_empty_or_non_mapping_file(tmp_path, text, fragment):
    path = tmp_path / "odd.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert_one_line_error(info.value, str(path), None, fragment)


def test_unknown_profile_name_lists_the_known_ones():
    with pytest.raises(ProfileError) as info:
        load_profile("nope")
    assert str(info.value) == (
        "nope: unknown hardware profile (known: " + ", ".join(BUNDLED) + "; or give a path to a .yaml file)"
    )


def test_missing_file(tmp_path):
    path = tmp_path / "does" / "not" / "exist.yaml"
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert_one_line_error(info.value, str(path), None, "file not found", "rtx4090-lohan")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile(tmp_path)
    assert_one_line_error(info.value, str(tmp_path), None, "is a directory")


def test_profile_from_dict_rejects_non_mapping_and_names_the_source():
    with pytest.raises(ProfileError) as info:
        profile_from_dict(["not", "a", "dict"])  # type: ignore[arg-type]
    assert_one_line_error(info.value, "<dict>", "(top level)", "expected a mapping")
    data = lohan_dict()
    data["gpu"]["peak_tflops"] = 0
    with pytest.raises(ProfileError) as info:
        profile_from_dict(data, source="calibrated")
    assert_one_line_error(info.value, "calibrated", "gpu.peak_tflops", "must be > 0, got 0")


def test_profile_error_is_a_value_error_and_joins_lines():
    assert issubclass(ProfileError, ValueError)
    assert str(ProfileError("a\nb   c")) == "a b c"


# ------------------------------------------------------------------------------------------------ overrides


def test_overrides_change_values_and_name_and_leave_the_original_alone():
    base = load_profile("rtx4090-lohan")
    p = base.with_overrides({"ssd.count": 6, "cpu.memory_gib": 256, "pcie.h2d_gbps": 50})
    assert p.ssd.count == 6 and p.cpu.memory_gib == 256 and p.pcie.h2d_gbps == 50
    # fewer drives, same host path
    assert p.ssd.total_read_gbps == pytest.approx(1 / (1 / (6 * 6.5) + 1 / p.ssd.host_path_gbps))
    assert p.name == "rtx4090-lohan[cpu.memory_gib=256,pcie.h2d_gbps=50,ssd.count=6]"
    assert p.source == base.source
    assert base.ssd.count == 12 and base.name == "rtx4090-lohan"
    assert p.gpu == base.gpu
    assert base.with_overrides({"ssd.count": 6}).name == "rtx4090-lohan[ssd.count=6]"


def test_overrides_accept_strings_from_a_command_line():
    p = load_profile("rtx4090-lohan").with_overrides(
        {"ssd.count": "6", "gpu.peak_tflops": "150.5", "ssd.array_read_gbps": "null",
         "ssd.host_path_gbps": "null", "ssd.model": "980 Pro"}
    )
    assert p.ssd.count == 6 and isinstance(p.ssd.count, int)
    assert p.gpu.peak_tflops == 150.5
    assert p.ssd.array_read_gbps is None and p.ssd.total_read_gbps == pytest.approx(6 * 6.5)
    assert p.ssd.model == "980 Pro"


def test_overrides_are_revalidated():
    base = load_profile("rtx4090-lohan")
    with pytest.raises(ProfileError) as info:
        base.with_overrides({"gpu.peak_tflops": -1})
    assert_one_line_error(
        info.value,
        "hwprofiles/rtx4090-lohan.yaml (overrides)",
        "gpu.peak_tflops",
        "must be > 0",
        "fix the override",
    )
    with pytest.raises(ProfileError) as info:
        base.with_overrides({"pcie.h2d_gbps": 10})  # below the 12 GB/s duplex rate
    assert_one_line_error(
        info.value, "hwprofiles/rtx4090-lohan.yaml (overrides)", "pcie.duplex_h2d_gbps", "<="
    )
    with pytest.raises(ProfileError) as info:
        base.with_overrides({"ssd.count": "many"})
    assert_one_line_error(
        info.value, "hwprofiles/rtx4090-lohan.yaml (overrides)", "ssd.count", "expected an integer"
    )


def test_unknown_override_key_suggests_the_close_one():
    with pytest.raises(ProfileError) as info:
        load_profile("rtx4090-lohan").with_overrides({"ssd.cuont": 6})
    assert str(info.value) == (
        "hwprofiles/rtx4090-lohan.yaml (overrides): ssd.cuont: unknown key (did you mean 'ssd.count'?)"
    )
    with pytest.raises(ProfileError):
        load_profile("rtx4090-lohan").with_overrides({"name": "x"})


def test_override_to_no_ssd_and_back():
    base = load_profile("rtx4090-lohan")
    none = base.with_overrides({"ssd.count": 0})
    assert none.ssd.total_read_gbps == 0 and none.ssd.capacity_bytes == 0
    again = none.with_overrides({"ssd.count": 12})
    assert again.ssd == base.ssd
    assert again.name == "rtx4090-lohan[ssd.count=0][ssd.count=12]"


def test_empty_overrides_return_the_same_profile():
    base = load_profile("h100-80g")
    assert base.with_overrides({}) is base


def test_profiles_are_frozen_and_hashable():
    p = load_profile("v100-32g")
    with pytest.raises(AttributeError):
        p.gpu.memory_gib = 1  # type: ignore[misc]
    assert len({p, load_profile("v100-32g")}) == 1


# ------------------------------------------------------------------------------------------------ user files


def test_a_users_own_file_loads_by_path(tmp_path):
    data = lohan_dict()
    data["name"] = "my-box"
    data["ssd"]["count"] = 2
    path = write_yaml(tmp_path, data, "my-box.yaml")
    for arg in (path, str(path)):
        p = load_profile(arg)
        assert p.name == "my-box" and p.ssd.count == 2 and p.source == str(path)


def test_relative_path_loads(tmp_path, monkeypatch):
    write_yaml(tmp_path, lohan_dict(), "box.yml")
    monkeypatch.chdir(tmp_path)
    assert load_profile("box.yml").name == "rtx4090-lohan"


def test_save_profile_round_trips(tmp_path):
    original = load_profile("a100-80g-nvme").with_overrides({"ssd.count": 8, "ssd.array_read_gbps": 40})
    path = tmp_path / "calibrated.yaml"
    save_profile(original, path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith("#")
    loaded = load_profile(path)
    assert loaded == original
    assert loaded.name == "a100-80g-nvme[ssd.array_read_gbps=40,ssd.count=8]"
    assert loaded.ssd.total_read_gbps == 40
    assert loaded.source == str(path)


def test_save_profile_of_every_bundled_profile_round_trips(tmp_path):
    for name in BUNDLED:
        p = load_profile(name)
        save_profile(p, tmp_path / f"{name}.yaml")
        assert load_profile(tmp_path / f"{name}.yaml") == p


def test_to_dict_is_a_deep_copy_safe_structure():
    p = load_profile("rtx3090-desktop")
    d = p.to_dict()
    d2 = copy.deepcopy(d)
    d["gpu"]["memory_gib"] = 1
    assert p.gpu.memory_gib == 24
    assert profile_from_dict(d2) == p
    assert list(d) == ["schema_version", "name", "description", "gpu", "pcie", "cpu", "ssd", "price",
                       "compute"]
