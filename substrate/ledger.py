"""What lives where on one instance: plain-Python bookkeeping, torch-free.

The ledger plans moves (kind and bytes) and records what happened; it moves nothing. A caller
asks it for a plan, has a mover perform the plan (``TorchMover`` live: measured; ``RateMover``
in sim: predicted), then commits the plan's outcome and records the move. The recorded moves
give the instance its measured bandwidths per kind.

Tracked: the active model; the model in the staging region and the staging state, or that the
active model's KV cache has the staging region lent to it (nothing can be staged then); models in
the host weight store (bytes each); each model's KV block size; host KV bytes (from the shared
``HostKVIndex``, the single source of truth for what the host store holds); totals of every
kind of move. Device KV is not here: the engine's KV manager is its one source of truth.
Users: ``substrate.instance_memory`` (live) and ``engine.sim.memory`` (simulated).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from substrate.host_kv_index import HostKVIndex
from substrate.moves import MoveKind, MoveRecord, PlannedMove

STAGING_REGIONS = ("largest", "second")


def check_memory_settings(kv_bytes: int | None, num_kv_blocks: int | None, host_kv_bytes: int,
                          staging_region: str, blocks_key: str = "num_kv_blocks") -> None:
    """An instance's memory settings' rules (ValueError naming the setting): the multi-model
    engine's config and ``talaria serve``'s (which checks them before it starts an instance;
    ``blocks_key``: the name its file gives ``num_kv_blocks``) both call this."""
    if kv_bytes is not None and kv_bytes <= 0:
        raise ValueError(f"kv_bytes must be > 0, got {kv_bytes}")
    if num_kv_blocks is not None and num_kv_blocks < 1:
        raise ValueError(f"{blocks_key} must be >= 1, got {num_kv_blocks}")
    if host_kv_bytes < 0:
        raise ValueError(f"host_kv_bytes must be >= 0, got {host_kv_bytes}")
    if staging_region not in STAGING_REGIONS:
        raise ValueError(f"staging_region must be one of {STAGING_REGIONS}, got "
                         f"{staging_region!r}")


def staging_region_bytes(region: str, shard_sizes: list[int], weight_bytes: int) -> int:
    """The staging region's size: ``largest``, the weight region's (every shard stages);
    ``second``, the second largest shard's (the largest model loads from host; the memory
    saved is the KV region's to take: the simulator gives it to it, a live deployment sizes
    its KV region with ``kv_bytes`` or ``kv_blocks``)."""
    if region not in STAGING_REGIONS:
        raise ValueError(f"staging_region must be one of {STAGING_REGIONS}, got {region!r}")
    if region == "second" and len(shard_sizes) > 1:
        return sorted(shard_sizes)[-2]
    return weight_bytes


class Placement(enum.StrEnum):
    """Where a model's weights are (the same strings as ``engine.interface.Residency``)."""

    ACTIVE = "active"
    STAGED = "staged"
    STAGING = "staging"
    HOST = "host"
    ABSENT = "absent"


class StagingState(enum.StrEnum):
    NONE = "none"  # the staging region holds no complete model
    IN_PROGRESS = "in_progress"
    READY = "ready"


@dataclass
class MoveTotals:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes / self.seconds if self.seconds > 0 else None


class Ledger:
    def __init__(
        self,
        weight_bytes: int,
        staging_bytes: int = 0,
        host_kv: HostKVIndex | None = None,
    ) -> None:
        self.weight_bytes = weight_bytes
        self.staging_bytes = staging_bytes
        self.host_kv = host_kv if host_kv is not None else HostKVIndex(0)
        self.active_model: str | None = None
        self.staged_model: str | None = None
        self.staging_state = StagingState.NONE
        self.staging_lent = False  # the active model's KV cache spans the staging region
        self._host_models: dict[str, int] = {}
        self._kv_block_bytes: dict[str, int] = {}
        self._moves: dict[str, MoveTotals] = {}

    # ---- weights ----------------------------------------------------------------------

    def add_host_model(self, model: str, nbytes: int) -> None:
        """Record a model loaded into the host weight store; fails if its shard cannot fit
        the weight region."""
        if nbytes > self.weight_bytes:
            raise ValueError(
                f"{model}: weight shard of {nbytes} bytes does not fit the weight region "
                f"of {self.weight_bytes} bytes"
            )
        self._host_models[model] = nbytes

    def remove_host_model(self, model: str) -> None:
        self.model_bytes(model)
        if model == self.active_model:
            raise ValueError(f"{model} is active; activate another model before removing it")
        if model == self.staged_model:
            self.clear_staging()
        del self._host_models[model]

    @property
    def host_models(self) -> dict[str, int]:
        return dict(self._host_models)

    def model_bytes(self, model: str) -> int:
        try:
            return self._host_models[model]
        except KeyError:
            raise KeyError(f"model {model!r} is not in the host weight store") from None

    def placement(self, model: str) -> Placement:
        if model == self.active_model:
            return Placement.ACTIVE
        if model == self.staged_model:
            if self.staging_state is StagingState.READY:
                return Placement.STAGED
            if self.staging_state is StagingState.IN_PROGRESS:
                return Placement.STAGING
        if model in self._host_models:
            return Placement.HOST
        return Placement.ABSENT

    def placements(self) -> dict[str, Placement]:
        return {model: self.placement(model) for model in self._host_models}

    def plan_activation(self, model: str) -> PlannedMove:
        """D2D from staging when the model is staged and ready, else H2D from host; no
        move when it is already active."""
        nbytes = self.model_bytes(model)
        if model == self.active_model:
            return PlannedMove(MoveKind.NONE, 0)
        if model == self.staged_model and self.staging_state is StagingState.READY:
            return PlannedMove(MoveKind.ACTIVATE_D2D, nbytes)
        return PlannedMove(MoveKind.ACTIVATE_H2D, nbytes)

    def begin_activation(self) -> None:
        """A copy into the weight region starts: until it is committed no model is there
        whole (a copy that fails leaves torn weights; re-activating the outgoing model must
        copy again, not find it active)."""
        self.active_model = None
        self.staging_lent = False

    def commit_activation(self, model: str, lend_staging: bool = False) -> None:
        """``model`` now occupies the weight region (the KV region is re-viewed for it). The
        staging region keeps its content, unless ``lend_staging``: it is lent to the KV
        cache until the next activation (whatever it held is gone)."""
        self.model_bytes(model)
        if lend_staging:
            if self.staging_bytes == 0:
                raise ValueError(f"{model}: no staging region to lend to the KV cache")
            self.clear_staging()
        self.active_model = model
        self.staging_lent = lend_staging

    def can_stage(self, model: str) -> bool:
        """Whether ``model``'s shard fits the staging region (False without one)."""
        return 0 < self.model_bytes(model) <= self.staging_bytes

    def plan_staging(self, model: str) -> PlannedMove:
        nbytes = self.model_bytes(model)
        if self.staging_bytes == 0:
            raise ValueError(
                f"{model}: staging is disabled on this instance (staging region of 0 bytes)"
            )
        if nbytes > self.staging_bytes:
            raise ValueError(
                f"{model}: weight shard of {nbytes} bytes does not fit the staging region of "
                f"{self.staging_bytes} bytes"
            )
        if self.staging_lent:
            raise ValueError(
                f"{model}: the staging region is lent to {self.active_model}'s KV cache until "
                f"the next activation"
            )
        if model == self.staged_model and self.staging_state is not StagingState.NONE:
            return PlannedMove(MoveKind.NONE, 0)
        return PlannedMove(MoveKind.STAGE, nbytes)

    def begin_staging(self, model: str) -> None:
        self.model_bytes(model)
        self.staged_model = model
        self.staging_state = StagingState.IN_PROGRESS

    def finish_staging(self, model: str) -> None:
        if model != self.staged_model or self.staging_state is StagingState.NONE:
            raise ValueError(f"{model} is not being staged (staging holds {self.staged_model})")
        self.staging_state = StagingState.READY

    def clear_staging(self) -> None:
        self.staged_model = None
        self.staging_state = StagingState.NONE

    # ---- KV ---------------------------------------------------------------------------

    def set_kv_block_bytes(self, model: str, nbytes: int) -> None:
        """Bytes of one KV block of ``model`` (all layers, K and V) on this rank."""
        self._kv_block_bytes[model] = nbytes

    def kv_block_bytes(self, model: str) -> int:
        try:
            return self._kv_block_bytes[model]
        except KeyError:
            raise KeyError(f"no KV block size recorded for model {model!r}") from None

    def host_kv_bytes(self, model: str | None = None) -> int:
        return self.host_kv.used_bytes if model is None else self.host_kv.bytes_of(model)

    # ---- moves ------------------------------------------------------------------------

    def record(self, move: MoveRecord) -> None:
        if move.kind == MoveKind.NONE:
            return
        totals = self._moves.setdefault(move.kind, MoveTotals())
        totals.count += 1
        totals.bytes += move.bytes
        totals.seconds += move.seconds

    def totals(self, kind: str) -> MoveTotals:
        return self._moves.get(kind, MoveTotals())

    def bandwidth(self, kind: str) -> float | None:
        """Measured (or modelled) bytes per second of ``kind`` so far; None if none."""
        return self.totals(kind).bytes_per_s
