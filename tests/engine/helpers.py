"""Test helpers: attention metadata, KV caches and a toy block allocator.

The real metadata comes from the model runner; these build the same structure by hand so
model and attention tests can drive the paged path directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttentionMetadata


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens are the last ``query_lens[i]`` of ``seq_lens[i]``."""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if len(table) * block_size < s_len:
            raise ValueError(f"block table {table} too short for {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


UNWRITTEN = 1e3


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (k, v) caches filled with a large finite value, so attending to an
    unwritten slot without masking it shows up as a large error (the backends may read
    such slots under a mask; the engine keeps every slot finite, as this fill does)."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [
        (torch.full(shape, UNWRITTEN, dtype=dtype), torch.full(shape, UNWRITTEN, dtype=dtype))
        for _ in range(num_layers)
    ]


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
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) for a batch of prefill chunks and decodes."""
    ids: list[int] = []
    positions: list[int] = []
    q_lens, s_lens, tables = [], [], []
    for st in steps:
        seq_len = st.num_cached + len(st.token_ids)
        tables.append(list(blocks.grow(st.seq, seq_len)))
        ids.extend(st.token_ids)
        positions.extend(range(st.num_cached, seq_len))
        q_lens.append(len(st.token_ids))
        s_lens.append(seq_len)
    meta = build_metadata(q_lens, s_lens, tables, blocks.block_size)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta
