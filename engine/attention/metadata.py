"""Attention metadata for one forward pass, passed explicitly (never through globals).

A batch is flattened: the new tokens of every scheduled sequence are concatenated
(a prefill chunk contributes its chunk, a decode contributes one token). Sequence i's new
tokens are ``query_start_loc[i]:query_start_loc[i+1]``; they sit at the end of its context
of ``seq_lens[i]`` tokens (cached + new), whose KV lives in the blocks
``block_tables[i, :ceil(seq_lens[i] / block_size)]``. Before attention, each layer writes
the new tokens' K and V into the cache at ``slot_mapping`` (block_id * block_size + offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host-side copies (lists) so backends need no device->host sync to loop over seqs.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
