"""Session-prefill (SP): a cost-benefit decision to serve a continuation in the current slot.

When the active model's slot has closed (queue empty or quantum expired) a continuation of
that model, already queued or reserved to arrive within the horizon, may still be served in
this slot. It pays when what the session saves

    benefit = the round it would otherwise wait (other models' slots and switches)
            + the switch back to this model + the KV rebuild it avoids

exceeds what the others pay

    cost = extra_delay * (calls waiting for other models)

where ``extra_delay`` is how much longer the slot lasts because of it: idle time until its
arrival (for a reserved one) plus its service beyond the end of the work already in flight.
The extension a slot gets from SP is bounded by ``sp_budget_s`` in total, so other models'
calls wait at most one quantum + one SP budget + drain + switches for their slot. A hold (idle
wait for a reserved continuation; ``PolicyConfig.sp_hold``, off in every preset: measured, it
cost more than it saved) never lasts beyond its predicted arrival plus a margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from talaria.policies.reservations import Reservation
from talaria.policies.round_scheduler import Slot
from talaria.policies.view import Estimates, InstanceView, QueuedCall

log = structlog.get_logger("talaria.session_prefill")

__all__ = ["Hold", "SPCandidate", "SPDecision", "SlotCosts", "decide", "decide_queued",
           "hold_until", "slot_costs"]


@dataclass
class SPCandidate:
    session_id: str
    arrival: float  # loop time: now for a queued call, the expected return for a reserved one
    service_s: float  # estimated prefill of its new suffix + decode of its output
    rebuild_s: float  # what rebuilding its KV would cost after a switch away and back
    queued: bool


@dataclass
class SPDecision:
    take: bool
    benefit_s: float
    cost_s: float
    extra_delay_s: float
    reason: str


def decide(
    cand: SPCandidate,
    *,
    now: float,
    drain_end: float,
    waiting_other_calls: int,
    round_wait_s: float,
    switch_back_s: float,
    horizon_s: float,
    budget_left_s: float,
) -> SPDecision:
    """Whether to serve ``cand`` in the current (closed) slot of its model."""
    start = max(now, cand.arrival)
    extra = max(0.0, start + cand.service_s - max(now, drain_end))
    if waiting_other_calls == 0:
        # Nothing else waits: the slot continues anyway; there is nothing to decide.
        return SPDecision(False, 0.0, 0.0, extra, "no other model waiting")
    benefit = round_wait_s + switch_back_s + cand.rebuild_s
    cost = extra * waiting_other_calls
    if cand.arrival - now > horizon_s:
        return SPDecision(False, benefit, cost, extra, "beyond horizon")
    if extra > budget_left_s:
        return SPDecision(False, benefit, cost, extra, "exceeds SP budget")
    if benefit <= cost:
        return SPDecision(False, benefit, cost, extra, "costs more than it saves")
    return SPDecision(True, benefit, cost, extra, "saves more than it costs")


def queued_candidate(view: InstanceView, est: Estimates, pending: QueuedCall) -> SPCandidate:
    call = pending.call
    return SPCandidate(
        session_id=call.session_id,
        arrival=view.now(),
        service_s=est.service_s(call),
        rebuild_s=est.rebuild_s(call.session_id, call.model),
        queued=True,
    )


def reserved_candidate(view: InstanceView, est: Estimates, res: Reservation) -> SPCandidate:
    return SPCandidate(
        session_id=res.session_id,
        arrival=max(view.now(), res.expected_return),
        service_s=est.reserved_service_s(res),
        rebuild_s=est.rebuild_s(res.session_id, res.model),
        queued=False,
    )


@dataclass(frozen=True)
class SlotCosts:
    """What every SP decision about one closed slot shares: computed once per pass over its
    candidates, and again after the pass admits a call (its budget moves) or waits for room
    (other models' queues may move meanwhile). The drain end is the caller's, per call."""

    waiting_other_calls: int
    round_wait_s: float
    switch_back_s: float
    budget_left_s: float


def slot_costs(view: InstanceView, est: Estimates, slot: Slot) -> SlotCosts:
    model = slot.model
    return SlotCosts(
        waiting_other_calls=view.others_waiting(model),
        round_wait_s=est.round_wait_s(model),
        switch_back_s=est.switch_back_s(model),
        budget_left_s=view.policy.sp_budget_s - slot.sp_used_s,
    )


def _decide(cand: SPCandidate, view: InstanceView, costs: SlotCosts, drain_end: float) -> SPDecision:
    return decide(
        cand,
        now=view.now(),
        drain_end=drain_end,
        waiting_other_calls=costs.waiting_other_calls,
        round_wait_s=costs.round_wait_s,
        switch_back_s=costs.switch_back_s,
        horizon_s=view.policy.sp_horizon_s,
        budget_left_s=costs.budget_left_s,
    )


def decide_queued(
    view: InstanceView, est: Estimates, pending: QueuedCall, costs: SlotCosts, drain_end: float
) -> SPDecision:
    """Whether to admit a queued continuation of the closed slot's model now (``costs``:
    ``slot_costs`` of that slot; ``drain_end``: when the calls in flight are expected done)."""
    return _decide(queued_candidate(view, est, pending), view, costs, drain_end)


@dataclass
class Hold:
    """Keep the idle slot until ``until`` (None: switch now); stop waiting for ``give_up``."""

    until: float | None
    give_up: list[str] = field(default_factory=list)


def hold_until(view: InstanceView, est: Estimates, slot: Slot) -> Hold:
    """Loop time until which the idle engine keeps ``slot`` for a reserved continuation, or
    None to switch now. Never past the continuation's predicted arrival plus the idle margin,
    nor past the slot's SP budget. Sessions not worth waiting for are given up."""
    model = slot.model
    now = view.now()
    margin = view.policy.sp_idle_margin_s
    queued = {p.call.session_id for p in view.queued(model)}
    give_up: list[str] = []
    candidates: list[tuple[float, SPCandidate]] = []
    for res in view.reservations.for_model(model):
        if res.session_id in slot.sp_given_up or res.session_id in queued:
            continue
        until = res.expected_return + margin
        if until <= now:
            give_up.append(res.session_id)
            continue
        candidates.append((until, reserved_candidate(view, est, res)))
    costs = slot_costs(view, est, slot)
    for until, cand in sorted(candidates, key=lambda item: item[1].arrival):
        decision = _decide(cand, view, costs, drain_end=now)
        if decision.take:
            log.debug(
                "sp_hold",
                session=cand.session_id,
                until=until,
                benefit=decision.benefit_s,
                cost=decision.cost_s,
            )
            return Hold(min(until, now + costs.budget_left_s), give_up)
        give_up.append(cand.session_id)
    return Hold(None, give_up)
