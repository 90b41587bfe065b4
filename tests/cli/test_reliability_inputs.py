"""Reliability of the command line on bad inputs: they get one line on stderr and exit code 2 (3 for a plan
that does not fit), never a traceback. Each test reproduces a reported failure through the real command
line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tierflow.cli import build_parser, main
from tierflow.hwprofiles import ProfileError, load_profile
from tierflow.hwprofiles.profile import _RULES
from tierflow.planner.core.models import get_model
from tierflow.planner.core.placement import Placement
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.io.planfile import load_plan, plan_from_graph, simulate_plan, write_plan

TINY = ["--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--schedule", "vertical", "--batch", "8",
        "--micro-batch", "2", "--seq", "64"]


def one_line_error(capsys, code: int, *needles: str) -> str:
    """The command's stderr is exactly one line holding every needle, and no traceback."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and "simulating [" not in x]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def run_cli(capsys, argv: list[str], code: int, *needles: str) -> str:
    assert main(argv) == code
    return one_line_error(capsys, code, *needles)


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    """The `tiny` plan the failures were reported with: tierflow simulate ... --write-plan p.json."""
    f = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["simulate", *TINY, "--write-plan", str(f)]) == 0
    return f.read_text()


def edited(tmp_path: Path, plan_text: str, path: list, value, drop_digest: bool = False) -> str:
    d = json.loads(plan_text)
    if drop_digest:
        del d["digest"]
    x = d
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value
    (tmp_path / "edited.json").write_text(json.dumps(d))
    return "edited.json"  # relative, as typed: the messages name it


# ---- class 3: plan fields checked against the ops ----------------------------------------------------------


def test_unedited_plan_loads_and_replays(tmp_path, plan_text, capsys):
    f = edited(tmp_path, plan_text, ["created_by"], "someone")  # not covered by the digest
    assert main(["simulate", "--plan", f]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("drop_digest", [False, True])
def test_edited_batch_is_refused(tmp_path, plan_text, capsys, drop_digest):
    """batch 8 -> 16 trained with the loss halved and tokens/s doubled; with or without a digest it is
    refused."""
    f = edited(tmp_path, plan_text, ["decisions", "batch"], 16, drop_digest)
    run_cli(capsys, ["simulate", "--plan", f], 2, "decisions.batch",
            "16 / micro_batch 2 = 8 micro-batches, the ops compute 4")


@pytest.mark.parametrize(("path", "value"), [(["model", "hidden"], 256), (["decisions", "seq"], 32),
                                             (["decisions", "alpha"], 0.5),
                                             (["hardware", "gpu", "peak_tflops"], 100.0)])
def test_edited_field_is_named_by_the_digest(tmp_path, plan_text, capsys, path, value):
    f = edited(tmp_path, plan_text, path, value)
    run_cli(capsys, ["simulate", "--plan", f], 2, ".".join(path) + ": not the value the ops were built for")


def test_a_plan_written_before_a_nullable_field_existed_still_loads(tmp_path, plan_text, capsys):
    """An older tierflow wrote neither the key nor its digest field (cpu.ssd_slowdown_beside_compute, null in
    the profile): the plan loads. The same field absent from the digest but set in the hardware section is
    refused."""
    from tierflow.planner.io.planvalidate import _digest_ops

    key = "hardware.cpu.ssd_slowdown_beside_compute"
    d = json.loads(plan_text)
    assert d["hardware"]["cpu"].pop("ssd_slowdown_beside_compute") is None
    del d["digest"]["fields"][key]
    d["digest"]["ops"] = _digest_ops(d, d["digest"]["fields"])  # as the older writer hashed its fields
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert main(["simulate", "--plan", "old.json"]) == 0
    capsys.readouterr()
    d["hardware"]["cpu"]["ssd_slowdown_beside_compute"] = 1.5
    (tmp_path / "old.json").write_text(json.dumps(d))
    run_cli(capsys, ["simulate", "--plan", "old.json"], 2, key + ": not the value the ops were built for")


def test_edited_ops_are_refused(tmp_path, plan_text, capsys):
    d = json.loads(plan_text)
    gpu = next(o for o in d["ops"] if o["resource"] == "gpu")
    f = edited(tmp_path, plan_text, ["ops", gpu["id"], "seconds"], 1.0)
    run_cli(capsys, ["simulate", "--plan", f], 2, "ops: ", "digest does not match")


def test_edited_model_without_digest_is_refused_by_recomputed_bytes(tmp_path, plan_text, capsys):
    f = edited(tmp_path, plan_text, ["model", "hidden"], 256, drop_digest=True)
    run_cli(capsys, ["simulate", "--plan", f], 2, "static_bytes.cpu", "11,680,256 bytes")
    f = edited(tmp_path, plan_text, ["hardware", "gpu", "memory_gib"], 12.0, drop_digest=True)
    run_cli(capsys, ["simulate", "--plan", f], 2, "capacity_bytes.gpu")


def test_run_refuses_an_overflowing_plan_as_simulate_does(tmp_path, capsys):
    m = get_model("tiny-gpt")
    hw = load_profile("rtx3090-desktop").with_overrides({"gpu.memory_gib": 0.004, "gpu.reserved_gib": 0})
    cfg = make_schedule("vertical", m, hw, batch=8, micro_batch=2, seq=64, placement=Placement.uniform("gpu"))
    f = tmp_path / "over.json"
    write_plan(plan_from_graph(m, hw, cfg, build_graph(m, hw, cfg)), f)  # a valid plan file, which overflows
    sim = run_cli(capsys, ["simulate", "--plan", str(f)], 3, "does not fit: gpu memory exceeded")
    run = run_cli(capsys, ["run", str(f), "--device", "cpu", "--steps", "1"], 3, "tierflow run: does not fit")
    assert sim.split("does not fit: ")[1] == run.split("does not fit: ")[1]


# ---- class 5: unbounded inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "needle"), [("1000000", "num_layers: 1000000 is above the limit of 4096"),
                                               (str(10**400), "num_layers: about 10^400 is above the limit")])
def test_model_shape_limits(tmp_path, capsys, value, needle):
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", "num_hidden_layers": ' + value + "}")
    run_cli(capsys, ["simulate", "--model", str(f), "--schedule", "vertical"], 2, needle)


def test_seq_shape_limit(capsys):
    run_cli(capsys, ["simulate", "--model", "tiny-llama", "--seq", str(1 << 23)], 2, "seq_len",
            "above the limit")


@pytest.mark.parametrize("argv", [["simulate", "--hw", "/dev/zero"], ["simulate", "--plan", "/dev/zero"],
                                  ["simulate", "--model", "/dev/zero"],
                                  ["simulate", "--model", "tiny-gpt", "--placement", "/dev/zero"]])
def test_non_regular_files_are_refused_before_reading(capsys, argv):
    run_cli(capsys, argv, 2, "/dev/zero", "not a regular file")


def test_files_over_the_limit_are_refused(tmp_path, capsys):
    f = tmp_path / "huge.yaml"
    f.write_text("# padding\n" * 120_000)  # 1.2 MB > 1 MiB
    run_cli(capsys, ["simulate", "--hw", str(f)], 2, "above the limit of 1 MiB")


def test_nesting_depth_limits(tmp_path, capsys, plan_text):
    y = tmp_path / "deep.yaml"
    y.write_text("gpu: " + "[" * 500 + "]" * 500 + "\n")
    run_cli(capsys, ["simulate", "--hw", str(y)], 2, "nested deeper than 32 levels")
    c = tmp_path / "config.json"
    c.write_text('{"model_type": "llama", "x": ' + "[" * 500 + "]" * 500 + "}")
    run_cli(capsys, ["simulate", "--model", str(c)], 2, "nested deeper than 32 levels")
    deep: list = []
    for _ in range(500):
        deep = [deep]
    p = edited(tmp_path, plan_text, ["solver"], {"x": deep})
    run_cli(capsys, ["simulate", "--plan", p], 2, "nested deeper than 32 levels")
    d = json.loads(plan_text)
    d["ops"][3]["deps"] = deep  # ops are validated field by field: refused without recursing
    (tmp_path / "deep_ops.json").write_text(json.dumps(d))
    run_cli(capsys, ["simulate", "--plan", str(tmp_path / "deep_ops.json")], 2, "op 3: dangling dependency")


@pytest.mark.parametrize("value", ["1e-310", "1e-300"])
def test_tiny_profile_values_are_refused(capsys, value):
    """1e-310 TFLOPS gave ZeroDivisionError, 1e-300 a 300-digit iteration time."""
    run_cli(capsys, ["simulate", "--model", "tiny-gpt", "--set", f"gpu.peak_tflops={value}"], 2,
            "gpu.peak_tflops: absurd value", "below the sanity floor 0.0001 TFLOPS")


def test_every_numeric_profile_field_has_a_floor():
    hw = load_profile("rtx3090-desktop")  # two SSDs: every ssd key is in force
    numeric = [(s, k, r) for s, rules in _RULES.items() for k, r in rules.items()
               if r.kind in ("number", "optional_number")]
    assert len(numeric) >= 25
    for section, key, rule in numeric:
        assert rule.floor is not None and rule.floor > 0, (section, key)
        # (mixed_efficiency's lower bound, 0.5, is above its floor: the bound answers first)
        match = f"{section}.{key}: (absurd value .*below the sanity floor|must be >= {rule.low:g})"
        with pytest.raises(ProfileError, match=match):
            hw.with_overrides({f"{section}.{key}": rule.floor / 10})


def test_bundled_and_calibrated_profiles_pass_the_floors():
    root = Path(__file__).resolve().parents[2]
    for name in ("rtx4090-lohan", "a100-80g-nvme", "rtx3090-desktop", "rtx2060-laptop", "v100-32g",
                 "h100-80g"):
        load_profile(name)
    load_profile(str(root / "experiments" / "results" / "closed_loop_cpu.yaml"))  # gpu.memory_gib 0.036


# ---- class 6: command-line edges ---------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "needle"), [
    (["simulate", *TINY, "--iterations", "0"], "argument --iterations: must be >= 1, got 0"),
    (["simulate", *TINY, "--iterations", "-3"], "argument --iterations: must be >= 1, got -3"),
    (["simulate", "--model", "tiny-gpt", "--seq", "0"], "argument --seq: must be >= 1, got 0"),
    (["simulate", "--model", "tiny-gpt", "--alpha", "nan"], "argument --alpha: expected a finite number"),
    (["simulate", "--model", "tiny-gpt", "--batch", "-8"], "argument --batch: must be >= 1"),
    (["simulate", "--model", "tiny-gpt", "--swap-layers", "-1"], "argument --swap-layers: must be >= 0"),
    (["plan", "--model", "tiny-gpt", "--time-limit", "-5"], "argument --time-limit: must be > 0, got -5"),
    (["plan", "--model", "tiny-gpt", "--time-limit", "inf"],
     "argument --time-limit: expected a finite number"),
    (["capacity", "--seq", "0"], "argument --seq: must be >= 1"),
    (["run", "p.json", "--checkpoint-every", "-1"], "argument --checkpoint-every: must be >= 1, got -1"),
    (["run", "p.json", "--checkpoint-every", "0"], "argument --checkpoint-every: must be >= 1, got 0"),
    (["run", "p.json", "--steps", "0"], "argument --steps: must be >= 1"),
    (["run", "p.json", "--seed", "-1"], "argument --seed: must be >= 0"),
    (["run", "p.json", "--lr", "0"], "argument --lr: must be > 0"),
])
def test_bad_numeric_flags(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    one_line_error(capsys, 2, needle, f"see tierflow {argv[0]} --help")


def test_every_numeric_flag_uses_a_checked_type():
    """The audit: no subcommand takes a bare int or float (0, negatives, nan and inf would pass)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.type not in (int, float), \
                f"tierflow {name} {action.option_strings}: bare {action.type}"
            checked += action.type is not None and action.type is not str
    assert checked >= 20


def test_long_inline_placement_is_json_not_a_path(tmp_path, capsys):
    full = {c: {"gpu": 0, "cpu": 0.5, "ssd": 0.5} for c in ("weights", "master", "adam_m", "adam_v", "grads")}
    full["checkpoints"] = {"gpu": 0, "cpu": 1, "ssd": 0}
    text = json.dumps(full)
    assert len(text) > 255  # "File name too long" when tried as a path first
    out = tmp_path / "p.json"
    assert main(["simulate", *TINY, "--placement", text, "--write-plan", str(out)]) == 0
    capsys.readouterr()
    assert load_plan(out).config.placement.weights.ssd == 0.5


@pytest.mark.parametrize(("text", "needle"), [
    ("[1,2]", "not gpu|cpu|ssd or JSON starting with '{'"),
    ('"gpu"', "not gpu|cpu|ssd or JSON starting with '{'"),
    ('{"weights": 5}', "weights: expected an object of gpu/cpu/ssd"),
    ('{"weights": {"gpu": "x"}}', "weights: expected an object")])
def test_bad_placements(capsys, text, needle):
    run_cli(capsys, ["simulate", *TINY, "--placement", text], 2, needle)


def test_placement_file_holding_a_list(tmp_path, capsys):
    f = tmp_path / "placement.json"
    f.write_text("[1, 2]")
    run_cli(capsys, ["simulate", *TINY, "--placement", str(f)], 2, "expected a JSON object of tensor classes")


# ---- class 7: other ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, plan_text) -> str:
    f = tmp_path_factory.mktemp("run") / "p.json"
    f.write_text(plan_text)
    return str(f)


def test_init_with_random_bytes(tmp_path, capsys, plan_file):
    d = tmp_path / "init"
    d.mkdir()
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    run_cli(capsys, ["run", plan_file, "--device", "cpu", "--steps", "1", "--init", str(d)], 2,
            "model.safetensors is not a readable safetensors file")


def test_init_with_an_int32_weight_names_the_tensor(tmp_path, capsys, plan_file):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "init"
    d.mkdir()
    save_file({"transformer.wte.weight": torch.zeros(256, 128, dtype=torch.int32)},
              str(d / "model.safetensors"))
    run_cli(capsys, ["run", plan_file, "--device", "cpu", "--steps", "1", "--init", str(d)], 2,
            "tensor 'transformer.wte.weight' has dtype I32, not floating point")


def test_data_shorter_than_one_batch(tmp_path, capsys, plan_file):
    f = tmp_path / "short.txt"
    f.write_text("x" * 400)
    run_cli(capsys, ["run", plan_file, "--device", "cpu", "--steps", "1", "--data", str(f)], 2,
            "400 tokens, shorter than one batch of 8 x 64 tokens + 1 = 513")


def _trace(plan, tmp_path: Path, dur_of_op: dict[int, float] | None = None) -> str:
    res = simulate_plan(plan)
    events = [{"ph": "X", "name": t.label, "ts": float(res.start_s[t.id] * 1e6),
               "dur": float((res.end_s[t.id] - res.start_s[t.id]) * 1e6), "args": {"id": t.id}}
              for t in plan.graph.tasks]
    for oid, dur in (dur_of_op or {}).items():
        events[oid]["dur"] = dur
    f = tmp_path / "trace.json"
    f.write_text(json.dumps({"traceEvents": events}))
    return str(f)


def test_compare_refuses_negative_durations(tmp_path, capsys, plan_file):
    plan = load_plan(plan_file)
    # the same trace with sane times compares
    assert main(["compare", plan_file, _trace(plan, tmp_path)]) == 0
    assert "ratio" in capsys.readouterr().out
    run_cli(capsys, ["compare", plan_file, _trace(plan, tmp_path, {7: -5.0})], 2,
            "traceEvents[7] (op 7", "dur -5.0 is not a non-negative number")
