"""One table of int objects per vocabulary, for the simulator's synthetic token ids.

A prompt held as a list of freshly made ints costs 36 bytes a token (the list's pointer and a
28-byte int); taking each id from one shared table of the vocabulary's ints costs the pointer
alone. Only where the int lives changes, never its value, so nothing downstream can tell.
"""

from __future__ import annotations

import functools

__all__ = ["vocabulary_ids"]


@functools.cache
def vocabulary_ids(vocab_size: int) -> tuple[int, ...]:
    """``ids[k] == k`` for ``k`` in ``[0, vocab_size)``, the same objects on every call."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return tuple(range(vocab_size))
