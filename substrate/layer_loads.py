"""Host KV blocks restored into a device KV cache group of layers by group of layers, inside
the forward pass that first reads them, so that on a GPU the copy overlaps the compute.

Lifetime of a load (who waits for what):
- ``add`` is called while a step is scheduled: the blocks are already allocated and in the
  prefix map, but hold no KV yet. On CUDA every group is copied there, on a side stream
  that first waits for the compute stream (a freshly allocated block may be one that a
  kernel still in flight reads), through a scratch buffer of at most ``chunk_bytes`` into
  the cache, each group recording an event.
- ``before_layer(l)``, called by the forward before layer ``l`` touches the cache, makes
  every pending group that starts at or before ``l`` hold its KV: on CUDA the compute
  stream waits for that group's event; without CUDA the group is copied right then (one
  stream has nothing to overlap with). So group g+1 crosses the host link while group g's
  layers compute, and only the first group's copy is exposed.
- ``finish`` writes whatever is still pending (a forward that raised, or one that never
  ran) and returns the record of the copies. Between two steps no block of the cache is
  left half-loaded.

A group spans ``ceil(num_layers / num_groups)`` layers: each block's host payload is
layer-major (``[num_layers, 2, block_size, kv_heads, head_dim]``), so one group of one block
is one contiguous copy, and a load issues ``num_blocks * num_groups`` host copies rather
than ``num_blocks * num_layers``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from substrate.mover import check_blocks
from substrate.moves import KV_RESTORE_LAYER_GROUPS, MoveKind, MoveRecord

__all__ = ["LayerwiseKVLoad", "layer_groups"]


def layer_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """``[(first layer, end layer), ...]``: at most ``num_groups`` consecutive groups of
    equal size (the last may be shorter) covering ``range(num_layers)``."""
    if num_layers < 1 or num_groups < 1:
        raise ValueError(f"need num_layers >= 1 and num_groups >= 1, got {num_layers}, {num_groups}")
    size = math.ceil(num_layers / num_groups)
    return [(lo, min(lo + size, num_layers)) for lo in range(0, num_layers, size)]


@dataclass(eq=False)  # identity: its fields hold tensors
class _Group:
    """Layers ``first..end`` of the blocks of one ``add``."""

    first: int
    end: int
    block_ids: list[int]
    host_blocks: Sequence[torch.Tensor]
    event: torch.cuda.Event | None = None  # CUDA: recorded once the side stream wrote it


class LayerwiseKVLoad:
    def __init__(
        self,
        device: torch.device,
        num_groups: int = KV_RESTORE_LAYER_GROUPS,
        chunk_bytes: int = 64 * 2**20,
    ) -> None:
        if num_groups < 1 or chunk_bytes < 1:
            raise ValueError(f"need num_groups >= 1 and chunk_bytes >= 1, got {num_groups}, "
                             f"{chunk_bytes}")
        self.device = torch.device(device)
        self.num_groups = num_groups
        self.chunk_bytes = chunk_bytes
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._kv_cache: torch.Tensor | None = None
        self._groups: list[_Group] = []
        self._nbytes = 0
        self._seconds = 0.0  # copies timed on the host (no CUDA)
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: per add

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    def add(
        self, kv_cache: torch.Tensor, host_blocks: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> int:
        """Queue host block payloads (``[num_layers, 2, block_size, kv_heads, head_dim]``,
        pinned for an asynchronous copy) for device blocks ``block_ids`` of ``kv_cache``;
        returns the bytes queued."""
        check_blocks(kv_cache, block_ids, host_blocks)
        if not block_ids:
            return 0
        if self._kv_cache is not None and self.pending and kv_cache is not self._kv_cache:
            raise RuntimeError("KV loads are pending on another KV cache; finish them first")
        self._kv_cache = kv_cache
        groups = [
            _Group(lo, hi, list(block_ids), list(host_blocks))
            for lo, hi in layer_groups(kv_cache.shape[0], self.num_groups)
        ]
        if self._stream is not None:
            self._issue(groups)
        self._groups.extend(groups)
        nbytes = sum(hb.numel() * hb.element_size() for hb in host_blocks)
        self._nbytes += nbytes
        return nbytes

    def before_layer(self, layer: int) -> None:
        """Make every queued group that starts at or before ``layer`` hold its KV."""
        while self._groups:
            ready = next((g for g in self._groups if g.first <= layer), None)
            if ready is None:
                return
            self._settle(ready)
            self._groups.remove(ready)  # only once written: a failed copy stays queued

    def finish(self) -> MoveRecord | None:
        """Write what is still queued; the record of every copy since the last ``finish``
        (None when there was none)."""
        try:
            while self._groups:
                self._settle(self._groups[0])
                self._groups.pop(0)
            if not self._nbytes:
                return None
            seconds = self._seconds
            if self._spans:
                self._spans[-1][1].synchronize()
                seconds = sum(start.elapsed_time(end) for start, end in self._spans) / 1e3
            return MoveRecord(MoveKind.KV_RESTORE, self._nbytes, seconds)
        finally:
            if not self._groups:
                self._nbytes, self._seconds, self._spans = 0, 0.0, []

    # ------------------------------------------------------------------ copies
    def _copy(self, group: _Group) -> None:
        """Copy the group's layers of its blocks into the cache, through scratch chunks of at
        most ``chunk_bytes`` (on the current stream)."""
        assert self._kv_cache is not None
        kv_cache, layers = self._kv_cache, group.end - group.first
        first = group.host_blocks[0][group.first : group.end]
        per_chunk = max(1, self.chunk_bytes // (first.numel() * first.element_size()))
        for lo in range(0, len(group.block_ids), per_chunk):
            hosts = group.host_blocks[lo : lo + per_chunk]
            ids = torch.tensor(group.block_ids[lo : lo + per_chunk], dtype=torch.long)
            if self._stream is not None:
                ids = ids.pin_memory()
            ids = ids.to(self.device, non_blocking=True)
            scratch = torch.empty((len(hosts), *first.shape), dtype=first.dtype, device=self.device)
            for i, hb in enumerate(hosts):
                scratch[i].copy_(hb[group.first : group.end], non_blocking=True)
            for offset in range(layers):
                kv_cache[group.first + offset].index_copy_(1, ids, scratch[:, offset].movedim(0, 1))

    def _issue(self, groups: list[_Group]) -> None:
        """CUDA: copy every group on the side stream now, an event after each."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            for group in groups:
                self._copy(group)
                group.event = torch.cuda.Event(enable_timing=True)
                group.event.record(self._stream)
        self._spans.append((start, groups[-1].event))  # type: ignore[arg-type]

    def _settle(self, group: _Group) -> None:
        """Make the group's KV visible to the current stream: wait for its copy on CUDA,
        copy it now otherwise."""
        if group.event is not None:
            torch.cuda.current_stream(self.device).wait_event(group.event)
            return
        start = time.perf_counter()
        self._copy(group)
        self._seconds += time.perf_counter() - start
