"""Hugging Face intake and output: --model as a model directory or a hub id in the local cache (no network), and
`tierflow run --export-hf` writing a directory transformers loads with the executor's own logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.planner.core.models import ModelError, find_cached_config, get_model, hf_cache_dir

CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
          "max_position_embeddings": 128, "tie_word_embeddings": True}


def make_cache(root: Path, repo_id: str, config: dict, *, with_ref: bool = True) -> Path:
    """The hub cache layout huggingface_hub writes: blobs, a snapshot per revision whose files link to the blobs,
    and refs/main naming the snapshot."""
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
    return subprocess.run([sys.executable, "-m", "tierflow.planner.io.cli", *args], capture_output=True, text=True,
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
