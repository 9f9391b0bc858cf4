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
  first, but never before it has waited ``min_wait_s`` (the slot quantum): a session whose
  one short call was served, then waited a few seconds, is not starved by any rotation's
  standard, and promoting it made slots thrash between models at their shortest length.
  A session not served yet is not promoted: it is ranked by the prior. When models
  rotate in round order the slot quantum bounds its wait; under the priority switch
  (``next_model`` below) nothing does, as a slot that reaches its quantum reopens for its
  own model while that model holds the first waiting session (on the real trace GLM's fresh
  sessions wait 1400 s behind Qwen's; README, "Other runs").

``next_model`` applies the same priority across the models of one server: the next slot goes
to the model whose best waiting call has the highest priority. Under ``priority`` (Talaria),
models rank by ``model_key``: a slot serves every ready session of its model at once, so
under ``remaining`` a model's best expected remaining calls count over the sessions it would
serve (Smith's ratio rule), and a session's arrival time, which orders sessions within a
model, is no reason to pick one model over another. With the starvation floor above, bursts
mind far less whether their sessions arrive at one instant or up to a second apart (before,
the first arrival's model got the device and slots then thrashed; a burst's mean moved by
4.5% and 9.0% on average in two draws, now 2.1% and 5.2%); at the suite's own arrivals it is
about neutral (docs/benchmark.md, "Arrivals a second apart"). Equal ranks go to the model
with the most calls waiting (``first_model``); round order breaks what ties remain, and is
the tie-break under ``las``.
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

__all__ = ["Service", "best_key", "first_model", "model_key", "next_model",
           "priority_key", "remaining_key"]

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


def priority_key(order: str, service: Service, starvation_ratio: float, *,
                 min_wait_s: float = 0.0) -> tuple[float, ...]:
    """Smaller goes first; equal keys keep arrival order. ``min_wait_s``: under
    ``remaining``, the least wait that makes a session starved whatever its service."""
    if order == "fifo":
        return ()
    if order == "program_fcfs":
        return (0.0 if service.pinned else 1.0, service.first_arrival)
    if order == "lpm":
        return (-float(service.device_cached_tokens),)
    if order == "remaining":
        return remaining_key(service.waited_s, service.attained_s, service.first_arrival,
                             service.calls, starvation_ratio, min_wait_s)
    if order == "las":
        starved = service.waited_s >= starvation_ratio * service.attained_s > 0
        return (0.0 if starved else 1.0, service.attained_s)
    raise ValueError(f"unknown queue order {order!r}")


def remaining_key(waited_s: float, attained_s: float, first_arrival: float, calls: int,
                  starvation_ratio: float, min_wait_s: float) -> tuple[float, float, float]:
    """``priority_key`` under ``remaining``, from a session's facts (``Service``'s fields of
    the same names) without building a ``Service``: the key every loop turn ranks each
    queue by. Among the starved, the one that has waited longest; otherwise the fewest
    expected remaining calls, then the earliest session. ``SessionKeeper.best_waiting_key``
    finds the least of these keys without building them: a change to the rule here goes
    there too (``tests/instance/test_session_priority.py`` holds the two equal)."""
    if waited_s >= starvation_ratio * attained_s > 0 and waited_s >= min_wait_s:
        return (0.0, -waited_s, first_arrival)
    return (1.0, swe_agent_prior().expected_remaining(calls), first_arrival)


def best_key(
    order: str, calls: Sequence[T], service_of: Callable[[T], Service], starvation_ratio: float,
    *, min_wait_s: float = 0.0,
) -> tuple[float, ...] | None:
    """The priority key of the first of ``calls`` under ``order`` (None: no calls)."""
    return min((priority_key(order, service_of(c), starvation_ratio, min_wait_s=min_wait_s)
                for c in calls), default=None)


def model_key(order: str, key: tuple[float, ...], sessions: int) -> tuple[float, ...]:
    """A model's rank for the next slot (smaller first), from the best priority ``key`` among
    its sessions and the ``sessions`` a slot of it would serve. Under ``remaining``: a starved
    session keeps its rank (the longest wait first); otherwise the best expected remaining
    calls over ``sessions`` (Smith's rule, each session a unit of weight, as one slot
    advances them all); the arrival-time tie-break is dropped either way. Other orders: the
    key itself."""
    if order != "remaining":
        return key
    if key[0] > 0.0:
        return (key[0], key[1] / max(1, sessions))
    return key[:2]


def next_model(
    rounds: RoundScheduler,
    current: str | None,
    waiting: Mapping[str, Sequence[T]],
    model_order: str,
    service_of: Callable[[T], Service],
    starvation_ratio: float,
    queue_order: str = "las",
    *,
    min_wait_s: float = 0.0,
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
        key = best_key(order, waiting[m], service_of, starvation_ratio, min_wait_s=min_wait_s)
        assert key is not None
        best[m] = key
    if model_order == "las":
        return min(candidates, key=best.__getitem__)
    return first_model(order, best, {m: len(waiting[m]) for m in candidates})


def first_model(order: str, best: Mapping[str, tuple[float, ...]],
                waiting_calls: Mapping[str, int]) -> str:
    """The model that ranks first by ``model_key`` (its best key under ``order`` and its
    calls waiting, ``waiting_calls``, or its sessions waiting where the caller counts those,
    as the priority switch does; missing: none); among equal ranks the one with the most
    waiting, then the best key itself (under ``remaining``: the earliest session), then
    the first in ``best``'s order."""
    if not best:
        raise ValueError("first_model needs at least one model")
    return min(best, key=lambda m: (model_key(order, best[m], waiting_calls.get(m, 0)),
                                    -waiting_calls.get(m, 0), best[m]))
