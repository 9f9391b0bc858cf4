"""Choosing an attention backend: "auto" (flash on CUDA when flash-attn imports and the
block size and dtype suit it, else torch), or forced "torch" / "flash"."""

from __future__ import annotations

import importlib.util
from collections.abc import Collection
from typing import Protocol

import torch

from engine.attention.flash import FLASH_BLOCK_MULTIPLE, FlashAttention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_paged import TorchPagedAttention

BACKEND_NAMES = ("auto", "torch", "flash")
# flash-attn's kernels compute in these only (they refuse float32 at the first call)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackend(Protocol):
    """``prepare`` runs once per forward pass (device ops only: it is part of what a CUDA
    graph captures); ``forward`` once per layer, with that layer's cache
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` and index."""

    name: str

    def prepare(self, attn: AttentionMetadata) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        layer: int,
    ) -> torch.Tensor: ...


def flash_available(device: torch.device | str) -> bool:
    return (
        torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    )


def get_attention_backend(
    name: str = "auto",
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    dtypes: Collection[torch.dtype] = (),
) -> AttentionBackend:
    """A backend object. ``block_size`` (optional) lets "auto" avoid flash when the KV block
    size is not a multiple of 256, which flash-attn's paged kernels reject; ``dtypes``
    (optional: the dtypes of the models it will run) lets "auto" avoid flash for a dtype
    other than float16 / bfloat16, which flash-attn's kernels reject too ("flash" then
    raises ValueError)."""
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name == "torch":
        return TorchPagedAttention()
    unsupported = sorted({str(d).removeprefix("torch.") for d in dtypes if d not in FLASH_DTYPES})
    if name == "flash":
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'flash' needs a CUDA device, got {device}")
        if unsupported:
            raise ValueError(
                f"attention backend 'flash' computes in float16 or bfloat16 only, not "
                f"{', '.join(unsupported)}; use such a dtype or attention backend 'torch'"
            )
        return FlashAttention()
    block_ok = block_size is None or block_size % FLASH_BLOCK_MULTIPLE == 0
    if block_ok and not unsupported and flash_available(device):
        try:
            return FlashAttention()
        except ImportError:
            return TorchPagedAttention()
    return TorchPagedAttention()
