"""Incremental detokenisation and stop-string matching, shared by the engine and the router.

The engine uses them to finish a request whose output text contains a stop string; the router
uses them to stream text deltas and cut the answer at a stop string. Both decode the same way
(the same window, seeded with the end of the prompt), so they agree on what the text is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopMatcher", "StopStringWatcher", "decode_text", "output_text"]

PROMPT_TAIL = 6  # prompt tokens that seed the window (so a space at the join decodes right)


def skipped_special_ids(tokenizer: Any, keep: Collection[int]) -> frozenset[int]:
    """The ids a decode that skips special tokens drops (the added tokens marked special),
    less ``keep``."""
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if t.special and i not in keep)


def decode_text(tokenizer: Any, ids: Sequence[int], keep_special: Collection[int] = ()) -> str:
    """``ids`` as text, special tokens skipped but those in ``keep_special`` (a tool
    format's tags, where the vocabulary marks them special: its parser must see them)."""
    if not keep_special:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    return _decode_dropping(tokenizer, ids, skipped_special_ids(tokenizer, keep_special))


def _decode_dropping(tokenizer: Any, ids: Sequence[int], drop: frozenset[int]) -> str:
    """``ids`` as text, special tokens included but those in ``drop``."""
    return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas.

    Decodes a small window (prefix_offset..end) and emits what extends past the text of
    (prefix_offset..read_offset), so the cost per token stays constant whatever the output's
    length. A window that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until
    the next tokens complete it; ``flush`` at the end releases what never completed, so the
    deltas join to the full decode of the tokens.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
        keep_special: Collection[int] = (),
    ) -> None:
        """``keep_special``: special token ids decoded even though special tokens are
        skipped (see :func:`decode_text`)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._drop = (skipped_special_ids(tokenizer, keep_special)
                      if skip_special_tokens and keep_special else None)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_TAIL:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if self._drop is not None:
            return _decode_dropping(self._tokenizer, ids, self._drop)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        return self._advance(prefix, full)

    def flush(self) -> str:
        """The text held back, as a full decode gives it (an incomplete character as
        U+FFFD); call it once the tokens have ended."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return self._advance(prefix, full)

    def _advance(self, prefix: str, full: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text; holds back a tail that could begin one.

    ``feed`` returns (text safe to emit, stopped). Once stopped, the emitted text ends just
    before the stop string, ``matched`` is that string (the earliest in the text; the first
    listed of those starting there) and later input is ignored. ``flush`` releases the held
    tail when the call ends without a stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buf += text
        hits = [(at, k) for k, at in enumerate(self._buf.find(s) for s in self._stops) if at >= 0]
        if hits:
            hit, k = min(hits)
            out, self._buf, self.stopped, self.matched = self._buf[:hit], "", True, self._stops[k]
            return out, True
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


class StopStringWatcher:
    """One request's output, detokenised as it grows, watched for its stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._matcher = StopMatcher(stops)

    def add(self, token_id: int) -> bool:
        """Append one output token; True once the output text contains a stop string."""
        return self._matcher.feed(self._detok.push([token_id]))[1]


def output_text(tokenizer: Any, prompt_token_ids: Sequence[int], output_ids: Sequence[int],
                stops: Sequence[str]) -> str:
    """A finished request's text as the engine's stop-string watch read it: decoded with the
    end of the prompt as context (a decoder that drops the first token's leading space when
    it decodes alone keeps it here, as vLLM's text does), cut before the earliest stop
    string."""
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
    matcher = StopMatcher(stops)
    text, stopped = matcher.feed(detok.push(output_ids))
    if not stopped:
        more, stopped = matcher.feed(detok.flush())
        text += more if stopped else more + matcher.flush()
    return text
