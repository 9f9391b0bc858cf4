"""Where Talaria keeps files it writes on first use (the tiny demo models)."""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_NAMES = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")


def cache_dir() -> Path:
    """``$TALARIA_CACHE``, else ``$XDG_CACHE_HOME/talaria``, else ``~/.cache/talaria``."""
    explicit = os.environ.get("TALARIA_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "talaria"


def default_models_dir(size: str = "tiny") -> Path:
    return cache_dir() / f"models-{size}"


def ensure_tiny_models(size: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """The tiny random-weight catalog, written on first use (seeded, so always the same)."""
    root = default_models_dir(size)
    paths = {name: root / name for name in TINY_MODEL_NAMES}
    if all((p / "config.json").is_file() and any(p.glob("*.safetensors")) for p in paths.values()):
        return paths
    from engine.models.tiny import make_tiny_models

    return make_tiny_models(root, size=size, seed=seed)
