"""D2D staging: which model to copy into the device staging region while the current runs.

The model most likely needed next is the next one in round order (after the active model)
with queued calls, else with live reservations. It is staged only when its weights are only
in host memory and no other staging copy is in progress, so a staged model is not replaced
while it is still the best guess.
"""

from __future__ import annotations

from engine.interface import Residency
from talaria.policies.view import InstanceView

__all__ = ["predicted_next", "staging_target"]


def predicted_next(view: InstanceView) -> str | None:
    active = view.active_model
    reserved = {r.model for r in view.reservations.all()}
    nxt = view.rounds.next_model(active, lambda m: m != active and bool(view.queued(m)))
    if nxt is None:
        nxt = view.rounds.next_model(active, lambda m: m != active and m in reserved)
    return nxt


def staging_target(view: InstanceView) -> str | None:
    """The model to start staging now, or None."""
    nxt = predicted_next(view)
    if nxt is None:
        return None
    if any(r == Residency.STAGING for r in view.residency.values()):
        return None
    if view.residency.get(nxt) != Residency.HOST:
        return None
    return nxt
