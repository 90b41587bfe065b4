"""executor/lora_peft.py: LoRA adapters exported as a PEFT directory that `peft.PeftModel.from_pretrained`
loads onto the transformers model of every family and computes the reference forward with (W' = W + s B A on
the right rows), read back exactly, PEFT's own saves read and re-exported, and the refusals (one line)."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from tierflow.executor.lora_peft import (  # noqa: E402
    CONFIG_NAME,
    WEIGHTS_NAME,
    PeftError,
    expected_shapes,
    export_peft,
    inspect_peft,
    projections,
    read_peft,
)
from tierflow.executor.models import hf_config, make_blocks  # noqa: E402
from tierflow.outputs import OutputError  # noqa: E402
from tierflow.planner.core.lora import LORA_TARGETS, LoraConfig  # noqa: E402
from tierflow.planner.core.models import get_model  # noqa: E402

GPT, LLAMA = (dataclasses.replace(get_model(n), num_layers=2) for n in ("tiny-gpt", "tiny-llama"))
FAMILIES = {
    "gpt": GPT,
    "gpt_neox": dataclasses.replace(GPT, name="tiny-neox", family="gpt_neox", max_positions=0,
                                    tied_embeddings=False, parallel_residual=True, rotary_fraction=0.25),
    "llama": LLAMA,
    "opt": dataclasses.replace(GPT, name="tiny-opt", family="opt", activation="relu", position_offset=2),
    "phi3": dataclasses.replace(LLAMA, name="tiny-phi3", family="phi3", rotary_fraction=0.5),
}
# the families that share LLaMA's module names
LLAMA_LIKE = {
    "mistral": dataclasses.replace(LLAMA, name="tiny-mistral", family="mistral", sliding_window=64),
    "qwen2": dataclasses.replace(LLAMA, name="tiny-qwen2", family="qwen2", qkv_bias=True,
                                 tied_embeddings=True),
    "qwen3": dataclasses.replace(LLAMA, name="tiny-qwen3", family="qwen3", qk_norm=True, head_dim=48),
    "gemma": dataclasses.replace(LLAMA, name="tiny-gemma", family="gemma", activation="geglu",
                                 tied_embeddings=True, head_dim=64),
}
SOME = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")  # fused modules partly targeted
RANK, ALPHA = 4, 12.0


def random_adapters(spec, lora, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.2 * torch.randn(shape, generator=g) for k, shape in expected_shapes(spec, lora).items()}


def hf_model(spec, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = dict(hf_config(spec))
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# The reference, written independently of lora_peft's tables: the transformers module of each target and
# the rows of its weight that are the target's outputs.
def reference_site(spec, model, layer, target):
    """(weight tensor of the module, rows of the target's outputs, stored (in, out)?)."""
    q, kv, f, hd = spec.q_dim, spec.kv_dim, spec.ffn_hidden, spec.head_dim
    fam = spec.family
    if fam == "gpt":
        blk = model.transformer.h[layer]
        fused = {"q_proj": range(0, q), "k_proj": range(q, q + kv), "v_proj": range(q + kv, q + 2 * kv)}
        if target in fused:
            return blk.attn.c_attn.weight, list(fused[target]), True
        mod = {"o_proj": blk.attn.c_proj, "up_proj": blk.mlp.c_fc, "down_proj": blk.mlp.c_proj}[target]
        return mod.weight, None, True
    if fam == "gpt_neox":
        blk = model.gpt_neox.layers[layer]
        if target in ("q_proj", "k_proj", "v_proj"):
            grid = torch.arange(3 * q).view(spec.num_heads, 3, hd)  # rows: (head, part, dim)
            return blk.attention.query_key_value.weight, \
                grid[:, ("q_proj", "k_proj", "v_proj").index(target), :].reshape(-1).tolist(), False
        mod = {"o_proj": blk.attention.dense, "up_proj": blk.mlp.dense_h_to_4h,
               "down_proj": blk.mlp.dense_4h_to_h}[target]
        return mod.weight, None, False
    if fam == "opt":
        blk = model.model.decoder.layers[layer]
        mod = {"q_proj": blk.self_attn.q_proj, "k_proj": blk.self_attn.k_proj, "v_proj": blk.self_attn.v_proj,
               "o_proj": blk.self_attn.out_proj, "up_proj": blk.fc1, "down_proj": blk.fc2}[target]
        return mod.weight, None, False
    blk = model.model.layers[layer]
    if fam == "phi3":
        fused = {"q_proj": (blk.self_attn.qkv_proj, range(0, q)), "k_proj": (blk.self_attn.qkv_proj,
                 range(q, q + kv)), "v_proj": (blk.self_attn.qkv_proj, range(q + kv, q + 2 * kv)),
                 "gate_proj": (blk.mlp.gate_up_proj, range(0, f)), "up_proj": (blk.mlp.gate_up_proj,
                 range(f, 2 * f))}
        if target in fused:
            mod, rows = fused[target]
            return mod.weight, list(rows), False
        mod = {"o_proj": blk.self_attn.o_proj, "down_proj": blk.mlp.down_proj}[target]
        return mod.weight, None, False
    part = blk.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else blk.mlp
    return getattr(part, target).weight, None, False


def reference_model(spec, lora, adapters):
    """The base with W' = W + (alpha / rank) B A merged into each target's rows."""
    model = hf_model(spec)
    with torch.no_grad():
        for name, a in adapters.items():
            if not name.endswith("lora_A"):
                continue
            _, layer, target, _ = name.split(".")
            delta = lora.scaling * adapters[name[:-1] + "B"] @ a  # (out, in)
            weight, rows, conv1d = reference_site(spec, model, int(layer), target)
            w = weight.t() if conv1d else weight  # as (out, in)
            if rows is None:
                w += delta
            else:
                w[rows] += delta
    return model


def peft_model(spec, directory):
    peft = pytest.importorskip("peft")
    return peft.PeftModel.from_pretrained(hf_model(spec), str(directory)).eval()


@pytest.mark.parametrize("targets", ["all", "some"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_peft_with_the_reference_logits_and_reads_back_exactly(family, targets, tmp_path):
    spec = FAMILIES[family]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=LORA_TARGETS if targets == "all" else SOME)
    adapters = random_adapters(spec, lora)
    out = export_peft(adapters, spec, tmp_path / "adapter", lora=lora, base_model="acme/base")
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    x = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference_model(spec, lora, adapters)(input_ids=x).logits
        got = peft_model(spec, out)(input_ids=x).logits
        base = hf_model(spec)(input_ids=x).logits
    assert (want - base).abs().max() > 1e-2  # the adapters change the logits visibly
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    config, back = read_peft(out, spec, base_model="acme/base")
    assert config == lora
    assert sorted(back) == sorted(adapters)
    for k, t in adapters.items():
        assert back[k].dtype == torch.float32 and torch.equal(back[k], t), k


@pytest.mark.parametrize("family", list(LLAMA_LIKE))
def test_llama_like_families_load_in_peft_with_the_reference_logits(family, tmp_path):
    spec = LLAMA_LIKE[family]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=SOME)
    adapters = random_adapters(spec, lora)
    out = export_peft(adapters, spec, tmp_path / "adapter", lora=lora)
    x = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference_model(spec, lora, adapters)(input_ids=x).logits
        got = peft_model(spec, out)(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_fused_adapter_without_tierflows_metadata_is_split_by_its_rows(tmp_path):
    spec = FAMILIES["phi3"]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=SOME)
    adapters = random_adapters(spec, lora)
    out = export_peft(adapters, spec, tmp_path / "a", lora=lora)
    save_file(load_file(out / WEIGHTS_NAME), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config, back = read_peft(out, spec)
    assert config == lora and all(torch.equal(back[k], t) for k, t in adapters.items())


def test_projection_tables_name_the_modules_of_the_executors_layers():
    for spec in FAMILIES.values():
        layer = make_blocks(spec, "meta", None, None)[1]
        modules = dict(layer.named_modules())
        for p in projections(spec):
            assert p.module in modules, (spec.family, p.module)


def peft_saved_llama(tmp_path, target_modules, seed=3):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf_model(LLAMA), peft.LoraConfig(
        r=RANK, lora_alpha=8, target_modules=target_modules, lora_dropout=0.05, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    model.save_pretrained(str(tmp_path / "peft"))
    return tmp_path / "peft"


def test_a_peft_saved_adapter_is_read_and_re_exported_to_the_same_tensors(tmp_path):
    saved = peft_saved_llama(tmp_path, ["q_proj", "v_proj", "down_proj"])
    config, adapters = read_peft(saved, LLAMA)
    assert config == LoraConfig(rank=RANK, alpha=8, targets=("q_proj", "v_proj", "down_proj"), dropout=0.05)
    assert len(adapters) == 2 * 3 * LLAMA.num_layers
    again = export_peft(adapters, LLAMA, tmp_path / "again", lora=config)
    a, b = load_file(saved / WEIGHTS_NAME), load_file(again / WEIGHTS_NAME)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------------
# refusals: one line each
# ------------------------------------------------------------------------------------------------------------


def refused(exc_type, fn, *args, **kw) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def exported(tmp_path):
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    return export_peft(random_adapters(LLAMA, lora), LLAMA, tmp_path / "x", lora=lora, base_model="acme/base")


def edit_config(directory, **changes):
    path = directory / CONFIG_NAME
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("key,value", [("use_dora", True), ("use_rslora", True), ("bias", "all"),
                                       ("modules_to_save", ["lm_head"]), ("layers_to_transform", [0]),
                                       ("peft_type", "IA3"), ("init_lora_weights", "pissa")])
def test_what_tierflow_cannot_train_is_refused_naming_the_key(exported, key, value):
    edit_config(exported, **{key: value})
    assert key in refused(PeftError, read_peft, exported, LLAMA)


def test_another_base_is_refused(exported):
    assert "acme/other" in refused(PeftError, read_peft, exported, LLAMA, base_model="acme/other")
    read_peft(exported, LLAMA, base_model="/models/acme/base")  # the same name, downloaded
    read_peft(exported, LLAMA)  # the run names no base


def test_missing_and_misshapen_tensors_are_refused(exported, tmp_path):
    tensors = load_file(exported / WEIGHTS_NAME)
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(exported / WEIGHTS_NAME))
    assert name in refused(PeftError, read_peft, exported, LLAMA)
    save_file({**tensors, name: tensors[name][:-1]}, str(exported / WEIGHTS_NAME))
    assert "shape" in refused(PeftError, read_peft, exported, LLAMA)
    lm_head = "base_model.model.lm_head.lora_A.weight"
    save_file({**tensors, lm_head: tensors[name].clone()}, str(exported / WEIGHTS_NAME))
    assert "lm_head" in refused(PeftError, read_peft, exported, LLAMA)
    wider = dataclasses.replace(LLAMA, ffn_hidden=LLAMA.ffn_hidden + 8)  # another model's adapter
    save_file(tensors, str(exported / WEIGHTS_NAME))
    assert "shape" in refused(PeftError, read_peft, exported, wider)
    edit_config(exported, target_modules=["q_proj", "attn.c_attn"])
    assert "attn.c_attn" in refused(PeftError, read_peft, exported, LLAMA)


def test_a_dense_b_on_a_fused_module_is_not_split(tmp_path):
    spec = FAMILIES["gpt"]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=("q_proj", "k_proj", "v_proj"))
    out = export_peft(random_adapters(spec, lora), spec, tmp_path / "a", lora=lora)
    tensors = load_file(out / WEIGHTS_NAME)
    name = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
    tensors[name] = torch.randn(tensors[name].shape)  # as PEFT trains one adapter on c_attn
    save_file(tensors, str(out / WEIGHTS_NAME))
    assert "block-diagonal" in refused(PeftError, read_peft, out, spec)


def test_hostile_files_are_one_line(exported):
    weights = exported / WEIGHTS_NAME
    good = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # a 1 TiB header
    assert "header" in refused(PeftError, read_peft, exported, LLAMA)
    weights.write_bytes(good[: len(good) // 2])
    assert "truncated" in refused(PeftError, read_peft, exported, LLAMA)
    weights.write_bytes(b"not safetensors")
    refused(PeftError, read_peft, exported, LLAMA)
    weights.write_bytes(good)
    bad = {k: (v.to(torch.int32) if "layers.0.self_attn.q_proj.lora_A" in k else v)
           for k, v in load_file(weights).items()}
    save_file(bad, str(weights))
    assert "I32" in refused(PeftError, read_peft, exported, LLAMA)
    (exported / CONFIG_NAME).write_text("[" * 100_000)
    refused(PeftError, read_peft, exported, LLAMA)
    (exported / CONFIG_NAME).write_text(" " * (2 << 20))
    assert "limit" in refused(PeftError, read_peft, exported, LLAMA)


def test_export_checks_the_directory_and_the_adapters_before_writing(tmp_path):
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    adapters = random_adapters(LLAMA, lora)
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep")
    assert "not empty" in refused(OutputError, export_peft, adapters, LLAMA, used, lora=lora)
    assert [p.name for p in used.iterdir()] == ["mine.txt"]
    export_peft(adapters, LLAMA, used, lora=lora, overwrite=True)  # the caller says so: files replaced
    assert sorted(p.name for p in used.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, "mine.txt"]
    one = next(iter(adapters))
    assert one in refused(PeftError, export_peft, {k: v for k, v in adapters.items() if k != one}, LLAMA,
                          tmp_path / "new", lora=lora)
    assert "NaN" in refused(PeftError, export_peft, {**adapters, one: adapters[one] * float("nan")}, LLAMA,
                            tmp_path / "new", lora=lora)
    assert not (tmp_path / "new").exists()
    assert "LoRA" in refused(PeftError, export_peft, adapters, LLAMA, tmp_path / "new")  # no lora at all
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_inspect_reads_no_tensor_data(exported):
    adapter = inspect_peft(exported, LLAMA)
    assert adapter.lora == LoraConfig(rank=RANK, alpha=ALPHA) and adapter.base_model == "acme/base"


# ------------------------------------------------------------------------------------------------------------
# tierflow run --export-peft / --init-peft: checked before any step
# ------------------------------------------------------------------------------------------------------------


def write_plan_of(spec, path):
    from tierflow.hwprofiles import load_profile
    from tierflow.planner.core.schedules import build_graph, make_schedule
    from tierflow.planner.io.planfile import plan_from_graph, write_plan

    hw = load_profile("rtx3090-desktop")
    cfg = make_schedule("vertical", spec, hw, batch=2, micro_batch=1, seq=32, iterations=1)
    write_plan(plan_from_graph(spec, hw, cfg, build_graph(spec, hw, cfg)), path)
    return str(path)


def run_cli(capsys, *args) -> tuple[int, str]:
    from tierflow.cli import main

    code = main(["run", *args, "--steps", "1", "--device", "cpu"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "step" not in captured.out
    return code, captured.err.strip()


def test_cli_peft_flags_are_checked_before_the_run(tmp_path, capsys, exported):
    full = write_plan_of(LLAMA, tmp_path / "full.json")
    lora = write_plan_of(LLAMA.with_lora(LoraConfig(rank=8, alpha=ALPHA)), tmp_path / "lora.json")
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep")
    code, err = run_cli(capsys, lora, "--export-peft", str(used))
    assert code == 2 and "\n" not in err and "--export-peft" in err and "not empty" in err
    assert [p.name for p in used.iterdir()] == ["mine.txt"]
    code, err = run_cli(capsys, full, "--export-peft", str(tmp_path / "new"))
    assert code == 2 and "\n" not in err and "no LoRA" in err and not (tmp_path / "new").exists()
    code, err = run_cli(capsys, lora, "--init-peft", str(tmp_path / "missing"))
    assert code == 2 and "\n" not in err and "--init-peft" in err and "does not exist" in err
    code, err = run_cli(capsys, lora, "--init-peft", str(exported))
    assert code == 2 and "\n" not in err and "trained on 'acme/base'" in err and "'tiny-llama'" in err
    edit_config(exported, base_model_name_or_path=LLAMA.name)
    code, err = run_cli(capsys, lora, "--init-peft", str(exported))  # a rank-4 adapter, a rank-8 plan
    assert code == 2 and "\n" not in err and "--lora 4 --lora-alpha 12" in err
    edit_config(exported, use_dora=True)
    code, err = run_cli(capsys, write_plan_of(LLAMA.with_lora(LoraConfig(rank=RANK, alpha=ALPHA)),
                                              tmp_path / "r4.json"), "--init-peft", str(exported))
    assert code == 2 and "\n" not in err and "use_dora" in err


def test_an_adapters_other_dropout_is_refused_naming_the_flag(tmp_path, capsys, exported):
    edit_config(exported, base_model_name_or_path=LLAMA.name, lora_dropout=0.1)
    plan = write_plan_of(LLAMA.with_lora(LoraConfig(rank=RANK, alpha=ALPHA)), tmp_path / "p0.json")
    code, err = run_cli(capsys, plan, "--init-peft", str(exported))
    assert code == 2 and "\n" not in err and "lora_dropout 0.1" in err and "--lora-dropout 0.1" in err
    from tierflow.executor.lora_peft import init_adapters
    from tierflow.executor.options import ModelDataOptions, RunConfig

    spec = LLAMA.with_lora(LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.1))  # the adapter's: it goes on
    config = RunConfig(steps=1, model_data=ModelDataOptions(init_peft=str(exported)))
    back, (_, direct) = init_adapters(config, spec), read_peft(exported, LLAMA)
    assert sorted(back) == sorted(direct) and all(torch.equal(back[k], v) for k, v in direct.items())
    edit_config(exported, lora_dropout=0.0)  # the plan's 0.1 against the adapter's 0: refused too
    assert "--lora-dropout 0" in refused(PeftError, init_adapters, config, spec)
    other = LLAMA.with_lora(LoraConfig(rank=RANK + 1, alpha=ALPHA, dropout=0.1))  # and with another rank
    assert f"--lora {RANK} --lora-alpha" in refused(PeftError, init_adapters, config, other)


def test_one_rank_and_one_scaling(exported):
    edit_config(exported, rank_pattern={"model.layers.1.mlp.up_proj": 8})
    assert "layer 0" in refused(PeftError, read_peft, exported, LLAMA)
    edit_config(exported, rank_pattern={"up_proj": 8})
    assert "up_proj has rank 8" in refused(PeftError, read_peft, exported, LLAMA)
    edit_config(exported, rank_pattern={}, alpha_pattern={"up_proj": 3})
    assert "scaling" in refused(PeftError, read_peft, exported, LLAMA)
    # PEFT's other spelling of target_modules, a regular expression over the module paths
    edit_config(exported, alpha_pattern={}, target_modules=r".*\.(q|k|v|o|gate|up|down)_proj")
    assert read_peft(exported, LLAMA)[0] == LoraConfig(rank=RANK, alpha=ALPHA)


def test_the_runs_calls_export_and_read_its_adapters(tmp_path):
    from tierflow.executor.lora_peft import export_adapters, init_adapters
    from tierflow.executor.options import ModelDataOptions, OutputOptions, RunConfig

    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=SOME)
    spec = FAMILIES["gpt_neox"].with_lora(lora)
    adapters = random_adapters(spec, lora)
    assert init_adapters(RunConfig(steps=1), spec) is None
    assert export_adapters(adapters, RunConfig(steps=1), spec) is None
    out = export_adapters(adapters, RunConfig(steps=1, output=OutputOptions(export_peft=str(tmp_path / "a"))),
                          spec)
    assert json.loads((out / CONFIG_NAME).read_text())["base_model_name_or_path"] == spec.name
    back = init_adapters(RunConfig(steps=1, model_data=ModelDataOptions(init_peft=str(out))), spec)
    assert sorted(back) == sorted(adapters) and all(torch.equal(back[k], v) for k, v in adapters.items())
    other = spec.with_lora(LoraConfig(rank=RANK + 1, alpha=ALPHA, targets=SOME))
    assert "--lora 4" in refused(PeftError, init_adapters,
                                 RunConfig(steps=1, model_data=ModelDataOptions(init_peft=str(out))), other)


def test_fresh_adapters_b_zero_round_trip_by_the_exports_metadata(tmp_path):
    spec = FAMILIES["gpt"]
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=SOME)  # c_attn: q and v of q, k, v
    adapters = {k: (torch.zeros_like(v) if k.endswith("B") else v)
                for k, v in random_adapters(spec, lora).items()}
    out = export_peft(adapters, spec, tmp_path / "a", lora=lora)
    config, back = read_peft(out, spec)
    assert config == lora and all(torch.equal(back[k], v) for k, v in adapters.items())
    save_file(load_file(out / WEIGHTS_NAME), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    assert "all zeros" in refused(PeftError, read_peft, out, spec)  # which parts: nothing says
