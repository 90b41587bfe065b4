"""`tierflow calibrate`: the real measurements at tiny sizes, the profile it writes, and its one-line
errors."""

from __future__ import annotations

import errno
import json

import pytest

torch = pytest.importorskip("torch")

from tierflow.cli import main  # noqa: E402
from tierflow.cli.calibrate import parse_sets  # noqa: E402
from tierflow.executor.calibration import cpu as cal_cpu  # noqa: E402
from tierflow.executor.calibration import executor_costs as cal_executor  # noqa: E402
from tierflow.executor.calibration import gpu as cal_gpu  # noqa: E402
from tierflow.executor.calibration import host_device as cal_host_device  # noqa: E402
from tierflow.executor.calibration import profile_builder as cal_profile  # noqa: E402
from tierflow.executor.calibration import ssd as cal_ssd  # noqa: E402
from tierflow.executor.calibration.common import CalibrationError  # noqa: E402
from tierflow.hwprofiles import OverrideError, load_profile  # noqa: E402
from tierflow.planner.core.costmodel import link_rates  # noqa: E402

HAS_GPU = torch.cuda.is_available()
GPU_KEYS = ["gpu.peak_tflops", "gpu.gemm_efficiency", "gpu.hbm_gbps", "pcie.h2d_gbps", "pcie.duplex_d2h_gbps"]


def test_cpu_measurements_are_positive():
    assert cal_cpu.measure_dram_gbps(16 * 2**20, repeats=2) > 0
    assert cal_cpu.measure_cpu_adam(300_000, steps=1, chunk=100_000) > 0
    assert cal_cpu.adam_impl() in ("fused", "foreach")
    assert cal_cpu.cpu_memory_gib() > 0
    assert cal_cpu.cpu_model().strip()


def test_ssd_measurement_is_positive_and_cleans_up(tmp_path):
    steps = []
    r = cal_ssd.measure_ssd(tmp_path, 8 * 2**20, 2**20, mixed_s=0.2, step=steps.append)
    for key in ("read_gbps", "write_gbps", "mixed_read_gbps", "mixed_write_gbps", "capacity_gb"):
        assert r[key] > 0, key
    assert r["rw_sharing"] in ("shared", "independent")
    assert len(steps) == 3
    assert list(tmp_path.iterdir()) == []


def test_ssd_falls_back_to_buffered_io_with_one_warning(tmp_path, monkeypatch):
    real_open = cal_ssd._open

    def refuse_direct(path, write, direct):
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, write, direct)

    monkeypatch.setattr(cal_ssd, "_open", refuse_direct)
    warnings = []
    r = cal_ssd.measure_ssd(tmp_path, 4 * 2**20, 2**20, mixed_s=0.1, warn=warnings.append)
    assert r["direct"] is False and r["read_gbps"] > 0 and r["write_gbps"] > 0
    assert len(warnings) == 1 and "O_DIRECT" in warnings[0] and "\n" not in warnings[0]
    assert list(tmp_path.iterdir()) == []


def test_ssd_test_files_are_removed_on_error(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cal_ssd, "_stream", fail)
    with pytest.raises(OSError):
        cal_ssd.measure_ssd(tmp_path, 4 * 2**20, 2**20)
    assert list(tmp_path.iterdir()) == []


def test_half_gflop_fit_inverts_the_cost_model_curve():
    e_max, h, f = 0.8, 3.2, 2.0
    assert cal_gpu.fit_gemm_half_gflop(f, e_max * f / (f + h), e_max) == pytest.approx(h)
    assert cal_gpu.fit_gemm_half_gflop(f, e_max, e_max) > 0  # small GEMM as fast as large: still valid


def fake_measurements() -> dict:
    return {
        "host": "testbox",
        "cpu_threads": 2,
        "gpu": {"model": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "best_tflops": 700.0,
                "small_gflop": 2.147, "small_tflops": 300.0, "hbm_gbps": 2900.0},
        "pcie": {"h2d_gbps": 52.0, "d2h_gbps": 50.0, "duplex_h2d_gbps": 53.0, "duplex_d2h_gbps": 40.0},
        "cpu": {"model": "test CPU", "memory_gib": 128.0, "memory_gbps": 150.0, "adam_gparams_per_s": 3.0,
                "adam_impl": "fused"},
        "ssd": None,
        "errors": [],
    }


def test_build_profile_with_a_gpu_and_a_datasheet_base():
    c = cal_profile.build_profile(fake_measurements(), load_profile("h100-80g"))
    g, p = c.profile.gpu, c.profile.pcie
    assert g.peak_tflops == 989  # datasheet kept
    assert g.gemm_efficiency == pytest.approx(700 / 989, rel=1e-3)
    e_small = 300 / 989
    assert g.gemm_efficiency * 2.147 / (2.147 + g.gemm_half_gflop) == pytest.approx(e_small, rel=1e-2)
    assert g.hbm_gbps == 3350 and g.hbm_efficiency == pytest.approx(2900 / 3350, rel=1e-3)
    assert p.generation == 5 and p.duplex_h2d_gbps <= p.h2d_gbps  # noisy duplex clamped to the solo rate
    assert c.profile.ssd == load_profile("h100-80g").ssd  # no --ssd-dir: the base's SSDs
    assert "gpu.peak_tflops" in c.not_measured and "gpu.gemm_efficiency" not in c.not_measured
    assert c.profile.compute == load_profile("h100-80g").compute  # the same GPU: its SMs and tiles kept


def test_build_profile_without_base_derives_the_peak_and_has_no_ssd():
    c = cal_profile.build_profile(fake_measurements())
    assert c.profile.gpu.peak_tflops == pytest.approx(700 / 0.9, rel=1e-3)
    assert c.profile.gpu.gemm_efficiency == pytest.approx(0.9)
    assert any("no --base" in n for n in c.notes)
    assert c.profile.ssd.count == 0 and "ssd.count" in c.not_measured
    assert c.profile.compute is None  # the default base's GPU (an RTX 4090) is not the one measured


def test_cli_writes_a_profile_the_planner_loads(tmp_path, capsys):
    out = tmp_path / "box.yaml"
    rc = main(["calibrate", "--quick", "--ssd-dir", str(tmp_path), "-o", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    hw = load_profile(str(out))
    assert hw.cpu.memory_gbps > 0 and hw.cpu.adam_gparams_per_s > 0 and hw.cpu.memory_gib > 0
    assert hw.ssd.count == 1 and hw.ssd.read_gbps > 0 and hw.ssd.write_gbps > 0 and hw.ssd.capacity_gb > 0
    assert [p.name for p in tmp_path.iterdir()] == ["box.yaml"]  # the SSD test files are gone
    assert "cpu.memory_gbps" in stdout and "measured" in stdout
    not_measured = [line for line in stdout.splitlines() if line.startswith("not measured")]
    assert len(not_measured) == 1
    if not HAS_GPU:  # --device auto on a box without CUDA: this CPU is the device, measured
        assert hw.gpu.host_cores is not None and hw.cpu.cores == hw.gpu.host_cores
        assert "via torch" in hw.gpu.model and hw.gpu.peak_tflops > 0 and hw.gpu.hbm_gbps > 0
        assert hw.gpu.memory_gib == cal_profile.DEFAULT_HOST_DEVICE_GIB and hw.gpu.reserved_gib == 0
        assert hw.pcie.generation == 1 and hw.pcie.duplex_h2d_gbps <= hw.pcie.h2d_gbps
        assert not any(k in not_measured[0] for k in ("gpu.peak_tflops", "gpu.hbm_gbps", "pcie.h2d_gbps"))


def test_gemm_curve_fit_recovers_peak_and_half_size():
    peak, half = 0.25, 0.05  # TFLOPS, GFLOP
    f = [0.002, 0.02, 0.1, 0.5, 2.0, 8.0]
    got = cal_host_device.fit_gemm_curve(f, [peak * x / (x + half) for x in f])
    assert got == pytest.approx((peak, half), rel=1e-6)
    # still rising: the best rate is the peak
    assert cal_host_device.fit_gemm_curve([1.0, 2.0], [0.1, 0.2])[0] == 0.2


def test_build_profile_for_a_cpu_device():
    m = fake_measurements()
    m["device"] = "cpu"
    m["gpu"] = {"model": "test CPU via torch (2 threads)", "host_cores": 2, "gemms": [{}, {}],
                "peak_tflops": 0.15, "half_gflop": 0.01, "elementwise_gbps": 30.0}
    m["pcie"] = {"h2d_gbps": 10.0, "d2h_gbps": 10.0, "duplex_h2d_gbps": 6.0, "duplex_d2h_gbps": 6.0}
    c = cal_profile.build_profile(m, device_gib=0.5, overrides={"cpu.memory_gib": 8})
    g, p, cpu = c.profile.gpu, c.profile.pcie, c.profile.cpu
    assert (g.memory_gib, g.reserved_gib, g.peak_tflops, g.gemm_efficiency, g.gemm_half_gflop) == (
        0.5, 0, 0.15, 1, 0.01)
    # real bytes per second: a CPU device's plans are fp32 (--precision fp32), its GEMMs fp32 too
    assert (g.hbm_gbps, g.hbm_efficiency, g.host_cores, cpu.cores) == (30, 1, 2, 2)
    assert (p.generation, p.h2d_gbps, p.duplex_d2h_gbps) == (1, 10, 6)
    assert g.fp32_tflops == g.peak_tflops == 0.15
    assert c.profile.compute is None  # a CPU's GEMMs on the fitted size curve, not a GPU's SMs and tiles
    assert cpu.memory_gib == 8  # --set wins
    with pytest.raises(CalibrationError, match="unknown profile key"):
        cal_profile.build_profile(m, overrides={"cpu.nonsense": 1})
    # compute, Adam and copies share the two cores in the simulator

    r = link_rates(c.profile)
    assert r.core_bound and (r.cores, r.gpu_cores, r.adam_cores, r.copy_cores) == (2, 2, 2, 1)


def test_build_profile_for_a_cpu_device_takes_the_executors_store_and_fixed_costs():
    m = fake_measurements()
    m["device"] = "cpu"
    m["gpu"] = {"model": "test CPU via torch (2 threads)", "host_cores": 2, "gemms": [{}, {}],
                "peak_tflops": 0.15, "half_gflop": 0.01, "elementwise_gbps": 30.0}
    m["pcie"] = {"h2d_gbps": 10.0, "d2h_gbps": 10.0, "duplex_h2d_gbps": 6.0, "duplex_d2h_gbps": 6.0}
    m["ssd"] = {"dir": "x", "direct": True, "model": "vda", "capacity_gb": 50.0, "block_bytes": 2**20,
                "read_gbps": 1.2, "write_gbps": 0.4, "mixed_read_gbps": 0.8, "mixed_write_gbps": 0.3,
                "rw_sharing": "shared",
                "store": {"read_gbps": 0.5, "write_gbps": 0.25, "file_bytes": 2**25, "mixed_read_gbps": 0.4,
                          "mixed_write_gbps": 0.2, "direct": True}}
    m["executor"] = {"op_overhead_us": 250.0, "pcie_latency_us": 80.0, "ssd_latency_us": 2000.0}
    m["gpu"].update(activation_gbps=8.0, attention_efficiency=0.25,
                    attention=[{"shape": [2, 4, 256, 64], "tflops": 0.04, "of_gemm": 0.25}])
    c = cal_profile.build_profile(m)
    g, p, s = c.profile.gpu, c.profile.pcie, c.profile.ssd
    assert (g.op_overhead_us, p.latency_us, s.latency_us) == (250, 80, 2000)
    assert (g.activation_gbps, g.attention_efficiency) == (8, 0.25)  # real bytes per second, like hbm_gbps
    # the store's, not the raw device's
    assert (s.read_gbps, s.write_gbps, s.mixed_efficiency) == (0.5, 0.25, 0.8)
    m["executor"] = {}
    bare = cal_profile.build_profile(m).profile
    assert (bare.gpu.op_overhead_us, bare.pcie.latency_us, bare.ssd.latency_us) == (None, None, None)
    assert not link_rates(bare).io_contention  # no interference measured: the proportional share of the cores
    m["interference"] = {"gemm_beside_copy": 2.2, "copy_beside_gemm": 1.6, "gemm_beside_ssd_read": 1.9,
                         "ssd_read_beside_gemm": 1.2, "compute_slowdown": 2.05, "copy_slowdown": 1.6,
                         "ssd_slowdown": 1.2}
    c = cal_profile.build_profile(m)
    cpu = c.profile.cpu
    assert (cpu.compute_slowdown_per_io_op, cpu.copy_slowdown_beside_compute,
            cpu.ssd_slowdown_beside_compute) == (2.05, 1.6, 1.2)
    assert "copy 2.20x, ssd_read 1.90x" in {f.key: f for f in c.fields}["cpu.compute_slowdown_per_io_op"].note
    r = link_rates(c.profile)
    assert r.io_contention and r.compute_io_extra == pytest.approx(1.05)
    assert r.beside_compute("ssd_write") == 1.2


def test_io_interference_is_measured_by_running_both_loops(tmp_path):
    """A GEMM loop beside a memcpy loop and the store's reads and writes, each against alone: every ratio is a
    positive number, the means are the means of the parts, and the store's files are gone afterwards."""
    itf = cal_executor.measure_io_interference(tmp_path, seconds=0.08, copy_bytes=2**22)
    parts = ("copy", "ssd_read", "ssd_write")
    assert all(itf[f"gemm_beside_{k}"] > 0 and itf[f"{k}_beside_gemm"] > 0 for k in parts)
    assert itf["compute_slowdown"] == pytest.approx(sum(itf[f"gemm_beside_{k}"] for k in parts) / 3)
    assert itf["ssd_slowdown"] == pytest.approx(
        (itf["ssd_read_beside_gemm"] + itf["ssd_write_beside_gemm"]) / 2)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("interference-")]
    assert "ssd_slowdown" not in cal_executor.measure_io_interference(None, seconds=0.04, copy_bytes=2**20)


def test_executor_costs_and_store_are_measured_by_running_them(tmp_path):
    """The tiny plan really runs through the executor (its SSD ops through the store) and every fixed cost is
    a positive number of microseconds; the store's rates are positive and its files are gone afterwards."""
    store = cal_executor.measure_store(tmp_path, 4 * 2**20, mixed_s=0.1, files=2)
    assert store["read_gbps"] > 0 and store["write_gbps"] > 0 and store["mixed_read_gbps"] > 0
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("calibrate-")]
    hw = load_profile("rtx3090-desktop")
    costs = cal_executor.measure_executor_costs(hw, "cpu", tmp_path, op_rounds=1)
    assert all(costs[k] is not None and 0 <= costs[k] < 1e6 for k in ("op_overhead_us", "pcie_latency_us",
                                                                      "ssd_latency_us")), costs
    assert {"gpu", "h2d", "d2h", "ssd_read", "ssd_write"} <= set(costs["ops"])
    # a CPU device has no graphs: null, with the reason the profile gives
    assert costs["graph_launch_us"] is None and "no CUDA graphs" in costs["graph_launch_note"]


def test_the_executors_own_cost_is_split_off_every_resources_fixed_cost():
    """calibrate's executor_op_us goes to cpu.executor_op_us (charged to every op) and comes off each
    resource's measured fixed cost, so that an op is charged what it measured once; on a CUDA device too."""
    m = fake_measurements()
    m["executor"] = {"op_overhead_us": 250.0, "pcie_latency_us": 80.0, "ssd_latency_us": None,
                     "executor_op_us": 100.0, "dispatch_parts_us": {"handoff": 20.0, "handler": 70.0}}
    m["device"] = "cuda"
    for device in ("cuda", "cpu"):
        if device == "cpu":
            m["device"] = "cpu"
            m["gpu"] = {"model": "test CPU via torch (2 threads)", "host_cores": 2, "gemms": [{}, {}],
                        "peak_tflops": 0.15, "half_gflop": 0.01, "elementwise_gbps": 30.0}
            m["pcie"] = {"h2d_gbps": 10.0, "d2h_gbps": 10.0, "duplex_h2d_gbps": 6.0, "duplex_d2h_gbps": 6.0}
        c = cal_profile.build_profile(m)
        p, info = c.profile, {f.key: f for f in c.fields}
        assert p.cpu.executor_op_us == 100 and "handoff 20" in info["cpu.executor_op_us"].note
        assert (p.gpu.op_overhead_us, p.pcie.latency_us) == (150, 0)  # 80 - 100: clamped at nothing
        assert info["gpu.op_overhead_us"].source == "measured"
        assert p.cpu.executor_op_s + p.gpu.op_overhead_s == pytest.approx(250e-6)
    m["executor"] = {"op_overhead_us": 250.0, "pcie_latency_us": 80.0}  # an older measurement: as before
    p = cal_profile.build_profile(m).profile
    assert (p.cpu.executor_op_us, p.gpu.op_overhead_us, p.pcie.latency_us) == (None, 250, 80)


def test_executor_costs_run_the_cuda_code_path_on_its_emulation():
    """The measurement calibrate makes on CUDA (the ops' spans from the device's events, the hand-offs from
    host clocks, the executor against plain PyTorch) runs unchanged on the emulation of CUDA."""
    costs = cal_executor.measure_executor_costs(load_profile("rtx3090-desktop"), "cpu-adversarial", None,
                                                dispatch_rounds=1, op_rounds=1)
    assert 0 <= costs["op_overhead_us"] < 1e6 and 0 <= costs["pcie_latency_us"] < 1e6, costs
    assert costs["graph_launch_us"] is not None and costs["moved_op_overhead_us"] is not None
    assert costs["dispatch_ops_per_step"] > 0 and costs["step_op_us"] >= 0
    parts = costs["dispatch_parts_us"]
    assert set(parts) == {"handoff", "events", "launch", "trace", "handler", "loop"}
    # the engine's own cost: its parts but the handler's (which stays with the ops' fixed costs), at most the
    # whole step's difference per op
    engine = sum(v for k, v in parts.items() if k != "handler")
    assert costs["executor_op_us"] == pytest.approx(min(engine, costs["step_op_us"]))
    assert parts["events"] > 0 and parts["handler"] > 0  # streams: the engine records and waits on events


def test_on_cuda_each_executor_measurement_fails_on_its_own(monkeypatch):
    """calibrate on a CUDA GPU (faked here: the GPU's own measurements stubbed, the executor's own cost per op
    measured on the emulation of CUDA): a tiny run that fails leaves its fields null with the reason in the
    notes, and the other's fields are still measured."""
    from tierflow.executor.calibration import measurements as cal_measure
    from tierflow.executor.calibration.common import Sizes
    from tierflow.executor.device.base import PageableCopyError

    gpu = fake_measurements()["gpu"]
    monkeypatch.setattr(cal_measure, "measure_gpu", lambda sizes, progress, errors: (dict(gpu), None))

    def fails(*args, **kwargs):
        raise PageableCopyError("copy_async with pageable host memory")

    monkeypatch.setattr(cal_measure, "measure_executor_costs", fails)
    monkeypatch.setattr(cal_measure, "measure_executor_dispatch",
                        lambda device: cal_executor.measure_executor_dispatch("cpu-adversarial", rounds=1))
    monkeypatch.setattr(cal_measure, "measure_graph_costs",
                        lambda hw, device: cal_executor.measure_graph_costs(
                            hw.with_overrides({"gpu.fp32_tflops": 60.0}), "cpu-adversarial", rounds=1))
    mib = 2**20
    sizes = Sizes(dram_bytes=8 * mib, adam_params=100_000, adam_steps=1, ssd_file_bytes=2 * mib,
                  ssd_block_bytes=mib, ssd_min_s=0.0, ssd_mixed_s=0.1, gpu_target_s=0.002, hbm_bytes=8 * mib,
                  pcie_bytes=8 * mib)
    m = cal_measure.run_measurements(sizes, None, gpu=True, device="cuda")
    assert m["executor"]["executor_op_us"] >= 0 and "op_overhead_us" not in m["executor"]
    assert any("fixed cost per op: PageableCopyError" in e for e in m["errors"])
    c = cal_profile.build_profile(m)
    assert c.profile.cpu.executor_op_us == pytest.approx(m["executor"]["executor_op_us"], rel=1e-3)
    assert c.profile.gpu.op_overhead_us is None
    assert any("PageableCopyError" in n for n in c.notes)
    # the graph replays are their own step: measured (on the emulation here) although the rest failed
    assert c.profile.gpu.graph_launch_us is not None and c.profile.gpu.graph_op_us is not None


def test_cli_set_is_parsed_and_checked():
    assert parse_sets(["gpu.memory_gib=2", "ssd.array_read_gbps=null", "cpu.model=x"]) == {
        "gpu.memory_gib": 2, "ssd.array_read_gbps": None, "cpu.model": "x"}
    with pytest.raises(OverrideError, match="expected SECTION.KEY=VALUE"):
        parse_sets(["memory=2"])


def test_cli_json_reports_sources(tmp_path, capsys):
    out = tmp_path / "box.yaml"
    rc = main(["calibrate", "--quick", "--ssd-dir", str(tmp_path), "--ssd-file-mib", "8",
               "--base", "h100-80g", "--json", "-o", str(out)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    sources = {f["field"]: f["source"] for f in d["fields"]}
    assert sources["cpu.memory_gbps"] == "measured" and sources["ssd.read_gbps"] == "measured"
    assert sources["price.gpu_usd"] == "from h100-80g"
    assert d["profile"] == load_profile(str(out)).to_dict()
    if not HAS_GPU:  # --device auto: this CPU is the device and is measured, the base only gives prices
        assert not set(GPU_KEYS) & set(d["not_measured"])
        assert sources["gpu.peak_tflops"] == "measured" and sources["gpu.host_cores"] == "measured"


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_bad_ssd_dir_is_one_line_rc_2(tmp_path, capsys, kind):
    bad = tmp_path / "nope"
    if kind == "file":
        bad.write_text("x")
    rc = main(["calibrate", "--quick", "--ssd-dir", str(bad), "-o", str(tmp_path / "box.yaml")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and str(bad) in err
    assert not (tmp_path / "box.yaml").exists()


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_gpu_measurements_are_positive():
    assert cal_gpu.measure_gemm_tflops(512, 512, 512, target_s=0.01) > 0
    assert cal_gpu.measure_hbm_gbps(64 * 2**20, target_s=0.01) > 0
    r = cal_gpu.measure_pcie(64 * 2**20)
    assert all(v > 0 for v in r.values())
    assert r["duplex_h2d_gbps"] <= r["h2d_gbps"] and r["duplex_d2h_gbps"] <= r["d2h_gbps"]


def test_unmeasured_box_specific_fields_are_null_with_their_reason():
    """A field calibrate does not measure is never the base's value (the base's box was measured or fitted,
    not this one): null, with why; the datasheet peaks of an explicit --base stay."""
    m = fake_measurements()
    m["ssd"] = {"dir": "x", "direct": True, "model": "vda", "capacity_gb": 50.0, "block_bytes": 2**20,
                "read_gbps": 1.2, "write_gbps": 0.4, "mixed_read_gbps": 0.8, "mixed_write_gbps": 0.3,
                "rw_sharing": "shared"}
    base = load_profile("rtx4090-lohan")
    assert base.ssd.host_path_gbps is not None and base.gpu.fp32_tflops is not None
    for explicit in (None, base):
        c = cal_profile.build_profile(m, explicit)
        info = {f.key: f for f in c.fields}
        p = c.profile
        assert p.ssd.host_path_gbps is None and "fitted" in info["ssd.host_path_gbps"].note
        assert p.gpu.op_overhead_us is None and p.pcie.latency_us is None
        assert p.cpu.deepspeed_adam_gparams_per_s is None and info["cpu.deepspeed_adam_gparams_per_s"].note
        assert "ssd.host_path_gbps" in c.not_measured
        # datasheet peaks: from an explicit base only
        assert p.gpu.fp32_tflops == (base.gpu.fp32_tflops if explicit else None)
    m["cpu"].update(deepspeed_adam_gparams_per_s=1.5)
    assert cal_profile.build_profile(m).profile.cpu.deepspeed_adam_gparams_per_s == 1.5


def test_deepspeed_adam_without_deepspeed_says_why(monkeypatch):
    monkeypatch.setattr(cal_cpu.importlib.util, "find_spec", lambda name: None)
    assert cal_cpu.measure_deepspeed_adam(100_000, steps=1) == (
        None, "DeepSpeed is not installed (the [baseline] extra)")


def test_gpu_launches_beside_the_host_optimizer_measured_and_put(monkeypatch):
    """contention.py times a burst of small kernels alone and beside the executor's adam op (here on the CPU:
    the code path a GPU runs), and the profile takes the ratio on a GPU box, null on a host device."""
    import threading

    import torch

    from tierflow.executor.calibration import profile_builder as pb
    from tierflow.executor.calibration.contention import measure_gpu_beside_host_optimizer

    k = measure_gpu_beside_host_optimizer("cpu", 1, adam_params=50_000, kernels=5, reps=1, dim=32)
    assert k["alone_s"] > 0 and k["beside_s"] > 0 and k["slowdown"] >= 1.0
    # the optimizer thread's count is its own: a thread made afterwards takes this thread's count, not 1
    # (with OpenMP a new thread takes the process-wide value, which set_num_threads in a thread also sets)
    seen = []
    th = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    th.start()
    th.join()
    assert seen == [torch.get_num_threads()]
    m = fake_measurements()
    m["contention"] = {"alone_s": 0.001, "beside_s": 0.004, "slowdown": 4.0, "threads": 15}
    c = pb.build_profile(m, load_profile("h100-80g"))
    assert c.profile.cpu.gpu_slowdown_beside_host_optimizer == 4.0
    info = next(f for f in c.fields if f.key == "cpu.gpu_slowdown_beside_host_optimizer")
    assert info.source == "measured" and "15 threads" in info.note
    del m["contention"]
    c = pb.build_profile(m, load_profile("h100-80g"))
    assert c.profile.cpu.gpu_slowdown_beside_host_optimizer is None
