"""The replay's synthetic token ids: seeded, in [1, vocab), each the vocabulary's one shared
int object (``engine.sim.tokens``), so a long prompt costs its list slots only."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from engine.sim.tokens import MAX_SHARED_VOCAB, token_ids
from workloads.replay.prompts import SessionTokens


@pytest.mark.parametrize("vocab", [2, 300, 151_936])
def test_ids_are_the_seeded_draws_as_shared_objects(vocab: int) -> None:
    tokens = SessionTokens("s7", 3, vocab)
    first, second = tokens.take(1000), tokens.take(5)
    rng = random.Random(zlib.crc32(b"3/s7"))  # the recipe, written out: values unchanged
    for got, n in ((first, 1000), (second, 5)):
        raw = np.frombuffer(rng.randbytes(4 * n), dtype=np.uint32).astype(np.uint64)
        assert got == (raw % (vocab - 1) + 1).tolist()
        assert all(1 <= t < vocab and t is token_ids(vocab)[t] for t in got)
    assert SessionTokens("s7", 3, vocab).take(1005) == first + second


def test_the_table_is_one_per_vocabulary_and_checked() -> None:
    assert token_ids(300) is token_ids(300)
    assert token_ids(300) == tuple(range(300))
    huge = token_ids(MAX_SHARED_VOCAB + 1)  # no table that size: the ids, unshared
    assert isinstance(huge, range) and huge[MAX_SHARED_VOCAB] == MAX_SHARED_VOCAB
    tokens = SessionTokens("s", 0, 2**33).take(50)
    assert all(1 <= t < 2**33 for t in tokens) and max(tokens) > MAX_SHARED_VOCAB
    with pytest.raises(ValueError, match="vocab_size"):
        token_ids(0)
