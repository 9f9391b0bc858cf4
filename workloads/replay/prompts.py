"""The replay's synthetic prompts: each session's token ids, and how a prompt grows.

Prompts are seeded random ids, so a session's continuation starts with exactly its previous
prompt and output (prefix caching, KV restore and cache-aware routing see what they would
see live) and two sessions share only what the trace says they share.
"""

from __future__ import annotations

import random
import zlib
from functools import lru_cache

import numpy as np

from engine.sim.tokens import token_ids
from talaria.protocol.text import BlockChain, block_hashes

__all__ = ["SessionTokens", "next_prompt", "prompt_chain"]


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


def next_prompt(
    prev_prompt: list[int], prev_output: list[int], input_tokens: int, tokens: SessionTokens,
    keep: int | None = None,
) -> list[int]:
    """Call k+1's prompt: the first ``input_tokens`` of prompt + output (its first ``keep``
    tokens when given) + fresh tool tokens."""
    base = prev_prompt + prev_output  # a new list, cut and extended in place (one copy)
    if keep is not None:
        del base[keep:]
    if input_tokens <= len(base):
        del base[input_tokens:]
        return base
    base.extend(tokens.take(input_tokens - len(base)))
    return base


def prompt_chain(prompt: list[int], known: BlockChain | None, shared: int,
                 block_size: int) -> BlockChain:
    """``prompt``'s block-hash chain, given ``known``: the chain of an earlier prompt whose
    first ``shared`` tokens ``prompt`` repeats (None: no such prompt). Only the blocks past
    the known ones are hashed, so a continuation costs its new tokens, not its length."""
    head = known.hashes[: shared // block_size] if known is not None else []
    done, full = len(head) * block_size, len(prompt) // block_size * block_size
    parent = head[-1] if head else None
    return BlockChain(block_size, head + block_hashes(prompt[done:full], block_size, parent))
