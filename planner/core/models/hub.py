"""Hugging Face hub ids (``org/name``) whose config.json is in the local Hugging Face cache: nothing is ever
downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tierflow.planner.core.models.spec import ModelError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(text: str) -> bool:
    """``org/name`` as the Hugging Face hub spells repository ids (one slash, no .json file name)."""
    return bool(_HUB_ID.match(text)) and not text.endswith(".json") and ".." not in text


def hf_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    ($XDG_CACHE_HOME/huggingface/hub when that is set)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def find_cached_config(repo_id: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """config.json of hub model ``repo_id`` in the local cache, or None; never touches the network.

    With huggingface_hub importable, ``try_to_load_from_cache`` (the snapshot ``refs/main`` points to); else,
    or when no ``main`` ref was cached, the newest ``models--org--name/snapshots/<rev>/config.json``."""
    cache = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache), repo_type="model")
        except Exception:  # an id huggingface_hub rejects: look for the folder ourselves
            found = None
        if isinstance(found, str) and Path(found).is_file():
            return Path(found)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        main = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if main.is_file():
            return main
    configs = [p for p in (repo / "snapshots").glob("*/config.json") if p.is_file()]
    return max(configs, key=lambda p: p.stat().st_mtime) if configs else None


def hub_config_path(repo_id: str) -> Path:
    """config.json of a cached hub model; a :class:`ModelError` saying how to download it when it is not
    cached."""
    found = find_cached_config(repo_id)
    if found is None:
        raise ModelError(
            f"{repo_id!r} is neither a local path nor a model in the Hugging Face cache ({hf_cache_dir()}); "
            f"tierflow does not download: fetch its config with `hf download {repo_id} config.json` "
            "(or set HF_HUB_CACHE / HF_HOME to the cache that holds it, or give a path to its config.json)"
        )
    return found


__all__ = ["find_cached_config", "hf_cache_dir", "hub_config_path", "is_hub_id"]
