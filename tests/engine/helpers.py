"""Test helpers: attention metadata, KV caches and a toy block allocator.

The metadata comes from the engine's own builder (the one the model runner uses), fed from
hand-made block tables, so model and attention tests can drive the paged path directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttentionMetadata, build_attention_metadata


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens are the last ``query_lens[i]`` of ``seq_lens[i]``."""
    return build_attention_metadata(query_lens, seq_lens, block_tables, block_size, device).attn


UNWRITTEN = 1e3


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A KV cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` filled with a large
    finite value, so attending to an unwritten slot without masking it shows up as a large
    error (the backends may read such slots under a mask; the engine keeps every slot
    finite, as this fill does)."""
    shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
    return torch.full(shape, UNWRITTEN, dtype=dtype)


@dataclass
class ToyBlocks:
    """Hands out blocks in a shuffled order (so tables are non-contiguous) as sequences grow."""

    num_blocks: int
    block_size: int
    seed: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self._free)

    def grow(self, seq: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            table.append(self._free.pop())
        return table


@dataclass
class Step:
    """One scheduled sequence of a batch: its id, new token ids and context length before."""

    seq: int
    token_ids: list[int]
    num_cached: int


def batch_inputs(
    steps: list[Step], blocks: ToyBlocks
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[slice]]:
    """(input_ids, positions, metadata, rows) for a batch of prefill chunks and decodes, in
    the batch order the metadata builder chose; ``rows[i]`` are ``steps[i]``'s batch rows."""
    q_lens, s_lens, tables = [], [], []
    for st in steps:
        seq_len = st.num_cached + len(st.token_ids)
        tables.append(list(blocks.grow(st.seq, seq_len)))
        q_lens.append(len(st.token_ids))
        s_lens.append(seq_len)
    layout = build_attention_metadata(q_lens, s_lens, tables, blocks.block_size)
    ids: list[int] = []
    expected: list[int] = []
    rows: dict[int, slice] = {}
    for i in layout.order:
        st = steps[i]
        rows[i] = slice(len(ids), len(ids) + len(st.token_ids))
        ids.extend(st.token_ids)
        expected.extend(range(st.num_cached, st.num_cached + len(st.token_ids)))
    assert sorted(layout.order) == list(range(len(steps)))
    assert layout.positions.tolist() == expected
    return (
        torch.tensor(ids, dtype=torch.int64),
        layout.positions,
        layout.attn,
        [rows[i] for i in range(len(steps))],
    )


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: q [m, h, d] are the last m of k/v [s, kv_h, d]; plain SDPA with repeated KV."""
    m, heads, _ = q.shape
    s, kv_heads, _ = k.shape
    rep = heads // kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    mask = torch.ones(m, s, dtype=torch.bool).tril(diagonal=s - m)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)
