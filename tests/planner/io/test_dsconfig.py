"""The DeepSpeed bridge: `tierflow simulate --ds-config` reads DeepSpeed configs as DeepSpeed documents them
and simulates the run as DeepSpeed executes it; `tierflow plan --emit-ds-config` writes the nearest config
back."""

from __future__ import annotations

import json

import pytest
from support.helpers import profile

from tierflow.cli import main
from tierflow.planner.core.models import get_model
from tierflow.planner.core.schedules import make_schedule
from tierflow.planner.io.deepspeed.config import (
    DsConfigError,
    ds_config_for_plan,
    parse_ds_config,
    read_ds_config,
)

# ZeRO-Infinity, as DeepSpeed's ZeRO-Infinity tutorial and config-json page write it (parameters and optimizer
# states on NVMe), with a batch split and bf16
ZERO_INFINITY = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        # buffer_size: the tutorial's 1e8 is below GPT-3 1.3B's embedding (102.9M elements), which stops
        # DeepSpeed at start-up (partitioned_param_swapper.py get_buffer)
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 2e8, "max_in_cpu": 1e9},
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
}
# ZeRO-3 with CPU offload of parameters and optimizer (DeepSpeed's ZeRO-Offload docs) and CPU checkpointing
CPU_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
    "steps_per_print": 100,
}
# Hugging Face Trainer's ZeRO-3 template (transformers docs, "ZeRO-3 example"): "auto" everywhere
# the Trainer fills
HF_TRAINER = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
M13 = get_model("gpt3-1.3b")


def write(tmp_path, data, name="ds_config.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def devices(pl) -> dict[str, str]:
    """The one tier each tensor class is on (the bridge never splits)."""
    d = pl.as_dict()
    return {k: next(t for t, f in v.items() if f == 1.0) for k, v in d.items()}


# ---- mapping -----------------------------------------------------------------------------------------------


def test_zero_infinity_nvme_config_puts_weights_and_states_on_the_ssds():
    ds = parse_ds_config(ZERO_INFINITY, "zinf.json", M13)
    assert (ds.stage, ds.param_device, ds.optimizer_device) == (3, "nvme", "nvme")
    assert devices(ds.placement()) == {"weights": "ssd", "master": "ssd", "adam_m": "ssd", "adam_v": "ssd",
                                       "grads": "ssd", "checkpoints": "gpu"}
    assert (ds.batch, ds.micro_batch, ds.accumulation) == (8, 2, 4)
    cfg = ds.schedule(M13, profile("rtx3090-desktop"), seq=M13.seq_len)
    assert (cfg.family, cfg.runtime, cfg.batch, cfg.micro_batch, cfg.num_micro_batches) == \
        ("horizontal", "deepspeed", 8, 2, 4)
    line = ds.warning_line()
    for key in ("aio.thread_count", "aio.queue_depth", "zero_optimization.offload_param.buffer_count"):
        assert key in line, key
    for key in ("zero_optimization.offload_param.buffer_size",
                "zero_optimization.reduce_bucket_size", "zero_optimization.contiguous_gradients"):
        assert key not in line, key  # modelled (dskeys.MODELLED_KEYS)
    assert cfg.ds_reduce_bucket_elems == 10_000_000 and cfg.ds_param_buffer_elems == 200_000_000
    # what the simulation models is not named as left out; paths have no effect on the step time
    assert cfg.ds_sub_group_elems == ZERO_INFINITY["zero_optimization"]["sub_group_size"]  # modelled now
    for key in ("zero_optimization.stage,", "offload_param.device", "nvme_path", "train_batch_size",
                "sub_group_size",
                "stage3_max_reuse_distance", "stage3_prefetch_bucket_size"):
        assert key not in line, key
    assert "zero_optimization.offload_param.nvme_path" in ds.no_effect


def test_cpu_offload_config_puts_weights_states_and_checkpoints_in_cpu_memory():
    ds = parse_ds_config(CPU_OFFLOAD, "offload.json", M13)
    assert devices(ds.placement()) == {"weights": "cpu", "master": "cpu", "adam_m": "cpu", "adam_v": "cpu",
                                       "grads": "cpu", "checkpoints": "cpu"}
    # DeepSpeed derives the batch from the micro-batch and the accumulation steps on one GPU
    assert (ds.batch, ds.micro_batch, ds.accumulation) == (8, 4, 2)
    assert ds.precision == "fp16"
    # the default prefetch bucket (5e7 elements) holds no whole 1.3B layer (50M params): one layer ahead
    assert ds.prefetch_depth(M13) == 1
    tiny = get_model("tiny-gpt")  # 198K params a layer: the bucket holds every layer
    assert parse_ds_config(CPU_OFFLOAD, "offload.json", tiny).prefetch_depth(tiny) == tiny.num_layers
    small = {**CPU_OFFLOAD, "zero_optimization": {**CPU_OFFLOAD["zero_optimization"],
                                                  "stage3_prefetch_bucket_size": 2 * tiny.layer_params() + 1}}
    assert parse_ds_config(small, "x.json", tiny).prefetch_depth(tiny) == 2
    line = ds.warning_line()
    assert "activation_checkpointing.partition_activations" in line
    # the loss scale's value changes no step's work (dskeys.NO_STEP_EFFECT)
    assert "fp16.loss_scale" not in line and "fp16.loss_scale" in ds.no_effect
    assert "optimizer" not in line and "steps_per_print" not in line  # no effect on the step time
    assert {"optimizer.params", "steps_per_print"} <= set(ds.no_effect)


def test_hf_trainer_auto_values_resolve_from_the_model_and_the_command_line():
    ds = parse_ds_config(HF_TRAINER, "hf.json", M13, batch_hint=16, micro_batch_hint=4)
    assert (ds.batch, ds.micro_batch, ds.accumulation) == (16, 4, 4)
    assert set(ds.from_command_line) == {"train_batch_size=16", "train_micro_batch_size_per_gpu=4"}
    h = M13.hidden
    assert ds.prefetch_bucket_elems == int(0.9 * h * h)  # the Trainer's 0.9 hidden^2
    assert any(r.startswith(f"zero_optimization.reduce_bucket_size={h * h} ") for r in ds.resolved)
    assert ds.precision == "16-bit (auto)"
    # reduce_bucket_size resolved to hidden^2 and simulated at that bucket (no longer named as left out)
    assert ds.reduce_bucket_elems == h * h and "reduce_bucket_size" not in ds.warning_line()
    # one "auto" between two numbers follows from them, whatever the command line says
    one = {**HF_TRAINER, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    ds1 = parse_ds_config(one, "hf.json", M13, batch_hint=64, micro_batch_hint=8)
    assert (ds1.batch, ds1.micro_batch, ds1.accumulation) == (6, 2, 3) and not ds1.from_command_line


# ---- the command -------------------------------------------------------------------------------------------


def test_ds_config_simulation_equals_simulate_with_the_same_explicit_options(tmp_path, capsys):
    path = write(tmp_path, CPU_OFFLOAD)
    # without pageable copies the config's ZeRO-3 boundary copy is the pinned one the explicit options give
    box = ["--model", "tiny-gpt", "--hw", "rtx3090-desktop", "--set", "pcie.pageable_d2h_gbps=null"]
    assert main(["simulate", "--ds-config", path, *box, "--no-plan", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    sched = got["deepspeed"]["schedule"]
    assert (sched["family"], sched["runtime"], sched["batch"], sched["micro_batch"]) == \
        ("horizontal", "deepspeed", 8, 4)
    assert sched["prefetch_depth"] == 4  # 5e7 elements hold all 4 tiny layers
    assert main(["simulate", "--schedule", "horizontal", "--runtime", "deepspeed", *box, "--batch", "8",
                 "--micro-batch", "4", "--prefetch", "4", "--placement", "cpu", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert got["deepspeed"]["iteration_s"] == ref["iteration_s"]
    assert got["deepspeed"]["link_bytes"] == ref["link_bytes"]
    # the config pins DeepSpeed's host gradient buffers (offload_optimizer.pin_memory, true by default):
    # torch's pinned allocator rounds each up to a power of two; the explicit options do not pin
    from tierflow.planner.core.dsruntime import DsKnobs, deepspeed_host_buffers_bytes
    n = get_model("tiny-gpt").total_params()
    rounded = (deepspeed_host_buffers_bytes(n, DsKnobs(pin_memory=True), False, False)
               - deepspeed_host_buffers_bytes(n, DsKnobs(), False, False))
    assert rounded > 0
    assert got["deepspeed"]["peak_bytes"]["cpu"] == pytest.approx(ref["peak_bytes"]["cpu"] + rounded)
    assert {k: v for k, v in got["deepspeed"]["peak_bytes"].items() if k != "cpu"} == \
        {k: v for k, v in ref["peak_bytes"].items() if k != "cpu"}
    # a different prefetch gives a different simulation: the comparison can fail
    assert main(["simulate", "--schedule", "horizontal", *box, "--batch", "8", "--micro-batch", "4",
                 "--placement", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] != got["deepspeed"]["peak_bytes"]
    # with them, the config (ZeRO-3, states in host memory) waits on its blocking fp32 gradient copy
    # (stage3.py partition_grads): slower than the explicit options, which name no ZeRO stage
    assert main(["simulate", "--ds-config", path, *box[:4], "--no-plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deepspeed"]["iteration_s"] > ref["iteration_s"]


def test_unmodelled_and_unknown_keys_are_named_in_one_warning_line(tmp_path, capsys):
    data = json.loads(json.dumps(ZERO_INFINITY))
    data["zero_optimization"]["aio"] = data.pop("aio")  # a common mistake: aio belongs at the top level
    data["fancy_new_feature"] = {"enabled": True}
    path = write(tmp_path, data, "zinf.json")
    assert main(["simulate", "--ds-config", path, "--model", "tiny-gpt", "--hw", "rtx3090-desktop",
                 "--no-plan"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("zinf.json: not modelled: ")
    assert "zero_optimization.stage3_param_persistence_threshold" in lines[0]
    assert "zero_optimization.offload_param.max_in_cpu" not in lines[0]  # modelled (dskeys.MODELLED_KEYS)
    assert "unknown to DeepSpeed (ignored): zero_optimization.aio, fancy_new_feature" in lines[0]
    assert "iteration time" in out and "deepspeed" in out


def test_side_by_side_with_tierflow_plan(tmp_path, capsys):
    path = write(tmp_path, ZERO_INFINITY)
    assert main(["simulate", "--ds-config", path, "--model", "tiny-gpt", "--hw", "rtx3090-desktop",
                 "--plan-time-limit", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["iteration_s"] > 0 and d["deepspeed"]["iteration_s"] > 0
    assert d["plan"]["decisions"]["batch"] == 8  # the plan is for the config's batch
    # the plan's search includes the fixed schedules with defaults, and here it beats DeepSpeed's
    # on-demand NVMe
    assert d["plan"]["iteration_s"] < d["deepspeed"]["iteration_s"]
    assert main(["simulate", "--ds-config", path, "--model", "tiny-gpt", "--hw", "rtx3090-desktop",
                 "--plan-time-limit", "5"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "deepspeed" in line and "tierflow plan" in line)
    assert header.split() == ["deepspeed", "tierflow", "plan"]
    assert "the tokens/s of this DeepSpeed config" in out


BAD = [
    ("{ not json", "not JSON"),
    ("[1, 2]", "a JSON object ({...}), got a list"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size 16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 1 GPU (= 8)"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device cpu needs zero_optimization.stage 3, got stage 2"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}, "zero_optimization.stage is \"auto\""),
    ({"train_batch_size": 8, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
     "offload_param.device \"disk\": expected one of none, cpu, nvme"),
    ({"gradient_accumulation_steps": 4}, "neither train_batch_size nor train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, "not an integer"),
]


@pytest.mark.parametrize("data,words", BAD)
def test_bad_configs_are_refused_with_one_line_and_exit_2(tmp_path, capsys, data, words):
    path = write(tmp_path, data)
    rc = main(["simulate", "--ds-config", path, "--model", "tiny-gpt", "--hw", "rtx3090-desktop",
               "--no-plan"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "ds_config.json" in err and words in err, err


def test_missing_file_and_clashing_flags_are_one_line(tmp_path, capsys):
    assert main(["simulate", "--ds-config", str(tmp_path / "nope.json"), "--model", "tiny-gpt",
                 "--no-plan"]) == 2
    err = capsys.readouterr().err
    assert "nope.json: cannot read" in err and len(err.strip().splitlines()) == 1
    path = write(tmp_path, ZERO_INFINITY)
    assert main(["simulate", "--ds-config", path, "--model", "tiny-gpt", "--placement", "gpu",
                 "--no-plan"]) == 2
    assert "drop --placement" in capsys.readouterr().err


def test_a_config_that_does_not_fit_exits_3(tmp_path, capsys):
    # everything on the GPU (stage 2, no offload): GPT-3 1.3B's 21 GB of states overflow a 6 GB RTX 2060
    path = write(tmp_path, {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                            "zero_optimization": {"stage": 2}})
    rc = main(["simulate", "--ds-config", path, "--model", "gpt3-1.3b", "--hw", "rtx2060-laptop",
               "--no-plan"])
    err = capsys.readouterr().err
    assert rc == 3 and "does not fit" in err and "gpu" in err


# ---- writing the nearest config ----------------------------------------------------------------------------


def test_emitted_config_names_what_deepspeed_cannot_express():
    hw = profile("rtx3090-desktop")
    m = get_model("tiny-gpt")
    ds_like = make_schedule("horizontal", m, hw, batch=8, micro_batch=2, placement=parse_ds_config(
        ZERO_INFINITY, "z.json", m).placement())
    assert ds_config_for_plan(m, ds_like).inexpressible == ()  # DeepSpeed's own schedule: nothing to say
    vertical = make_schedule("vertical", m, hw, batch=8, micro_batch=2, swap_layers=2)
    said = " ".join(ds_config_for_plan(m, vertical).inexpressible)
    for words in ("vertical order", "optimizer overlapped with the backward", "alpha deferral",
                  "per-layer swap-vs-recompute (2 of 4 layers"):
        assert words in said, words


def test_round_trip_plan_emit_then_read_back(tmp_path, capsys):
    """--emit-ds-config written by `tierflow plan`, read back by --ds-config: the same devices and batch
    split."""
    # 0.02 GiB for tensors beside the ~0.1 GiB the executor's CUDA runtime maps under the cap (devicemem)
    small_box = ["--hw", "rtx3090-desktop", "--set", "gpu.memory_gib=0.12", "--set", "gpu.reserved_gib=0",
                 "--set", "cpu.memory_gib=0.02", "--set", "cpu.reserved_gib=0"]
    ds_path = str(tmp_path / "ds.json")
    rc = main(["plan", "--model", "tiny-gpt", *small_box, "--batch", "8", "--time-limit", "5", "--no-window",
               "--emit-ds-config", ds_path, "--json"])
    assert rc == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert (f"wrote DeepSpeed config {ds_path}" in err
            and "DeepSpeed cannot express these decisions of the plan:\n  - " in err)
    decided = plan["decisions"]
    emitted = json.loads((tmp_path / "ds.json").read_text())
    zero = emitted["zero_optimization"]

    def device(split: dict) -> str:  # the slowest tier holding any part
        return "nvme" if split["ssd"] > 0 else "cpu" if split["cpu"] > 0 else "none"

    pl = decided["placement"]
    assert zero.get("offload_param", {}).get("device", "none") == device(pl["weights"])
    assert zero.get("offload_optimizer", {}).get("device", "none") == device(pl["master"])
    assert device(pl["master"]) != "none"  # the small box forces the optimizer states off the GPU
    # read back (on the full box, where DeepSpeed's own GPU buffers fit)
    assert main(["simulate", "--ds-config", ds_path, "--model", "tiny-gpt", "--hw", "rtx3090-desktop",
                 "--no-plan", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["warning"] is None  # every key the bridge writes is one it models
    read = back["ds_config"]
    assert (read["offload_param"], read["offload_optimizer"]) == (device(pl["weights"]), device(pl["master"]))
    assert read["cpu_checkpointing"] == (pl["checkpoints"]["gpu"] < 1)
    assert (read["train_batch_size"], read["train_micro_batch_size_per_gpu"],
            read["gradient_accumulation_steps"]) \
        == (decided["batch"], decided["micro_batch"], decided["batch"] // decided["micro_batch"])
    assert back["deepspeed"]["schedule"]["prefetch_depth"] == (decided["prefetch_depth"]
                                                               if read["offload_param"] == "cpu" else 1)


def test_null_sections_are_deepspeed_defaults():
    ds = parse_ds_config({"train_batch_size": 4, "bf16": {"enabled": True},
                          "zero_optimization": {"stage": 3, "offload_param": None}}, "n.json", M13)
    assert ds.param_device == "none" and ds.warning_line() is None


def test_read_ds_config_reads_a_file(tmp_path):
    ds = read_ds_config(write(tmp_path, ZERO_INFINITY), M13)
    assert ds.source == "ds_config.json" and ds.param_device == "nvme"
    with pytest.raises(DsConfigError, match="not JSON"):
        read_ds_config(write(tmp_path, "{"), M13)
