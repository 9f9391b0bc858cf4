"""Device arena: fixed weight addresses across model switches, KV re-views, size errors."""

from __future__ import annotations

import pytest
import torch
from substrate_testing import TinyLM, state_of

from substrate.arena import DeviceArena
from substrate.layout import ALIGNMENT, TensorSpec, WeightLayout


def test_layout_offsets_are_aligned_and_cover_every_tensor() -> None:
    layout = WeightLayout(
        [
            TensorSpec("a", (3,), torch.float32),
            TensorSpec("b", (5, 7), torch.bfloat16),
            TensorSpec("c", (1,), torch.int64),
        ]
    )
    assert layout.offsets == {"a": 0, "b": 256, "c": 512}
    assert layout.total_bytes == 768
    assert all(off % ALIGNMENT == 0 for off in layout.offsets.values())
    with pytest.raises(ValueError, match="duplicate"):
        WeightLayout([TensorSpec("a", (1,), torch.float32)] * 2)


def test_layout_from_meta_module_counts_tied_weights_once() -> None:
    with torch.device("meta"):
        model = TinyLM()
    layout = WeightLayout.from_module(model)
    names = [s.name for s in layout]
    assert "head.weight" not in names and "embed.weight" in names
    assert names[-1] == "scale"
    assert "scale" not in [s.name for s in WeightLayout.from_module(model, include_buffers=False)]


def _activate(arena: DeviceArena, layout: WeightLayout, weights: dict[str, torch.Tensor]) -> None:
    """Copy a model's tensors into the weight region (the host store does this in one copy)."""
    for name, view in arena.weight_views(layout).items():
        view.copy_(weights[name])


def test_rebinding_another_model_keeps_every_address() -> None:
    torch.manual_seed(0)
    ref_a, ref_b = TinyLM(vocab=32, hidden=16), TinyLM(vocab=48, hidden=8)
    weights_a, weights_b = state_of(ref_a), state_of(ref_b)
    with torch.device("meta"):
        model_a, model_b = TinyLM(vocab=32, hidden=16), TinyLM(vocab=48, hidden=8)
    layout_a, layout_b = WeightLayout.from_module(model_a), WeightLayout.from_module(model_b)
    arena = DeviceArena.for_layouts("cpu", [layout_a, layout_b], kv_bytes=4096)
    base = arena.buffer.data_ptr()
    arena.bind_module(model_a, layout_a)
    arena.bind_module(model_b, layout_b)
    assert model_a.head.weight is model_a.embed.weight  # still tied
    ptrs_a = {n: p.data_ptr() for n, p in model_a.named_parameters()}
    assert ptrs_a["embed.weight"] == arena.weight_region.data_ptr() == base
    assert model_b.embed.weight.data_ptr() == arena.weight_region.data_ptr()

    ids = torch.tensor([[1, 5, 7, 3]])
    _activate(arena, layout_a, weights_a)
    out_a = model_a(ids)
    torch.testing.assert_close(out_a, ref_a(ids))
    _activate(arena, layout_b, weights_b)
    torch.testing.assert_close(model_b(ids), ref_b(ids))
    _activate(arena, layout_a, weights_a)
    assert {n: p.data_ptr() for n, p in model_a.named_parameters()} == ptrs_a
    assert arena.buffer.data_ptr() == base
    torch.testing.assert_close(model_a(ids), out_a)


def test_bind_rejects_a_module_that_does_not_match_the_layout() -> None:
    with torch.device("meta"):
        small, other = TinyLM(vocab=32, hidden=16), TinyLM(vocab=32, hidden=8)
    arena = DeviceArena("cpu", 1 << 16, 0, 0)
    with pytest.raises(ValueError, match="in the module but"):
        arena.bind_module(small, WeightLayout.from_module(other))
    with pytest.raises(ValueError, match="missing from the weight layout"):
        arena.bind_module(small, WeightLayout([TensorSpec("proj.weight", (16, 16), torch.float32)]))


def test_a_shard_too_big_for_the_weight_region_names_both_sizes() -> None:
    with torch.device("meta"):
        big = TinyLM(vocab=512, hidden=64)
    layout = WeightLayout.from_module(big)
    arena = DeviceArena("cpu", 4096, 0, 0)
    with pytest.raises(ValueError) as err:
        arena.bind_module(big, layout)
    assert str(layout.total_bytes) in str(err.value) and "4096" in str(err.value)
    with pytest.raises(ValueError, match="staging region of 0 bytes"):
        arena.check_stageable(layout, "big")


def test_kv_caches_of_two_shapes_share_the_base_address_and_stay_inside_the_region() -> None:
    arena = DeviceArena("cpu", 1024, 0, 64 * 1024)
    first = arena.kv_cache(2, None, 4, 2, 8, torch.float32)
    second = arena.kv_cache(3, 5, 16, 1, 4, torch.bfloat16)
    assert first.data_ptr() == second.data_ptr() == arena.kv_region.data_ptr()
    n = arena.kv_num_blocks(2, 4, 2, 8, torch.float32)
    assert n == 64 * 1024 // (2 * 2 * 4 * 2 * 8 * 4)
    assert first.shape == (2, 2, n, 4, 2, 8) and first.dtype == torch.float32
    assert second.shape == (3, 2, 5, 16, 1, 4) and second.dtype == torch.bfloat16
    end = arena.kv_region.data_ptr() + arena.kv_bytes
    for kv in (first, second):
        assert kv.is_contiguous()
        assert kv.data_ptr() + kv.numel() * kv.element_size() <= end
        for layer in range(kv.shape[0]):
            kv[layer, 0].fill_(2 * layer)
            kv[layer, 1].fill_(2 * layer + 1)
        for layer in range(kv.shape[0]):
            assert torch.all(kv[layer, 0] == 2 * layer) and torch.all(kv[layer, 1] == 2 * layer + 1)


def test_kv_errors_name_the_sizes() -> None:
    arena = DeviceArena("cpu", 0, 0, 8192)
    fit = arena.kv_num_blocks(2, 16, 2, 8, torch.float16)
    with pytest.raises(ValueError, match=f"at most {fit} blocks fit") as err:
        arena.kv_cache(2, fit + 1, 16, 2, 8, torch.float16)
    assert "8192" in str(err.value)
    with pytest.raises(ValueError, match="holds no KV block"):
        arena.kv_cache(64, None, 16, 8, 128, torch.float16)
    with pytest.raises(ValueError, match="weight region size must be >= 0"):
        DeviceArena("cpu", -1, 0, 0)
