"""One rank's share of a multi-model engine: the substrate and one runner per model.

Everything that touches device memory lives here, behind methods that take plain data
(model names, block hashes, block ids), so that at TP=N the same call can be executed on
every rank, each on its own arena and shard, in the same order. Scheduling state (requests,
block tables, prefix maps) stays with the controller and is identical for all ranks.

Address invariant (from the substrate): each model's parameters and buffers are views of
the one weight region, bound once at start-up; each model's KV cache is one tensor viewing
the one KV region, created once. ``activate`` only copies bytes into those addresses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.attention.selector import get_attention_backend
from engine.model_runner import ModelRunner
from engine.multi_model.catalog import CatalogEntry, build_meta_model, checkpoint_fill
from engine.parallel_context import SINGLE, ParallelContext
from substrate.host_kv_index import HostKVIndex
from substrate.instance_memory import InstanceMemory, KVSpec
from substrate.layout import align_up
from substrate.ledger import Placement, StagingState
from substrate.moves import MoveRecord, PlannedMove
from substrate.staging import StagingOutcome


def kv_region_bytes(spec: KVSpec, num_blocks: int) -> int:
    """Bytes of the KV region that ``num_blocks`` blocks of ``spec`` take (aligned as the
    arena aligns its regions)."""
    return align_up(num_blocks * spec.block_bytes)


class RankModels:
    def __init__(
        self,
        catalog: Mapping[str, CatalogEntry],
        device: torch.device,
        *,
        block_size: int,
        kv_bytes: int | None,
        num_kv_blocks: int | None,
        host_kv_bytes: int,
        staging: bool,
        weight_bytes: int | None = None,
        staging_region: str = "largest",
        attention_backend: str = "auto",
        parallel: ParallelContext = SINGLE,
        seed: int = 0,
        pin: bool | None = None,
    ) -> None:
        """Size the arena for the catalog (a shard that does not fit ``weight_bytes`` fails
        here with the sizes), load every shard into the host weight store once, bind each
        model to the weight region and view its KV caches over the KV region."""
        if kv_bytes is None:
            if num_kv_blocks is None:
                raise ValueError("give kv_bytes or num_kv_blocks to size the KV region")
            kv_bytes = max(kv_region_bytes(e.kv_spec, num_kv_blocks) for e in catalog.values())
        self.catalog = dict(catalog)
        self.device = device
        self.memory = InstanceMemory(
            device,
            {name: entry.layout for name, entry in catalog.items()},
            kv_bytes,
            host_kv_bytes,
            staging=staging,
            weight_bytes=weight_bytes,
            staging_region=staging_region,
            pin=pin,
        )
        backend = get_attention_backend(attention_backend, device=device, block_size=block_size,
                                        dtypes={e.dtype for e in catalog.values()})
        self.runners: dict[str, ModelRunner] = {}
        for name, entry in catalog.items():
            self.memory.load_model(name, checkpoint_fill(entry, parallel), entry.kv_spec)
            model = build_meta_model(entry, backend, parallel)
            self.memory.bind_module(name, model)
            kv_cache = self.memory.kv_cache(name, num_kv_blocks)
            self.runners[name] = ModelRunner(
                model,
                num_blocks=kv_cache.shape[2],
                block_size=block_size,
                vocab_size=entry.vocab_size,
                device=device,
                dtype=entry.dtype,
                kv_cache=kv_cache,
                hf_config=entry.hf_config,
                seed=seed,
            )

    # ---------------------------------------------------- ops every rank executes
    def activate(self, name: str, lend_staging: bool = False) -> MoveRecord:
        """Copy ``name``'s weights in and point its runner at its KV cache: the one over the
        KV region, or with ``lend_staging`` the larger one over the staging region too."""
        record = self.memory.activate(name, lend_staging)
        self.runners[name].bind_kv_cache(self.memory.kv_cache(name))
        return record

    @property
    def staging_lent(self) -> bool:
        """Whether the active model's KV cache spans the staging region now."""
        return self.memory.ledger.staging_lent

    @property
    def has_staging_region(self) -> bool:
        return self.memory.arena.staging_enabled

    def kv_capacity_blocks(self, name: str, lent: bool = False) -> int:
        """Device KV blocks ``name`` gets while active (``lent``: with the staging region
        lent to its KV cache; as many as without when there is none)."""
        if lent and not self.memory.arena.staging_enabled:
            lent = False
        return int(self.memory.kv_cache(name, lent=lent).shape[2])

    def stage(self, name: str, wait: bool) -> tuple[PlannedMove, MoveRecord | None]:
        """Start staging ``name``; with ``wait``, block until the copy is done and return
        its record too."""
        plan = self.memory.stage(name)
        record = self.memory.poll_staging(block=True, raise_failure=True) if wait else None
        return plan, record

    def offload_kv(
        self, name: str, block_hashes: list[int], block_ids: list[int], session_id: str | None
    ) -> MoveRecord:
        self.runners[name].settle_kv_loads()  # never copy out a block still being loaded
        return self.memory.offload_kv(name, block_hashes, block_ids, session_id)

    def can_stage(self, name: str) -> bool:
        return self.memory.ledger.can_stage(name)

    def poll_staging(self, block: bool = False, raise_failure: bool = False) -> MoveRecord | None:
        """The staging record, once, when the copy in flight is seen complete (a failed copy
        is queued for ``take_staging_outcomes``, or raised with ``raise_failure``)."""
        return self.memory.poll_staging(block=block, raise_failure=raise_failure)

    def take_staging_outcomes(self) -> list[StagingOutcome]:
        """Every staging copy seen ending since the last call, each once, whichever poll saw
        it end (``InstanceMemory.poll_staging``)."""
        return self.memory.take_staging_outcomes()

    def drop_staged(self, name: str) -> bool:
        """Forget ``name``'s completed staging copy (``InstanceMemory.drop_staged``)."""
        return self.memory.drop_staged(name)

    @property
    def staged_model(self) -> str | None:
        return self.memory.ledger.staged_model

    def restore_kv(self, name: str, block_hashes: list[int], block_ids: list[int]) -> int:
        """Queue host-stored blocks of ``name`` for device blocks ``block_ids``: the next
        forward pass of ``name`` writes them, layer group by layer group (see
        ``engine.model_runner``). Returns the bytes queued."""
        payloads = self.memory.host_kv.payloads(name, block_hashes)
        return self.runners[name].queue_kv_load(payloads, block_ids)

    def take_kv_load_records(self, name: str) -> list[MoveRecord]:
        """The records of ``name``'s KV loads settled since the last call (booked in the
        ledger as they are taken)."""
        records = self.runners[name].take_kv_load_records()
        for record in records:
            self.memory.ledger.record(record)
        return records

    def host_kv_lookup(self, name: str, block_hashes: list[int], touch: bool = False) -> int:
        """Leading hashes of the chain held by the host KV store (``touch``: mark them
        recently used, which changes eviction order: every rank must do the same)."""
        return self.memory.host_kv.lookup(name, block_hashes, touch=touch)

    def hold_host_kv(self, session_id: str, held: bool) -> None:
        """Evict the session's host KV only after every unheld block (``held=False``: as
        any other again); it changes eviction order, so every rank must do the same."""
        self.memory.host_kv.index.hold(session_id, held)

    def forget_host_kv(self, session_id: str) -> None:
        """The session is gone: the host KV it saved is no longer its (a new session under
        its id, held, holds none of it); every rank must do the same."""
        self.memory.host_kv.index.forget(session_id)

    # ------------------------------------------------------------------ queries
    def host_kv_index(self) -> HostKVIndex:
        """This rank's host KV index (every rank's holds the same blocks)."""
        return self.memory.host_kv.index

    def host_kv_usage(self) -> tuple[int, int]:
        """(bytes used, capacity) of the host KV store."""
        return self.memory.host_kv.used_bytes, self.memory.host_kv.capacity_bytes

    def move_totals(self, kind: str) -> tuple[int, float]:
        """(bytes, seconds) of every move of ``kind`` so far."""
        totals = self.memory.ledger.totals(kind)
        return totals.bytes, totals.seconds

    def placements(self, poll: bool = True) -> dict[str, Placement]:
        """Where each model is; ``poll`` first books a finished staging copy (at TP=N the
        controller polls all ranks together instead, so that no rank reports STAGED alone)."""
        return self.memory.placements() if poll else self.memory.ledger.placements()

    def staging_copy_running(self) -> bool:
        """Whether a staging copy is still in flight (the ledger waits for it, the stager
        has not finished it)."""
        memory = self.memory
        return (
            memory.ledger.staging_state is StagingState.IN_PROGRESS
            and memory.stager.state is StagingState.IN_PROGRESS
        )

    def shutdown(self) -> None:
        """Nothing to stop: this rank lives in the caller's process (see the TP proxy)."""

    def estimate(self, plan: PlannedMove) -> float | None:
        return self.memory.estimate(plan)

    @property
    def weight_region(self) -> torch.Tensor:
        return self.memory.arena.weight_region

    @property
    def kv_region(self) -> torch.Tensor:
        return self.memory.arena.kv_region
