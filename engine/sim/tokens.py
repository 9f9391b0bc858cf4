"""Token ids as shared objects: one int object per id of a vocabulary.

The simulator holds every session's prompt and answer as Python lists of token ids, and a
Python int above 256 is an object of its own (28-32 bytes) behind each 8-byte list slot.
Ids drawn from ``token_ids(vocab_size)`` are the same objects wherever they appear, so a
token costs its list slot only (docs/benchmark.md, "Token ids shared"). Values are
unchanged, and so is everything computed from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

__all__ = ["MAX_SHARED_VOCAB", "token_ids"]

MAX_SHARED_VOCAB = 1 << 20  # a table's size: about 36 MB; models' vocabularies are < 300k


@lru_cache(maxsize=16)
def token_ids(vocab_size: int) -> Sequence[int]:
    """``ids[t]`` is ``t``: one shared object per id in ``[0, vocab_size)``, in a tuple (no
    caller can change the table the others read). Beyond ``MAX_SHARED_VOCAB`` ids, a
    ``range``: the same values, each a new object."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return tuple(range(vocab_size)) if vocab_size <= MAX_SHARED_VOCAB else range(vocab_size)
