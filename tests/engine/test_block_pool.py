"""Block pool: exact ids, LRU eviction, ref counts under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free([a[2]])
    pool.free([a[0]])
    assert pool.free_block_ids() == [2, 0]
    assert pool.allocate(1) == [2]


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    assert pool.cache_block(b, 111)
    pool.free([b])
    assert pool.lookup(111) == b
    assert pool.num_cached_free_blocks == 1
    pool.touch([b])  # a prefix hit takes it back out of the free queue
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.free([b])
    # Allocation takes the untouched block 1 first, then evicts block 0.
    assert pool.allocate(1) == [1]
    assert pool.lookup(111) == 0
    assert pool.allocate(1) == [0]
    assert pool.lookup(111) is None
    assert pool.num_cached_free_blocks == 0


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 7)
    assert not pool.cache_block(b, 7)
    assert pool.lookup(7) == a and pool.block_hash(b) is None


def test_caching_a_run_is_caching_each_block_in_order() -> None:
    """``cache_blocks`` over a run: a hash repeated inside the run or already held by another
    block leaves the later block unhashed, as ``cache_block`` one by one would; ``lookup_all``
    answers each hash, None where nothing holds it; ``lookup_prefix`` up to the first such."""
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    pool.cache_block(blocks[0], 100)
    pool.cache_blocks(blocks[1:], [200, 100, 300, 200])
    assert [pool.block_hash(b) for b in blocks] == [100, 200, None, 300, None]
    assert pool.lookup_all([100, 200, 300, 400]) == [blocks[0], blocks[1], blocks[3], None]
    assert pool.lookup_prefix([100, 200, 400, 300]) == [blocks[0], blocks[1]]  # stops at 400
    with pytest.raises(ValueError):
        pool.cache_blocks(blocks[:2], [1])  # a hash for every block
    pool.free(blocks[4:])
    with pytest.raises(RuntimeError, match="not referenced"):
        pool.cache_blocks(blocks[4:], [500])


def test_errors_are_clear() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(3)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="not referenced"):
        pool.cache_block(b, 5)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_reset_requires_all_free_and_forgets_hashes() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache_block(a[0], 9)
    with pytest.raises(RuntimeError, match="still referenced"):
        pool.reset()
    pool.free(a)
    pool.reset()
    assert pool.lookup(9) is None
    assert pool.free_block_ids() == [0, 1, 2]


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "fork", "free", "cache", "touch_hash"]), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_counts_consistent(program: list[tuple[str, int]]) -> None:
    """Model: a multiset of owners, each a list of block ids; invariants after every op."""
    n = 8
    pool = BlockPool(n)
    owners: list[list[int]] = []
    for op, arg in program:
        if op == "alloc":
            k = arg % 3 + 1
            if k <= pool.num_free_blocks:
                owners.append(pool.allocate(k))
            else:
                with pytest.raises(RuntimeError):
                    pool.allocate(k)
        elif op == "fork" and owners:
            src = owners[arg % len(owners)]
            pool.touch(src)
            owners.append(list(src))
        elif op == "free" and owners:
            pool.free(owners.pop(arg % len(owners)))
        elif op == "cache" and owners:
            blocks = owners[arg % len(owners)]
            pool.cache_block(blocks[0], 1000 + arg)
        elif op == "touch_hash":
            b = pool.lookup(1000 + arg)
            if b is not None:
                pool.touch([b])
                owners.append([b])
        refs = [0] * n
        for blocks in owners:
            for b in blocks:
                refs[b] += 1
        assert [pool.ref_count(b) for b in range(n)] == refs
        probe = [*range(n), arg % n]  # a repeated id counts each time it is named
        assert pool.count_unreferenced(probe) == sum(1 for b in probe if refs[b] == 0)
        free = pool.free_block_ids()
        assert sorted(free) == [b for b in range(n) if refs[b] == 0]
        assert pool.num_free_blocks == len(free)
        hashed = [b for b in range(n) if pool.block_hash(b) is not None]
        assert pool.num_hashed_blocks == len(hashed)
        for b in hashed:
            assert pool.lookup(pool.block_hash(b)) == b
        assert pool.num_cached_free_blocks == sum(1 for b in free if b in hashed)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == n
