"""The live host KV store: the ``HostKVIndex`` plus one host tensor per block.

A block's payload is a host tensor ``[num_layers, 2, block_size, kv_heads, head_dim]`` (K at
``[:, 0]``, V at ``[:, 1]``), pinned when CUDA is present. Payload lifetime: created by
``save``, freed when the index evicts or drops the block; ``load`` copies and keeps it.

Correctness never depends on this store: a block that is missing (never saved, evicted)
just ends the restorable prefix there, and the engine prefills the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from substrate.host_kv_index import HostKVIndex, HostKVKey
from substrate.layer_loads import LayerwiseKVLoad
from substrate.mover import TorchMover, block_shape
from substrate.moves import MoveKind, MoveRecord

__all__ = ["HostKVCache", "HostKVIndex", "HostKVStore"]


class HostKVStore:
    def __init__(
        self,
        capacity_bytes: int,
        pin: bool | None = None,
        kv_chunk_bytes: int = 64 * 2**20,
    ) -> None:
        self.index = HostKVIndex(capacity_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.kv_chunk_bytes = kv_chunk_bytes
        self._payloads: dict[HostKVKey, torch.Tensor] = {}
        self._movers: dict[torch.device, TorchMover] = {}
        self._loads: dict[torch.device, LayerwiseKVLoad] = {}

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, model: str, block_hashes: Sequence[int], touch: bool = True) -> int:
        return self.index.lookup(model, block_hashes, touch=touch)

    def save(
        self,
        model: str,
        block_hashes: Sequence[int],
        block_ids: Sequence[int],
        kv_cache: torch.Tensor,
        session_id: str | None = None,
    ) -> MoveRecord:
        """Copy device blocks (``block_ids[i]`` holds the block of ``block_hashes[i]``) to
        host. Blocks already stored are only touched; old blocks are evicted to make room;
        the record counts the bytes actually copied."""
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} block ids")
        if not block_hashes:
            return MoveRecord(MoveKind.KV_OFFLOAD, 0, 0.0)
        shape, dtype = block_shape(kv_cache), kv_cache.dtype
        block_nbytes = math.prod(shape) * dtype.itemsize
        result = self.index.insert_chain(model, block_hashes, block_nbytes, session_id)
        if session_id is not None:
            self.index.follow(session_id, model, block_hashes)  # what a hold keeps
        for entry in result.evicted:
            self._payloads.pop(entry.key, None)
        if not result.inserted:
            return MoveRecord(MoveKind.KV_OFFLOAD, 0, 0.0)
        first = {}
        for h, b in zip(block_hashes, block_ids, strict=True):
            first.setdefault(h, b)
        ids = [first[h] for h in result.inserted]
        try:
            host = [torch.empty(shape, dtype=dtype, pin_memory=self.pin) for _ in ids]
            record = self._mover(kv_cache).kv_offload(kv_cache, ids, host)
        except BaseException:
            for h in result.inserted:
                self.index.remove(model, h)
            raise
        for h, payload in zip(result.inserted, host, strict=True):
            self._payloads[(model, h)] = payload
        return record

    def load(
        self,
        model: str,
        block_hashes: Sequence[int],
        block_ids: Sequence[int],
        kv_cache: torch.Tensor,
    ) -> MoveRecord:
        """Copy stored blocks into device blocks ``block_ids`` now (the caller allocated them,
        after ``lookup`` said the hashes are present), through the engine's layer-wise
        restore, settled at once."""
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} block ids")
        if not block_hashes:
            return MoveRecord(MoveKind.KV_RESTORE, 0, 0.0)
        device = kv_cache.device
        if device not in self._loads:
            self._loads[device] = LayerwiseKVLoad(device, chunk_bytes=self.kv_chunk_bytes)
        loads = self._loads[device]
        loads.add(kv_cache, self.payloads(model, block_hashes), block_ids)
        record = loads.finish()
        assert record is not None
        return record

    def payloads(self, model: str, block_hashes: Sequence[int]) -> list[torch.Tensor]:
        """The stored host tensors of these blocks, for a caller that copies them itself
        (``substrate.layer_loads``); touched as a load would. KeyError when one is missing."""
        missing = [h for h in block_hashes if (model, h) not in self._payloads]
        if missing:
            raise KeyError(
                f"{model}: {len(missing)} blocks not in the host KV store, e.g. {missing[0]}"
            )
        self.index.touch(model, block_hashes)
        return [self._payloads[(model, h)] for h in block_hashes]

    def drop_model(self, model: str) -> int:
        """Forget every block of ``model``; returns the bytes freed."""
        dropped = self.index.drop_model(model)
        for entry in dropped:
            self._payloads.pop(entry.key, None)
        return sum(e.nbytes for e in dropped)

    def bind(self, model: str, kv_cache: torch.Tensor) -> HostKVCache:
        return HostKVCache(self, model, kv_cache)

    def _mover(self, kv_cache: torch.Tensor) -> TorchMover:
        device = kv_cache.device
        if device not in self._movers:
            self._movers[device] = TorchMover(device, kv_chunk_bytes=self.kv_chunk_bytes)
        return self._movers[device]


class HostKVCache:
    """The store as the engine's secondary cache, bound to one model and its device KV
    cache (``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``). Records of the
    copies it made accumulate until ``drain_records``."""

    def __init__(self, store: HostKVStore, model: str, kv_cache: torch.Tensor) -> None:
        self.store = store
        self.model = model
        self.kv_cache = kv_cache
        self._records: list[MoveRecord] = []

    def lookup(self, block_hashes: list[int]) -> int:
        return self.store.lookup(self.model, block_hashes)

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        self._records.append(self.store.load(self.model, block_hashes, block_ids, self.kv_cache))

    def save(
        self, block_hashes: list[int], block_ids: list[int], session_id: str | None = None
    ) -> MoveRecord:
        record = self.store.save(self.model, block_hashes, block_ids, self.kv_cache, session_id)
        self._records.append(record)
        return record

    def drain_records(self) -> list[MoveRecord]:
        records, self._records = self._records, []
        return records
