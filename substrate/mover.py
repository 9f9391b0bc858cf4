"""The live mover: real torch copies, each measured and reported as a ``MoveRecord``.

Deciding what lives where is the ledger's job; this only moves bytes. Each copy is timed with
``time.perf_counter`` between two device synchronisations. (The simulator's mover, which
predicts durations instead, is ``substrate.moves.RateMover``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from substrate.moves import MoveKind, MoveRecord

__all__ = ["MoveKind", "MoveRecord", "TorchMover", "block_shape", "check_blocks", "synchronize"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchMover:
    """Synchronous, measured torch copies on one device.

    ``kv_chunk_bytes`` bounds the device scratch used to gather KV blocks for an offload;
    the scratch comes from torch's allocator, outside the arena, and is released to its cache
    after each call. (Restores go through ``substrate.layer_loads``.)
    """

    def __init__(self, device: torch.device | str, kv_chunk_bytes: int = 64 * 2**20) -> None:
        self.device = torch.device(device)
        self.kv_chunk_bytes = kv_chunk_bytes

    def timed(self, kind: str, nbytes: int, fn: Callable[[], None]) -> MoveRecord:
        """Run ``fn`` between two device synchronisations and time it."""
        synchronize(self.device)
        start = time.perf_counter()
        fn()
        synchronize(self.device)
        return MoveRecord(kind, nbytes, time.perf_counter() - start)

    def copy_flat(self, kind: str, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> MoveRecord:
        """Copy the first ``nbytes`` of flat uint8 ``src`` into ``dst``."""
        if nbytes > dst.numel() or nbytes > src.numel():
            raise ValueError(
                f"{kind}: copy of {nbytes} bytes from {src.numel()} into {dst.numel()} bytes"
            )
        return self.timed(kind, nbytes, lambda: dst[:nbytes].copy_(src[:nbytes], non_blocking=True))

    def activate_from_host(
        self, weight_region: torch.Tensor, host_buffer: torch.Tensor, nbytes: int
    ) -> MoveRecord:
        return self.copy_flat(MoveKind.ACTIVATE_H2D, weight_region, host_buffer, nbytes)

    def activate_from_staging(
        self, weight_region: torch.Tensor, staging_region: torch.Tensor, nbytes: int
    ) -> MoveRecord:
        return self.copy_flat(MoveKind.ACTIVATE_D2D, weight_region, staging_region, nbytes)

    def kv_offload(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], host_blocks: Sequence[torch.Tensor]
    ) -> MoveRecord:
        """Copy blocks ``block_ids`` of ``kv_cache`` (``[num_layers, 2, num_blocks, block_size,
        kv_heads, head_dim]``) into host tensors of shape ``[num_layers, 2, block_size,
        kv_heads, head_dim]`` (one per block)."""
        check_blocks(kv_cache, block_ids, host_blocks)
        nbytes = sum(hb.numel() * hb.element_size() for hb in host_blocks)

        def run() -> None:
            for lo, hi, idx, scratch in self._chunks(kv_cache, block_ids):
                scratch.copy_(kv_cache.index_select(2, idx).movedim(2, 0))
                for i in range(lo, hi):
                    host_blocks[i].copy_(scratch[i - lo], non_blocking=True)

        return self.timed(MoveKind.KV_OFFLOAD, nbytes, run)

    def _chunks(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(lo, hi, device ids of blocks lo..hi, scratch ``[hi-lo, layers, 2, ...]``)."""
        shape = block_shape(kv_cache)
        block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        per_chunk = max(1, self.kv_chunk_bytes // max(1, block_bytes))
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for lo in range(0, len(block_ids), per_chunk):
            hi = min(lo + per_chunk, len(block_ids))
            scratch = torch.empty((hi - lo, *shape), dtype=kv_cache.dtype, device=self.device)
            yield lo, hi, ids[lo:hi], scratch


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """One block of every layer, K and V: ``[num_layers, 2, block_size, kv_heads, head_dim]``."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "a KV cache is [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], got "
            f"shape {tuple(kv_cache.shape)}"
        )
    layers, two, _, *rest = kv_cache.shape
    return (layers, two, *rest)


def check_blocks(
    kv_cache: torch.Tensor, block_ids: Sequence[int], host_blocks: Sequence[torch.Tensor]
) -> None:
    if len(block_ids) != len(host_blocks):
        raise ValueError(f"{len(block_ids)} block ids for {len(host_blocks)} host blocks")
    want = block_shape(kv_cache)
    for hb in host_blocks:
        if tuple(hb.shape) != want or hb.dtype != kv_cache.dtype:
            raise ValueError(
                f"host KV block is {hb.dtype} {tuple(hb.shape)}, the device cache needs "
                f"{kv_cache.dtype} {want}"
            )
    num_blocks = kv_cache.shape[2]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:5]} out of range for {num_blocks} device blocks")
