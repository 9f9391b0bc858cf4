"""Whether the active model's open slot yields to another model now (the priority switch).

Both sides of the comparison are weighed by the sessions their slots would serve: the active
model's queued, running and soon-returning sessions, and each waiting model's distinct
sessions. Weighing a waiting model by its calls made one session's parallel calls on two
models (an agent's) outrank each other, so a slot yielded at once after every switch."""

from __future__ import annotations

from talaria.instance.calls import CallBook
from talaria.instance.estimates import Estimator
from talaria.instance.sessions import SessionKeeper
from talaria.policies.config import PolicyConfig
from talaria.policies.model_choice import SlotYield, holds_slot, outranking_model
from talaria.policies.priority import best_key, first_model
from talaria.policies.round_scheduler import Slot

__all__ = ["slot_outranked"]


def slot_outranked(
    slot: Slot, now: float, models: list[str], policy: PolicyConfig, calls: CallBook,
    sessions: SessionKeeper, est: Estimator,
) -> SlotYield:
    """Whether a waiting session of another model outranks every session of the slot's
    model: queued, in flight, or expected back before the switch would be over."""
    order, ratio = policy.admission_order, policy.starvation_ratio
    floor = policy.starvation_min_wait_s
    best_waiting = sessions.best_waiting_key
    waiting_best = {}
    for m in models:
        key = None if m == slot.model else best_waiting(calls.waiting(m), now)
        if key is not None:
            waiting_best[m] = key
    if not waiting_best:
        return SlotYield(None, "nothing else waits")
    own = [*calls.waiting(slot.model), *calls.running.values()]
    keys = [best_waiting(own, now)]
    waiting_sessions = {m: len({p.call.session_id for p in calls.waiting(m)})
                        for m in waiting_best}
    switch_s = est.switch_s(first_model(order, waiting_best, waiting_sessions))
    reserved = sessions.reservations.for_model(slot.model)
    returning = [r.session_id for r in reserved
                 if holds_slot(r.expected_return, now, switch_s, policy.sp_idle_margin_s)]
    keys.append(best_key(order, returning, lambda sid: sessions.service(sid, 0.0),
                         ratio, min_wait_s=floor))
    active_best = min((k for k in keys if k is not None), default=None)
    served = {p.call.session_id for p in own} | {r.session_id for r in reserved}
    return outranking_model(
        active_best, waiting_best, slot_age_s=now - slot.opened, switch_in_s=slot.switch_s,
        switch_to_s={m: est.switch_s(m) for m in waiting_best},
        min_slot_factor=policy.min_slot_factor, order=order,
        waiting_sessions=waiting_sessions, active_sessions=len(served))
