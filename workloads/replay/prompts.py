"""The replay's synthetic prompts: each session's token ids, and how a prompt grows.

Prompts are seeded random ids, so a session's continuation starts with exactly its previous
prompt and output (prefix caching, KV restore and cache-aware routing see what they would
see live) and two sessions share only what the trace says they share.

A prompt is a ``PromptView``: the first tokens of a list that only grows. A continuation
extends its session's list with the answer and the new tokens and views more of it, so a
call costs its new tokens, not a copy of its whole context (and freeing the copy after).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import islice
from typing import overload

import numpy as np

from engine.sim.tokens import token_ids
from talaria.protocol.text import BlockChain, block_hashes

__all__ = ["PromptView", "SessionTokens", "next_prompt", "prompt_chain"]


class SessionTokens:
    """A session's synthetic token ids: seeded by (seed, session id), ids in [1, vocab)."""

    def __init__(self, session_id: str, seed: int, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self._rng = random.Random(zlib.crc32(f"{seed}/{session_id}".encode()))
        self._mod = vocab_size - 1
        self._ids = _shared_ids(vocab_size)

    def take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        raw = np.frombuffer(self._rng.randbytes(4 * n), dtype=np.uint32).astype(np.uint64)
        drawn = raw % self._mod + 1  # uint64: any vocabulary size fits
        return (self._ids[drawn] if self._ids is not None else drawn).tolist()


@lru_cache(maxsize=16)
def _shared_ids(vocab_size: int) -> np.ndarray | None:
    """``engine.sim.tokens.token_ids`` as a read-only object array: indexing it with the
    drawn ids gives the shared int objects in one C-level pass (None: a vocabulary too
    large to share)."""
    shared = token_ids(vocab_size)
    if not isinstance(shared, tuple):
        return None
    ids = np.array(shared, dtype=object)
    ids.flags.writeable = False
    return ids


class PromptView(Sequence[int]):
    """The first ``n`` tokens of ``tokens``, a list that is only ever appended to (never
    changed or cut), so a view's tokens never change: a prompt without a list of its own.
    Reads (``len``, indexing, slices, iteration, ``+`` and ``==`` with any sequence) are a
    list's; a slice or ``+`` is a new list."""

    __slots__ = ("_tokens", "_n")

    def __init__(self, tokens: list[int], n: int) -> None:
        if not 0 <= n <= len(tokens):
            raise ValueError(f"a view of {n} tokens of a list of {len(tokens)}")
        self._tokens, self._n = tokens, n

    @property
    def at_end(self) -> bool:
        """Whether the view reaches the end of its list (appending to it extends this prompt)."""
        return self._n == len(self._tokens)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:  # the reads the replay and the engine make: one copy of the part
                return self._tokens[start:stop]
            return self._tokens[: self._n][index]
        if not -self._n <= index < self._n:
            raise IndexError("prompt index out of range")
        return self._tokens[index % self._n]

    def __iter__(self) -> Iterator[int]:
        return islice(self._tokens, self._n)

    def __add__(self, other: Sequence[int]) -> list[int]:
        joined = self._tokens[: self._n]
        joined.extend(other)
        return joined

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptView):
            if other._tokens is self._tokens:  # views of one list: equal if equally long
                return other._n == self._n
            other = other._tokens[: other._n]
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return len(other) == self._n and self._tokens[: self._n] == list(other)

    __hash__ = None  # type: ignore[assignment]  # as a list's

    def __repr__(self) -> str:
        return f"PromptView({self._n} of {len(self._tokens)} tokens)"


def next_prompt(
    prev_prompt: Sequence[int], prev_output: list[int], input_tokens: int, tokens: SessionTokens,
    keep: int | None = None,
) -> PromptView:
    """Call k+1's prompt: the first ``input_tokens`` of prompt + output (its first ``keep``
    tokens when given) + fresh tool tokens. When it keeps all of ``prev_prompt`` and that is
    a view at the end of its list, the list grows and the new prompt views more of it (no
    copy); otherwise (a compacted context) the prompt gets a list of its own."""
    kept = min(len(prev_prompt) + len(prev_output), input_tokens,
               len(prev_prompt) + len(prev_output) if keep is None else keep)
    if isinstance(prev_prompt, PromptView) and prev_prompt.at_end and kept >= len(prev_prompt):
        grown = prev_prompt._tokens
        grown.extend(prev_output[: kept - len(prev_prompt)])
    else:
        grown = prev_prompt[:kept]
        grown.extend(prev_output[: max(0, kept - len(prev_prompt))])
    grown.extend(tokens.take(input_tokens - kept))
    return PromptView(grown, len(grown))


def prompt_chain(prompt: Sequence[int], known: BlockChain | None, shared: int,
                 block_size: int) -> BlockChain:
    """``prompt``'s block-hash chain, given ``known``: the chain of an earlier prompt whose
    first ``shared`` tokens ``prompt`` repeats (None: no such prompt). Only the blocks past
    the known ones are hashed, so a continuation costs its new tokens, not its length."""
    head = known.hashes[: shared // block_size] if known is not None else []
    done, full = len(head) * block_size, len(prompt) // block_size * block_size
    parent = head[-1] if head else None
    return BlockChain(block_size, head + block_hashes(prompt[done:full], block_size, parent))
