"""GGUF checkpoints converted once into Hugging Face model directories, kept in a cache.

:func:`model_dir` is where every loader entry point turns a model path into a directory: a
directory is used as it is; a ``.gguf`` file is converted (dequantized to float32
safetensors, config.json, generation_config.json, tokenizer.json, tokenizer_config.json with
the chat template) into ``<cache>/gguf/<stem>-<key>/`` on first use, where the key hashes the
file's content, the converter's version and any chat template given in place of the file's.
Later starts only hash the file and find the directory. A conversion is written to a
temporary directory and renamed into place, so a reader never sees half of one and two
processes converting at once both end with the same complete directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import structlog

__all__ = ["CONVERTER_VERSION", "default_cache_dir", "gguf_cache_key", "convert_gguf", "model_dir"]

log = structlog.get_logger("engine.models.checkpoint_cache")

CONVERTER_VERSION = 4  # bump when a conversion's output changes: old cache entries are ignored
SOURCE_FILE = "talaria_source.json"  # what a converted directory was made from


def default_cache_dir() -> Path:
    """``$TALARIA_CACHE``, else ``$XDG_CACHE_HOME/talaria``, else ``~/.cache/talaria``."""
    explicit = os.environ.get("TALARIA_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "talaria"


def gguf_cache_key(path: Path, chat_template: str | None = None) -> str:
    """Hash of the file's bytes, the converter version and the chat template override."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    digest.update(f"converter-{CONVERTER_VERSION}".encode())
    if chat_template is not None:
        digest.update(b"template:" + chat_template.encode())
    return digest.hexdigest()[:24]


def convert_gguf(path: str | Path, out: str | Path, chat_template: str | None = None) -> Path:
    """Write the Hugging Face directory of a GGUF file to ``out`` (created)."""
    from safetensors.torch import save_file

    from engine.models.gguf_checkpoint import GGUFCheckpoint
    from engine.models.gguf_tokenizer import build_tokenizer, stop_token_ids, tokenizer_config

    ckpt = GGUFCheckpoint.open(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = ckpt.hf_config()
    meta = ckpt.tokenizer_metadata()
    tokenizer = build_tokenizer(meta)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ValueError(f"{path}: the tokenizer has more tokens than the model's vocab_size")
    tensors = dict(ckpt.tensors())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if k in config}
    stops = stop_token_ids(meta)  # EOS, end of turn and of message, as llama.cpp's
    if stops:
        generation["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(meta, config["max_position_embeddings"], chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out


def model_dir(
    path: str | Path, cache_root: str | Path | None = None, chat_template: str | None = None
) -> Path:
    """A loadable model directory for ``path`` (see the module docstring)."""
    path = Path(path).expanduser()
    if path.is_dir() or path.suffix.lower() != ".gguf":
        if chat_template is not None:
            raise ValueError(f"a chat template can only be given for a .gguf file, not {path}")
        return path
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    root = Path(cache_root) if cache_root is not None else default_cache_dir()
    key = gguf_cache_key(path, chat_template)
    target = root / "gguf" / f"{path.stem}-{key}"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=target.parent))
    try:
        convert_gguf(path, tmp, chat_template)
        seconds = time.perf_counter() - start
        source = {"gguf": str(path), "key": key, "converter_version": CONVERTER_VERSION,
                  "seconds": round(seconds, 2)}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep its directory
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf.converted", gguf=str(path), dir=str(target), seconds=round(seconds, 2))
    return target
