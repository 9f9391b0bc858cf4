"""Host KV store: real tensors saved from some device blocks come back into others."""

from __future__ import annotations

import pytest
import torch

from substrate.arena import DeviceArena
from substrate.host_kv import HostKVStore

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8


def _caches(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYERS, 2, num_blocks, BLOCK, HEADS, DIM), generator=g)


def _block_bytes() -> int:
    return LAYERS * 2 * BLOCK * HEADS * DIM * 4


def test_save_then_load_into_different_block_ids() -> None:
    src = _caches(8, 0)
    store = HostKVStore(capacity_bytes=10 * _block_bytes(), pin=False)
    saved = store.save("m", [11, 12, 13], [5, 2, 7], src, session_id="s")
    assert saved.kind == "kv_offload" and saved.bytes == 3 * _block_bytes()
    assert store.used_bytes == saved.bytes and len(store) == 3

    arena = DeviceArena("cpu", 0, 0, 8 * _block_bytes())
    dst = arena.kv_cache(LAYERS, 8, BLOCK, HEADS, DIM, torch.float32)
    dst.zero_()
    assert store.lookup("m", [11, 12, 13, 14]) == 3
    restored = store.load("m", [11, 12, 13], [0, 3, 6], dst)
    assert restored.kind == "kv_restore" and restored.bytes == saved.bytes
    for s_id, d_id in ((5, 0), (2, 3), (7, 6)):
        assert torch.equal(dst[:, :, d_id], src[:, :, s_id])
    for untouched in (1, 2, 4, 5, 7):
        assert torch.count_nonzero(dst[:, :, untouched]) == 0
    again = store.save("m", [11, 12], [0, 3], dst)
    assert again.bytes == 0 and len(store) == 3  # already stored: nothing copied


def test_small_chunks_give_the_same_result() -> None:
    src = _caches(6, 1)
    store = HostKVStore(capacity_bytes=6 * _block_bytes(), pin=False, kv_chunk_bytes=1)
    store.save("m", list(range(6)), [5, 4, 3, 2, 1, 0], src)
    dst = _caches(6, 2)
    store.load("m", list(range(6)), list(range(6)), dst)
    assert torch.equal(dst, src.flip(2))


def test_eviction_frees_payloads_and_ends_the_prefix() -> None:
    src = _caches(4, 3)
    store = HostKVStore(capacity_bytes=3 * _block_bytes(), pin=False)
    store.save("a", [1, 2], [0, 1], src)
    store.save("b", [1, 2], [2, 3], src)  # evicts a's tail block first
    assert store.used_bytes == 3 * _block_bytes()
    assert store.lookup("a", [1, 2]) == 1 and store.lookup("b", [1, 2]) == 2
    with pytest.raises(KeyError, match="not in the host KV store"):
        store.load("a", [1, 2], [0, 1], src)
    assert store.drop_model("b") == 2 * _block_bytes()
    assert store.used_bytes == _block_bytes()


def test_adapter_has_the_engines_secondary_cache_shape() -> None:
    src, dst = _caches(4, 4), _caches(4, 5)
    store = HostKVStore(capacity_bytes=4 * _block_bytes(), pin=False)
    store.bind("m", src).save([7, 8], [3, 1], session_id="s")
    cache = store.bind("m", dst)
    assert cache.lookup([7, 8, 9]) == 2
    assert store.bind("other", dst).lookup([7, 8]) == 0
    cache.load([7, 8], [0, 2])
    assert torch.equal(dst[:, :, 0], src[:, :, 3]) and torch.equal(dst[:, :, 2], src[:, :, 1])
    records = cache.drain_records()
    assert [r.kind for r in records] == ["kv_restore"] and cache.drain_records() == []


def test_shape_and_argument_errors() -> None:
    src = _caches(4, 6)
    store = HostKVStore(capacity_bytes=4 * _block_bytes(), pin=False)
    with pytest.raises(ValueError, match="2 block hashes for 1 block ids"):
        store.save("m", [1, 2], [0], src)
    with pytest.raises(ValueError, match="out of range for 4 device blocks"):
        store.save("m", [1], [9], src)
    assert len(store) == 0  # a failed copy leaves nothing behind
    store.save("m", [1], [0], src)
    other = torch.zeros(LAYERS, 2, 4, BLOCK, 1, DIM)
    with pytest.raises(ValueError, match="the device cache needs"):
        store.load("m", [1], [0], other)
    with pytest.raises(ValueError, match="a KV cache is"):
        store.save("m", [2], [0], src[0])


def test_a_failed_host_allocation_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocating the host payloads fails (pinned memory runs out): the index does not keep
    blocks it holds no payload for, which a lookup would offer and a restore fail on."""
    src = _caches(4, 7)
    store = HostKVStore(capacity_bytes=4 * _block_bytes(), pin=False)

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("out of pinned memory")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", no_memory)
        with pytest.raises(RuntimeError, match="out of pinned memory"):
            store.save("m", [1, 2], [0, 1], src)
    assert store.lookup("m", [1, 2]) == 0
    assert len(store) == 0 and store.used_bytes == 0


def test_a_held_session_holds_only_the_chain_it_continues() -> None:
    """A session whose new chain forks from its last (it continues an earlier call, or a
    compaction starts it afresh) no longer needs the old chain's tail: holding the session
    keeps what it will read, not that tail before an unreserved session's KV."""
    src = _caches(8, 4)
    store = HostKVStore(capacity_bytes=6 * _block_bytes(), pin=False)
    store.save("m", [1, 2, 3], [0, 1, 2], src, session_id="r")
    store.save("m", [1, 2, 7], [0, 1, 3], src, session_id="r")  # forks after block 2
    store.index.hold("r")
    store.save("m", [5, 6], [4, 5], src, session_id="u")  # unreserved
    evicted = store.index.insert_chain("m", [8], _block_bytes()).evicted
    assert [e.block_hash for e in evicted] == [3]  # the tail r no longer continues
    assert store.lookup("m", [5, 6], touch=False) == 2
    assert store.lookup("m", [1, 2, 7], touch=False) == 3

