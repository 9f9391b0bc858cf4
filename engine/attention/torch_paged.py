"""Pure-torch paged attention: works on any device and is the oracle for the others.

A layer's cache is ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K, V), a view of the
model's one KV tensor. Each layer first writes the new tokens' K/V at ``slot_mapping``; then
each group of sequences (``AttentionMetadata.groups``, contiguous in the batch) is attended
in one batched call: the group's blocks are gathered once for K and V together (or, for a
decode group that continues one of the previous step's, its kept context only takes the new
tokens: ``engine.attention.decode_context``), its queries
are its rows of the batch (gathered into a padded ``[seqs, query_width]`` batch only when
its members' chunks differ in length), and an additive mask (built once per step by
``prepare``) hides keys a query may not see, including every padding key. A group of fresh
prefills (no cached context) needs no mask: plain causal attention is exact for its real
queries, and its padding queries' outputs are dropped. Scores and
softmax are in float32; grouped-query attention shares each KV head among
``heads / kv_heads`` query heads.

Padding keys read slots no token of the sequence wrote: the caches' owners keep every slot
finite (zeroed at allocation and at each model switch), so the mask cancels them. The forward
pass runs no host synchronisation and no data-dependent shape, so it can be captured in a
CUDA graph when the metadata has fixed shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionGroup, AttentionMetadata, with_group_masks


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata
) -> None:
    """Store ``k``/``v`` ``[n, kv_heads, d]`` at ``attn.slot_mapping`` of a layer's cache."""
    if attn.write_rows is not None:
        k = k.index_select(0, attn.write_rows)
        v = v.index_select(0, attn.write_rows)
    two, num_blocks, block_size, kv_heads, d = kv_cache.shape
    flat = kv_cache.view(two, num_blocks * block_size, kv_heads, d)
    flat[0].index_copy_(0, attn.slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, attn.slot_mapping, v.to(kv_cache.dtype))


def group_mask(group: AttentionGroup, block_size: int) -> torch.Tensor:
    """Additive float32 mask ``[seqs, 1, query_width, num_blocks * block_size]``: query j of
    a sequence sits at position ``seq_len - query_len + j`` and sees keys up to it."""
    device = group.seq_lens.device
    keys = torch.arange(group.num_blocks * block_size, device=device)
    offsets = torch.arange(group.query_width, device=device)
    query_pos = (group.seq_lens - group.query_lens)[:, None] + offsets[None, :]
    visible = keys[None, None, :] <= query_pos[:, :, None]
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    return mask.masked_fill_(~visible, float("-inf")).unsqueeze(1)


def group_context(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values ``[seqs, kv_heads, >= num_blocks * block_size, d]`` for
    this layer, after this step's tokens were written to the paged cache: gathered from the
    cache, or the group's kept context (head-major) with the new tokens appended."""
    b, (_, kv_heads, d) = group.num_seqs, kv_cache.shape[2:]
    if group.context is None:
        gathered = kv_cache.index_select(1, group.block_ids).view(2, b, -1, kv_heads, d)
        return gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)
    kept = group.context[layer]
    if group.context_fresh:
        gathered = kv_cache.index_select(1, group.block_ids).view(2, b, -1, kv_heads, d)
        kept[:, :, :, : gathered.shape[2]].copy_(gathered.transpose(2, 3))
    else:
        assert group.append_slots is not None
        rows = slice(group.token_start, group.token_start + group.num_tokens)
        flat = kept.view(2, -1, d)
        flat[0].index_copy_(0, group.append_slots, k[rows].reshape(-1, d).to(kept.dtype))
        flat[1].index_copy_(0, group.append_slots, v[rows].reshape(-1, d).to(kept.dtype))
    return kept[0], kept[1]


def attend_group(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one group's tokens over its keys/values ``[seqs, kv_heads, >= width,
    d]``: ``[group.num_tokens, heads, d]`` float32."""
    if group.needs_mask and group.mask is None:
        raise ValueError("attention group has no mask: call the backend's prepare() first")
    b, m, heads, d = group.num_seqs, group.query_width, q.shape[1], q.shape[2]
    width = group.num_blocks * block_size
    if group.query_rows is None:
        queries = q[group.token_start : group.token_start + group.num_tokens]
    else:
        queries = q.index_select(0, group.query_rows)
    queries = queries.float().view(b, m, heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries,
        keys[:, :, :width].float(),
        values[:, :, :width].float(),
        attn_mask=group.mask,
        is_causal=not group.needs_mask,
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(b * m, heads, d)
    return out if group.out_rows is None else out.index_select(0, group.out_rows)


class TorchPagedAttention:
    name = "torch"

    def prepare(self, attn: AttentionMetadata) -> AttentionMetadata:
        """Once per forward pass: the masks of the groups that need one (device ops only)."""
        if all(g.mask is not None or not g.needs_mask for g in attn.groups):
            return attn
        masks = [group_mask(g, attn.block_size) if g.needs_mask else None for g in attn.groups]
        return with_group_masks(attn, masks)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        layer: int,
    ) -> torch.Tensor:
        """``q`` ``[n, heads, d]``, ``k``/``v`` ``[n, kv_heads, d]`` -> ``[n, heads, d]``;
        ``kv_cache`` is layer ``layer``'s."""
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
            )
        if q.shape[0] != attn.num_tokens:
            raise ValueError(
                f"metadata covers {attn.num_tokens} tokens but the batch has {q.shape[0]}"
            )
        write_kv(k, v, kv_cache, attn)
        block_size = kv_cache.shape[2]
        parts = [
            attend_group(q, *group_context(k, v, kv_cache, g, layer), g, block_size, scale)
            for g in attn.groups
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.to(q.dtype)
