"""Layer-wise KV loads: which layers hold their KV when, and that nothing is left half-loaded."""

from __future__ import annotations

import pytest
import torch

from substrate.layer_loads import LayerwiseKVLoad, layer_groups

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 5, 6, 4, 2, 3


def _cache() -> torch.Tensor:
    return torch.full((LAYERS, 2, BLOCKS, BLOCK, HEADS, DIM), float("nan"))


def _payloads(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((LAYERS, 2, BLOCK, HEADS, DIM), generator=gen) for _ in range(n)]


def _loaded_layers(cache: torch.Tensor, block_id: int) -> list[int]:
    return [layer for layer in range(LAYERS) if not cache[layer, :, block_id].isnan().any()]


def test_layer_groups_cover_every_layer_once() -> None:
    assert layer_groups(5, 4) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(2, 4) == [(0, 1), (1, 2)]
    assert layer_groups(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_groups(3, 1) == [(0, 3)]
    with pytest.raises(ValueError):
        layer_groups(0, 4)
    with pytest.raises(ValueError):
        layer_groups(4, 0)


def test_a_group_is_written_only_when_its_first_layer_is_reached() -> None:
    cache, host = _cache(), _payloads(2, seed=1)
    load = LayerwiseKVLoad(torch.device("cpu"), num_groups=3)  # groups (0,2) (2,4) (4,5)
    assert load.add(cache, host, [4, 1]) == 2 * host[0].numel() * 4
    assert load.pending and _loaded_layers(cache, 4) == []
    load.before_layer(0)
    assert _loaded_layers(cache, 4) == [0, 1] and _loaded_layers(cache, 1) == [0, 1]
    load.before_layer(1)
    assert _loaded_layers(cache, 4) == [0, 1]
    load.before_layer(2)
    assert _loaded_layers(cache, 4) == [0, 1, 2, 3]
    assert load.pending
    record = load.finish()
    assert not load.pending
    assert record is not None and record.kind == "kv_restore"
    assert record.bytes == 2 * host[0].numel() * 4 and record.seconds >= 0
    for block_id, payload in zip([4, 1], host, strict=True):
        assert torch.equal(cache[:, :, block_id], payload)
    assert _loaded_layers(cache, 0) == []  # no other block was touched
    assert load.finish() is None


def test_finish_writes_loads_a_forward_never_reached() -> None:
    cache, first, second = _cache(), _payloads(1, seed=2), _payloads(2, seed=3)
    load = LayerwiseKVLoad(torch.device("cpu"), chunk_bytes=1)  # one block per scratch chunk
    load.add(cache, first, [0])
    load.add(cache, second, [2, 5])  # two requests restoring in one step
    record = load.finish()
    assert record is not None and record.bytes == 3 * first[0].numel() * 4
    for block_id, payload in zip([0, 2, 5], first + second, strict=True):
        assert torch.equal(cache[:, :, block_id], payload)
    again = _payloads(2, seed=7)  # the same blocks again, a step later: the counts restart
    load.add(cache, again, [2, 5])
    load.before_layer(LAYERS - 1)
    assert not load.pending
    record = load.finish()
    assert record is not None and record.bytes == 2 * again[0].numel() * 4
    assert torch.equal(cache[:, :, 2], again[0]) and torch.equal(cache[:, :, 0], first[0])


def test_bad_loads_are_refused_before_anything_is_queued() -> None:
    cache = _cache()
    load = LayerwiseKVLoad(torch.device("cpu"))
    with pytest.raises(ValueError, match="block ids"):
        load.add(cache, _payloads(2, seed=4), [0])
    with pytest.raises(ValueError, match="the device cache needs"):
        load.add(cache, [torch.zeros((LAYERS, 2, BLOCK, HEADS, DIM + 1))], [0])
    with pytest.raises(ValueError, match="out of range"):
        load.add(cache, _payloads(1, seed=8), [BLOCKS])
    assert not load.pending and load.add(cache, [], []) == 0
    load.add(cache, _payloads(1, seed=5), [3])
    with pytest.raises(RuntimeError, match="another KV cache"):
        load.add(_cache(), _payloads(1, seed=6), [3])
    with pytest.raises(ValueError):
        LayerwiseKVLoad(torch.device("cpu"), num_groups=0)
    with pytest.raises(ValueError):
        LayerwiseKVLoad(torch.device("cpu"), chunk_bytes=0)
