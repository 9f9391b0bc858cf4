"""Tokenizers at the router: prompts to token ids, token ids back to text.

The router owns tokenization so it can hash prompt prefixes for KV locality, with the
engine's own block-hash chain (``talaria.protocol.text.block_hashes``): the router's prefix
index and session table then name KV exactly as the instances do.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from talaria.protocol.text import IncrementalDetokenizer

T = TypeVar("T")


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

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        prefill: str = "",
    ) -> list[int]:
        """The chat template applied (with ``tools`` when given, through transformers, whose
        ``tojson`` the templates expect), the generation prompt added and ``prefill``
        written after it as the start of the answer; then tokenized."""
        if self.chat_template is None:
            raise ValueError(f"model {self.name!r} has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        return self.encode_text(text + prefill, add_special_tokens=False)

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
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids)


def _config_context_len(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text_config = data.get("text_config") or {}
    value = data.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    return int(value) if value else None
