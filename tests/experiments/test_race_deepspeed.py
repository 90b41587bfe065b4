"""experiments/race_deepspeed.py: tierflow against DeepSpeed ZeRO-Infinity on this machine.

The race itself runs only where DeepSpeed (`pip install -e '.[baseline]'`) and libaio are installed; CI does
not install the baseline extra, so there it is skipped with the reason. The config and skip checks always run.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import race_deepspeed  # noqa: E402

from tierflow.planner.io.deepspeed.config import parse_ds_config  # noqa: E402


@pytest.mark.parametrize("variant", race_deepspeed.DS_VARIANTS)
def test_every_deepspeed_config_is_one_the_bridge_reads_as_run(variant):
    """The configs DeepSpeed runs are the ones the bridge simulates: no key unknown to DeepSpeed, the batch as
    the point says, and the placement the variant means (everything on NVMe, or the optimizer only)."""
    p = race_deepspeed.SWEEP[0]
    ds = parse_ds_config(race_deepspeed.ds_config(p, "nvme", variant), f"{variant}.json", p.spec())
    assert ds.unknown == ()
    assert (ds.stage, ds.batch, ds.micro_batch, ds.accumulation) == (3, p.batch, p.batch, 1)
    assert ds.optimizer_device == "nvme"
    assert ds.param_device == ("none" if variant == "ds-opt-nvme" else "nvme")
    pl = ds.placement()
    assert pl.master.ssd == pl.adam_m.ssd == pl.adam_v.ssd == 1.0
    # DeepSpeed's max_in_cpu (1e9 elements by default) keeps every race model's weights in host memory,
    # NVMe offload_param or not (race_deepspeed.HOST_WEIGHTS; dskeys)
    assert pl.weights.ssd == 0.0
    assert pl.weights.cpu == (0.0 if variant == "ds-opt-nvme" else 1.0)


def test_the_tuned_buffers_hold_the_largest_parameter():
    """DeepSpeed refuses a parameter swap buffer smaller than the largest parameter (the embedding)."""
    for p in race_deepspeed.SWEEP + [race_deepspeed.QUICK_POINT]:
        buf = (race_deepspeed.ds_config(p, "nvme", "ds-tuned")
               ["zero_optimization"]["offload_param"]["buffer_size"])
        spec = p.spec()
        assert buf >= max(spec.vocab_size * spec.hidden, spec.hidden * spec.ffn_hidden)


def test_without_deepspeed_it_skips_with_one_line(monkeypatch, tmp_path, capsys):
    import importlib.metadata as md

    real = md.version

    def version(name):
        if name == "deepspeed":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    assert race_deepspeed.run(True, tmp_path) == []
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "pip install -e '.[baseline]'" in out[0]
    assert "libaio" in out[0]
    assert not (tmp_path / "race.csv").exists()


MISSING = race_deepspeed.deepspeed_missing()


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_quick_race_runs_both_on_the_same_point(tmp_path):
    """One small point, DeepSpeed (everything on NVMe) against tierflow's horizontal and vertical plans, each
    in its own process: both train, both move bytes through the SSD directory, both are predicted."""
    heads = race_deepspeed.run(True, tmp_path)
    with open(tmp_path / "race.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["variant"] for r in rows} == {"ds-default", "tf-horizontal", "tf-vertical"}
    for r in rows:
        assert r["failed"] == "" and int(r["runs"]) == 1, r
        assert float(r["tokens_per_s"]) > 0 and float(r["peak_rss_gb"]) > 0.1
        # every step reads and writes the fp32 optimizer states (12 B/param at least) on the SSD directory
        params = float(r["params_m"]) * 1e6
        assert float(r["ssd_write_gb_per_step"]) * 1e9 >= 8 * params, r
        assert float(r["predicted_s"]) > 0
    assert (tmp_path / "race.png").stat().st_size > 0
    md = (tmp_path / "race.md").read_text()
    assert "deepspeed 0.19.8" in md and "| ds-default |" in md
    assert any("tierflow / DeepSpeed tokens/s" in h["metric"] for h in heads)


def test_hostweights_keeps_weights_and_grads_in_host_memory_and_only_the_optimizer_on_the_ssd(tmp_path):
    """tf-hostweights is DeepSpeed's NVMe offload as it runs (parameters in host memory under max_in_cpu,
    fp32 gradients there, master and Adam states on NVMe): its plan reads from the SSD only the optimizer
    states, less than the all-on-SSD plans."""
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.io.planfile import load_plan

    hw = load_profile("rtx4090-lohan")
    p = race_deepspeed.QUICK_POINT
    plans = race_deepspeed.tf_plans(p, hw, None, tmp_path, ("tf-horizontal", "tf-hostweights"))
    assert set(plans) == {"tf-horizontal", "tf-hostweights"}
    host = load_plan(plans["tf-hostweights"][0])
    pl = host.config.placement
    assert pl.weights.cpu == pl.grads.cpu == 1.0
    assert pl.master.ssd == pl.adam_m.ssd == pl.adam_v.ssd == 1.0
    all_ssd = load_plan(plans["tf-horizontal"][0])

    def ssd_read_bytes(plan):
        return sum(t.work for t in plan.graph.tasks if t.resource == "ssd_read" and t.iteration == 1)

    assert 0 < ssd_read_bytes(host) < ssd_read_bytes(all_ssd)


def test_the_planner_gets_deepspeeds_memory_split_over_device_and_host():
    """ds_budget: device + host (above its reserve) hold what DeepSpeed's process held; the host what
    DeepSpeed keeps there (8 B/param and buffers), not the optimizer states."""
    from tierflow.hwprofiles import load_profile

    hw = load_profile("rtx4090-lohan")
    spec = race_deepspeed.SWEEP[1].spec()
    box = race_deepspeed.ds_budget(hw, spec, 1.5e9)
    host = (box.cpu.memory_gib - hw.cpu.reserved_gib) * 2**30
    assert abs((box.gpu.memory_gib - hw.gpu.reserved_gib) * 2**30 + host - 1.5e9) < 2e6
    assert 8 * spec.total_params() <= host < 12 * spec.total_params()


def test_trace_profile_walks_a_critical_path_that_covers_the_step():
    """race_profile.trace_profile on a simulated run: busy per resource is at most the step, and the critical
    path's time per resource plus its gaps add up to the step."""
    import race_profile

    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.schedules import make_schedule
    from tierflow.planner.core.simulate import simulate_config

    hw = load_profile("rtx4090-lohan")
    p = race_deepspeed.QUICK_POINT
    cfg = make_schedule("horizontal", p.spec(), hw, batch=p.batch, micro_batch=p.batch, seq=p.seq,
                        placement=race_deepspeed.ALL_ON_SSD, recompute=False, iterations=3)
    prof = race_profile.trace_profile(simulate_config(p.spec(), hw, cfg))
    w = prof["window_s"]
    assert w > 0
    assert all(0 <= b <= w * (1 + 1e-9) for b in prof["busy_s"].values())
    assert prof["busy_s"]["ssd_read"] > 0 and prof["critical_s"]["gpu"] > 0
    assert abs(sum(prof["critical_s"].values()) + prof["critical_gap_s"] - w) < 1e-6 * max(1.0, w)


def _cpu_box_measurements() -> dict:
    """Raw calibration measurements of a CPU device with an SSD directory (the shape run_measurements
    gives)."""
    return {
        "host": "testbox", "cpu_threads": 2, "device": "cpu", "errors": [],
        "gpu": {"model": "test CPU via torch (2 threads)", "host_cores": 2, "gemms": [{}, {}],
                "peak_tflops": 0.12, "half_gflop": 0.002, "elementwise_gbps": 24.0, "activation_gbps": 3.0},
        "pcie": {"h2d_gbps": 12.0, "d2h_gbps": 12.0, "duplex_h2d_gbps": 6.0, "duplex_d2h_gbps": 6.0},
        "cpu": {"model": "test CPU", "memory_gib": 16.0, "memory_gbps": 20.0, "adam_gparams_per_s": 1.2,
                "adam_impl": "fused"},
        "ssd": {"dir": "x", "direct": True, "model": "vda", "capacity_gb": 50.0, "block_bytes": 2**20,
                "read_gbps": 2.0, "write_gbps": 1.5, "mixed_read_gbps": 1.0, "mixed_write_gbps": 0.8,
                "rw_sharing": "shared",
                "store": {"read_gbps": 1.0, "write_gbps": 0.8, "file_bytes": 2**25, "mixed_read_gbps": 0.8,
                          "mixed_write_gbps": 0.6, "direct": True}},
    }


def test_predict_only_re_predicts_the_measured_race_in_fp32_without_running_it(tmp_path):
    """--predict-only rebuilds the box from the calibration's raw measurements (real bytes per second) and
    predicts each run from what it ran, both sides in fp32 as they train: tierflow's plan from its decisions,
    DeepSpeed's config (no fp16 / bf16 section) through the bridge; no DeepSpeed, no run."""
    import json
    from dataclasses import asdict, replace

    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.contract import ScheduleConfig
    from tierflow.planner.core.simulate import simulate_config

    m = _cpu_box_measurements()
    hw = race_deepspeed.box_profile(m, tmp_path)
    p = race_deepspeed.QUICK_POINT
    spec = p.spec()
    assert spec.precision == "fp32" and hw.gpu.fp32_tflops == hw.gpu.peak_tflops == 0.12
    assert hw.gpu.hbm_gbps == 24.0 and hw.pcie.h2d_gbps == 12.0  # real bytes, not 2-byte plan bytes
    plans = race_deepspeed.tf_plans(p, hw, None, tmp_path, ("tf-horizontal",))

    def measured(step_s: float) -> dict:
        return {"step_s": [step_s, step_s], "losses": [7.0], "peak_rss_bytes": 1e9, "ssd_read_bytes": 1e8,
                "ssd_write_bytes": 1e8}

    record = {"point": asdict(p), "runs": {"ds-default": [measured(2.0)],
                                           "tf-horizontal": [measured(1.0), measured(1.5)]},
              "plans": {v: d for v, (_, d) in plans.items()}, "budget_bytes": None}
    (tmp_path / race_deepspeed.RUNS_FILE).write_text(json.dumps({"calibration": m, "commands": ["c"],
                                                                 "points": [record]}))
    (tmp_path / "race_box.yaml").unlink()
    race_deepspeed.predict_only(tmp_path)
    with open(tmp_path / "race.csv", newline="") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert load_profile(str(tmp_path / "race_box.yaml")).gpu.fp32_tflops == 0.12
    tf = rows["tf-horizontal"]
    assert float(tf["step_s"]) == 1.25 and int(tf["runs"]) == 2  # the median of the runs' medians
    cfg = ScheduleConfig.from_dict(plans["tf-horizontal"][1])
    assert float(tf["predicted_s"]) == pytest.approx(simulate_config(spec, hw, cfg).iteration_s, abs=1e-3)
    ds = parse_ds_config(race_deepspeed.ds_config(p, "nvme", "ds-default"), "ds.json", spec)
    bf16 = spec.with_precision(None)
    as_bf16 = simulate_config(bf16, hw, replace(ds.schedule(bf16, hw, seq=p.seq), recompute=False))
    assert float(rows["ds-default"]["predicted_s"]) > as_bf16.iteration_s  # 4-byte weights and gradients
    ds_row = rows["ds-default"]
    assert float(ds_row["error"]) == pytest.approx(2.0 / float(ds_row["predicted_s"]) - 1, rel=2e-2)


def test_predict_only_without_a_measured_race_is_one_line_and_exit_2(tmp_path, capsys):
    """Nothing measured under --out: one line that says where to look, exit code 2, nothing written."""
    out = tmp_path / "empty"
    with pytest.raises(SystemExit) as e:
        race_deepspeed.main(["--predict-only", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "race_runs.json" in err[0] and "wrote" not in err[0]
    assert not (out / "race.csv").exists()
