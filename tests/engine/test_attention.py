"""The paged torch backend equals dense causal attention, across block boundaries."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from helpers import allocate_kv_cache, build_metadata, dense_causal

from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.selector import flash_available, get_attention_backend
from engine.attention.torch_paged import TorchPagedAttention


def run_against_dense(
    seqs: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int = 4, seed: int = 0
) -> AttentionMetadata:
    """Attend ``(cached, new)`` sequences through the paged backend and compare with dense
    causal attention per sequence; returns the metadata used."""
    torch.manual_seed(seed)
    d = 8
    scale = d**-0.5
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    kv = allocate_kv_cache(1, num_blocks, block_size, kv_heads, d)[0]
    flat_k, flat_v = kv[0].view(-1, kv_heads, d), kv[1].view(-1, kv_heads, d)
    free = torch.randperm(num_blocks).tolist()
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        full_k.append(torch.randn(total, kv_heads, d))
        full_v.append(torch.randn(total, kv_heads, d))
        for pos in range(cached):  # context written by earlier steps
            slot = table[pos // block_size] * block_size + pos % block_size
            flat_k[slot], flat_v[slot] = full_k[-1][pos], full_v[-1][pos]
    layout = build_attention_metadata(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, block_size
    )
    qs = [torch.randn(n, heads, d) for _, n in seqs]
    order = layout.order
    q = torch.cat([qs[i] for i in order])
    k_new = torch.cat([full_k[i][seqs[i][0] :] for i in order])
    v_new = torch.cat([full_v[i][seqs[i][0] :] for i in order])

    backend = TorchPagedAttention()
    out = backend.forward(q, k_new, v_new, kv, backend.prepare(layout.attn), scale, 0)

    expected = torch.cat([dense_causal(qs[i], full_k[i], full_v[i], scale) for i in order])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for (cached, new), table, k_all in zip(seqs, tables, full_k, strict=True):
        for pos in range(cached, cached + new):  # the new tokens' K/V landed at their slots
            slot = table[pos // block_size] * block_size + pos % block_size
            torch.testing.assert_close(flat_k[slot], k_all[pos])
    return layout.attn


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch_matches_dense(heads: int, kv_heads: int) -> None:
    # (cached tokens, new tokens): a prefill from scratch, a chunk after cached context,
    # and two decodes (one right after a block boundary).
    run_against_dense([(0, 11), (9, 6), (12, 1), (7, 1)], heads, kv_heads)


def test_many_groups_of_mixed_lengths_match_dense() -> None:
    """Decodes of very different lengths split into several groups; prefill chunks of
    different lengths share a group padded to the longest chunk."""
    rng = random.Random(1)
    decodes = [(rng.randint(0, 120), 1) for _ in range(40)]
    prefills = [(0, 37), (0, 5), (23, 9), (60, 2), (0, 64), (3, 30)]
    seqs = decodes[:20] + prefills + decodes[20:]
    attn = run_against_dense(seqs, heads=4, kv_heads=2, block_size=4, seed=2)
    decode_groups = [g for g in attn.groups if g.query_width == 1]
    prefill_groups = [g for g in attn.groups if g.query_width > 1]
    assert len(decode_groups) > 1 and sum(g.num_seqs for g in decode_groups) == 40
    assert any(g.query_rows is not None for g in prefill_groups)  # padded queries exercised
    assert sum(g.num_tokens for g in attn.groups) == attn.num_tokens


def test_metadata_token_count_mismatch_raises() -> None:
    kv = allocate_kv_cache(1, 4, 4, 1, 8)[0]
    backend = TorchPagedAttention()
    meta = backend.prepare(build_metadata([2], [2], [[0]], 4))
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="tokens"):
        backend.forward(q, k, k, kv, meta, 1.0, 0)
    with pytest.raises(ValueError, match="prepare"):  # a chunk after cached context
        backend.forward(q[:2], k[:2], k[:2], kv, build_metadata([2], [3], [[0]], 4), 1.0, 0)


def test_selector_cpu_and_errors() -> None:
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope", "cpu")
    with pytest.raises((ValueError, ImportError), match="flash"):
        get_attention_backend("flash", "cpu")


@pytest.mark.skipif(
    not flash_available("cuda") or not torch.cuda.is_available(), reason="needs CUDA and flash-attn"
)
@pytest.mark.parametrize("decode_only", [False, True])
def test_flash_matches_torch_on_gpu(decode_only: bool) -> None:
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    heads, kv_heads, d, block_size, num_blocks = 8, 2, 64, 256, 12
    seqs = [(0, 300), (260, 40), (511, 1)] if not decode_only else [(300, 1), (511, 1)]
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    meta = build_metadata(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, block_size, device
    )
    kv = torch.randn(2, num_blocks, block_size, kv_heads, d, dtype=dtype, device=device)
    kv_copy = kv.clone()
    n = sum(n for _, n in seqs)
    q = torch.randn(n, heads, d, dtype=dtype, device=device)
    k = torch.randn(n, kv_heads, d, dtype=dtype, device=device)
    v = torch.randn(n, kv_heads, d, dtype=dtype, device=device)
    flash = get_attention_backend("flash", device)
    out_flash = flash.forward(q, k, v, kv, flash.prepare(meta), d**-0.5, 0)
    torch_backend = TorchPagedAttention()
    out_torch = torch_backend.forward(q, k, v, kv_copy, torch_backend.prepare(meta), d**-0.5, 0)
    torch.testing.assert_close(out_flash.float(), out_torch.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kv, kv_copy)


def test_fresh_prefills_of_different_lengths_share_a_causal_group() -> None:
    """Short fresh prompts are padded together and attended without a mask."""
    attn = run_against_dense([(0, 10), (0, 9), (0, 12), (0, 7), (0, 11)], heads=4, kv_heads=2)
    assert [(g.causal, g.query_rows is not None, g.mask) for g in attn.groups] == [
        (True, True, None)
    ]


class _FakeFlash:
    """Stands in for the flash backend where flash-attn cannot be imported."""

    name = "flash"


def test_auto_avoids_flash_for_a_dtype_flash_attn_cannot_compute(monkeypatch) -> None:
    """flash-attn computes in float16 / bfloat16 only (its kernels refuse float32): "auto"
    picks it only then, and a forced "flash" says why it cannot run a float32 model."""
    from engine.attention import selector

    monkeypatch.setattr(selector, "flash_available", lambda device: True)
    monkeypatch.setattr(selector, "FlashAttention", _FakeFlash)
    pick = partial(get_attention_backend, "auto", "cuda", 256)
    assert pick(dtypes=(torch.bfloat16,)).name == "flash"
    assert pick(dtypes=(torch.float16, torch.bfloat16)).name == "flash"
    assert pick(dtypes=(torch.float32,)).name == "torch"
    assert pick(dtypes=(torch.bfloat16, torch.float32)).name == "torch"
    with pytest.raises(ValueError, match="float32"):
        get_attention_backend("flash", "cuda", 256, dtypes=(torch.float32,))


def test_a_float32_engine_with_flash_sized_blocks_runs_on_the_torch_backend(
    monkeypatch, tmp_path
) -> None:
    """The runner tells the selector its dtype: a float32 checkpoint with 256-token blocks
    where flash-attn is importable gets the torch backend, not one that fails at its first
    forward pass."""
    from engine import EngineConfig, EngineCore, SamplingParams
    from engine.attention import selector
    from engine.interface import EngineRequest
    from engine.models.tiny import write_random_checkpoint

    monkeypatch.setattr(selector, "flash_available", lambda device: True)
    monkeypatch.setattr(selector, "FlashAttention", _FakeFlash)
    path = write_random_checkpoint(tmp_path / "llama", "llama", seed=0)
    core = EngineCore(EngineConfig(model=path, device="cpu", dtype="float32", block_size=256,
                                   num_kv_blocks=2, max_model_len=64))
    assert core.runner.model.attn_backend.name == "torch"
    core.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3)))
    while core.has_unfinished():
        core.step()
