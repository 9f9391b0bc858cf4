"""Tokenizers at the router: prompts to token ids, token ids back to text, stop strings.

The router owns tokenization so it can hash prompt prefixes for KV locality: the chained
hash of each full block of ``block_size`` tokens (:func:`block_hashes`) only has to be
consistent within the router (its session table and prefix index).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_PROMPT_TAIL = 6  # prompt tokens that seed the detokeniser (spaces at the join decode right)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: h_k = hash((h_{k-1}, block_k)).

    Equal hash at position k means (with overwhelming probability) an equal prefix of
    (k + 1) * block_size tokens. Python hashes ints and tuples of ints deterministically.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    h = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out


class ModelTokenizer:
    """One catalog model's tokenizer, chat template and context length."""

    def __init__(self, name: str, tokenizer: Any, context_len: int) -> None:
        if context_len < 2:
            raise ValueError(f"context length of {name!r} must be >= 2, got {context_len}")
        self.name = name
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = len(tokenizer)
        # One worker: a HF fast tokenizer must not encode from two threads at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an encode off the event loop, on this tokenizer's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @classmethod
    def load(cls, name: str, path: str | Path, max_model_len: int | None = None) -> ModelTokenizer:
        """Load with ``AutoTokenizer`` from the model directory. The context length is
        ``max_model_len`` if given, else ``max_position_embeddings`` from config.json."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory for {name!r} not found: {path}")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        context = max_model_len or _config_context_len(path)
        if context is None:
            raise ValueError(
                f"model {name!r}: no max_position_embeddings in {path / 'config.json'}; "
                "set max_model_len in the router config"
            )
        return cls(name, tokenizer, int(context))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"model {self.name!r} has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.encode_text(text, add_special_tokens=False)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids[-_PROMPT_TAIL:])


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas.

    Decodes a small window (prefix_offset..end) and emits what extends past the text of
    (prefix_offset..read_offset), so the cost per token stays constant. A window that ends
    in an incomplete UTF-8 sequence (U+FFFD) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer: ModelTokenizer, seed_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(seed_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text; holds back a tail that could begin one.

    ``feed`` returns (text safe to emit, stopped). Once stopped, the emitted text ends just
    before the stop string and later input is ignored. ``flush`` releases the held tail
    when the call ends without a stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buf += text
        hit = min((i for i in (self._buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if hit >= 0:
            out, self._buf, self.stopped = self._buf[:hit], "", True
            return out, True
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


def _config_context_len(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text_config = data.get("text_config") or {}
    value = data.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    return int(value) if value else None
