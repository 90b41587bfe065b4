"""planner/core/hostadam.py: CPU Adam's rate from the host, per implementation, and its use for processes
that share a box (planner/core/world.py)."""

from __future__ import annotations

import pytest

from tierflow.hwprofiles import load_profile
from tierflow.planner.core import hostadam
from tierflow.planner.core.hostadam import CORE_COSTS, IMPLS, HostCpu, adam_rate, profile_rate
from tierflow.planner.core.world import host_share, independent_process_profile, process_adam_rates

ZEN3 = CORE_COSTS["zen3"]


def test_many_cores_are_bound_by_the_socket_one_core_by_itself():
    socket = HostCpu(64, 2.8, ZEN3, 204.8, 0.75)
    for impl in IMPLS.values():
        r = adam_rate(impl, socket)
        assert r.bound == "memory"
        assert r.gparams_per_s == pytest.approx(204.8 * 0.75 / impl.bytes_per_param)
    one = HostCpu(1, 2.45, ZEN3, 204.8, 0.75)  # one core cannot draw the socket's rate
    r = adam_rate("torch_fused", one)
    assert r.gparams_per_s == pytest.approx(min(ZEN3.core_gbps / 28, r.compute_gparams_per_s))
    assert r.gparams_per_s < adam_rate("torch_fused", socket).gparams_per_s


def test_a_slow_clock_makes_the_divide_unit_bind():
    slow = HostCpu(1, 0.2, ZEN3, 1000.0, 1.0)
    ds, fused = adam_rate("deepspeed", slow), adam_rate("torch_fused", slow)
    assert ds.bound == fused.bound == "compute"
    # DeepSpeed folds the bias correction into an FMA: one division fewer per element than torch's loop
    assert ds.gparams_per_s > fused.gparams_per_s
    assert ds.gparams_per_s == pytest.approx(0.2 / (ZEN3.sqrt_cycles + ZEN3.div_cycles))


def test_bytes_moved_order_the_memory_bound_implementations():
    cpu = HostCpu(32, 2.8, ZEN3, 204.8, 0.75)
    rates = {k: adam_rate(k, cpu).gparams_per_s for k in IMPLS}
    # tierflow's kernel also writes the bf16 copy (it leaves the gradient for the next step's first write to
    # overwrite): 30 B against 28
    assert rates["tierflow"] / rates["torch_fused"] == pytest.approx(28 / 30)


def test_a_profile_without_its_cpu_cannot_say():
    hw = load_profile("h200-lent")  # the lent machine's CPU model was not recorded
    assert hw.cpu.clock_ghz is None and hostadam.host_cpu(hw) is None
    assert profile_rate(hw, "tierflow") is None


def test_an_unmeasured_microarchitecture_takes_lower_bounds():
    hw = load_profile("rtx4090-lohan")
    assert hw.cpu.microarchitecture not in CORE_COSTS
    cpu = hostadam.host_cpu(hw)
    assert cpu.core is hostadam.LOWER_BOUND_COSTS
    # 52 cores x 7 GB/s exceed the socket's sustained 307 GB/s: the socket binds whatever the core
    assert adam_rate("deepspeed", cpu).gparams_per_s == pytest.approx(409.6 * 0.75 / 28)
    few = hw.with_overrides({"cpu.physical_cores": 4})
    assert profile_rate(few, "deepspeed").gparams_per_s == pytest.approx(4 * 7.0 / 28)


def test_processes_share_cores_memory_array_and_uplink():
    hw = load_profile("rtx4090-lohan-4gpu").with_overrides({"topology.gpus_per_switch": 2,
                                                             "topology.switch_uplink_gbps": 20.0})
    s = host_share(hw, 2)
    assert (s.cores, s.memory_gbps, s.ssd_drives, s.uplink_gbps) == (26, 204.8, 6, 10.0)
    one = independent_process_profile(hw, 2)
    assert one.cpu.physical_cores == 26 and one.pcie.h2d_gbps == 10.0
    assert one.gpu == hw.gpu


def test_process_adam_rates_follow_the_model_on_a_few_core_box():
    """On a box whose optimizer is bound by its cores, a process gets its share of the cores; the profile's
    own rate is scaled as the model scales it (half the threads: half the rate)."""
    hw = load_profile("polaris-a100-40g").with_overrides({"cpu.physical_cores": 2})
    rates = process_adam_rates(hw, 2)
    alone, shared = profile_rate(hw, "tierflow"), profile_rate(hw, "tierflow", 1, 0.5)
    assert alone.bound == "memory"  # two cores' streams, well below the socket
    assert rates["cpu.adam_gparams_per_s"] == pytest.approx(hw.cpu.adam_gparams_per_s * shared.gparams_per_s
                                                            / alone.gparams_per_s)
    assert rates["cpu.adam_gparams_per_s"] == pytest.approx(hw.cpu.adam_gparams_per_s / 2)
    assert process_adam_rates(hw, 1)["cpu.adam_gparams_per_s"] == pytest.approx(hw.cpu.adam_gparams_per_s)


def test_microarchitecture_is_a_checked_choice():
    from tierflow.hwprofiles.profile import ProfileError

    hw = load_profile("polaris-a100-40g")
    with pytest.raises((ProfileError, ValueError)) as e:
        hw.with_overrides({"cpu.microarchitecture": "pentium4"})
    assert "microarchitecture" in str(e.value)


def _profile_lines(name: str) -> dict[str, str]:
    """The comment of each CPU Adam line of a bundled profile's YAML."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "hwprofiles" / f"{name}.yaml").read_text()
    return {key: re.search(rf"^  {key}: [^#\n]*#\s*(.*)$", text, re.M).group(1)
            for key in hostadam.PROFILE_FIELDS}


def test_bundled_profiles_carry_the_models_rates_or_a_measured_one():
    """One source of truth: each bundled profile's two CPU Adam rates are the host model's on its cpu fields
    (written by experiments/host_adam_model.py --write-profiles), unless the line says it is measured or
    fitted; a profile the model cannot describe carries only measured (or null) rates."""
    from tierflow.hwprofiles import list_profiles

    modelled = 0
    for name in list_profiles():
        hw, comments = load_profile(name), _profile_lines(name)
        fields = hostadam.profile_fields(hw)
        for key in hostadam.PROFILE_FIELDS:
            value, comment = getattr(hw.cpu, key), comments[key]
            if comment.startswith(hostadam.KEPT_SOURCES) or (value is None and key not in fields):
                continue
            assert key in fields, (name, key, comment)
            assert comment.startswith("host model"), (name, key, comment)
            assert value == pytest.approx(fields[key][0], rel=1e-9), (name, key)
            modelled += 1
    assert modelled >= 15  # nine profiles describe their host; polaris' DeepSpeed rate is fitted


def test_the_rates_comment_names_the_binding_bound_and_its_inputs():
    hw = load_profile("polaris-a100-40g")
    value, text = hostadam.rate_comment(hw, "tierflow")
    assert value == pytest.approx(204.8 * 0.75 / 30, rel=5e-3)
    assert "memory-bound at the socket" in text and "204.8 GB/s x 0.75" in text and "30 B" in text
    few = hw.with_overrides({"cpu.physical_cores": 1, "cpu.clock_ghz": 0.3})
    value, text = hostadam.rate_comment(few, "deepspeed")
    assert "compute-bound: 1 cores x 0.3 GHz" in text
    assert value == pytest.approx(profile_rate(few, "deepspeed").compute_gparams_per_s, rel=5e-3)  # 3 digits
    assert hostadam.rate_comment(load_profile("h200-lent"), "tierflow") is None
