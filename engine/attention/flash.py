"""flash-attn backend (GPU): paged prefill/mixed batches through ``flash_attn_varlen_func``
with the caches as paged K/V and a block table, decode-only batches through
``flash_attn_with_kvcache``. ``flash_attn`` is imported lazily, on construction.

A layer's cache is ``[2, num_blocks, block_size, kv_heads, head_dim]``: ``[0]`` and ``[1]``
are the ``k_cache`` / ``v_cache`` of flash-attn's paged API (``[num_blocks, block_size,
kv_heads, head_dim]`` each, with ``block_table`` ``[num_seqs, max_blocks]`` int32). The
decode call has fixed shapes for fixed-shape metadata and syncs nothing, so it can be
captured in a CUDA graph.

flash-attn 2 requires the paged block size to be a multiple of 256; the backend checks it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_paged import write_kv

FLASH_BLOCK_MULTIPLE = 256


def import_flash_attn() -> Any:
    """The ``flash_attn`` module, or ImportError saying how to get it."""
    try:
        import flash_attn
    except ImportError as exc:
        raise ImportError(
            "the flash attention backend needs the 'flash-attn' package "
            "(pip install 'talaria[gpu]') on a CUDA device; use attention backend 'torch' otherwise"
        ) from exc
    return flash_attn


class FlashAttention:
    name = "flash"

    def __init__(self) -> None:
        fa = import_flash_attn()
        self._varlen = fa.flash_attn_varlen_func
        self._with_kvcache = fa.flash_attn_with_kvcache

    def prepare(self, attn: AttentionMetadata) -> AttentionMetadata:
        """Nothing to derive: flash-attn reads the metadata's tensors as they are."""
        return attn

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
        if attn.block_size % FLASH_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"flash-attn paged KV needs block_size divisible by {FLASH_BLOCK_MULTIPLE}, "
                f"got {attn.block_size}; use the torch backend or a larger block size"
            )
        write_kv(k, v, kv_cache, attn)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if attn.is_decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=attn.seq_lens,
                block_table=attn.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=attn.query_start_loc,
            cu_seqlens_k=attn.seq_start_loc,
            max_seqlen_q=attn.max_query_len,
            max_seqlen_k=attn.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=attn.block_tables,
        )
