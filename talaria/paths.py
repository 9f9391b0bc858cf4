"""Where Talaria keeps files it writes on first use (the tiny demo models, converted GGUF
checkpoints)."""

from __future__ import annotations

from pathlib import Path

from engine.models.checkpoint_cache import default_cache_dir

TINY_MODEL_NAMES = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")


def cache_dir() -> Path:
    """``$TALARIA_CACHE``, else ``$XDG_CACHE_HOME/talaria``, else ``~/.cache/talaria``."""
    return default_cache_dir()


def default_models_dir(size: str = "tiny") -> Path:
    return cache_dir() / f"models-{size}"


def ensure_tiny_models(size: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """The tiny random-weight catalog, written on first use (seeded, so always the same). A
    catalog written before the chat template changed (it takes tools now) gets the current
    tokenizer files; the weights stay."""
    from engine.models.tiny import CHAT_TEMPLATE, make_tiny_models, write_tokenizer_files

    root = default_models_dir(size)
    paths = {name: root / name for name in TINY_MODEL_NAMES}
    if all((p / "config.json").is_file() and any(p.glob("*.safetensors")) for p in paths.values()):
        stale = [p for p in paths.values() if _chat_template(p) != CHAT_TEMPLATE]
        if stale:
            write_tokenizer_files(stale)
        return paths
    return make_tiny_models(root, size=size, seed=seed)


def _chat_template(model_dir: Path) -> str | None:
    path = model_dir / "chat_template.jinja"
    return path.read_text() if path.is_file() else None
