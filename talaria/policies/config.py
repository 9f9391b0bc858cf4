"""Instance policy configuration: one switch per mechanism.

Every mechanism sits on top of the round scheduler and can be turned on or off alone, so
each ablation is one preset or one override away. Talaria's own mechanisms are the ladder's
(``LADDER``); the others (slot-closing rule, preemption, admission and model order, TTL
rule) are what the peer systems of the benchmark are built from, on the same control plane.
Placement switches belong to the router's configuration, not here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = [
    "ADMISSIONS", "ENGINE_PREEMPTS", "LADDER", "LEAVE_ONE_OUT", "MECHANISMS", "MODEL_ORDERS", "PolicyConfig", "PRESETS",
    "QUEUE_ORDERS", "RESERVATION_TTLS", "Rung", "SLOT_CLOSE_RULES", "TALARIA_SETTING", "preset",
]

# When an open slot closes before its quantum, once another model waits: its queue is empty;
# its queue is empty and none of its calls is in flight; never (only at the quantum).
SLOT_CLOSE_RULES = ("empty", "drained", "quantum")
# Admission order within a model: arrival; program-level FCFS, sessions holding a pin first
# (Continuum); program-level least attained service (Autellix's PLAS); fewest expected
# remaining calls (Talaria's session-level priority, talaria.policies.priority); longest
# prefix cached on the device first (SGLang's schedule_policy "lpm").
QUEUE_ORDERS = ("fifo", "program_fcfs", "las", "remaining", "lpm")
# Which model gets the next slot: round robin; the model of the waiting session with the
# least attained service (Autellix's PLAS across the models of one server); the model of the
# waiting session that comes first by the queue order (Talaria).
MODEL_ORDERS = ("round", "las", "priority")
# How long a soft reservation lives: reservation_ttl_s; Continuum's TTL rule.
RESERVATION_TTLS = ("fixed", "continuum")
# How queued calls of the active model enter the engine: Talaria's budget (a call's prompt
# and expected answer must fit the KV region beside the calls running and the reservations
# kept, yielding reservations to make room); or as a vLLM-style engine admits them on its
# own (vLLM V1's scheduler: in queue order while fewer than max_num_seqs run and the free KV
# blocks hold the prompt, no room kept for the answer; a decode that finds no block preempts
# the latest admitted call, recomputed later: vllm/v1/core/sched/scheduler.py).
ADMISSIONS = ("budget", "engine")
# Which running call the engine preempts when a decode finds no free KV block: the latest
# admitted (vLLM V1's FCFS); or the one whose session arrived last (program-level), as
# Continuum's scheduler picks its victim: ``pop_running_request_based_on_last_step`` in
# vllm/v1/core/sched/scheduler.py of the paper's code (Hanchenli's vllm-continuum, commit
# 69fa78b, read from the fork Whrlicht/vllm-continuum) preempts the running request whose
# job first arrived latest; its ``is_last_step`` exemption is for an agent's step limit,
# which no trace here reaches.
ENGINE_PREEMPTS = ("admitted", "program")


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "talaria"
    # mechanisms
    session_prefill: bool = True  # admit active-model continuations before the slot ends
    soft_reservations: bool = True  # keep KV + slot time for a session's likely return
    host_kv: bool = True  # offload outgoing KV to host on a switch, restore on return
    d2d_staging: bool = True  # stage the next model on the device while the current runs
    # sessions with the fewest expected remaining calls first, within a model's queue and for
    # its KV budget (talaria.policies.priority, session_length); replaces queue_order
    session_priority: bool = True
    # the next model is the one of the first waiting session, and an open slot yields to a
    # waiting session of another model that outranks all of its own once it has lasted
    # min_slot_factor x its switches (talaria.policies.model_choice); replaces model_order
    priority_switch: bool = True
    # under KV pressure, each session's new KV is copied to host as its call ends (with
    # host_kv; inert without): a reservation that yields, an eviction and a switch then
    # lose nothing (talaria.policies.reservations.demotion_due). Off in every preset: with
    # host copies priced alike it paid at no figure (`make loo`, 24 scenarios x 2 draws:
    # -0.6 / -0.1 / +0.1% at p50 / p95 / mean without it; off on the development scenarios
    # +0.03 / -0.40 / -0.10%, none beyond its interval; docs/constants.md), so it is not
    # part of Talaria's one configuration; an option kept for research runs.
    kv_demotion: bool = False
    # under KV pressure at a switch (the incoming model's queued calls need more blocks than
    # its KV region holds), or inside an open slot once its calls in flight drain, the slot
    # lends the staging region to the KV cache and stages nothing (with d2d_staging; inert
    # without): talaria.policies.staging.lend_staging_due
    lend_staging: bool = True
    # round scheduler. The defaults are Talaria's one configuration (TALARIA_SETTING): every
    # preset and `talaria serve` run it, and the benchmark runs Talaria and its leave-one-out
    # rows at it on every trace; chosen on the development scenarios (docs/constants.md)
    slot_quantum_s: float = 480.0  # a slot admits queued calls for at most this long
    slot_close: str = "drained"  # SLOT_CLOSE_RULES: when a slot closes before its quantum
    preempt: bool = False  # at the quantum, suspend the model's calls in flight (Aegaeon)
    queue_order: str = "fifo"  # QUEUE_ORDERS: admission order within a model
    model_order: str = "round"  # MODEL_ORDERS: which model gets the next slot
    # Autellix's anti-starvation: a session whose total wait reaches this multiple of its
    # attained service goes first (beta; 8 in the public reproduction, the paper's is a GAP)
    las_starvation_ratio: float = 8.0
    # session_priority's starvation guard: a session whose total wait reaches this multiple
    # of its attained service goes first. Fixed once for all traces (chosen on the default
    # trace at drained/240 s: 2 and 4 give 344 / 1010-1015 s, 8 the same p50 and a 6% longer
    # p95, 1072 s); las keeps Autellix's 8.
    remaining_starvation_ratio: float = 4.0
    min_slot_factor: float = 10.0  # priority_switch: a slot lasts this x its switches first
    # the least wait that makes a session starved under session_priority; None: one slot
    # quantum (starvation_min_wait_s)
    starvation_floor_s: float | None = None
    # session-prefill
    sp_horizon_s: float = 10.0  # consider continuations expected within this horizon
    sp_budget_s: float = 20.0  # max extra slot time SP may add to one slot
    sp_idle_margin_s: float = 1.0  # idle wait past a continuation's predicted arrival
    # Session-prefill's hold: an idle engine keeps a closed slot for a reserved continuation
    # expected within sp_horizon_s, while other models' calls wait. Off in every preset: on
    # the development traces (default, mini-swe-agent, the real trace's half; 1 and 4
    # servers) Talaria with it took up to 1.23x as long at p50 and 1.31x at p95 as without
    # it (docs/constants.md). Admitting queued continuations stays.
    sp_hold: bool = False
    # soft reservations / gap prediction
    reservation_ttl_s: float = 60.0  # a reservation expires this long after its call ended
    reservation_ttl: str = "fixed"  # RESERVATION_TTLS: how that lifetime is chosen
    # A call that does not fit waits for calls in flight instead of taking reserved KV; a
    # reservation yields only when nothing runs (Continuum's pins and deadlock guard)
    hard_pins: bool = False
    # a yield copies the KV to host even when that evicts other sessions' host KV (True was
    # the original behaviour; it thrashes the host store under overload)
    yield_offload_may_evict: bool = False
    default_gap_s: float = 2.0  # prior for a session's tool gap before anything is learned
    # An answer's expected length before any call has finished here (a client's max_tokens
    # says what it allows, not what it gets): the order of a coding agent's answer (the shared
    # real trace's calls: median 113, p90 556 output tokens)
    output_prior_tokens: int = 256
    gap_ewma_alpha: float = 0.5
    # admission budget
    admission: str = "budget"  # ADMISSIONS: Talaria's budget, or the engine's own
    engine_preempt: str = "admitted"  # ENGINE_PREEMPTS: whose call the engine preempts
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
    # a model whose staging copy failed is not staged again for this long, doubling while
    # its copies keep failing (talaria.instance.staging); its switch copies from host
    staging_retry_backoff_s: float = 1.0
    # a live engine operation (a step, a switch) still running after this long has wedged
    # the engine (a hung collective, a driver fault): the instance is unhealthy and its
    # process exits to be restarted; 0 disables the watchdog
    engine_op_timeout_s: float = 600.0
    # a running call that has sent its first token and made no progress for this long gets
    # an empty event, so the router's stall deadline (60 s) and a client's idle timeout see
    # it alive while the engine holds it (talaria.instance.heartbeats); 0 sends none
    call_heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"PolicyConfig.{f.name} must be a bool, got {value!r}")
        for key, allowed in (("slot_close", SLOT_CLOSE_RULES), ("queue_order", QUEUE_ORDERS),
                             ("model_order", MODEL_ORDERS), ("reservation_ttl", RESERVATION_TTLS),
                             ("admission", ADMISSIONS), ("engine_preempt", ENGINE_PREEMPTS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"PolicyConfig.{key} must be one of {allowed}, got "
                                 f"{getattr(self, key)!r}")
        positive = ("slot_quantum_s", "reservation_ttl_s", "state_refresh_s", "session_memory_s",
                    "las_starvation_ratio", "remaining_starvation_ratio", "staging_retry_backoff_s")
        if self.model_order == "priority" and self.admission_order == "fifo":
            raise ValueError("PolicyConfig.model_order 'priority' needs a queue_order that "
                             "ranks sessions, not 'fifo'")
        if self.session_priority and self.queue_order not in ("fifo", "remaining"):
            raise ValueError(f"PolicyConfig.session_priority orders the queue by remaining "
                             f"calls; queue_order {self.queue_order!r} contradicts it")
        if self.priority_switch and self.model_order not in ("round", "priority"):
            raise ValueError(f"PolicyConfig.priority_switch chooses the next model by priority; "
                             f"model_order {self.model_order!r} contradicts it")
        if self.priority_switch and self.admission_order == "fifo":
            raise ValueError("PolicyConfig.priority_switch needs sessions ranked: turn on "
                             "session_priority or set a queue_order other than 'fifo'")
        for key in positive:
            if not getattr(self, key) > 0:
                raise ValueError(f"PolicyConfig.{key} must be > 0, got {getattr(self, key)!r}")
        non_negative = ("sp_horizon_s", "sp_budget_s", "sp_idle_margin_s", "default_gap_s",
                        "engine_fault_backoff_s", "engine_op_timeout_s", "min_slot_factor",
                        "call_heartbeat_s")
        if self.starvation_floor_s is not None and not self.starvation_floor_s >= 0:
            raise ValueError(f"PolicyConfig.starvation_floor_s must be >= 0, got "
                             f"{self.starvation_floor_s!r}")
        for key in non_negative:
            if not getattr(self, key) >= 0:
                raise ValueError(f"PolicyConfig.{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("gap_ewma_alpha", "rate_ewma_alpha"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(
                    f"PolicyConfig.{key} must be in (0, 1], got {getattr(self, key)!r}"
                )
        for key in ("max_queue_calls", "max_running_calls", "max_engine_faults", "max_sessions",
                    "output_prior_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PolicyConfig.{key} must be an integer >= 1, got {value!r}")

    @property
    def admission_order(self) -> str:
        """The queue order in force (QUEUE_ORDERS): ``remaining`` under session priority."""
        return "remaining" if self.session_priority else self.queue_order

    @property
    def starvation_ratio(self) -> float:
        """The starvation guard of the queue order in force."""
        if self.admission_order == "remaining":
            return self.remaining_starvation_ratio
        return self.las_starvation_ratio

    @property
    def starvation_min_wait_s(self) -> float:
        """The least wait that makes a session starved under ``remaining``: one slot quantum,
        the wait a rotation in round order bounds (``talaria.policies.priority``); none
        under the other orders (Autellix's guard is its own)."""
        if self.admission_order != "remaining":
            return 0.0
        return self.slot_quantum_s if self.starvation_floor_s is None else self.starvation_floor_s

    @property
    def model_choice(self) -> str:
        """The model order in force (MODEL_ORDERS): ``priority`` under the priority switch."""
        return "priority" if self.priority_switch else self.model_order

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
# one, from the reference's baseline (the system itself with session-prefill, host-KV
# restoration, D2D staging and session priority off: its switch is the substrate's H2D copy
# and drops the outgoing model's KV) to Talaria. The benchmark's systems are built from it.
LADDER: tuple[Rung, ...] = (
    Rung("baseline", ("soft_reservations",), "round scheduler with soft reservations; a "
         "switch is the substrate's H2D copy and drops the outgoing model's KV"),
    Rung("+staging", ("d2d_staging",), "the next model staged on the device: D2D switches"),
    Rung("+host_kv", ("host_kv",), "outgoing KV offloaded to host, restored on return"),
    Rung("+sp", ("session_prefill",), "session-prefill"),
    Rung("+priority", ("session_priority",), "sessions with the fewest expected remaining "
         "calls first, within each model's queue and its KV budget"),
    Rung("+priority_switch", ("priority_switch",), "the next model is the first session's, "
         "and a slot yields to a session of another model that outranks its own"),
    Rung("talaria", ("lend_staging",), "under KV pressure at a switch, the slot lends the "
         "staging region to the KV cache (its next switch is then an H2D copy)"),
)
MECHANISMS = ("session_prefill", "soft_reservations", "host_kv", "d2d_staging",
              "session_priority", "priority_switch", "lend_staging")
# A mechanism that works only with another: leaving the latter out leaves out both.
NEEDS = {"lend_staging": "d2d_staging"}
# Talaria minus one mechanism each: (preset name, the mechanism turned off). Session
# priority is not left out alone: the priority switch ranks sessions by it.
LEAVE_ONE_OUT: tuple[tuple[str, str], ...] = (
    ("-staging", "d2d_staging"),
    ("-host_kv", "host_kv"),
    ("-sp", "session_prefill"),
    ("-reservations", "soft_reservations"),
    ("-priority_switch", "priority_switch"),
    ("-lending", "lend_staging"),
)


def _presets() -> dict[str, PolicyConfig]:
    on: set[str] = set()
    out: dict[str, PolicyConfig] = {}
    for rung in LADDER:
        on.update(rung.adds)
        out[rung.name] = PolicyConfig(name=rung.name, **{m: m in on for m in MECHANISMS})
    for name, off in LEAVE_ONE_OUT:
        kept = {m for m in on if m != off and NEEDS.get(m) != off}
        out[name] = PolicyConfig(name=name, **{m: m in kept for m in MECHANISMS})
    return out


PRESETS: dict[str, PolicyConfig] = _presets()
# Talaria's one configuration as the benchmark names a setting (slot-closing rule, quantum):
# PolicyConfig's defaults, so the preset served and the rows benchmarked are the same.
TALARIA_SETTING: dict[str, Any] = {"slot_close": PRESETS["talaria"].slot_close,
                                   "slot_quantum_s": PRESETS["talaria"].slot_quantum_s}


def preset(name: str, **overrides: Any) -> PolicyConfig:
    """A named preset, optionally with fields overridden (e.g. ``slot_quantum_s=10``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown policy preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides)
