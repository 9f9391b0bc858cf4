"""Named system configurations compared by the replay benchmark.

Each row is the instance's admission policy (:class:`~talaria.policies.config.PolicyConfig`), what the
simulated engine underneath has (memory layout, switch mechanism, staging region, host KV
tier) and the router's placement policy; every mechanism is a switch on the same control
plane.

- The ablation ladder (``talaria.policies.config.LADDER``): ``baseline`` is the reference's, the
  Talaria system itself (stable substrate, soft reservations, session-aware placement) with
  session-prefill, host-KV restoration and D2D staging off, so a switch is the substrate's
  H2D copy and drops the outgoing model's KV; each rung adds one mechanism up to ``talaria``.
- Leave-one-out rows: talaria minus one mechanism (``talaria.policies.config.LEAVE_ONE_OUT``,
  ``-placement``: load-only routing, and ``-layerwise``: host KV restored before the forward
  pass instead of layer group by layer group inside it, ``engine.sim.kv_tier``). ``-lending`` is the ladder's ``+priority_switch`` and is not
  run twice.
- Peers, the systems a user would deploy instead (constants sourced in
  ``engine.sim.switching`` and ``engine.sim.kv_tier``; ``talaria.policies.priority`` and
  ``talaria.policies.ttl`` for their scheduling rules). Each admits as its own engine does
  (``PolicyConfig.admission`` "engine": vLLM V1's scheduler, in queue order while the free
  KV blocks hold the prompt and fewer than max_num_seqs run, preempting and recomputing
  the latest call when a decode finds no block), not by Talaria's budget:

  - ``vllm_sleep``: one vLLM engine per model (each model's KV region is what its own weights
    leave), switched on demand by sleep mode level 1: the outgoing engine sleeps (weights
    copied to host, KV discarded), the incoming one wakes (weights copied back, CUDA graphs
    kept), both at vLLM's measured multi-GPU efficiency of the host link; FCFS. The
    vLLM-based rows (these two, Continuum and Aegaeon) are routed as the vLLM Router routes
    by default: cache-aware (``_VLLM_ROUTER``).
  - ``vllm_sleep_lmcache``: the same with LMCache's CPU backend: KV written through to host
    as it is computed, surviving sleep; layer-wise (``use_layerwise``), its best setting
    here: each layer retrieved before it runs and stored after it, overlapping the compute
    (on the default trace 521 / 1110 s p50 / p95 against 523 / 1121 s retrieving before
    the forward pass, on the real trace 1706 / 3730 against 1733 / 3851, both at its
    previously tuned setting).
  - ``sglang_hicache``: SGLang engines (release/resume memory occupation: the same sleep and
    wake), HiCache write-through host tier with layer-overlapped loads, flushed on every
    release; its longest-prefix-match queue order (``schedule_policy="lpm"``); SGLang's
    cache-aware router.
  - ``continuum_ttl``: vLLM sleep-mode engines running Continuum: KV pinned on the device
    after each call for the TTL of its rule (a call that does not fit waits rather than
    evict a pin, unless nothing runs), program-level FCFS with pinned sessions first; a
    decode that finds no block preempts the running call whose session arrived last
    (``engine_preempt="program"``, Continuum's victim). Where Continuum's engine has one
    call running it unpins the pin that ends last instead; here that call is preempted and
    the step that then runs nothing makes a pin yield (``Intake.unstall``): one step later,
    its blocks recomputed or found again in the prefix cache.
  - ``autellix``: vLLM sleep-mode engines running Autellix's PLAS: the session with the
    least attained service first (within a model and for the next model), anti-starvation
    promotion; locality-aware routing.
  - ``aegaeon``: token-level preemptive multi-model scheduling: short slots (its quota is at
    most Q_MAX = 4 s) that preempt the calls in flight, their KV swapped to host and back;
    scale-ups at the link floor plus a small fixed cost; finished sessions' KV is not kept
    across a switch. Its optional prefetch of the next model is off: on this server the
    memory it needs comes out of KV, and it measured worse with it (see the row).

The bounds are not systems: ``workloads.bounds.bound`` (the proven lower bound),
``workloads.bounds.isolated`` (``isolated``) and ``workloads.bounds.oracle`` (an oracle schedule).

Every row of the table runs at the slot-closing rule and quantum that suit it best on the
trace (``workloads.benchmark.tuning``; ``grid`` names the settings it may take), except
Talaria, the ladder's rungs above the baseline and the leave-one-out rows: they run
Talaria's one configuration (``talaria.policies.config.TALARIA_SETTING``) on every trace, as
in the scenario suite, so that a rung or a left-out mechanism differs from Talaria in its
mechanisms only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.sim.engine import SimEngineConfig
from talaria.policies.config import LADDER, LEAVE_ONE_OUT, PolicyConfig, Rung, preset

__all__ = [
    "LAYERWISE_ROW",
    "PLACEMENT_ROW",
    "SystemConfig",
    "SYSTEMS",
    "ABLATIONS",
    "LADDER_LEAVE_ONE_OUT",
    "LEAVE_ONE_OUT_ROWS",
    "PEERS",
    "DEFAULT_POLICIES",
    "system",
    "parse_policies",
    "check_fits",
]

# The settings the tuner may give a row: round-scheduled quanta, Aegaeon's quotas, or none
# ("fixed": the row runs its own, Talaria's one configuration, on every trace)
GRIDS = ("round", "preempt", "fixed")
# Quanta a round-scheduled row is tried at (with every closing rule): from a few seconds to
# a slot that outlasts most sessions; the best of the default trace's rows lie inside.
ROUND_QUANTA: tuple[float, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# Aegaeon's quota is bounded by Q_MAX = 4 s (SOSP'25).
PREEMPT_QUANTA: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class SystemConfig:
    """One row of the benchmark: instance policy, engine features, router placement."""

    name: str
    description: str
    policy: PolicyConfig
    placement: str  # router placement policy: "load" | "cache_aware" | "talaria"
    stable_substrate: bool = True  # False: one plain engine per model (its own KV region)
    staging: bool = False
    # the staging region's size (substrate.ledger.STAGING_REGIONS): for the largest shard,
    # or for the second largest (the largest model then always loads from host)
    staging_region: str = "largest"
    host_kv: bool = False  # the engine has a host KV store (sized from the host memory left)
    switch: str = "copy"  # engine.sim.switching kind
    kv_tier: str = "offload"  # engine.sim.kv_tier: how the host KV store fills and restores
    sleep_wake_efficiency: float | None = None  # None: vLLM's measured multi-GPU efficiency
    scale_up_fixed_s: float | None = None  # None: engine.sim.switching.AEGAEON_FIXED_S
    grid: str = "round"  # the settings the tuner may give it (GRIDS)

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
        if self.grid not in GRIDS:
            raise ValueError(f"system {self.name!r}: unknown settings grid {self.grid!r}")

    def engine_config(self, server: str = "h200x8", tp: int = 8, **overrides: Any) -> SimEngineConfig:
        """The simulated engine of one instance of this system on ``server`` at ``tp``."""
        fields: dict[str, Any] = dict(
            server=server, tp=tp, stable_substrate=self.stable_substrate, staging=self.staging,
            staging_region=self.staging_region,
            host_kv_bytes=None if self.host_kv else 0, switch=self.switch,
            kv_tier=self.kv_tier, sleep_wake_efficiency=self.sleep_wake_efficiency,
        )
        if self.scale_up_fixed_s is not None:
            fields["scale_up_fixed_s"] = self.scale_up_fixed_s
        fields.update(overrides)
        return SimEngineConfig(**fields)

    @property
    def setting(self) -> dict[str, Any]:
        """The settings the tuner chooses (what the table prints beside the row)."""
        return {"slot_close": self.policy.slot_close, "slot_quantum_s": self.policy.slot_quantum_s}

    def with_setting(self, **setting: Any) -> SystemConfig:
        """The same system at another slot-closing rule and quantum."""
        return replace(self, policy=self.policy.with_(**setting))

    def with_quantum(self, slot_quantum_s: float) -> SystemConfig:
        return self.with_setting(slot_quantum_s=slot_quantum_s)

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
        hint = " (try --no-staging)" if system.staging and "must divide" not in str(exc) else ""
        raise ValueError(f"policy {system.name!r} does not fit: {exc}{hint}") from None


def _talaria_row(name: str, policy: PolicyConfig, description: str,
                 placement: str = "talaria", grid: str = "fixed") -> SystemConfig:
    """Talaria's system with some mechanisms off: the engine has what the policy uses.
    With host KV its staging region holds every shard, the largest included: what the KV
    region gives up is kept on host, and under KV pressure a slot lends the region back
    (``lend_staging``). Without host KV the device holds a session's only KV, so the region
    holds every shard but the largest: the largest model loads from host, and the KV region
    keeps what its sessions need (chosen on the development scenarios: docs/constants.md)."""
    region = "largest" if policy.host_kv else "second"
    return SystemConfig(name, description, policy, placement, staging=policy.d2d_staging,
                        staging_region=region, host_kv=policy.host_kv, grid=grid)


def _ladder() -> dict[str, SystemConfig]:
    out: dict[str, SystemConfig] = {}
    below: Rung | None = None
    for rung in LADDER:
        description = (f"{below.name} + {rung.description}" if below is not None else
                       f"the reference's baseline: {rung.description}; session-aware placement")
        # the baseline is tuned per trace (at its best, as every peer); each rung above it
        # adds its mechanisms at Talaria's one configuration
        out[rung.name] = _talaria_row(rung.name, preset(rung.name), description,
                                      grid="round" if below is None else "fixed")
        below = rung
    return out


ABLATIONS: dict[str, SystemConfig] = _ladder()


PLACEMENT_ROW = "-placement"  # placement matters only with several instances
LAYERWISE_ROW = "-layerwise"  # an engine feature, not a policy mechanism: its own row


def _leave_one_out() -> dict[str, SystemConfig]:
    """Talaria minus one mechanism each, except where that is a rung of the ladder."""
    rungs = {row.policy.with_(name="") for row in ABLATIONS.values()}
    out = {
        name: _talaria_row(name, preset(name), f"talaria without {mechanism}")
        for name, mechanism in LEAVE_ONE_OUT
        if preset(name).with_(name="") not in rungs
    }
    out[PLACEMENT_ROW] = _talaria_row(PLACEMENT_ROW, preset("talaria").with_(name=PLACEMENT_ROW),
                                     "talaria with load-only routing", placement="load")
    out[LAYERWISE_ROW] = replace(
        _talaria_row(LAYERWISE_ROW, preset("talaria").with_(name=LAYERWISE_ROW),
                     "talaria restoring host KV before the forward pass, not inside it"),
        kv_tier="offload_serial",
    )
    return out


LEAVE_ONE_OUT_ROWS: dict[str, SystemConfig] = _leave_one_out()
# Leave-one-out rows that are a rung of the ladder, by their leave-one-out name: the rung
# the suite's leave-one-out check runs for them (the default table runs it once, as a rung).
LADDER_LEAVE_ONE_OUT: dict[str, str] = {
    name: rung for name, _ in LEAVE_ONE_OUT for rung, row in ABLATIONS.items()
    if name not in LEAVE_ONE_OUT_ROWS and row.policy.with_(name="") == preset(name).with_(name="")
}

# A plain engine's policy: none of Talaria's mechanisms, and the engine's own admission
# (vLLM V1's and SGLang's schedulers admit by free KV for the prompt, up to max_num_seqs).
_PLAIN = dict(session_prefill=False, soft_reservations=False, host_kv=False, d2d_staging=False,
              session_priority=False, priority_switch=False, kv_demotion=False,
              lend_staging=False, admission="engine")
_SLEEP = dict(stable_substrate=False, switch="sleep_wake")


def _peer(name: str, description: str, placement: str, policy: dict[str, Any],
          **engine: Any) -> SystemConfig:
    return SystemConfig(name, description, PolicyConfig(name=name, **{**_PLAIN, **policy}),
                        placement, **engine)


# The vLLM-based rows route as the vLLM Router does by default (vllm-project/router, derived
# from SGLang's model gateway; its default policy is ``cache_aware``: the instance holding the
# longest prefix, then load): a vLLM fleet's own router. Until 2026-12-06 they routed by load
# only, with no source, which made vLLM sleep, Continuum and Aegaeon about 1.3x slower on four
# servers in the development scenarios (vLLM + LMCache within 4%; docs/benchmark.md, "The
# vLLM rows behind the vLLM Router").
_VLLM_ROUTER = "cache_aware"

PEERS: dict[str, SystemConfig] = {
    s.name: s
    for s in (
        _peer("vllm_sleep", "vLLM engines switched by sleep mode level 1; KV dropped on sleep; "
              "the vLLM Router (cache-aware)", _VLLM_ROUTER, {}, **_SLEEP),
        _peer("vllm_sleep_lmcache", "vllm_sleep + LMCache CPU tier (write-through, survives "
              "sleep; layer-wise)", _VLLM_ROUTER, {}, host_kv=True, kv_tier="lmcache_layerwise",
              **_SLEEP),
        _peer("sglang_hicache", "SGLang engines (release/resume) + HiCache host tier "
              "(flushed on release), longest-prefix-match scheduling; cache-aware router",
              "cache_aware", {"queue_order": "lpm"}, host_kv=True, kv_tier="hicache",
              **_SLEEP),
        _peer("continuum_ttl", "vllm_sleep + Continuum: KV pinned for its TTL rule, "
              "program-level FCFS", _VLLM_ROUTER,
              {"soft_reservations": True, "reservation_ttl": "continuum", "hard_pins": True,
               "queue_order": "program_fcfs", "engine_preempt": "program"}, **_SLEEP),
        _peer("autellix", "vllm_sleep + Autellix PLAS (least attained service first, "
              "anti-starvation); locality-aware routing", "cache_aware",
              {"queue_order": "las", "model_order": "las"}, **_SLEEP),
        # Without its optional prefetch of the next model: prefetch needs spare device memory
        # the size of a shard, which this server can only take from KV; its best setting
        # leaves it off (docs/constants.md).
        _peer("aegaeon", "token-level preemptive multi-model scheduling: short slots, KV of "
              "calls in flight swapped to host, link-floor scale-ups; cache-aware routing",
              _VLLM_ROUTER,
              {"preempt": True, "slot_close": "quantum", "slot_quantum_s": 4.0},
              switch="scale_up", grid="preempt"),
    )
}

SYSTEMS: dict[str, SystemConfig] = {**ABLATIONS, **LEAVE_ONE_OUT_ROWS, **PEERS}
DEFAULT_POLICIES: tuple[str, ...] = tuple(SYSTEMS)


def system(name: str) -> SystemConfig:
    """The row ``name`` names; a leave-one-out name that is a rung of the ladder
    (``-lending``) is that rung's row, under the ladder's name (it is one row, run once)."""
    try:
        return SYSTEMS[LADDER_LEAVE_ONE_OUT.get(name, name)]
    except KeyError:
        aliases = [f"{alias} (the row {rung})" for alias, rung in LADDER_LEAVE_ONE_OUT.items()]
        raise ValueError(f"unknown policy {name!r}; known: "
                         f"{', '.join([*SYSTEMS, *aliases])}") from None


def parse_policies(text: str | Sequence[str] | None) -> list[SystemConfig]:
    """``"baseline,talaria"`` (or a list of names; None: all) -> systems, in the order given."""
    if text is None:
        return [SYSTEMS[n] for n in DEFAULT_POLICIES]
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if not names:
        raise ValueError("no policy named; choose from " + ", ".join(SYSTEMS))
    rows = [system(n) for n in names]
    if len({s.name for s in rows}) != len(rows):
        same = "".join(f"; {a} is {r}" for a, r in LADDER_LEAVE_ONE_OUT.items() if a in names)
        raise ValueError(f"a policy is named twice in {names}{same}")
    return rows
