"""Host KV blocks restored into a device KV cache group of layers by group of layers, inside
the forward pass that first reads them, so that on a GPU the copy overlaps the compute.

Lifetime of a load (who waits for what):
- ``add`` is called while a step is scheduled: the blocks are already allocated and in the
  prefix map, but hold no KV yet. On CUDA every group's host-to-device copy is issued there,
  on a side stream that first waits for the compute stream (a freshly allocated block may be
  one an earlier kernel in flight still reads), each group recording an event.
- ``before_layer(l)``, called by the forward before layer ``l`` touches the cache, writes
  every pending group that starts at or before ``l`` into the cache (on CUDA after making the
  compute stream wait for that group's event; without CUDA the group is copied right then:
  one stream has nothing to overlap with). So the copy of group g+1 runs while group g's
  layers compute, and only the first group's copy is exposed.
- ``finish`` writes whatever is still pending (a forward that raised, or one that never ran)
  and returns the record of the copies. Between two steps no block of the cache is left
  half-loaded.

A group spans ``ceil(num_layers / num_groups)`` layers: each block's host payload is
layer-major (``[num_layers, 2, block_size, kv_heads, head_dim]``), so one group of one block
is one contiguous copy, and a load issues ``num_blocks * num_groups`` copies rather than
``num_blocks * num_layers``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from substrate.mover import block_shape
from substrate.moves import KV_RESTORE_LAYER_GROUPS, MoveKind, MoveRecord

__all__ = ["LayerwiseKVLoad", "layer_groups"]


def layer_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """``[(first layer, end layer), ...]``: at most ``num_groups`` consecutive groups of
    equal size (the last may be shorter) covering ``range(num_layers)``."""
    if num_layers < 1 or num_groups < 1:
        raise ValueError(f"need num_layers >= 1 and num_groups >= 1, got {num_layers}, {num_groups}")
    size = math.ceil(num_layers / num_groups)
    return [(lo, min(lo + size, num_layers)) for lo in range(0, num_layers, size)]


@dataclass
class _Group:
    """One group of layers of one ``add``: ``scratch`` is ``[blocks, layers, 2, ...]``."""

    first: int
    end: int
    block_ids: torch.Tensor
    host_blocks: Sequence[torch.Tensor]
    scratch: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


class LayerwiseKVLoad:
    def __init__(self, device: torch.device, num_groups: int = KV_RESTORE_LAYER_GROUPS) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.device = torch.device(device)
        self.num_groups = num_groups
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._kv_cache: torch.Tensor | None = None
        self._groups: list[_Group] = []
        self._nbytes = 0
        self._seconds = 0.0  # copies timed on the host (no CUDA)
        self._first_event: torch.cuda.Event | None = None
        self._last_event: torch.cuda.Event | None = None

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    def add(
        self, kv_cache: torch.Tensor, host_blocks: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> int:
        """Queue host block payloads (``[num_layers, 2, block_size, kv_heads, head_dim]``,
        pinned for an asynchronous copy) for device blocks ``block_ids`` of ``kv_cache``;
        returns the bytes queued."""
        shape = block_shape(kv_cache)
        if len(host_blocks) != len(block_ids):
            raise ValueError(f"{len(block_ids)} block ids for {len(host_blocks)} host blocks")
        for hb in host_blocks:
            if tuple(hb.shape) != shape or hb.dtype != kv_cache.dtype:
                raise ValueError(
                    f"host block {tuple(hb.shape)} {hb.dtype} does not match the KV cache's "
                    f"blocks {shape} {kv_cache.dtype}"
                )
        if not block_ids:
            return 0
        if self._kv_cache is not None and self.pending and kv_cache is not self._kv_cache:
            raise RuntimeError("KV loads are pending on another KV cache; finish them first")
        self._kv_cache = kv_cache
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        groups = [
            _Group(lo, hi, ids, host_blocks) for lo, hi in layer_groups(shape[0], self.num_groups)
        ]
        if self._stream is not None:
            self._issue(groups)
        self._groups.extend(groups)
        nbytes = sum(hb.numel() * hb.element_size() for hb in host_blocks)
        self._nbytes += nbytes
        return nbytes

    def before_layer(self, layer: int) -> None:
        """Make every queued group that starts at or before ``layer`` hold its KV."""
        if not self._groups:
            return
        ready = [g for g in self._groups if g.first <= layer]
        if ready:
            self._groups = [g for g in self._groups if g.first > layer]
            self._write(ready)

    def finish(self) -> MoveRecord | None:
        """Write what is still queued; the record of every copy since the last ``finish``
        (None when there was none)."""
        if self._groups:
            groups, self._groups = self._groups, []
            self._write(groups)
        if not self._nbytes:
            return None
        seconds = self._seconds
        if self._first_event is not None and self._last_event is not None:
            self._last_event.synchronize()
            seconds = self._first_event.elapsed_time(self._last_event) / 1e3
        record = MoveRecord(MoveKind.KV_RESTORE, self._nbytes, seconds)
        self._nbytes, self._seconds = 0, 0.0
        self._first_event = self._last_event = None
        return record

    # ------------------------------------------------------------------ copies
    def _fill(self, group: _Group) -> None:
        """Copy the group's layers of every host block into a device scratch tensor."""
        first = group.host_blocks[0][group.first : group.end]
        group.scratch = torch.empty(
            (len(group.host_blocks), *first.shape), dtype=first.dtype, device=self.device
        )
        for i, hb in enumerate(group.host_blocks):
            group.scratch[i].copy_(hb[group.first : group.end], non_blocking=True)

    def _issue(self, groups: list[_Group]) -> None:
        """CUDA: start every group's copy on the side stream, an event after each."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if self._first_event is None:
                self._first_event = torch.cuda.Event(enable_timing=True)
                self._first_event.record(self._stream)
            for group in groups:
                self._fill(group)
                group.event = torch.cuda.Event(enable_timing=True)
                group.event.record(self._stream)
                self._last_event = group.event

    def _write(self, groups: list[_Group]) -> None:
        """Scatter the groups' scratch into the KV cache on the current stream."""
        assert self._kv_cache is not None
        start = time.perf_counter()
        for group in groups:
            if group.event is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(group.event)
                assert group.scratch is not None
                group.scratch.record_stream(compute)  # allocated on the side stream
            else:
                self._fill(group)
            assert group.scratch is not None
            for layer in range(group.first, group.end):
                src = group.scratch[:, layer - group.first].movedim(0, 1)
                self._kv_cache[layer].index_copy_(1, group.block_ids, src)
            group.scratch = None
        if self._stream is None:
            self._seconds += time.perf_counter() - start
