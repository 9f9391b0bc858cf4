"""The live mover: real torch copies, each measured and reported as a ``MoveRecord``.

Deciding what lives where is the ledger's job; this only moves bytes. Each copy is timed with
``time.perf_counter`` between two device synchronisations. (The simulator's mover, which
predicts durations instead, is ``substrate.moves.RateMover``.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from substrate.arena import KVCaches
from substrate.moves import MoveKind, MoveRecord

__all__ = ["MoveKind", "MoveRecord", "TorchMover", "synchronize"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchMover:
    """Synchronous, measured torch copies on one device.

    ``kv_chunk_bytes`` bounds the device scratch used to gather (offload) or scatter
    (restore) KV blocks; the scratch comes from torch's allocator, outside the arena, and is
    released to its cache after each call.
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
        self, kv_caches: KVCaches, block_ids: Sequence[int], host_blocks: Sequence[torch.Tensor]
    ) -> MoveRecord:
        """Copy device blocks ``block_ids`` into host tensors of shape
        ``[num_layers, 2, block_size, kv_heads, head_dim]`` (one per block)."""
        _check_blocks(kv_caches, block_ids, host_blocks)
        nbytes = sum(hb.numel() * hb.element_size() for hb in host_blocks)

        def run() -> None:
            for lo, hi, idx, scratch in self._chunks(kv_caches, block_ids):
                for layer, (k, v) in enumerate(kv_caches):
                    scratch[:, layer, 0] = k.index_select(0, idx)
                    scratch[:, layer, 1] = v.index_select(0, idx)
                for i in range(lo, hi):
                    host_blocks[i].copy_(scratch[i - lo], non_blocking=True)

        return self.timed(MoveKind.KV_OFFLOAD, nbytes, run)

    def kv_restore(
        self, host_blocks: Sequence[torch.Tensor], kv_caches: KVCaches, block_ids: Sequence[int]
    ) -> MoveRecord:
        """Copy host block tensors into device blocks ``block_ids`` (inverse of offload)."""
        _check_blocks(kv_caches, block_ids, host_blocks)
        nbytes = sum(hb.numel() * hb.element_size() for hb in host_blocks)

        def run() -> None:
            for lo, hi, idx, scratch in self._chunks(kv_caches, block_ids):
                for i in range(lo, hi):
                    scratch[i - lo].copy_(host_blocks[i], non_blocking=True)
                for layer, (k, v) in enumerate(kv_caches):
                    k.index_copy_(0, idx, scratch[:, layer, 0])
                    v.index_copy_(0, idx, scratch[:, layer, 1])

        return self.timed(MoveKind.KV_RESTORE, nbytes, run)

    def _chunks(
        self, kv_caches: KVCaches, block_ids: Sequence[int]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(lo, hi, device ids of blocks lo..hi, scratch [hi-lo, layers, 2, ...])."""
        k0 = kv_caches[0][0]
        block_bytes = 2 * len(kv_caches) * k0[0].numel() * k0.element_size()
        per_chunk = max(1, self.kv_chunk_bytes // max(1, block_bytes))
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for lo in range(0, len(block_ids), per_chunk):
            hi = min(lo + per_chunk, len(block_ids))
            scratch = torch.empty(
                (hi - lo, len(kv_caches), 2, *k0.shape[1:]), dtype=k0.dtype, device=self.device
            )
            yield lo, hi, ids[lo:hi], scratch


def _check_blocks(
    kv_caches: KVCaches, block_ids: Sequence[int], host_blocks: Sequence[torch.Tensor]
) -> None:
    if len(block_ids) != len(host_blocks):
        raise ValueError(f"{len(block_ids)} block ids for {len(host_blocks)} host blocks")
    if not kv_caches:
        raise ValueError("no KV caches given")
    k0 = kv_caches[0][0]
    want = (len(kv_caches), 2, *k0.shape[1:])
    for hb in host_blocks:
        if tuple(hb.shape) != want or hb.dtype != k0.dtype:
            raise ValueError(
                f"host KV block is {hb.dtype} {tuple(hb.shape)}, the device caches need "
                f"{k0.dtype} {want}"
            )
    num_blocks = k0.shape[0]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:5]} out of range for {num_blocks} device blocks")
