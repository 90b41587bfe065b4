"""Hugging Face intake and output: --model as a model directory or a hub id in the local cache (no network),
and `tierflow run --export-hf` writing a directory transformers loads with the executor's own logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import accumulate_gradients

from tierflow.planner.core.models import ModelError, find_cached_config, get_model, hf_cache_dir

CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
          "max_position_embeddings": 128, "tie_word_embeddings": True}


def make_cache(root: Path, repo_id: str, config: dict, *, with_ref: bool = True) -> Path:
    """The hub cache layout huggingface_hub writes: blobs, a snapshot per revision whose files link to the
    blobs, and refs/main naming the snapshot."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b"
    blob.write_text(json.dumps(config))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if with_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return snap / "config.json"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hf_cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("hub_importable", [True, False], ids=["huggingface_hub", "no-huggingface_hub"])
def test_hub_id_found_in_the_cache(cache, monkeypatch, hub_importable):
    if hub_importable:
        pytest.importorskip("huggingface_hub")
    else:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails: the layout is read directly
    config = make_cache(cache, "acme/tiny-qwen3", CONFIG)
    assert find_cached_config("acme/tiny-qwen3") == config
    spec = get_model("acme/tiny-qwen3")
    assert spec.name == "acme/tiny-qwen3" and spec.family == "qwen3" and spec.qk_norm
    assert spec.total_params() == 256 * 64 + 2 * spec.layer_params() + 64
    # a snapshot without refs/main (downloaded at a pinned revision) is found too
    make_cache(cache, "acme/pinned", CONFIG, with_ref=False)
    assert get_model("acme/pinned").family == "qwen3"


def test_hub_id_not_cached_says_how_to_download(cache):
    with pytest.raises(ModelError) as exc_info:
        get_model("acme/not-there")
    message = str(exc_info.value)
    assert "\n" not in message and "acme/not-there" in message and str(cache) in message
    assert "hf download acme/not-there config.json" in message


def test_model_directory_and_local_path_win_over_the_cache(tmp_path, cache, monkeypatch):
    local = tmp_path / "acme" / "tiny-qwen3"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))
    make_cache(cache, "acme/tiny-qwen3", CONFIG)
    monkeypatch.chdir(tmp_path)
    assert get_model("acme/tiny-qwen3").num_layers == 3  # the relative directory exists: it is read
    assert get_model(str(local)).name == "tiny-qwen3"


def run_cli(*args: str, env_cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "HF_HUB_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "tierflow.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_simulate_takes_a_hub_id_and_refuses_an_uncached_one(cache):
    make_cache(cache, "acme/tiny-qwen3", CONFIG)
    p = run_cli("simulate", "--model", "acme/tiny-qwen3", "--hw", "rtx3090-desktop", "--schedule", "vertical",
                "--batch", "4", "--micro-batch", "2", "--seq", "64", "--json", env_cache=cache)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["params"] == get_model("acme/tiny-qwen3").total_params()
    p = run_cli("simulate", "--model", "acme/nope", "--hw", "rtx3090-desktop", env_cache=cache)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf download acme/nope" in lines[0] and "Traceback" not in p.stderr
    p = run_cli("simulate", "--model", "acme/tiny-qwen3", "--seq", "256", "--hw", "rtx3090-desktop",
                env_cache=cache)
    assert p.returncode == 0, p.stderr  # qwen3 without use_sliding_window: any --seq


# ------------------------------------------------------------------------------------------------------------
# tierflow run trains every family, and --export-hf writes what transformers loads
# ------------------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

import dataclasses  # noqa: E402

from tierflow.executor.data import TokenData  # noqa: E402
from tierflow.executor.engine import Hyper  # noqa: E402
from tierflow.executor.models import BlockModel, build_blocks  # noqa: E402
from tierflow.executor.optim.decay import decayed  # noqa: E402
from tierflow.executor.run import OptimizerOptions, OutputOptions, RunConfig, run_plan  # noqa: E402
from tierflow.executor.tiers.state import BlockLayout  # noqa: E402
from tierflow.hwprofiles import load_profile  # noqa: E402
from tierflow.planner.core.placement import Placement, Split  # noqa: E402
from tierflow.planner.core.schedules import build_graph, make_schedule  # noqa: E402
from tierflow.planner.io.planfile import plan_from_graph, write_plan  # noqa: E402

HW = load_profile("rtx3090-desktop")
BATCH, MICRO, SEQ, STEPS = 4, 2, 32, 2
HYPER = Hyper(lr=1e-2, weight_decay=0.1)  # a large step, so that two steps move every weight visibly
SSD_STATES = Placement(master=Split(0.0, 0.0, 1.0), adam_m=Split(0.0, 0.5, 0.5), adam_v=Split(0.0, 0.0, 1.0))

GPT, LLAMA = get_model("tiny-gpt"), get_model("tiny-llama")
FAMILIES = {
    "gpt": GPT,
    "llama": LLAMA,
    "mistral": dataclasses.replace(LLAMA, name="tiny-mistral", family="mistral", sliding_window=64),
    "qwen2": dataclasses.replace(LLAMA, name="tiny-qwen2", family="qwen2", qkv_bias=True,
                                 tied_embeddings=True),
    "qwen3": dataclasses.replace(LLAMA, name="tiny-qwen3", family="qwen3", qk_norm=True, head_dim=48),
    "gemma": dataclasses.replace(LLAMA, name="tiny-gemma", family="gemma", activation="geglu",
                                 tied_embeddings=True, head_dim=64),
    "phi3": dataclasses.replace(LLAMA, name="tiny-phi3", family="phi3", rotary_fraction=0.5),
    "opt": dataclasses.replace(GPT, name="tiny-opt", family="opt", activation="relu", position_offset=2),
    "gpt_neox": dataclasses.replace(GPT, name="tiny-neox", family="gpt_neox", max_positions=0,
                                    tied_embeddings=False, parallel_residual=True, rotary_fraction=0.25),
}


def make_plan(spec):
    cfg = make_schedule("vertical", spec, HW, batch=BATCH, micro_batch=MICRO, seq=SEQ, placement=SSD_STATES,
                        alpha=0.25, iterations=STEPS)
    return plan_from_graph(spec, HW, cfg, build_graph(spec, HW, cfg))


def decay_groups(ref: BlockModel, weight_decay: float) -> list[dict]:
    named = [(n, p) for b in ref.blocks for n, p in b.named_parameters()]
    return [{"params": [p for n, p in named if decayed(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if not decayed(n)], "weight_decay": 0.0}]


def reference_losses(spec):
    """Plain PyTorch AdamW on the same blocks and data, with gradient accumulation over the micro-batches."""
    torch.manual_seed(0)
    ref = BlockModel(spec, build_blocks(spec))
    # biases and norm weights not decayed, as the executor
    opt = torch.optim.AdamW(decay_groups(ref, HYPER.weight_decay), lr=HYPER.lr,
                            betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps)
    data = TokenData.load(None, spec.vocab_size, seed=0)
    losses = []
    for s in range(STEPS):
        x, y = data.batch(s, BATCH, SEQ)
        opt.zero_grad()
        total = accumulate_gradients(ref, x, y, MICRO)
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("family", list(FAMILIES))
def test_run_trains_the_family_and_exports_what_transformers_loads(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = FAMILIES[family]
    (tmp_path / "ssd").mkdir()
    out = tmp_path / "hf"
    opts = RunConfig(steps=STEPS, device="cpu", ssd_dir=str(tmp_path / "ssd"),
                     optimizer=OptimizerOptions(lr=HYPER.lr, weight_decay=HYPER.weight_decay),
                     output=OutputOptions(quiet=True, collect_final=True, export_hf=str(out)))
    res = run_plan(make_plan(spec), opts)
    # the executor's training is plain PyTorch AdamW training of these blocks
    for got, want in zip(res.losses, reference_losses(spec), strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # the executor's model with the trained weights ...
    layout = BlockLayout(spec)
    model = BlockModel(spec, build_blocks(spec)).eval()
    model.load_block_state_dicts([layout.params(b, v) for b, v in enumerate(res.final_master)])
    torch.manual_seed(0)
    init = BlockModel(spec, build_blocks(spec))
    moved = [n for (n, p), q in zip(model.named_parameters(), init.parameters()) if not torch.equal(p, q)]
    assert len(moved) == len(list(init.parameters()))  # two steps moved every tensor
    # ... and transformers' model from the exported directory compute the same logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    assert sum(p.numel() for p in hf.parameters()) == spec.total_params()
    x = TokenData.load(None, spec.vocab_size, seed=7).batch(0, 2, SEQ)[0]
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, model(x), atol=1e-4, rtol=0)


def test_cli_export_hf_refuses_a_used_directory_before_training(tmp_path, capsys):
    from tierflow.cli import main

    plan = tmp_path / "plan.json"
    write_plan(make_plan(LLAMA), plan)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert main(["run", str(plan), "--steps", "1", "--device", "cpu", "--export-hf", str(used)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--export-hf" in err and "not an empty directory" in err
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    # a model transformers' class cannot express is refused before any step, too
    sliding_qwen = dataclasses.replace(FAMILIES["qwen2"], name="tiny-qwen2-sliding", sliding_window=64)
    write_plan(make_plan(sliding_qwen), plan)
    assert main(["run", str(plan), "--steps", "1", "--device", "cpu",
                 "--export-hf", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "max_window_layers" in err and "step" not in capsys.readouterr().out


def test_cli_export_hf_writes_after_the_last_step(tmp_path, capsys):
    from tierflow.cli import main

    plan = tmp_path / "plan.json"
    write_plan(make_plan(FAMILIES["opt"]), plan)
    (tmp_path / "ssd").mkdir()
    tok = tmp_path / "tok"  # the model's tokenizer (--tokenizer, or --init's): exported beside the weights
    _tiny_tokenizer(tok)
    rc = main(["run", str(plan), "--steps", "2", "--device", "cpu", "--ssd-dir", str(tmp_path / "ssd"),
               "--export-hf", str(tmp_path / "out"), "--tokenizer", str(tok)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "exported the fp32 weights after step 2" in text and "tokenizer.json" in text
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "opt" and config["do_layer_norm_before"] is True
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).encode("x = 1") == \
        AutoTokenizer.from_pretrained(str(tok)).encode("x = 1")


def _tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([Path(json.__file__).read_text()], trainers.BpeTrainer(vocab_size=120))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)


def test_plans_of_the_new_families_follow_the_plan_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from tierflow.planner.io.planfile import load_plan

    schema = json.loads((Path(__file__).resolve().parents[3] / "docs" / "plan.schema.json").read_text())
    for family in ("qwen3", "gemma", "phi3", "mistral"):
        path = tmp_path / f"{family}.json"
        write_plan(make_plan(FAMILIES[family]), path)
        # the section these fields live in
        model_schema = {**schema["$defs"]["model"], "$defs": schema["$defs"]}
        jsonschema.validate(json.loads(path.read_text())["model"], model_schema)
        assert load_plan(path).model == FAMILIES[family]  # the new fields survive the round trip
