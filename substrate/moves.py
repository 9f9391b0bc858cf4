"""Byte movements as records, and the mover that predicts their durations (torch-free).

Every move, real or simulated, is reported as ``MoveRecord(kind, bytes, seconds)``.
``TorchMover`` (substrate.mover) performs and measures real copies; ``RateMover`` performs
nothing and predicts the duration from bandwidths (fed from device specs in the simulator,
or from bandwidths the ledger measured live).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class MoveKind:
    """Kinds of byte movement (the same strings as ``engine.interface.MoveReport.kind``)."""

    ACTIVATE_H2D = "activate_h2d"  # host weight store -> weight region
    ACTIVATE_D2D = "activate_d2d"  # staging region -> weight region
    STAGE = "stage"  # host weight store -> staging region
    KV_OFFLOAD = "kv_offload"  # device KV blocks -> host KV store
    KV_RESTORE = "kv_restore"  # host KV store -> device KV blocks
    NONE = "none"  # nothing to move (e.g. activating the active model)

    ALL = (ACTIVATE_H2D, ACTIVATE_D2D, STAGE, KV_OFFLOAD, KV_RESTORE)

# A KV restore is copied in this many groups of layers inside the forward pass that reads it
# (``substrate.layer_loads``; the simulator's ``offload`` tier prices the same pipeline):
# four leave a quarter of the copy exposed, for four times a whole-block restore's copies.
KV_RESTORE_LAYER_GROUPS = 4


@dataclass(frozen=True)
class MoveRecord:
    kind: str
    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class PlannedMove:
    """A move the ledger has decided on, before anyone performs or times it."""

    kind: str
    bytes: int


class RateMover:
    """Predicts durations from bandwidths (bytes/s per kind) plus a fixed latency per
    non-empty move; moves nothing."""

    def __init__(self, bandwidths: Mapping[str, float], latency_s: float = 0.0) -> None:
        for kind, bw in bandwidths.items():
            if bw <= 0:
                raise ValueError(f"bandwidth for {kind!r} must be > 0, got {bw}")
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self.bandwidths = dict(bandwidths)
        self.latency_s = latency_s

    @classmethod
    def for_links(
        cls, host_link_bytes_per_s: float, d2d_bytes_per_s: float, latency_s: float = 0.0
    ) -> RateMover:
        """Every host<->device kind at the host-link rate, activation from staging at the
        device-to-device rate (e.g. from a ``substrate.devices.DeviceSpec``, per GPU)."""
        host_kinds = (
            MoveKind.ACTIVATE_H2D,
            MoveKind.STAGE,
            MoveKind.KV_OFFLOAD,
            MoveKind.KV_RESTORE,
        )
        rates = {kind: host_link_bytes_per_s for kind in host_kinds}
        rates[MoveKind.ACTIVATE_D2D] = d2d_bytes_per_s
        return cls(rates, latency_s)

    def move(self, kind: str, nbytes: int) -> MoveRecord:
        try:
            bw = self.bandwidths[kind]
        except KeyError:
            raise KeyError(f"no bandwidth known for move kind {kind!r}") from None
        seconds = 0.0 if nbytes == 0 else self.latency_s + nbytes / bw
        return MoveRecord(kind, nbytes, seconds)

    def perform(self, plan: PlannedMove) -> MoveRecord:
        return self.move(plan.kind, plan.bytes)
