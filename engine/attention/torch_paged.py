"""Pure-torch paged attention: works on any device and is the oracle for the others.

For each layer call: the new tokens' K/V are written into the paged caches at
``attn.slot_mapping``; then each sequence's whole context (cached + new, ``seq_lens[i]``
tokens) is gathered through its block table and attended causally, the sequence's
``query_lens[i]`` new tokens being the last ones of its context. Decodes (one new token)
are attended together in one padded batch; prefill chunks one sequence at a time. Scores
and softmax are in float32; grouped-query attention shares each KV head among
``heads / kv_heads`` query heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` ``[n, kv_heads, d]`` at flat slots of caches ``[blocks, bs, kv_heads, d]``."""
    kv_heads, d = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens ``[seq_len, kv_heads, d]`` a block table points at."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` ``[m, h, d]`` are the last ``m`` positions of ``k``/``v`` ``[s, kv_h, d]``."""
    m, s = q.shape[0], k.shape[0]
    visible = torch.ones(m, s, dtype=torch.bool, device=q.device).tril(diagonal=s - m)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


def batched_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[b, h, d]`` -> ``[b, h, d]``.

    Contexts are gathered padded to the longest and padded keys are masked out. Padding
    reads slots no token of this sequence wrote: the caches' owners keep every slot finite
    (zeroed at allocation and at each model switch), so a mask cancels them.
    """
    b, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = -(-max(seq_lens) // block_size)
    table = block_tables[:, :max_blocks].long()
    width = max_blocks * block_size
    visible = torch.arange(width, device=q.device)[None, :] < torch.tensor(
        seq_lens, device=q.device
    )[:, None]
    flat = table.reshape(-1)  # index_select is several times faster than k_cache[table]
    k = k_cache.index_select(0, flat).view(b, width, kv_heads, d).float()
    v = v_cache.index_select(0, flat).view(b, width, kv_heads, d).float()
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :].to(q.dtype)


class TorchPagedAttention:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``q`` ``[n, heads, d]``, ``k``/``v`` ``[n, kv_heads, d]`` -> ``[n, heads, d]``."""
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
            )
        num_tokens = sum(attn.query_lens_host)
        if q.shape[0] != num_tokens or attn.slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"metadata covers {num_tokens} tokens ({attn.slot_mapping.shape[0]} slots) "
                f"but the batch has {q.shape[0]}"
            )
        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = torch.empty_like(q)
        decode_rows: list[int] = []  # sequence index of each decode
        decode_tokens: list[int] = []  # its token's row in q
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(attn.query_lens_host, attn.seq_lens_host, strict=True)
        ):
            if query_len > seq_len:
                raise ValueError(f"sequence {i}: query_len {query_len} exceeds seq_len {seq_len}")
            end = start + query_len
            if query_len == 1:
                decode_rows.append(i)
                decode_tokens.append(start)
            else:
                table = attn.block_tables[i]
                k_ctx = gather_context(k_cache, table, seq_len)
                v_ctx = gather_context(v_cache, table, seq_len)
                out[start:end] = causal_attention(q[start:end], k_ctx, v_ctx, scale)
            start = end
        if decode_rows:
            rows = torch.tensor(decode_rows, device=q.device)
            tokens = torch.tensor(decode_tokens, device=q.device)
            out[tokens] = batched_decode_attention(
                q[tokens],
                k_cache,
                v_cache,
                attn.block_tables.index_select(0, rows),
                [attn.seq_lens_host[i] for i in decode_rows],
                scale,
            )
        return out
