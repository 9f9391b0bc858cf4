"""Engine configuration (one model, one device or TP group)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class EngineConfig:
    """How to build and run one engine.

    KV cache size: ``num_kv_blocks`` if given, else ``kv_memory_fraction`` of the device
    memory that is free after the model is loaded (on a CPU: of available host memory,
    capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use).
    ``max_model_len`` None means the model's ``max_position_embeddings``.
    ``dtype`` "auto" means the checkpoint's dtype (float32 when it names none).
    At ``tensor_parallel_size`` > 1 the ranks meet at ``distributed_address``:
    ``distributed_port`` (0: a free port chosen by the OS); a collective that waits longer
    than ``distributed_timeout_s`` fails. ``cuda_graphs``: on a GPU at TP=1, decode-only
    steps are replayed from CUDA graphs (``engine.graphs.decode``). The integer, boolean and
    number settings are checked by type (a boolean is not an integer) before their ranges.
    """

    model: str | Path
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.5
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    device: str = "auto"
    seed: int = 0
    distributed_address: str = "127.0.0.1"
    distributed_port: int = 0
    distributed_timeout_s: float = 60.0
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        check_distributed_settings(
            self.tensor_parallel_size, self.distributed_port, self.distributed_timeout_s
        )

    def _check_types(self) -> None:
        """Each setting's type, before any range check compares it (a boolean is not an
        integer, nor is an integer a boolean)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) and not (value is None and name in _OPTIONAL_FIELDS):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")


_INT_FIELDS = ("max_model_len", "block_size", "num_kv_blocks", "max_num_batched_tokens",
               "max_num_seqs", "tensor_parallel_size", "seed", "distributed_port")
_OPTIONAL_FIELDS = ("max_model_len", "num_kv_blocks")
_BOOL_FIELDS = ("enable_prefix_caching", "cuda_graphs")
_NUMBER_FIELDS = ("kv_memory_fraction", "distributed_timeout_s")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_distributed_settings(tensor_parallel_size: int, port: int, timeout_s: float) -> None:
    """Validate the tensor-parallel settings shared by every engine config."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if not 0 <= port <= 65535:
        raise ValueError(f"distributed_port must be in [0, 65535], got {port}")
    if timeout_s <= 0:
        raise ValueError(f"distributed_timeout_s must be positive, got {timeout_s}")
