"""When the active model gives the instance up to a session that outranks all of its own.

Under session-level priority (``talaria.policies.priority``) a slot does not wait for its
quantum or for its model to drain when another model ranks before it (``priority.model_key``:
a slot serves all of its model's sessions at once, so the best session's rank counts over
the sessions served): the waiting calls of that model against the active model's sessions,
the ones queued, the ones in flight, and the ones expected back (their reservations; the
best key among those only of the ones due before the switch would be over). The slot then
closes: the active model admits nothing more, its calls in flight finish, and the
outranking model is switched in. So the sessions served first are the ones the priority
puts first, whatever model they use, as in a step-level schedule whose switches were free.

A session of the active model expected back (a soft reservation) counts among its sessions
only while waiting for it is cheaper than switching away: it is due before the switch to the
outranking model would even be over, and it is not overdue (``holds_slot``). Holding the
slot for a session due later, or one that has not come back when expected, costs the
outranking session, which is waiting now, more than the switch back costs the returning one.
That rule picks the active model's best key only. The count of sessions its slot serves
(``active_sessions``, the rank's divisor) takes every session holding a reservation on the
model, due soon or not: they are the sessions a switch away makes pay a switch back.
Counting only those due before the switch yields more often and was slower on the 30
development scenarios (+5.6% [+2.0, +10.1] at p50, +2.8% [+1.0, +5.3] at the mean;
docs/constants.md).

Switches are not free, so a slot first lasts ``min_slot_factor`` times the switch that
opened it plus the switch to the outranking model: a round trip's switching is then at most
a fraction 1/``min_slot_factor`` of the time. Over staged (D2D) weights a switch costs tens
of milliseconds and slots may be that short; over host-to-device copies they last seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from talaria.policies.priority import first_model, model_key

__all__ = ["SlotYield", "outranking_model", "holds_slot"]

Key = tuple[float, ...]


@dataclass(frozen=True)
class SlotYield:
    """The model that outranks the active one (None: keep the slot) and why."""

    model: str | None
    reason: str


def outranking_model(
    active_best: Key | None,
    waiting_best: Mapping[str, Key],
    *,
    slot_age_s: float,
    switch_in_s: float,
    switch_to_s: Mapping[str, float],
    min_slot_factor: float,
    order: str = "remaining",
    waiting_sessions: Mapping[str, int] | None = None,
    active_sessions: int = 1,
) -> SlotYield:
    """Whether the open slot of the active model yields now, and to which model.

    ``active_best``: the best priority key among the active model's queued, running and
    soon-returning sessions (None: it has none); ``waiting_best``: each other model's best
    waiting key (models with nothing waiting left out); ``switch_in_s``: what the switch
    into the active model cost; ``switch_to_s``: each other model's switch cost now;
    ``order``: the queue order the keys are of; ``waiting_sessions``: each other model's
    distinct sessions waiting (the sessions its slot would serve; they also break ties,
    ``priority.first_model``), counted as ``active_sessions`` is: the sessions the active
    model's slot serves (queued, in flight or expected back). Both sides count sessions, not
    calls, or one session's parallel calls on two models outrank each other
    (``talaria.instance.slot_yield``).
    """
    if not waiting_best:
        return SlotYield(None, "nothing else waits")
    waiting_sessions = waiting_sessions or {}
    model = first_model(order, waiting_best, waiting_sessions)
    if active_best is not None and not (
            model_key(order, waiting_best[model], waiting_sessions.get(model, 0))
            < model_key(order, active_best, active_sessions)):
        return SlotYield(None, "the active model's sessions come first")
    min_slot = min_slot_factor * (switch_in_s + switch_to_s.get(model, 0.0))
    if slot_age_s < min_slot:
        return SlotYield(None, "the slot has not paid for its switch yet")
    return SlotYield(model, "outranked")


def holds_slot(expected_return: float, now: float, switch_s: float, overdue_margin_s: float) -> bool:
    """Whether a reservation of the active model, its session expected back at
    ``expected_return``, keeps the slot from yielding to an outranking model whose switch takes
    ``switch_s``: it is due before that switch would be over, and not more than
    ``overdue_margin_s`` late."""
    return now - overdue_margin_s < expected_return <= now + switch_s
