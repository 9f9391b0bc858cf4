"""Placement policies: rank instances for one call (DESIGN.md section 6).

Every policy answers ``choose(call, session, states, healthy) -> [instance ids, best first]``
from the instances' last reported states plus what the router itself knows (its prefix
index and the work it has sent but not yet seen finish, in :class:`PlacementContext`). An
instance whose report says it cannot serve the model (model absent from a non-empty
catalog) is left out; an instance with no report yet is assumed empty and able. Policies
are pure functions of their inputs: no clock, no I/O, so the replay driver runs them as is.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Protocol

from router.sessions.table import SessionBranch
from talaria.protocol import InstanceState, ModelState, Residency


@dataclass
class PlacementCall:
    """What placement needs to know of a call."""

    model: str
    session_id: str  # as the instance knows it: the call's branch (router.sessions.table.branch_key)
    prompt_len: int
    block_hashes: list[int]  # of the prompt's full blocks (router.tokenization.block_hashes)
    block_size: int
    expected_output: int = 16  # output tokens expected of it (router.sessions.output_lengths)
    affinity: str | None = None  # an instance preferred among equals (a subagent's parent's)
    # for a main loop's call, (instance, model) of its session's side calls that ended since
    # its own last call (``SessionRecord.side_calls_since``; none for a subagent's first
    # call or a side call): where one of their models holds the slot, the main loop's model
    # was most likely switched out for the session itself
    siblings: tuple[tuple[str, str], ...] = ()


class PrefixIndex:
    """Which prompt blocks the router has sent to each instance (for each model), as a
    bounded LRU set of chained block hashes: SGLang's cache-aware routing tree, flattened.
    A chained hash names its whole prefix, so matching walks the call's hashes in order."""

    def __init__(self, max_blocks_per_instance: int = 1 << 18) -> None:
        self.max_blocks = max_blocks_per_instance
        self._sets: dict[tuple[str, str], OrderedDict[int, None]] = {}

    def insert(self, instance_id: str, model: str, hashes: list[int]) -> None:
        """The hashes become the most recently used, in their order (a repeated hash at its
        last place); the least recently used leave beyond ``max_blocks``."""
        blocks = self._sets.setdefault((instance_id, model), OrderedDict())
        # in at the end if new, then each moved to the end in turn (loops at C speed)
        deque(map(blocks.setdefault, hashes), maxlen=0)
        deque(map(blocks.move_to_end, hashes), maxlen=0)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match_blocks(self, instance_id: str, model: str, hashes: list[int]) -> int:
        blocks = self._sets.get((instance_id, model))
        if not blocks:
            return 0
        return len(list(takewhile(blocks.__contains__, hashes)))

    def drop_instance(self, instance_id: str) -> None:
        for key in [k for k in self._sets if k[0] == instance_id]:
            del self._sets[key]


@dataclass
class PlacementContext:
    """The router's own view, shared by policies: prefix index and the tokens of calls it
    has sent to each instance that have not finished (reports lag; this does not)."""

    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    outstanding_tokens: dict[str, int] = field(default_factory=dict)
    outstanding_prefill: dict[str, int] = field(default_factory=dict)

    def add(self, instance_id: str, prefill_tokens: int, total_tokens: int) -> None:
        self.outstanding_tokens[instance_id] = self.outstanding_tokens.get(instance_id, 0) + total_tokens
        self.outstanding_prefill[instance_id] = self.outstanding_prefill.get(instance_id, 0) + prefill_tokens

    def prefill_done(self, instance_id: str, prefill_tokens: int) -> None:
        left = self.outstanding_prefill.get(instance_id, 0) - prefill_tokens
        self.outstanding_prefill[instance_id] = max(0, left)

    def remove(self, instance_id: str, total_tokens: int) -> None:
        left = self.outstanding_tokens.get(instance_id, 0) - total_tokens
        self.outstanding_tokens[instance_id] = max(0, left)


@dataclass
class RateDefaults:
    """Rates assumed where an instance has not reported its own (0 in its state)."""

    prefill_tokens_per_s: float = 10_000.0
    decode_step_s: float = 0.02
    switch_host_s: float = 5.0
    switch_staged_s: float = 0.5
    kv_restore_bytes_per_s: float = 25e9


class PlacementPolicy(Protocol):
    name: str

    def choose(
        self,
        call: PlacementCall,
        session: SessionBranch | None,
        states: Mapping[str, InstanceState],
        healthy: Collection[str],
    ) -> list[str]: ...


def can_serve(state: InstanceState | None, model: str) -> bool:
    if state is None or not state.models:
        return True
    ms = state.models.get(model)
    return ms is not None and ms.residency != Residency.ABSENT


def reported_outstanding(state: InstanceState | None) -> int:
    if state is None:
        return 0
    return sum(m.queued_tokens + m.running_tokens for m in state.models.values())


class _Base:
    name = "base"

    def __init__(self, ctx: PlacementContext | None = None, rates: RateDefaults | None = None) -> None:
        self.ctx = ctx if ctx is not None else PlacementContext()
        self.rates = rates if rates is not None else RateDefaults()

    def _eligible(
        self, call: PlacementCall, states: Mapping[str, InstanceState], healthy: Collection[str]
    ) -> list[str]:
        return sorted(i for i in healthy if can_serve(states.get(i), call.model))

    def load(self, instance_id: str, states: Mapping[str, InstanceState]) -> int:
        """Outstanding tokens: the larger of the instance's report and the router's count."""
        return max(
            reported_outstanding(states.get(instance_id)),
            self.ctx.outstanding_tokens.get(instance_id, 0),
        )

    def local_tokens(
        self, instance_id: str, call: PlacementCall, session: SessionBranch | None,
        states: Mapping[str, InstanceState],
    ) -> tuple[int, int]:
        """(prefix tokens on the device, further tokens in the host KV store) for the call."""
        state = states.get(instance_id)
        device = self.ctx.prefix_index.match_blocks(instance_id, call.model, call.block_hashes)
        device *= call.block_size
        ms = state.models.get(call.model) if state is not None else None
        if ms is not None and ms.residency != Residency.ACTIVE:
            device = 0  # the model was switched out: its KV left the device
        host = 0
        owner = session.key if session is not None else call.session_id  # its branch, or a parent's
        kv = state.sessions.get(owner) if state is not None else None
        if kv is not None and kv.model == call.model:
            reported = max(kv.device_tokens, kv.host_tokens)
            if session is not None and session.kv.blocks:
                # The session's KV only helps as far as this prompt still extends it.
                reported = min(reported, session.kv.shared_blocks(call.block_hashes) * call.block_size)
            device = max(device, min(kv.device_tokens, reported))
            host = max(0, min(kv.host_tokens, reported) - device)  # a host copy starts at token 0
        limit = max(0, call.prompt_len - 1)  # at least one token is always prefilled
        device = min(device, limit)
        host = min(host, limit - device)
        return device, host


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LoadOnly(_Base):
    """The baseline: fewest outstanding tokens."""

    name = "load"

    def choose(
        self,
        call: PlacementCall,
        session: SessionBranch | None,
        states: Mapping[str, InstanceState],
        healthy: Collection[str],
    ) -> list[str]:
        return sorted(self._eligible(call, states, healthy), key=lambda i: (self.load(i, states), i))


class CacheAware(_Base):
    """Longest prefix held by the instance (SGLang's cache-aware router); ties by load."""

    name = "cache_aware"

    def choose(
        self,
        call: PlacementCall,
        session: SessionBranch | None,
        states: Mapping[str, InstanceState],
        healthy: Collection[str],
    ) -> list[str]:
        def key(i: str) -> tuple[int, bool, int, str]:
            device, host = self.local_tokens(i, call, session, states)
            return (-(device + host), i != call.affinity, self.load(i, states), i)

        return sorted(self._eligible(call, states, healthy), key=key)


@dataclass
class TtftEstimate:
    instance_id: str
    wait_s: float
    switch_s: float
    rebuild_s: float
    queue_s: float
    local_tokens: int
    resident: bool  # its KV holds the session there (model active, or staged behind a side call)

    @property
    def total_s(self) -> float:
        return self.wait_s + self.switch_s + self.rebuild_s + self.queue_s


class Talaria(_Base):
    """KV locality where the call's model is resident first, then load, then the minimum
    estimated time to first token (wait + switch + rebuild + queue: model residency and
    pressure).

    A session stays where its KV is while its model is active there: its later calls follow
    it, so moving it for one call's shorter TTFT moves all of them, which a one-call estimate
    does not price. Ranked by the estimate first, sessions left their KV
    for whichever instance had their model active and piled up there (default trace on 4
    servers: p50 / p95 536 / 1026 s; locality first 442 / 1004 s; then load 415 / 980 s).

    KV kept only in an instance's host memory, its model switched out there, does not hold
    the session: counted as locality, it kept every session where it started, so every
    instance kept serving every model and switched between them (mini-swe-agent, Poisson at
    saturation, 4 servers: 916 switches and 1792 s of waiting for slots, against 91 and 89 s
    with host KV off, where sessions drifted to instances with their model active and each
    instance came to serve mostly one model). Measured on the development traces only (4
    servers; p50 / p95 / mean s, before -> after): mini-swe-agent Poisson 1.0 197 / 568 / 235
    -> 164 / 474 / 205, Poisson 0.5 154 / 421 / 180 -> 148 / 421 / 173, burst 430 / 1087 /
    504 -> 380 / 1060 / 464; the real trace's development half Poisson 1.0 199 / 655 / 225 ->
    180 / 603 / 208, Poisson 0.5 182 / 613 / 212 -> 182 / 606 / 209, burst 445 / 1292 / 540 ->
    455 / 1151 / 497; the default trace 239 / 635 / 307 -> 217 / 625 / 284. The host copy still
    shortens the rebuild in the estimate, and a session whose model comes back stays.

    Nor does a model staged there (the next one the instance will switch in), unless the
    model holding the slot is one the session's own side calls ran there since its main
    loop's last call (``PlacementCall.siblings``: an agent's main loop waits out its own side
    call and comes back). Staged models held their sessions until commit 8514b22, and staging
    then cost 1-3% at the mean in five of the eight four-server Poisson scenarios of ``make
    loo``; counted only where active, Talaria's mean fell on 16 of 18 development runs
    (mini-swe-agent, the real trace's development half and the default trace; burst, Poisson
    0.5 and 1.0; four servers; two draws): by 0.3-7.8% in Poisson, and by -6.5% to +4.6% in
    bursts (docs/constants.md).

    A new session (no locality anywhere) goes to the least loaded instance, and the estimate
    breaks the remaining ties: an instance with the model active or staged first."""

    name = "talaria"

    def choose(
        self,
        call: PlacementCall,
        session: SessionBranch | None,
        states: Mapping[str, InstanceState],
        healthy: Collection[str],
    ) -> list[str]:
        estimates = [self.estimate(i, call, session, states) for i in self._eligible(call, states, healthy)]
        estimates.sort(key=lambda e: (
            -(e.local_tokens if e.resident else 0), e.instance_id != call.affinity,
            self.load(e.instance_id, states), round(e.total_s, 9), e.instance_id))
        return [e.instance_id for e in estimates]

    def estimate(
        self, instance_id: str, call: PlacementCall, session: SessionBranch | None,
        states: Mapping[str, InstanceState],
    ) -> TtftEstimate:
        state = states.get(instance_id)
        ms = state.models.get(call.model) if state is not None else None
        ms = ms or ModelState(name=call.model, residency=Residency.ACTIVE)
        rates = self._rates(ms)
        active = ms.residency == Residency.ACTIVE
        wait = 0.0 if active else ms.wait_s
        if active:
            switch = 0.0
        elif ms.residency == Residency.STAGED:
            switch = rates.switch_staged_s
        else:
            switch = rates.switch_host_s
        device, host = self.local_tokens(instance_id, call, session, states)
        restore = (host * ms.kv_bytes_per_token / rates.kv_restore_bytes_per_s) if ms.kv_bytes_per_token else 0.0
        rebuild = restore + (call.prompt_len - device - host) / rates.prefill_tokens_per_s
        queue = self._queue(instance_id, call.prompt_len - device + call.expected_output, ms, state, rates)
        resident = active or (ms.residency == Residency.STAGED
                              and _serving_a_sibling(instance_id, state, call.siblings))
        return TtftEstimate(instance_id, wait, switch, rebuild, queue, device + host, resident)

    def _queue(
        self, instance_id: str, new_tokens: int, ms: ModelState,
        state: InstanceState | None, rates: RateDefaults,
    ) -> float:
        """Pressure: the model's prefill backlog ahead of the call, plus a stall of about one
        running call's remaining decode when the call's blocks exceed the free ones (blocks
        held by reservations are not free; they yield only under pressure)."""
        backlog = max(ms.queued_tokens, self.ctx.outstanding_prefill.get(instance_id, 0))
        queue = backlog / rates.prefill_tokens_per_s
        if state is not None and state.total_kv_blocks > 0:
            needed = math.ceil(new_tokens / max(1, state.block_size))
            if needed > state.free_kv_blocks and ms.running_calls > 0:
                queue += ms.running_tokens / ms.running_calls * rates.decode_step_s
        return queue

    def _rates(self, ms: ModelState) -> RateDefaults:
        d = self.rates
        return RateDefaults(
            prefill_tokens_per_s=ms.prefill_tokens_per_s or d.prefill_tokens_per_s,
            decode_step_s=ms.decode_step_s or d.decode_step_s,
            switch_host_s=ms.switch_host_s or d.switch_host_s,
            switch_staged_s=ms.switch_staged_s or d.switch_staged_s,
            kv_restore_bytes_per_s=ms.kv_restore_bytes_per_s or d.kv_restore_bytes_per_s,
        )


def _serving_a_sibling(instance_id: str, state: InstanceState | None,
                       siblings: tuple[tuple[str, str], ...]) -> bool:
    """Whether the model active on the instance is one of ``siblings``' (side calls) that ran
    there."""
    if state is None:
        return False
    active = {name for name, ms in state.models.items() if ms.residency == Residency.ACTIVE}
    return any(i == instance_id and m in active for i, m in siblings)


POLICIES: dict[str, type[_Base]] = {"load": LoadOnly, "cache_aware": CacheAware, "talaria": Talaria}


def make_policy(
    name: str, ctx: PlacementContext | None = None, rates: RateDefaults | None = None
) -> PlacementPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(ctx, rates)  # type: ignore[return-value]
