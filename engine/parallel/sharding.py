"""Can a model be split over N tensor-parallel ranks? Checked before any worker starts."""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.torch_paged import TorchPagedAttention
from engine.models.registry import architecture_of, build_model
from engine.parallel_context import ParallelContext


def check_shardable(hf_config: Any, world_size: int) -> None:
    """Raise ValueError saying why ``hf_config`` cannot be split over ``world_size`` ranks.

    Query heads, linear widths and MoE widths must divide by the size; KV heads must divide
    by it or divide it (they are then replicated); the vocabulary is padded to a multiple of
    the size but must give every rank at least one real row. The model is built on the meta
    device, so the layers' own checks run without allocating weights."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world_size}")
    arch = architecture_of(hf_config)
    prefix = f"cannot shard {arch} with tensor_parallel_size={world_size}"
    vocab = int(getattr(hf_config, "vocab_size", 0))
    if vocab < world_size:
        raise ValueError(f"{prefix}: vocab_size ({vocab}) is smaller than the number of ranks")
    heads = int(getattr(hf_config, "num_attention_heads", 0))
    if heads % world_size != 0:
        raise ValueError(
            f"{prefix}: num_attention_heads ({heads}) is not divisible by {world_size}"
        )
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if kv_heads % world_size != 0 and world_size % kv_heads != 0:
        raise ValueError(
            f"{prefix}: num_key_value_heads ({kv_heads}) neither divides by {world_size} nor "
            f"divides it (replication needs {world_size} to be a multiple of it)"
        )
    for rank in (0, world_size - 1):
        try:
            with torch.device("meta"):
                build_model(
                    hf_config,
                    torch.float32,
                    ParallelContext(rank, world_size, None),
                    TorchPagedAttention(),
                )
        except ValueError as exc:
            raise ValueError(f"{prefix}: {exc}") from exc
