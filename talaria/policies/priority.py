"""Priorities between sessions: which queued call is admitted first, which model is served
next. Pure decisions on what a session has had so far (``Service``).

- ``fifo``: calls in arrival order (the round scheduler's own order).
- ``program_fcfs`` (Continuum, arXiv 2511.02230): program-level first come first served, by
  the session's first arrival; sessions whose KV is pinned (within their TTL) go first.
- ``las`` (Autellix, arXiv 2502.13965, PLAS): program-level least attained service, the
  session whose earlier calls have had the least execution time first; a session whose
  total wait has reached ``starvation_ratio`` times its service is promoted ahead of all
  (Autellix's anti-starvation rule, Alg. 1).
- ``lpm`` (SGLang's ``schedule_policy="lpm"``, python/sglang/srt/managers/schedule_policy.py):
  the call whose session has the longest prefix cached on the device first (its radix tree's
  longest prefix match), arrival order among equals. SGLang's default is now ``fcfs``; LPM is
  the policy it offers for prefix reuse, the one agents' growing prompts suit.
- ``remaining`` (Talaria): the session with the fewest expected remaining calls first, by the
  calls it has made and a prior on session length (``talaria.policies.session_length``):
  shortest expected remaining work. The same starvation guard as ``las`` promotes a session
  that has waited ``starvation_ratio`` times its service, the one that has waited longest
  first. A session not served yet is not promoted: it is ranked by the prior. When models
  rotate in round order the slot quantum bounds its wait; under the priority switch
  (``next_model`` below) nothing does, as a slot that reaches its quantum reopens for its
  own model while that model holds the first waiting session (on the real trace GLM's fresh
  sessions wait 1400 s behind Qwen's; README, "Other runs").

``next_model`` applies the same priority across the models of one server: the next slot goes
to the model whose best waiting call has the highest priority. Under ``priority`` (Talaria),
equal best calls (every session fresh and arrived together, as at the start of a burst) go to
the model with the most calls waiting, whose slot advances the most sessions at once
(``first_model``); round order breaks what ties remain, and is the tie-break under ``las``.
Measured on the default trace with the catalog's round order permuted: talaria's p50 moved
from 344 s to 423, 494 and 624 s under the round-order tie-break, the model served first
sticking (its advanced sessions then outrank the fresh ones), and under the last of them
vllm_sleep_lmcache (540 s) was ahead at p50.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from talaria.policies.round_scheduler import RoundScheduler
from talaria.policies.session_length import swe_agent_prior

__all__ = ["Service", "priority_key", "order_queue", "next_model", "best_key", "first_model"]

T = TypeVar("T")


@dataclass(frozen=True)
class Service:
    """What one waiting call's session has had: execution time of its earlier calls, time it
    has waited in all (this call's wait so far included), when it first arrived, whether it
    holds a pinned reservation, and how many calls it has finished."""

    attained_s: float
    waited_s: float
    first_arrival: float
    pinned: bool = False
    calls: int = 0
    device_cached_tokens: int = 0  # its KV on the device (read only under ``lpm``)


def priority_key(order: str, service: Service, starvation_ratio: float) -> tuple[float, ...]:
    """Smaller goes first; equal keys keep arrival order."""
    if order == "fifo":
        return ()
    if order == "program_fcfs":
        return (0.0 if service.pinned else 1.0, service.first_arrival)
    if order == "lpm":
        return (-float(service.device_cached_tokens),)
    starved = service.waited_s >= starvation_ratio * service.attained_s > 0
    if order == "las":
        return (0.0 if starved else 1.0, service.attained_s)
    if order == "remaining":
        # Among the starved, the one that has waited longest; otherwise the fewest expected
        # remaining calls, then the earliest session.
        if starved:
            return (0.0, -service.waited_s, service.first_arrival)
        return (1.0, swe_agent_prior().expected_remaining(service.calls), service.first_arrival)
    raise ValueError(f"unknown queue order {order!r}")


def order_queue(
    order: str, calls: Sequence[T], service_of: Callable[[T], Service], starvation_ratio: float
) -> list[T]:
    """``calls`` (in arrival order) in admission order."""
    if order == "fifo":
        return list(calls)
    return sorted(calls, key=lambda c: priority_key(order, service_of(c), starvation_ratio))


def best_key(
    order: str, calls: Sequence[T], service_of: Callable[[T], Service], starvation_ratio: float
) -> tuple[float, ...] | None:
    """The priority key of the first of ``calls`` under ``order`` (None: no calls)."""
    return min((priority_key(order, service_of(c), starvation_ratio) for c in calls),
               default=None)


def next_model(
    rounds: RoundScheduler,
    current: str | None,
    waiting: Mapping[str, Sequence[T]],
    model_order: str,
    service_of: Callable[[T], Service],
    starvation_ratio: float,
    queue_order: str = "las",
) -> str | None:
    """The next model to serve under ``model_order`` (``talaria.policies.config.MODEL_ORDERS``):
    round order after ``current`` (``current`` last); under ``las`` the model whose best
    waiting call has the least attained service (round order among equals); under
    ``priority`` the model whose best waiting call comes first by ``queue_order``, among
    equals the one with the most calls waiting (``first_model``). None when nothing
    waits."""
    candidates = [m for m in rounds.after(current) if waiting.get(m)]
    if model_order == "round" or not candidates:
        return candidates[0] if candidates else None
    order = "las" if model_order == "las" else queue_order
    if order == "fifo":
        raise ValueError("model_order 'priority' needs a queue order that ranks sessions")

    best: dict[str, tuple[float, ...]] = {}
    for m in candidates:
        key = best_key(order, waiting[m], service_of, starvation_ratio)
        assert key is not None
        best[m] = key
    if model_order == "las":
        return min(candidates, key=best.__getitem__)
    return first_model(best, {m: len(waiting[m]) for m in candidates})


def first_model(best: Mapping[str, tuple[float, ...]], waiting_calls: Mapping[str, int]) -> str:
    """The model whose best key comes first; among equal keys the one with the most calls
    waiting (``waiting_calls``; missing: none), then the first in ``best``'s order."""
    if not best:
        raise ValueError("first_model needs at least one model")
    return min(best, key=lambda m: (best[m], -waiting_calls.get(m, 0)))
