"""Incremental detokenisation of a request's output, for stop strings.

Decodes a short window of recent tokens instead of the whole output each step; text is
emitted only once it no longer ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def find_stop(self, delta: str) -> str | None:
        """The stop string that the text newly contains after ``delta``, if any."""
        if not delta or not self.stop:
            return None
        window = self.text[-(len(delta) + self.max_stop_len - 1) :]
        for s in self.stop:
            if s in window:
                return s
        return None
