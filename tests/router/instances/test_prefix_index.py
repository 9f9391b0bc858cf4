"""The router's prefix index: an LRU set of block hashes per (instance, model)."""

from __future__ import annotations

import random

from router.instances.placement import PrefixIndex


def _reference_insert(order: list[int], hashes: list[int], max_blocks: int) -> list[int]:
    """The LRU as a plain list, least recently used first: each hash moves to the end."""
    for h in hashes:
        if h in order:
            order.remove(h)
        order.append(h)
    return order[max(0, len(order) - max_blocks):]


def _order(index: PrefixIndex, instance: str, model: str) -> list[int]:
    return list(index._sets[(instance, model)])


def test_insert_moves_known_hashes_to_the_end_and_evicts_the_oldest() -> None:
    index = PrefixIndex(max_blocks_per_instance=4)
    index.insert("i0", "m", [1, 2, 3])
    index.insert("i0", "m", [2, 4])
    assert _order(index, "i0", "m") == [1, 3, 2, 4]
    index.insert("i0", "m", [5])
    assert _order(index, "i0", "m") == [3, 2, 4, 5]  # 1 was the least recently used
    assert index.match_blocks("i0", "m", [3, 2, 9, 4]) == 2
    assert index.match_blocks("i0", "m", [1, 3]) == 0
    assert index.match_blocks("i1", "m", [3]) == 0  # another instance knows nothing


def test_a_repeated_hash_takes_its_last_place() -> None:
    index = PrefixIndex()
    index.insert("i0", "m", [7, 8, 7])
    assert _order(index, "i0", "m") == [8, 7]


def test_random_inserts_match_a_plain_lru() -> None:
    rng = random.Random(5)
    index = PrefixIndex(max_blocks_per_instance=12)
    reference: list[int] = []
    for _ in range(300):
        hashes = [rng.randrange(30) for _ in range(rng.randrange(0, 8))]
        if rng.random() < 0.7:
            hashes = list(dict.fromkeys(hashes))  # mostly chains without repeats
        index.insert("i0", "m", hashes)
        reference = _reference_insert(reference, hashes, 12)
        assert _order(index, "i0", "m") == reference
        probe = [rng.randrange(30) for _ in range(6)]
        expected = next((k for k, h in enumerate(probe) if h not in reference), len(probe))
        assert index.match_blocks("i0", "m", probe) == expected
