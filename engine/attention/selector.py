"""Choosing an attention backend: "auto" (flash on CUDA when flash-attn imports and the
block size suits it, else torch), or forced "torch" / "flash"."""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from engine.attention.flash import FLASH_BLOCK_MULTIPLE, FlashAttention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_paged import TorchPagedAttention

BACKEND_NAMES = ("auto", "torch", "flash")


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
    name: str = "auto", device: torch.device | str = "cpu", block_size: int | None = None
) -> AttentionBackend:
    """A backend object. ``block_size`` (optional) lets "auto" avoid flash when the KV block
    size is not a multiple of 256, which flash-attn's paged kernels reject."""
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name == "torch":
        return TorchPagedAttention()
    if name == "flash":
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'flash' needs a CUDA device, got {device}")
        return FlashAttention()
    block_ok = block_size is None or block_size % FLASH_BLOCK_MULTIPLE == 0
    if block_ok and flash_available(device):
        try:
            return FlashAttention()
        except ImportError:
            return TorchPagedAttention()
    return TorchPagedAttention()
