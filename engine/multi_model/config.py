"""Configuration of the live multi-model engine (one device, or one tensor-parallel group)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import check_distributed_settings
from substrate.ledger import check_memory_settings

__all__ = ["MultiModelConfig"]


@dataclass
class MultiModelConfig:
    """How to build a multi-model engine on one device (TP=1) or a tensor-parallel group.

    At ``tensor_parallel_size`` N > 1 every model is split over ranks on ``device`` and the
    next N-1 devices (CPU: N processes), meeting at ``distributed_address``:
    ``distributed_port`` (0: a free port); byte sizes (``kv_bytes``, ``weight_bytes``,
    ``host_kv_bytes``) are per rank. KV region: ``kv_bytes`` if given (each model gets as many blocks as fit, or exactly
    ``num_kv_blocks`` if that is given too), else sized so that every model gets
    ``num_kv_blocks`` blocks. ``weight_bytes`` None sizes the weight region for the largest
    shard. ``wait_for_staging``: ``stage`` blocks until the copy is done and reports its
    measured seconds (otherwise it returns at once with a predicted duration).
    ``initial_model`` is activated at start-up when given.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_bytes: int | None = None
    num_kv_blocks: int | None = None
    host_kv_bytes: int = 1 << 30
    staging: bool = True
    staging_region: str = "largest"  # substrate.instance_memory.staging_region_bytes
    weight_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    initial_model: str | None = None
    wait_for_staging: bool = False
    cuda_graphs: bool = True  # EngineConfig.cuda_graphs for every model's engine (TP=1 only)
    load_tokenizers: bool = True
    pin_host_memory: bool | None = None
    tensor_parallel_size: int = 1
    distributed_address: str = "127.0.0.1"
    distributed_port: int = 0
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_distributed_settings(
            self.tensor_parallel_size, self.distributed_port, self.distributed_timeout_s
        )
        if self.kv_bytes is None and self.num_kv_blocks is None:
            raise ValueError("MultiModelConfig needs kv_bytes or num_kv_blocks")
        check_memory_settings(self.kv_bytes, self.num_kv_blocks, self.host_kv_bytes,
                              self.staging_region)
