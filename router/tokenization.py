"""Tokenizers at the router: prompts to token ids, token ids back to text.

The router owns tokenization so it can hash prompt prefixes for KV locality, with the
engine's own block-hash chain (``talaria.protocol.text.block_hashes``): the router's prefix
index and session table then name KV exactly as the instances do.

Encoding runs off the event loop in two lanes per model, each one thread with its own copy
of the tokenizer (a fast tokenizer must not encode from two threads at once): prompts of up
to ``large_prompt_bytes`` in one, longer ones in the other, so a huge prompt never makes a
small call of the same model wait behind it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from router.api.reasoning import THINK_CLOSE, THINK_OPEN, prompt_think_start, prompt_think_tag
from router.api.template_roles import TemplateRoles
from talaria.protocol.text import IncrementalDetokenizer, decode_text

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids; for a chat prompt, the think tag its rendered text ends with
    (``router.api.reasoning.prompt_think_tag``: where the answer starts), and how many of
    its ids the conversation's next prompt repeats when that is not all of them: those
    before the think tags it ends with (``router.api.reasoning.prompt_think_start``) and any
    prefill after them (``router.sessions.inference`` anchors the session there)."""

    ids: list[int]
    think_tag: str | None = None
    repeated: int | None = None  # None: all of ``ids``


class ModelTokenizer:
    """One catalog model's tokenizer, chat template and context length."""

    def __init__(
        self, name: str, tokenizer: Any, context_len: int, large_prompt_bytes: int = 64 * 1024
    ) -> None:
        if context_len < 2:
            raise ValueError(f"context length of {name!r} must be >= 2, got {context_len}")
        self.name = name
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = len(tokenizer)
        self.byte_level = _is_byte_level(tokenizer)
        self.large_prompt_bytes = large_prompt_bytes
        self.roles = TemplateRoles(name)
        self._think_tag_ids: dict[str, list[int]] | None = None  # encoded on first use
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}")
        self._large: tuple[ThreadPoolExecutor, Any] | None = None  # made on first use

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an encode off the event loop, on this tokenizer's own (small-prompt) thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def think_tag_ids(self) -> dict[str, list[int]]:
        """Each think tag's ids (``tag_ids``), for a thinking budget
        (``router.api.reasoning.thinking_budget_fields``): encoded once, on this tokenizer's
        own thread, when a request first asks for a budget."""
        if self._think_tag_ids is None:
            self._think_tag_ids = await self.run(_think_tag_ids, self.tokenizer)
        return self._think_tag_ids

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], size: int,
        tools: list[dict[str, Any]] | None = None, prefill: str = "",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """``encode_chat`` in the lane for a prompt of ``size`` bytes, with the think tag the
        rendered prompt ends with."""
        executor, tokenizer = self._lane(size)
        return await asyncio.get_running_loop().run_in_executor(
            executor, _encode_chat, tokenizer, self.name, messages, tools, prefill, self.roles,
            template_kwargs or {},
        )

    async def tokenize_text(self, text: str, size: int) -> list[int]:
        """``encode_text`` in the lane for a prompt of ``size`` bytes."""
        executor, tokenizer = self._lane(size)
        return await asyncio.get_running_loop().run_in_executor(
            executor, _encode_text, tokenizer, text, True
        )

    def _lane(self, size: int) -> tuple[ThreadPoolExecutor, Any]:
        if size <= self.large_prompt_bytes:
            return self._executor, self.tokenizer
        if self._large is None:
            self._large = (
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-large-{self.name}"),
                copy.deepcopy(self.tokenizer),
            )
        return self._large

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
        return _chat_template(self.tokenizer)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        prefill: str = "", template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The chat template applied (with ``tools`` when given, through transformers, whose
        ``tojson`` the templates expect, and ``template_kwargs`` as more of its variables),
        the generation prompt added and ``prefill`` written after it as the start of the
        answer; then tokenized. A role the template would drop is a ValueError
        (``router.api.template_roles``)."""
        return _encode_chat(self.tokenizer, self.name, messages, tools, prefill, self.roles,
                            template_kwargs or {}).ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode_text(self.tokenizer, text, add_special_tokens)

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def decode(self, token_ids: Sequence[int], keep_special: Sequence[int] = ()) -> str:
        """Special tokens skipped, but ``keep_special`` (see ``special_ids``)."""
        return decode_text(self.tokenizer, token_ids, keep_special)

    def special_ids(self, texts: Sequence[str]) -> list[int]:
        """The ids of the special tokens whose text is one of ``texts`` (a tool format's
        tags, in a vocabulary that marks them special)."""
        return [i for i, t in self.tokenizer.added_tokens_decoder.items()
                if t.special and t.content in texts]

    def is_skipped(self, token_id: int, keep_special: Sequence[int] = ()) -> bool:
        """Whether a decode leaves ``token_id`` out of the text: a special token (an EOS, an
        end of turn) not in ``keep_special``."""
        added = self.tokenizer.added_tokens_decoder.get(token_id)
        return added is not None and added.special and token_id not in keep_special

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, so the tokens that split one character (an emoji, CJK)
        each give their part of its UTF-8 (``piece_bytes``; byte-level stand-ins only in a
        byte-level vocabulary); a token with no byte form is its text decoded alone."""
        pieces = self.tokenizer.convert_ids_to_tokens(list(token_ids))
        return [piece_bytes(piece, self.byte_level)
                or self.tokenizer.decode([t], skip_special_tokens=False).encode()
                for t, piece in zip(token_ids, pieces, strict=True)]

    def detokenizer(
        self, prompt_token_ids: Sequence[int], keep_special: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, keep_special=keep_special)


def tag_ids(tokenizer: Any, tag: str) -> list[int]:
    """The ids that write ``tag``: its own id when the vocabulary holds it as one token
    (Qwen3's ``</think>``), else its encoding."""
    token_id = tokenizer.convert_tokens_to_ids(tag)
    if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == tag:
        return [token_id]
    return _encode_text(tokenizer, tag, False)


def _think_tag_ids(tokenizer: Any) -> dict[str, list[int]]:
    return {tag: tag_ids(tokenizer, tag) for tag in (THINK_OPEN, THINK_CLOSE)}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the vocabulary spells bytes in the byte-level alphabet (GPT-2, Llama 3, Qwen,
    SmolLM): its decoder is ``ByteLevel``, alone or in a sequence. A SentencePiece vocabulary
    spells text as itself, so its piece ``é`` is that character, not byte 0xE9."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel(" in str(decoder)


def _chat_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def _encode_chat(
    tokenizer: Any, name: str, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None, prefill: str, roles: TemplateRoles,
    template_kwargs: Mapping[str, Any],
) -> Prompt:
    if _chat_template(tokenizer) is None:
        raise ValueError(f"model {name!r} has no chat template; use /v1/completions")
    roles.check(tokenizer, messages)
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    ids = _encode_text(tokenizer, text + prefill, add_special_tokens=False)
    return Prompt(ids, prompt_think_tag(text), _repeated(tokenizer, ids, text, prefill))


def _repeated(tokenizer: Any, ids: list[int], text: str, prefill: str) -> int | None:
    """How many of ``ids`` (``text`` and ``prefill`` tokenized) come before the think tags
    ``text`` ends with: the length of ``ids`` less that of the tags and ``prefill`` tokenized
    alone, when ``ids`` ends with those tokens (None: no tags, or a boundary that tokenizes
    otherwise, where the whole prompt stands)."""
    start = prompt_think_start(text)
    if start is None:
        return None
    tail = _encode_text(tokenizer, text[start:] + prefill, add_special_tokens=False)
    n = len(ids) - len(tail)
    return n if n > 0 and ids[n:] == tail else None


def _encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _config_context_len(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    text_config = data.get("text_config") or {}
    value = data.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    return int(value) if value else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``:
    printable Latin-1 bytes stand for themselves, the others for code points from 256 up),
    inverted: stand-in character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


_BYTE_OF = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_PIECE = "\u2581"  # SentencePiece's stand-in for a space


def piece_bytes(piece: str | None, byte_level: bool = True) -> bytes | None:
    """A vocabulary entry's bytes: a byte-fallback token ``<0xNN>`` its byte, an entry of
    byte-level stand-ins (in a ``byte_level`` vocabulary) the bytes they stand for, a
    SentencePiece word piece (another vocabulary's entry with ``▁``) its text with ``▁`` a
    space, as the piece reads inside a text (decoded alone, its leading space would be
    dropped); None for any other: decode it instead."""
    if not piece:
        return None
    if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
        return bytes([int(m.group(1), 16)])
    if byte_level:
        return bytes(_BYTE_OF[c] for c in piece) if all(c in _BYTE_OF for c in piece) else None
    return piece.replace(_SPACE_PIECE, " ").encode() if _SPACE_PIECE in piece else None
