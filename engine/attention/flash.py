"""flash-attn backend (GPU): paged prefill/mixed batches through ``flash_attn_varlen_func``
with the caches as paged K/V and a block table, decode-only batches through
``flash_attn_with_kvcache``. ``flash_attn`` is imported lazily, on construction.

flash-attn 2 requires the paged block size to be a multiple of 256; the backend checks it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
        if attn.block_size % FLASH_BLOCK_MULTIPLE != 0:
            raise ValueError(
                f"flash-attn paged KV needs block_size divisible by {FLASH_BLOCK_MULTIPLE}, "
                f"got {attn.block_size}; use the torch backend or a larger block size"
            )
        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
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
        cu_seqlens_k = F.pad(attn.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=attn.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=attn.max_query_len,
            max_seqlen_k=attn.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=attn.block_tables,
        )
