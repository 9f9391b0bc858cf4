"""Named system configurations compared by the replay benchmark.

Each is a configuration of the same system: the instance's admission policy
(:class:`~talaria.config.PolicyConfig`), what the simulated engine underneath has (stable
substrate, staging region, host KV store) and the router's placement policy. Nothing else
differs between two rows of the benchmark table.

The ablation ladder (``baseline`` -> ``talaria``) is ``talaria.config.LADDER``; each rung
becomes a row whose engine has what its policy uses (a staging region for D2D staging, a host
KV store for host KV) and whose router places by session when reservations are on. The
``baseline`` alone runs on an engine *without* the stable substrate: every switch frees,
re-allocates, reloads and re-captures (``switch_seconds_baseline``).

Peers, as configurations of the same system (each on the plain engine: no stable substrate,
no staging, no host KV; KV lives only in the engine's LRU prefix cache and is dropped by a
switch):

- ``load_lru``: a plain engine behind a load balancer. It has no round quantum: it switches
  on demand (a slot admits what is queued for its model when it opens; once another model
  waits, the slot closes after ``ON_DEMAND_QUANTUM_S``). Measured: on the plain engine the
  KV region never blocks admission, so a slot's queue empties at once and the round
  scheduler closes it as soon as another model waits whatever the quantum: ``load_lru``
  then behaves exactly as ``baseline`` on one instance; routing tells them apart only with
  several instances.
- ``cache_aware``: the same engines behind SGLang-style cache-aware routing (to the instance
  holding the longest prefix of the prompt).
- ``ttl_pin``: Continuum-style TTL pinning: after each call the session's KV is pinned on the
  device for its predicted tool gap, up to a TTL (soft reservations without session-prefill,
  staging or host KV); cache-aware routing, so a session comes back to its pins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.sim.engine import SimEngineConfig
from talaria.config import LADDER, PolicyConfig, Rung, preset

__all__ = [
    "SystemConfig",
    "SYSTEMS",
    "ABLATIONS",
    "PEERS",
    "DEFAULT_POLICIES",
    "ON_DEMAND_QUANTUM_S",
    "system",
    "parse_policies",
    "check_fits",
]

# Slot quantum that makes the round scheduler switch on demand: a slot admits the calls
# queued when it opens and closes as soon as another model waits.
ON_DEMAND_QUANTUM_S = 0.5


@dataclass(frozen=True)
class SystemConfig:
    """One row of the benchmark: instance policy, engine features, router placement."""

    name: str
    description: str
    policy: PolicyConfig
    placement: str  # router placement policy: "load" | "cache_aware" | "talaria"
    stable_substrate: bool
    staging: bool
    host_kv: bool  # the engine has a host KV store (sized from the server's host memory)

    def __post_init__(self) -> None:
        if self.staging and not self.stable_substrate:
            raise ValueError(f"system {self.name!r}: staging needs the stable substrate")
        if self.policy.d2d_staging and not self.staging:
            raise ValueError(f"system {self.name!r}: the policy stages but the engine cannot")
        if self.policy.host_kv and not self.host_kv:
            raise ValueError(f"system {self.name!r}: the policy offloads KV but the engine "
                             "has no host KV store")
        if self.placement not in ("load", "cache_aware", "talaria"):
            raise ValueError(f"system {self.name!r}: unknown placement {self.placement!r}")

    def engine_config(self, server: str = "h200x8", tp: int = 8, **overrides: Any) -> SimEngineConfig:
        """The simulated engine of one instance of this system on ``server`` at ``tp``."""
        return SimEngineConfig(
            server=server,
            tp=tp,
            stable_substrate=self.stable_substrate,
            staging=self.staging,
            host_kv_bytes=None if self.host_kv else 0,
            **overrides,
        )

    def with_quantum(self, slot_quantum_s: float) -> SystemConfig:
        """The same system with another slot quantum (for the quantum sweep)."""
        return replace(self, policy=self.policy.with_(slot_quantum_s=slot_quantum_s))

    def with_policy(self, **overrides: Any) -> SystemConfig:
        return replace(self, policy=self.policy.with_(**overrides))

    def without_staging(self) -> SystemConfig:
        """The same system with no staging region (switches on the stable substrate are then
        H2D copies): for servers whose memory cannot hold two copies of a model's shard."""
        if not self.staging:
            return self
        return replace(self, name=f"{self.name}/nostage", staging=False,
                       description=f"{self.description}; no staging region (H2D switches)",
                       policy=self.policy.with_(d2d_staging=False))


def check_fits(system: SystemConfig, config: SimEngineConfig, models: Sequence[str]) -> None:
    """Raise ValueError (naming the system) if its engine cannot be built on the server."""
    from engine.sim.engine import SimEngine

    try:
        SimEngine(list(models), config)
    except ValueError as exc:
        hint = " (try --no-staging)" if system.staging else ""
        raise ValueError(f"policy {system.name!r} does not fit: {exc}{hint}") from None


def _ladder_system(rung: Rung, description: str) -> SystemConfig:
    """A rung of talaria.config.LADDER as a benchmark row: its policy, and an engine that
    has what the policy uses (no stable substrate for the baseline alone)."""
    policy = preset(rung.name)
    placement = "talaria" if policy.soft_reservations else "load"
    stable = rung.name != "baseline"
    return SystemConfig(rung.name, description, policy, placement, stable,
                        policy.d2d_staging, policy.host_kv)


def _ladder() -> dict[str, SystemConfig]:
    out: dict[str, SystemConfig] = {}
    for rung in LADDER:
        below = list(out)[-1] if out else None
        description = f"{below} + {rung.description}" if below else (
            f"{rung.description}; no stable substrate (each switch reloads and re-captures), "
            "load-only routing"
        )
        out[rung.name] = _ladder_system(rung, description)
    return out


ABLATIONS: dict[str, SystemConfig] = _ladder()

_PLAIN = dict(session_prefill=False, soft_reservations=False, host_kv=False, d2d_staging=False,
              slot_quantum_s=ON_DEMAND_QUANTUM_S)

PEERS: dict[str, SystemConfig] = {
    s.name: s
    for s in (
        SystemConfig("load_lru", "plain engine (LRU prefix cache, on-demand switches) behind "
                     "a load balancer", PolicyConfig(name="load_lru", **_PLAIN), "load",
                     False, False, False),
        SystemConfig("cache_aware", "plain engines behind cache-aware (longest prefix) "
                     "routing, as SGLang's router", PolicyConfig(name="cache_aware", **_PLAIN),
                     "cache_aware", False, False, False),
        SystemConfig("ttl_pin", "plain engines + KV pinned across tool calls up to a TTL, as "
                     "Continuum; cache-aware routing",
                     PolicyConfig(name="ttl_pin", **{**_PLAIN, "soft_reservations": True}),
                     "cache_aware", False, False, False),
    )
}

SYSTEMS: dict[str, SystemConfig] = {**ABLATIONS, **PEERS}
DEFAULT_POLICIES: tuple[str, ...] = tuple(SYSTEMS)


def system(name: str) -> SystemConfig:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(SYSTEMS)}") from None


def parse_policies(text: str | Sequence[str] | None) -> list[SystemConfig]:
    """``"baseline,talaria"`` (or a list of names; None: all) -> systems, in the order given."""
    if text is None:
        return [SYSTEMS[n] for n in DEFAULT_POLICIES]
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if not names:
        raise ValueError("no policy named; choose from " + ", ".join(SYSTEMS))
    if len(set(names)) != len(names):
        raise ValueError(f"a policy is named twice in {names}")
    return [system(n) for n in names]
