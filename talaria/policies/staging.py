"""D2D staging: which model to copy into the device staging region while the current runs.

The model most likely needed next: under the priority switch, the one the priority would
pick (the model of the first queued session, else of the first session expected back);
otherwise the next one in round order (after the active model) with queued calls, else with
live reservations. It is staged only when its weights are only in host memory, fit the
staging region, and no other staging copy is in progress, so a staged model is not replaced
while it is still the best guess.
"""

from __future__ import annotations

from engine.interface import Residency
from talaria.policies.priority import best_key, priority_key
from talaria.policies.view import InstanceView

__all__ = ["predicted_next", "staging_target"]


def predicted_next(view: InstanceView) -> str | None:
    active = view.active_model
    if view.policy.priority_switch:
        return _first_by_priority(view, active)
    reserved = {r.model for r in view.reservations.all()}
    nxt = view.rounds.next_model(active, lambda m: m != active and bool(view.queued(m)))
    if nxt is None:
        nxt = view.rounds.next_model(active, lambda m: m != active and m in reserved)
    return nxt


def _first_by_priority(view: InstanceView, active: str | None) -> str | None:
    order, ratio = view.policy.admission_order, view.policy.starvation_ratio
    now = view.now()
    best: dict[str, tuple[float, ...]] = {}
    for m in view.models:
        key = best_key(order, list(view.queued(m)),
                       lambda c: view.service(c.call.session_id, now - c.arrived), ratio)
        if m != active and key is not None:
            best[m] = key
    if not best:
        for res in view.reservations.all():
            key = priority_key(order, view.service(res.session_id, 0.0), ratio)
            if res.model != active and (res.model not in best or key < best[res.model]):
                best[res.model] = key
    return min(best, key=lambda m: best[m]) if best else None


def staging_target(view: InstanceView) -> str | None:
    """The model to start staging now, or None."""
    nxt = predicted_next(view)
    if nxt is None:
        return None
    if any(r == Residency.STAGING for r in view.residency.values()):
        return None
    if view.residency.get(nxt) != Residency.HOST or not view.can_stage(nxt):
        return None
    return nxt
