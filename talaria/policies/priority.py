"""Priorities between sessions: which queued call is admitted first, which model is served
next. Pure decisions on what a session has had so far (``Service``).

- ``fifo``: calls in arrival order (the round scheduler's own order).
- ``program_fcfs`` (Continuum, arXiv 2511.02230): program-level first come first served, by
  the session's first arrival; sessions whose KV is pinned (within their TTL) go first.
- ``las`` (Autellix, arXiv 2502.13965, PLAS): program-level least attained service, the
  session whose earlier calls have had the least execution time first; a session whose
  total wait has reached ``starvation_ratio`` times its service is promoted ahead of all
  (Autellix's anti-starvation rule, Alg. 1).

``next_model`` applies the same priority across the models of one server: the next slot goes
to the model whose best waiting call has the highest priority (round order breaks ties).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from talaria.policies.round_scheduler import RoundScheduler

__all__ = ["Service", "priority_key", "order_queue", "next_model"]

T = TypeVar("T")


@dataclass(frozen=True)
class Service:
    """What one waiting call's session has had: execution time of its earlier calls, time it
    has waited in all (this call's wait so far included), when it first arrived, and whether
    it holds a pinned reservation."""

    attained_s: float
    waited_s: float
    first_arrival: float
    pinned: bool = False


def priority_key(order: str, service: Service, starvation_ratio: float) -> tuple[float, ...]:
    """Smaller goes first; equal keys keep arrival order."""
    if order == "fifo":
        return ()
    if order == "program_fcfs":
        return (0.0 if service.pinned else 1.0, service.first_arrival)
    if order == "las":
        starved = service.waited_s >= starvation_ratio * service.attained_s > 0
        return (0.0 if starved else 1.0, service.attained_s)
    raise ValueError(f"unknown queue order {order!r}")


def order_queue(
    order: str, calls: Sequence[T], service_of: Callable[[T], Service], starvation_ratio: float
) -> list[T]:
    """``calls`` (in arrival order) in admission order."""
    if order == "fifo":
        return list(calls)
    return sorted(calls, key=lambda c: priority_key(order, service_of(c), starvation_ratio))


def next_model(
    rounds: RoundScheduler,
    current: str | None,
    waiting: Mapping[str, Sequence[T]],
    model_order: str,
    service_of: Callable[[T], Service],
    starvation_ratio: float,
) -> str | None:
    """The next model to serve under ``model_order`` (``talaria.config.MODEL_ORDERS``):
    round order after ``current`` (``current`` last), or under ``las`` the model whose best
    waiting call has the least attained service, round order among equals. None when
    nothing waits."""
    models = rounds.order
    start = models.index(current) + 1 if current in models else 0
    rotated = [models[(start + i) % len(models)] for i in range(len(models))]
    candidates = [m for m in rotated if waiting.get(m)]
    if model_order == "round" or not candidates:
        return candidates[0] if candidates else None

    def best(m: str) -> tuple[float, ...]:
        return min(priority_key("las", service_of(c), starvation_ratio) for c in waiting[m])

    return min(candidates, key=best)
