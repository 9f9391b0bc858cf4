"""KV cache manager: prefix reuse, last token never reused, secondary restore, sessions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_hash import block_hashes, hash_block_tokens
from engine.kv_cache_manager import KVCacheManager, SecondaryKVCache
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], session: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), session_id=session)


def run_prefill(kv: KVCacheManager, r: Request) -> int:
    """Admit and fully prefill a request the way the scheduler does; returns cached tokens."""
    prefix = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - prefix.num_tokens, prefix)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return prefix.num_tokens


class DictSecondary:
    """A host store keyed by block hash; ``load`` records where each hash went."""

    def __init__(self, hashes: list[int]) -> None:
        self.held = set(hashes)
        self.loads: list[tuple[list[int], list[int]]] = []

    def lookup(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.held:
                break
            n += 1
        return n

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        self.loads.append((list(block_hashes), list(block_ids)))


def test_hashes_are_chained_and_stable() -> None:
    a = block_hashes(list(range(8)), BS)
    assert a == [hash_block_tokens(None, [0, 1, 2, 3]), hash_block_tokens(a[0], [4, 5, 6, 7])]
    # Same second block after a different first block hashes differently.
    b = block_hashes([9, 9, 9, 9, 4, 5, 6, 7], BS)
    assert a[1] != b[1]
    assert block_hashes([1, 2, 3], BS) == []
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, [1, 2, 3, 4])


def test_prefix_reused_and_counted() -> None:
    kv = KVCacheManager(16, BS)
    a = req("a", list(range(10)))
    assert run_prefill(kv, a) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(a)
    b = req("b", list(range(8)) + [50, 51, 52])
    assert run_prefill(kv, b) == 8
    assert kv.block_ids("b")[:2] == [0, 1]


def test_last_prompt_token_never_reused() -> None:
    kv = KVCacheManager(16, BS)
    a = req("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    same = req("b", list(range(8)))
    prefix = kv.get_computed_blocks(same)
    # Both blocks are cached but the second holds the last token: only 4 tokens reused.
    assert prefix.block_ids == [0] and prefix.num_tokens == 4


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(3, BS)
    a = req("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    b = req("b", list(range(4)) + [99] * 12)  # hits block 0, needs 3 more
    prefix = kv.get_computed_blocks(b)
    assert prefix.block_ids == [0]
    assert not kv.allocate_slots(b, 12, prefix)
    assert kv.num_free_blocks == 3 and not kv.holds_blocks("b")
    assert kv.pool.ref_count(0) == 0


def test_free_releases_tail_first() -> None:
    kv = KVCacheManager(8, BS)
    a = req("a", list(range(12)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.pool.free_block_ids()[-3:] == [2, 1, 0]


def test_secondary_cache_restores_following_blocks() -> None:
    kv = KVCacheManager(16, BS)
    tokens = list(range(17))
    hashes = block_hashes(tokens, BS)
    a = req("a", tokens[:8])
    run_prefill(kv, a)  # device holds blocks 0..1 (hash 0, 1)
    kv.free(a)
    store = DictSecondary(hashes[:4])
    assert isinstance(store, SecondaryKVCache)
    kv.secondary = store
    b = req("b", tokens)
    prefix = kv.get_computed_blocks(b)
    assert prefix.block_ids == [0, 1]
    assert prefix.restore_hashes == hashes[2:4]
    assert kv.allocate_slots(b, 1, prefix)
    assert store.loads == [(hashes[2:4], kv.block_ids("b")[2:4])]
    # Restored blocks are now in the device prefix cache.
    assert kv.pool.lookup(hashes[2]) == kv.block_ids("b")[2]
    assert prefix.num_restored_tokens == 8 and prefix.num_tokens == 16


def test_session_memory_pin_and_unpin() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(9)), session="s")
    run_prefill(kv, a)
    a.output_token_ids.append(100)  # sampled token; no KV yet
    kv.free(a, remember_session=True)
    assert kv.session_block_ids("s") == [0, 1]
    assert len(kv.session_block_hashes("s")) == 2
    assert kv.pin_session("s") == 2
    assert kv.pool.ref_count(0) == 1 and kv.num_free_blocks == 2
    # Pressure: a request needing every free block cannot evict the pinned ones.
    other = req("o", [77] * 8)
    run_prefill(kv, other)
    assert set(kv.block_ids("o")).isdisjoint({0, 1})
    assert kv.num_free_blocks == 0
    kv.free(other)
    kv.unpin_session("s")
    assert kv.num_free_blocks == 4 and kv.session_block_ids("s") == [0, 1]
    # Now eviction reaches them.
    big = req("big", [55] * 16)
    assert kv.allocate_slots(big, 16, kv.get_computed_blocks(big))
    assert kv.session_block_ids("s") == []
    assert kv.pin_session("s") == 0


def test_reset_drops_everything_and_refuses_with_live_requests() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(8)), session="s")
    run_prefill(kv, a)
    with pytest.raises(RuntimeError, match="hold blocks"):
        kv.reset()
    kv.free(a, remember_session=True)
    kv.pin_session("s")
    kv.reset()
    assert kv.num_free_blocks == 4 and kv.num_pinned_blocks == 0
    assert kv.session_block_hashes("s") == []
    assert kv.get_computed_blocks(req("b", list(range(8)))).num_tokens == 0


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(9)))).num_tokens == 0
    assert kv.pool.num_hashed_blocks == 0


def _walk(kv: KVCacheManager, session: str) -> int:
    """The session's cached blocks found the slow way: its chain walked in the prefix map."""
    n = 0
    for h in kv.session_block_hashes(session):
        if kv.pool.lookup(h) is None:
            break
        n += 1
    return n


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["s1", "s2", "s3", None]),
                              st.lists(st.integers(0, 3), min_size=1, max_size=14),
                              st.sampled_from(["run", "forget", "pin"])), max_size=25))
def test_session_cached_blocks_follow_every_eviction_and_reuse(
    ops: list[tuple[str | None, list[int], str]],
) -> None:
    """The kept count of each session's cached prefix (no walk per question) equals a walk of
    its chain, through prefix reuse, eviction under pressure, pins and forgetting."""
    kv = KVCacheManager(6, BS)
    for i, (session, tokens, op) in enumerate(ops):
        if op == "forget" and session is not None:
            kv.forget_session(session)
        elif op == "pin" and session is not None:
            kv.pin_session(session)
        else:
            r = req(f"r{i}", tokens, session=session)
            prefix = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - prefix.num_tokens, prefix):
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
                kv.free(r, remember_session=True)
        for s in ("s1", "s2", "s3"):
            assert kv.session_cached_blocks(s) == _walk(kv, s)
            assert len(kv.session_block_ids(s)) == _walk(kv, s)
    for s in ("s1", "s2", "s3"):
        kv.unpin_session(s)
    kv.reset()
    assert all(kv.session_cached_blocks(s) == 0 for s in ("s1", "s2", "s3"))


def test_refused_growth_leaves_a_blockless_request_without_an_entry() -> None:
    """``allocate_slots`` without a prefix (the simulator's resume of a parked request) that
    finds too few blocks must change nothing: an empty entry left behind makes the scheduler
    take the waiting request for one that holds KV, and skip its prefix lookup."""
    kv = KVCacheManager(2, BS)
    r = req("r", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert not kv.holds_blocks("r")
