"""Instance policy configuration: one switch per Talaria mechanism.

Every mechanism sits on top of the round scheduler (the baseline) and can be turned on or off
alone, so each ablation is one preset or one override away. Placement switches belong to the
router's configuration, not here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["LADDER", "MECHANISMS", "PolicyConfig", "PRESETS", "Rung", "preset"]


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "talaria"
    # mechanisms
    session_prefill: bool = True  # admit active-model continuations before the slot ends
    soft_reservations: bool = True  # keep KV + slot time for a session's likely return
    host_kv: bool = True  # offload outgoing KV to host on a switch, restore on return
    d2d_staging: bool = True  # stage the next model on the device while the current runs
    # round scheduler
    slot_quantum_s: float = 30.0  # a slot admits queued calls for at most this long
    # session-prefill
    sp_horizon_s: float = 10.0  # consider continuations expected within this horizon
    sp_budget_s: float = 20.0  # max extra slot time SP may add to one slot
    sp_idle_margin_s: float = 1.0  # idle wait past a continuation's predicted arrival
    # soft reservations / gap prediction
    reservation_ttl_s: float = 60.0  # a reservation expires this long after its call ended
    # a yield copies the KV to host even when that evicts other sessions' host KV (True was
    # the original behaviour; it thrashes the host store under overload)
    yield_offload_may_evict: bool = False
    default_gap_s: float = 2.0  # prior for a session's tool gap before anything is learned
    gap_ewma_alpha: float = 0.5
    # admission budget
    max_queue_calls: int = 1024  # queued (not yet admitted) calls beyond which Overloaded
    max_running_calls: int = 256
    # measured rates
    rate_ewma_alpha: float = 0.2
    state_refresh_s: float = 1.0  # how often session KV locations are re-read from the engine
    session_memory_s: float = 3600.0  # forget a quiet session with no KV here after this long
    max_sessions: int = 10_000  # beyond, the least recently seen idle sessions are forgotten
    # engine faults: each fails the calls in the engine; this many in a row without
    # progress stop the loop (the instance reports unhealthy and is restarted)
    max_engine_faults: int = 5
    engine_fault_backoff_s: float = 0.1  # wait after a fault, doubling while they repeat

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"PolicyConfig.{f.name} must be a bool, got {value!r}")
        positive = ("slot_quantum_s", "reservation_ttl_s", "state_refresh_s", "session_memory_s")
        for key in positive:
            if not getattr(self, key) > 0:
                raise ValueError(f"PolicyConfig.{key} must be > 0, got {getattr(self, key)!r}")
        non_negative = ("sp_horizon_s", "sp_budget_s", "sp_idle_margin_s", "default_gap_s",
                        "engine_fault_backoff_s")
        for key in non_negative:
            if not getattr(self, key) >= 0:
                raise ValueError(f"PolicyConfig.{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("gap_ewma_alpha", "rate_ewma_alpha"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(
                    f"PolicyConfig.{key} must be in (0, 1], got {getattr(self, key)!r}"
                )
        for key in ("max_queue_calls", "max_running_calls", "max_engine_faults", "max_sessions"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PolicyConfig.{key} must be an integer >= 1, got {value!r}")

    def with_(self, **overrides: Any) -> PolicyConfig:
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown PolicyConfig field(s): {sorted(unknown)}")
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyConfig:
        """Build from a mapping; ``preset`` names a base preset the other keys override."""
        data = dict(data)
        base = preset(data.pop("preset")) if "preset" in data else cls()
        return base.with_(**data)


@dataclass(frozen=True)
class Rung:
    """One step of the ablation ladder: the mechanisms it turns on (beyond the previous
    step's) and what that means, in words."""

    name: str
    adds: tuple[str, ...]
    description: str


# The ablation ladder, the one definition of it: each step adds mechanisms to the previous
# one, from the round scheduler alone to Talaria. The benchmark's systems are built from it.
LADDER: tuple[Rung, ...] = (
    Rung("baseline", (), "round scheduler; a switch drops the outgoing model's KV"),
    Rung("+staging", ("d2d_staging",), "the next model staged on the device: D2D switches"),
    Rung("+host_kv", ("host_kv",), "outgoing KV offloaded to host, restored on return"),
    Rung("+sp", ("session_prefill",), "session-prefill"),
    Rung("talaria", ("soft_reservations",), "soft reservations and session-aware placement"),
)
MECHANISMS = ("session_prefill", "soft_reservations", "host_kv", "d2d_staging")


def _ladder_presets() -> dict[str, PolicyConfig]:
    on: set[str] = set()
    out: dict[str, PolicyConfig] = {}
    for rung in LADDER:
        on.update(rung.adds)
        out[rung.name] = PolicyConfig(name=rung.name, **{m: m in on for m in MECHANISMS})
    return out


PRESETS: dict[str, PolicyConfig] = _ladder_presets()


def preset(name: str, **overrides: Any) -> PolicyConfig:
    """A named preset, optionally with fields overridden (e.g. ``slot_quantum_s=10``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides)
