"""Sessions inferred from prompts, for calls that name none.

An agent's next call sends its whole conversation again: the previous call's prompt, then
the answer and the tool results. So a call whose prompt starts with an earlier call's entire
prompt continues that call's session. The index finds such calls by the block-hash chain the
router computes anyway (``talaria.protocol.text.block_hashes``, the engine's own): a chained
hash names its whole prefix, so one hash per session, that of the last full block of the
session's latest prompt, is found among the new prompt's hashes by dictionary lookups, and
the few tokens after that block (the prompt's partial tail) are compared exactly.

Rules (why each call lands where it does):
- the call joins a session whose latest prompt is a prefix of its prompt (equal counts: a
  retry); none: it starts a new session, ``inferred-<n>`` (an ``n`` whose name no client's
  session holds: the counter starts at 0 again in every router process, whose names the
  app makes ``inferred-<8 random hex>-<n>``, ``process_prefix``, so that an id kept from
  before a restart names no new conversation). A prompt whose
  chat template ended it with think tags after the generation prompt (thinking switched
  off: an empty ``<think></think>``; opened: ``<think>``) stands only up to them, before any
  prefill: the next turn renders that answer without them
  (``router.tokenization.Prompt.repeated``);
- among several, the one whose latest answer the prompt also repeats for longest (the agent
  sent that answer back), then the most recently seen;
- prompts from different models never match; sessions are forgotten when the router drops
  them (idle past the TTL, or ended), and beyond ``max_sessions`` the least recently seen.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.instances.placement import common_prefix_len

__all__ = ["SessionInference", "process_prefix"]

ANSWER_TOKENS_KEPT = 64  # of a session's latest answer: all the tie-break between sessions reads


@dataclass
class _Anchor:
    session_id: str
    model: str
    prompt_len: int
    full_blocks: int  # of the prompt
    last_hash: int | None  # hash of the prompt's last full block (None: shorter than a block)
    tail: tuple[int, ...]  # the prompt's tokens after its full blocks
    seen: int = 0  # when its latest prompt was assigned (a counter: later is larger)
    calls: int = 1  # prompts assigned to the session so far
    answer: tuple[int, ...] = ()  # the first tokens of its latest call's output


def process_prefix() -> str:
    """A router process's names for inferred sessions, ``inferred-<8 hex>-<n>``: the counter
    starts at 0 in every process, so without the random part a client that kept an
    X-Session-ID from before a restart would join a new anonymous conversation given its
    name."""
    return f"inferred-{secrets.token_hex(4)}-"


class SessionInference:
    def __init__(self, block_size: int, max_sessions: int = 1 << 16, prefix: str = "inferred-") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.prefix = prefix
        self._anchors: OrderedDict[str, _Anchor] = OrderedDict()  # least recently seen first
        self._by_hash: dict[tuple[str, int], set[str]] = {}  # (model, last full-block hash)
        self._short: dict[tuple[str, tuple[int, ...]], set[str]] = {}  # prompts under one block
        self._ids = itertools.count()
        self._seen = itertools.count()

    def __len__(self) -> int:
        return len(self._anchors)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._anchors

    def assign(self, model: str, prompt: Sequence[int], hashes: Sequence[int],
               repeated: int | None = None, taken: Callable[[str], bool] | None = None) -> str:
        """The session this prompt continues (a new one if none, named so that ``taken``
        says it is not: a session a client named so); its first ``repeated`` tokens (None:
        all), what the next prompt repeats, become the session's latest prompt. ``hashes``:
        ``block_hashes(prompt, block_size)``."""
        session_id = self.match(model, prompt, hashes) or self._new_id(taken)
        self._set_anchor(session_id, model, prompt, hashes, self.calls(session_id) + 1, repeated)
        return session_id

    def _new_id(self, taken: Callable[[str], bool] | None) -> str:
        while True:
            session_id = f"{self.prefix}{next(self._ids)}"
            if taken is None or not taken(session_id):
                return session_id

    def calls(self, session_id: str) -> int:
        """How many prompts the session has been assigned (0: unknown)."""
        anchor = self._anchors.get(session_id)
        return anchor.calls if anchor is not None else 0

    def match(self, model: str, prompt: Sequence[int], hashes: Sequence[int]) -> str | None:
        candidates: list[_Anchor] = []
        for i, h in enumerate(hashes):
            for sid in self._by_hash.get((model, h), ()):
                anchor = self._anchors[sid]
                if anchor.full_blocks == i + 1 and self._extends(prompt, anchor):
                    candidates.append(anchor)
        for n in range(min(self.block_size - 1, len(prompt)), 0, -1):
            for sid in self._short.get((model, tuple(prompt[:n])), ()):
                candidates.append(self._anchors[sid])
        if not candidates:
            return None
        best = max(candidates, key=lambda a: (
            common_prefix_len(prompt[a.prompt_len:a.prompt_len + len(a.answer)], a.answer), a.seen))
        return best.session_id

    def record_answer(self, session_id: str, answer: Sequence[int]) -> None:
        """The output of the session's latest call (its first ``ANSWER_TOKENS_KEPT`` tokens
        break ties between sessions)."""
        anchor = self._anchors.get(session_id)
        if anchor is not None:
            anchor.answer = tuple(answer[:ANSWER_TOKENS_KEPT])

    def forget(self, session_id: str) -> None:
        anchor = self._anchors.pop(session_id, None)
        if anchor is None:
            return
        key, index = self._key(anchor)
        members = index[key]
        members.discard(session_id)
        if not members:
            del index[key]

    def _extends(self, prompt: Sequence[int], anchor: _Anchor) -> bool:
        start = anchor.full_blocks * self.block_size
        return len(prompt) >= anchor.prompt_len and tuple(prompt[start:anchor.prompt_len]) == anchor.tail

    def _set_anchor(
        self, session_id: str, model: str, prompt: Sequence[int], hashes: Sequence[int], calls: int,
        length: int | None = None,
    ) -> None:
        """The session's latest prompt is ``prompt``'s first ``length`` tokens (None: all)."""
        self.forget(session_id)
        length = len(prompt) if length is None else min(length, len(prompt))
        full = length // self.block_size
        if len(hashes) < full:
            raise ValueError(f"{len(hashes)} block hashes for a prompt of {full} full blocks")
        anchor = _Anchor(session_id, model, length, full, hashes[full - 1] if full else None,
                         tuple(prompt[full * self.block_size:length]), next(self._seen), calls)
        self._anchors[session_id] = anchor
        key, index = self._key(anchor)
        index.setdefault(key, set()).add(session_id)
        while len(self._anchors) > self.max_sessions:
            self.forget(next(iter(self._anchors)))

    def _key(self, anchor: _Anchor) -> tuple[tuple, dict]:
        if anchor.last_hash is None:
            return (anchor.model, anchor.tail), self._short
        return (anchor.model, anchor.last_hash), self._by_hash

