"""`tierflow fit`: recovering known profile values from synthetic measurements made by the simulator, bounds,
identifiability, one-line errors for bad run files, the written profile and the command line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from tierflow.cli import main
from tierflow.hwprofiles import load_profile
from tierflow.planner.fit.profile_fit import (
    COLUMNS,
    FitError,
    FitField,
    Run,
    fit,
    load_runs,
    predict,
    write_fitted_profile,
)

BOX = "a100-80g-nvme"  # 4 SSDs at 6.4 GB/s read each, PCIe 4.0 at 25 GB/s (12 while D2H runs)
TRUE = {"ssd.read_gbps": 5.0, "pcie.h2d_gbps": 20.0}  # what the synthetic "measurements" were made with
ON_SSD = {"gpu": 0, "cpu": 0, "ssd": 1}
STATES_ON_SSD = json.dumps({"master": ON_SSD, "adam_m": ON_SSD, "adam_v": ON_SSD})
# (schedule, micro-batch, SSD count): optimizer states stream from the SSDs every iteration, so each run
# depends on the drives' read rate; micro-batches of 1 fetch the weights over PCIe once per micro-batch, which
# makes some runs depend on the PCIe rate too, in other proportions
SPECS = [("fuyou", 1, 1), ("fuyou", 1, 4), ("fuyou", 4, 2), ("vertical", 4, 1), ("horizontal", 2, 2)]


def make_runs(truth: dict[str, float], specs=SPECS, measure: str = "iteration_s") -> list[Run]:
    true_hw = load_profile(BOX).with_overrides(truth)
    runs = []
    for row, (schedule, mb, count) in enumerate(specs, start=1):
        run = Run("gpt3-125m", BOX, schedule, 4, mb, 512, STATES_ON_SSD, {"ssd.count": str(count)}, 1.0,
                  measure, row=row, source="synthetic.csv")
        runs.append(Run(**{**run.__dict__, "measured": predict(run, true_hw).value}))
    return runs


def write_csv(path: Path, runs: list[Run]) -> Path:
    with path.open("w", newline="") as f:
        f.write("# synthetic measurements made by the simulator\n")
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in runs:
            w.writerow([r.model, r.hw, r.schedule, r.batch, r.micro_batch, r.seq or "", r.placement,
                        ";".join(f"{k}={v}" for k, v in r.overrides.items()), repr(r.measured), r.measure])
    return path


@pytest.fixture(scope="module")
def synthetic():
    runs = make_runs(TRUE)
    fields = [FitField("ssd.read_gbps", 1.0, 12.0), FitField("pcie.h2d_gbps", 13.0, 40.0)]
    return runs, fields, fit(runs, load_profile(BOX), fields)


def test_fit_recovers_known_values(synthetic):
    runs, _, res = synthetic
    for key, value in TRUE.items():
        assert res.values[key] == pytest.approx(value, rel=0.02), (key, res.values)
    assert res.rms < 0.005 and res.max_abs < 0.01
    assert res.loo_rms is not None and res.loo_rms < 0.02
    assert all(abs(r.loo_residual) < 0.02 for r in res.runs)
    assert not res.unidentified and not res.at_bound
    assert [r.run.row for r in res.runs] == [1, 2, 3, 4, 5]
    # the runs were chosen to be sensitive to both fields, in different proportions
    assert max(abs(s) for s in res.sensitivity["ssd.read_gbps"]) > 0.2
    assert max(abs(s) for s in res.sensitivity["pcie.h2d_gbps"]) > 0.2
    d = res.to_dict()
    assert d["evaluations"] == res.evaluations > 0 and d["wall_s"] > 0
    json.dumps(d)


def test_a_bound_that_excludes_the_true_value_is_respected_and_reported(synthetic):
    runs, _, _ = synthetic
    fields = [FitField("ssd.read_gbps", 5.5, 12.0), FitField("pcie.h2d_gbps", 13.0, 40.0)]
    res = fit(runs, load_profile(BOX), fields, loo=False, restarts=0)
    assert 5.5 <= res.values["ssd.read_gbps"] <= 5.5 * 1.002
    assert res.at_bound == {"ssd.read_gbps": "lower"}
    assert any("ssd.read_gbps: at its lower bound 5.5" in n for n in res.notes())
    assert res.runs[0].loo_residual is None and res.loo_rms is None


def test_a_field_nothing_depends_on_is_unidentified(synthetic):
    runs, _, _ = synthetic
    fields = [FitField("ssd.read_gbps", 1.0, 12.0), FitField("price.gpu_usd", 1000.0, 40000.0)]
    res = fit(runs, load_profile(BOX), fields, loo=False, restarts=0)
    assert set(res.unidentified) == {"price.gpu_usd"}
    assert "no run is sensitive to it" in res.unidentified["price.gpu_usd"]
    assert all(abs(s) < 1e-9 for s in res.sensitivity["price.gpu_usd"])


def test_fitted_profile_loads_and_names_the_data(synthetic, tmp_path):
    _, _, res = synthetic
    base = load_profile(BOX)
    out = tmp_path / "fitted.yaml"
    hw = write_fitted_profile(base, res, out, "synthetic.csv")
    assert load_profile(out) == hw
    assert hw.name == f"{BOX}-fit"
    assert hw.ssd.read_gbps == pytest.approx(res.values["ssd.read_gbps"], rel=1e-3)
    assert hw.pcie.h2d_gbps == pytest.approx(res.values["pcie.h2d_gbps"], rel=1e-3)
    assert (hw.ssd.write_gbps, hw.cpu.memory_gib, hw.gpu) == (base.ssd.write_gbps, base.cpu.memory_gib,
                                                              base.gpu)
    text = out.read_text()
    [read_line] = [line for line in text.splitlines() if line.strip().startswith("read_gbps:")]
    assert "# fit: synthetic.csv, 5 runs" in read_line and "LOO error" in read_line
    assert "bounds [1, 12]" in read_line
    [h2d_line] = [line for line in text.splitlines() if line.strip().startswith("h2d_gbps:")]
    assert "# fit: synthetic.csv" in h2d_line and "bounds [13, 40]" in h2d_line
    # the other fields keep the base file's comments
    base_text = (Path(__file__).resolve().parents[3] / "hwprofiles" / f"{BOX}.yaml").read_text()
    [write_line] = [line for line in base_text.splitlines() if line.strip().startswith("write_gbps:")]
    assert write_line in text.splitlines()


def test_fitted_profile_from_a_profile_with_overrides(synthetic, tmp_path):
    """A base carrying --set overrides: the written file holds the overridden values, not the file's."""
    _, _, res = synthetic
    base = load_profile(BOX).with_overrides({"cpu.memory_gib": 256})
    hw = write_fitted_profile(base, res, tmp_path / "f.yaml", "synthetic.csv")
    assert hw.cpu.memory_gib == 256
    assert hw.ssd.read_gbps == pytest.approx(res.values["ssd.read_gbps"], rel=1e-3)


def test_runs_load_from_csv_and_yaml(tmp_path):
    runs = make_runs(TRUE, specs=SPECS[:2])
    assert load_runs(write_csv(tmp_path / "r.csv", runs)) == [
        Run(**{**r.__dict__, "source": str(tmp_path / "r.csv")}) for r in runs]
    records = [{"model": r.model, "hw": r.hw, "schedule": r.schedule, "batch": r.batch,
                "micro_batch": r.micro_batch, "seq": r.seq, "placement": json.loads(r.placement),
                "overrides": {"ssd.count": int(r.overrides["ssd.count"])},
                "measured": r.measured, "measure": r.measure} for r in runs]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(records))
    loaded = load_runs(tmp_path / "r.yaml")
    assert [(r.overrides, r.measured, r.micro_batch) for r in loaded] == [
        (r.overrides, r.measured, r.micro_batch) for r in runs]


GOOD = "gpt3-125m,a100-80g-nvme,fuyou,4,best,512,default,ssd.count=2,0.5,iteration_s"
HEADER = ",".join(COLUMNS)


@pytest.mark.parametrize("text, where, column", [
    (",".join(COLUMNS[:-1]) + "\n" + GOOD.rsplit(",", 1)[0], "header", "measure"),
    (HEADER + "\n" + GOOD + "\n" + GOOD.replace(",4,best,", ",four,best,"), "row 2", "batch"),
    (HEADER + "\n" + GOOD.replace("fuyou", "zero3"), "row 1", "schedule"),
    (HEADER + "\n" + GOOD.replace("ssd.count=2", "ssd.cuont=2"), "row 1", "overrides"),
    (HEADER + "\n" + GOOD.replace("ssd.count=2", "ssd.count=two"), "row 1", "overrides"),
    (HEADER + "\n" + GOOD.replace("ssd.count=2", "ssd.count"), "row 1", "overrides"),
    (HEADER + "\n" + GOOD.replace(",0.5,", ",fast,"), "row 1", "measured"),
    (HEADER + "\n" + GOOD.replace("iteration_s", "tokens_per_s"), "row 1", "measure"),
    (HEADER + "\n" + GOOD.replace(",best,", ",3,"), "row 1", "micro_batch"),
    (HEADER + "\n" + GOOD.replace("default", "{bad"), "row 1", "placement"),
    (HEADER + "\n" + GOOD.replace("gpt3-125m", "gpt9"), "row 1", "model"),
    (HEADER + "\n" + GOOD.replace("ssd.count=2", "model.lm_heads=false"), "row 1", "overrides"),
    (HEADER + "\n" + GOOD.replace("ssd.count=2", "model.lm_head=maybe"), "row 1", "overrides"),
])
def test_bad_csv_gives_one_line_naming_row_and_column(tmp_path, text, where, column):
    path = tmp_path / "bad.csv"
    path.write_text("# a comment line\n" + text + "\n")
    with pytest.raises(FitError) as e:
        load_runs(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {where}") and f"column {column}:" in msg, msg


def test_bad_fields_are_refused():
    base = load_profile(BOX)
    runs = make_runs(TRUE, specs=SPECS[:1])
    for field, words in [(FitField("ssd.read_gbs", 1, 8), "did you mean 'ssd.read_gbps'"),
                         (FitField("ssd.count", 1, 8), "only real-valued fields"),
                         (FitField("pcie.h2d_gbps", 5, 40), "invalid")]:
        with pytest.raises(FitError, match=words):
            fit(runs, base, [field])
    with pytest.raises(FitError, match="LOW:HIGH"):
        FitField.parse("ssd.read_gbps=8")
    with pytest.raises(FitError, match="0 < LOW < HIGH"):
        FitField.parse("ssd.read_gbps=8:1")
    assert FitField.parse("ssd.read_gbps=0.5:8") == FitField("ssd.read_gbps", 0.5, 8.0)


def test_cli_fits_end_to_end_with_json(tmp_path, capsys):
    truth = {"ssd.read_gbps": 4.0}
    runs = make_runs(truth, specs=[("fuyou", "best", 1), ("vertical", 4, 2), ("fuyou", 4, 4)],
                     measure="hw_tflops")
    path = write_csv(tmp_path / "runs.csv", runs)
    out = tmp_path / "fitted.yaml"
    rc = main(["fit", str(path), "--hw", BOX, "--field", "ssd.read_gbps=1:12", "--no-loo", "--json",
               "-o", str(out)])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["values"]["ssd.read_gbps"] == pytest.approx(4.0, rel=0.02)
    assert [r["row"] for r in d["runs"]] == [1, 2, 3] and d["runs"][0]["micro_batch"] == "best"
    assert d["runs"][0]["micro_batch_used"] in (1, 2, 4)
    assert all(abs(r["residual"]) < 0.01 and r["loo_residual"] is None for r in d["runs"])
    assert d["profile_file"] == str(out) and load_profile(out).ssd.read_gbps == pytest.approx(4.0, rel=0.02)
    # the readable tables
    rc = main(["fit", str(path), "--field", "ssd.read_gbps=1:12", "--no-loo"])
    text = capsys.readouterr().out
    assert rc == 0 and "fitted" in text and "residual" in text and "RMS relative error" in text


def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "\n" + GOOD.replace(",4,best,", ",4.5,best,") + "\n")
    assert main(["fit", str(path), "--field", "ssd.read_gbps=1:12"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "row 1" in err and "column batch" in err
    assert main(["fit", str(path).replace("bad", "missing"), "--field", "ssd.read_gbps=1:12"]) == 2
    assert main(["fit", str(path), "--field", "ssd.read_gbps"]) == 2


def test_fields_one_run_cannot_separate_are_reported_collinear():
    runs = make_runs({"ssd.read_gbps": 5.0, "ssd.write_gbps": 3.0}, specs=[("fuyou", 4, 1)])
    fields = [FitField("ssd.read_gbps", 1.0, 12.0), FitField("ssd.write_gbps", 1.0, 12.0)]
    res = fit(runs, load_profile(BOX), fields, loo=False, restarts=0)
    assert res.rms < 1e-3
    assert "collinear with ssd.write_gbps" in res.unidentified["ssd.read_gbps"]
    assert "collinear with ssd.read_gbps" in res.unidentified["ssd.write_gbps"]


def test_model_overrides_change_the_simulated_model(tmp_path):
    """model.FIELD=VALUE in the overrides column changes the model (here: LoHan's benchmark model without an
    LM head), not the box; the run's label says so."""
    from tierflow.planner.fit.profile_fit import load_runs, predict

    path = tmp_path / "runs.csv"
    headless = GOOD.replace("ssd.count=2", "model.lm_head=false;ssd.count=2")
    path.write_text(HEADER + "\n" + GOOD + "\n" + headless + "\n")
    with_head, headless = load_runs(path)
    assert headless.model_overrides == (("lm_head", "false"),) and headless.overrides == {"ssd.count": "2"}
    assert "model.lm_head=false" in headless.label()
    hw = load_profile("a100-80g-nvme")
    assert predict(headless, hw).iteration_s < predict(with_head, hw).iteration_s  # no logits to compute
