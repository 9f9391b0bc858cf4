"""One rank's memory substrate, assembled: arena, host weight store, stager, host KV store,
ledger and mover, kept consistent through the plan -> move -> commit -> record cycle.

The multi-model engine drives this; it decides *when* (no running requests before an
activation, which sessions to offload), this decides *how* and keeps the books.

Address invariant: every model's parameters are views of the same weight region, bound once
(``bind_module``); every model's KV cache is one tensor viewing the same KV region, created
once per model and returned again on each activation (``kv_cache``), so addresses a model's
captured CUDA graphs hold stay valid across any number of switches. A slot that lends the
staging region to the KV cache uses the model's second, larger view from the same base
address (two tensors per model, each created once; a graph is captured per view, as the
layers' offsets differ between them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from substrate.arena import DeviceArena
from substrate.host_kv import HostKVCache, HostKVStore
from substrate.host_weights import FillFn, HostWeightStore
from substrate.layout import WeightLayout, dtype_size
from substrate.ledger import Ledger, Placement, StagingState, staging_region_bytes
from substrate.mover import TorchMover
from substrate.moves import MoveKind, MoveRecord, PlannedMove
from substrate.staging import Stager, StagingOutcome

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KVSpec:
    """A model's per-rank KV cache shape:
    ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.kv_heads
            * self.head_dim
            * dtype_size(self.dtype)
        )


class InstanceMemory:
    def __init__(
        self,
        device: torch.device | str,
        layouts: Mapping[str, WeightLayout],
        kv_bytes: int,
        host_kv_bytes: int,
        staging: bool = True,
        weight_bytes: int | None = None,
        staging_region: str = "largest",
        pin: bool | None = None,
    ) -> None:
        """Size and allocate the arena for the catalog ``layouts`` (model -> this rank's
        layout). ``weight_bytes`` (default: the largest layout) fixes the weight region; a
        model that does not fit it fails here, with the sizes. ``staging_region``: how large
        the staging region is, when ``staging`` (``staging_region_bytes``)."""
        if not layouts:
            raise ValueError("InstanceMemory needs at least one model layout")
        sizes = sorted(layout.total_bytes for layout in layouts.values())
        weight_bytes = sizes[-1] if weight_bytes is None else weight_bytes
        staging_bytes = staging_region_bytes(staging_region, sizes, weight_bytes) if staging else 0
        self.arena = DeviceArena(device, weight_bytes, staging_bytes, kv_bytes)
        for name, layout in layouts.items():
            self.arena.check_fits(layout, name)
        self.layouts = dict(layouts)
        self.hosts = HostWeightStore(pin=pin)
        self.host_kv = HostKVStore(host_kv_bytes, pin=pin)
        self.ledger = Ledger(self.arena.weight_bytes, self.arena.staging_bytes, self.host_kv.index)
        self.mover = TorchMover(self.arena.device)
        self.stager = Stager(self.arena.staging_region)
        self._staging_outcomes: list[StagingOutcome] = []
        self._kv_specs: dict[str, KVSpec] = {}
        self._kv_caches: dict[tuple[str, bool], torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @property
    def active_model(self) -> str | None:
        return self.ledger.active_model

    def load_model(self, name: str, fill: FillFn, kv_spec: KVSpec) -> int:
        """Load ``name``'s shard into the host weight store through ``fill`` (see
        ``HostWeightStore.add_model``) and record its KV shape. Returns its bytes."""
        layout = self._layout(name)
        if (
            self.arena.kv_num_blocks(
                kv_spec.num_layers,
                kv_spec.block_size,
                kv_spec.kv_heads,
                kv_spec.head_dim,
                kv_spec.dtype,
            )
            <= 0
        ):
            raise ValueError(
                f"{name}: the KV region of {self.arena.kv_bytes} bytes holds no KV block of "
                f"{kv_spec.block_bytes} bytes"
            )
        nbytes = self.hosts.add_model(name, layout, fill)
        self.ledger.add_host_model(name, nbytes)
        self.ledger.set_kv_block_bytes(name, kv_spec.block_bytes)
        self._kv_specs[name] = kv_spec
        return nbytes

    def bind_module(self, name: str, module: nn.Module) -> None:
        """Make ``module``'s parameters views of the weight region (once per model)."""
        self.arena.bind_module(module, self._layout(name))

    def kv_cache(
        self, name: str, num_blocks: int | None = None, lent: bool | None = None
    ) -> torch.Tensor:
        """``name``'s KV cache over the KV region (as many blocks as fit by default), or over
        the KV and staging regions when ``lent`` (every block that fits). ``lent=None``: as
        ``name`` is now, lent while it is the active model and the staging region is lent to
        it. The same tensor on every call for the same model and lending."""
        if lent is None:
            lent = self.ledger.staging_lent and name == self.ledger.active_model
        key = (name, lent)
        if key not in self._kv_caches:
            spec = self._kv_spec(name)
            self._kv_caches[key] = self.arena.kv_cache(
                spec.num_layers,
                None if lent else num_blocks,
                spec.block_size,
                spec.kv_heads,
                spec.head_dim,
                spec.dtype,
                lent=lent,
            )
        return self._kv_caches[key]

    def activate(self, name: str, lend_staging: bool = False) -> MoveRecord:
        """Copy ``name``'s weights into the weight region: D2D when staged (waiting for a
        staging of this very model still in flight), else H2D. The caller must have no
        running requests of the outgoing model and must treat its device KV as gone (the KV
        region is zeroed). ``lend_staging``: until the next activation, ``name``'s KV cache
        spans the staging region too (``kv_cache``); a staging copy in flight is waited for
        and whatever the region held is dropped, and nothing can be staged meanwhile."""
        if lend_staging and not self.arena.staging_enabled:
            raise ValueError(f"{name}: no staging region to lend to the KV cache")
        self.poll_staging(block=self.ledger.staged_model == name)
        plan = self.ledger.plan_activation(name)
        relent = lend_staging != self.ledger.staging_lent
        if plan.kind != MoveKind.NONE:
            self.ledger.begin_activation()
        if plan.kind == MoveKind.ACTIVATE_D2D:
            record = self.mover.activate_from_staging(
                self.arena.weight_region, self.arena.staging_region, plan.bytes
            )
        elif plan.kind == MoveKind.ACTIVATE_H2D:
            record = self.mover.activate_from_host(
                self.arena.weight_region, self.hosts.get(name).buffer, plan.bytes
            )
        else:
            record = MoveRecord(MoveKind.NONE, 0, 0.0)
        if lend_staging:
            self._reclaim_staging()
        if plan.kind != MoveKind.NONE or relent:
            # the outgoing KV (and staged weights, when lent) is gone; keep every slot finite
            self.arena.clear_kv(lent=lend_staging)
        self.ledger.commit_activation(name, lend_staging)
        self.ledger.record(record)
        return record

    def _reclaim_staging(self) -> None:
        """Wait for a staging copy in flight (booked: it crossed the host link) and forget
        what the region holds. A copy that failed staged nothing: it costs its D2D switch,
        not this activation (``poll_staging`` logs and queues it)."""
        self.poll_staging(block=True)
        self.stager.invalidate()
        self.ledger.clear_staging()

    def stage(self, name: str) -> PlannedMove:
        """Start copying ``name`` into the staging region in the background (no-op if it is
        staged or being staged). Returns what will move; ``estimate`` gives a duration."""
        self.poll_staging()
        plan = self.ledger.plan_staging(name)
        if plan.kind == MoveKind.STAGE:
            self.poll_staging(block=True)  # one copy at a time: finish (and book) the last
            self.stager.start(name, self.hosts.get(name).buffer, plan.bytes)
            self.ledger.begin_staging(name)
        return plan

    def poll_staging(self, block: bool = False, raise_failure: bool = False) -> MoveRecord | None:
        """Bring the ledger up to date with the stager (waiting for a copy in flight if
        ``block``); returns the staging record when this call saw the copy complete. A copy
        that failed staged nothing (the ledger holds no staged model; its model activates
        from host): it is logged, or raised as RuntimeError with ``raise_failure`` (the
        caller waits for the copy it asked for).

        Invariant: every copy that ends is queued exactly once for
        ``take_staging_outcomes``, whichever poll saw it end (this method is called from
        inside ``activate`` and ``stage`` too, whose callers never see its return), except a
        failure raised to the caller, who hears of it that way instead."""
        if self.ledger.staging_state is not StagingState.IN_PROGRESS:
            return None
        if not block and self.stager.state is StagingState.IN_PROGRESS:
            return None
        name = self.ledger.staged_model
        try:
            record = self.stager.wait()
        except RuntimeError:
            self.ledger.clear_staging()
            if raise_failure:
                raise
            log.warning("staging_copy_failed", model=name)
            if name is not None:
                self._staging_outcomes.append(StagingOutcome(name, None))
            return None
        if record is None or name is None:
            self.ledger.clear_staging()
            return None
        self.ledger.finish_staging(name)
        self.ledger.record(record)
        self._staging_outcomes.append(StagingOutcome(name, record))
        return record

    def drop_staged(self, name: str) -> bool:
        """Forget ``name``'s completed staging copy; whether this rank held one. At TP=N a
        copy that failed on another rank is dropped here too: no rank holds a model staged
        alone, so the ranks' ledgers agree (``name`` activates from host on every rank) and
        a later ``stage`` of it starts a copy on every rank, whose outcomes then pair up. A
        copy in flight, or another model's, is kept."""
        ledger = self.ledger
        if ledger.staged_model != name or ledger.staging_state is not StagingState.READY:
            return False
        self.stager.invalidate()
        ledger.clear_staging()
        return True

    def take_staging_outcomes(self) -> list[StagingOutcome]:
        """The staging copies seen ending since the last call, in order (see
        ``poll_staging``); polls nothing itself."""
        outcomes, self._staging_outcomes = self._staging_outcomes, []
        return outcomes

    @property
    def staging_outcomes_pending(self) -> bool:
        """Whether ``take_staging_outcomes`` has something to give."""
        return bool(self._staging_outcomes)

    def estimate(self, plan: PlannedMove) -> float | None:
        """Seconds ``plan`` should take at the bandwidth measured so far for its kind
        (staging falls back to the H2D rate: the same link); None before any measurement."""
        if plan.kind == MoveKind.NONE or plan.bytes == 0:
            return 0.0
        rate = self.ledger.bandwidth(plan.kind)
        if rate is None and plan.kind == MoveKind.STAGE:
            rate = self.ledger.bandwidth(MoveKind.ACTIVATE_H2D)
        return plan.bytes / rate if rate else None

    def placements(self) -> dict[str, Placement]:
        self.poll_staging()
        return self.ledger.placements()

    def host_kv_cache(self, name: str) -> HostKVCache:
        """The host KV store as ``name``'s secondary cache, over its KV cache."""
        return self.host_kv.bind(name, self.kv_cache(name))

    def offload_kv(
        self,
        name: str,
        block_hashes: list[int],
        block_ids: list[int],
        session_id: str | None = None,
    ) -> MoveRecord:
        """Save device blocks of ``name`` (chain order) to the host KV store."""
        record = self.host_kv.save(name, block_hashes, block_ids, self.kv_cache(name), session_id)
        self.ledger.record(record)
        return record

    def _layout(self, name: str) -> WeightLayout:
        try:
            return self.layouts[name]
        except KeyError:
            raise KeyError(f"model {name!r} is not in this instance's catalog") from None

    def _kv_spec(self, name: str) -> KVSpec:
        try:
            return self._kv_specs[name]
        except KeyError:
            raise KeyError(f"model {name!r} has not been loaded (no KV shape known)") from None
