"""Arrival times for a trace's sessions: a Poisson process at a rate, or all at once.

``poisson_arrivals`` draws each gap as ``expovariate(rate)``, which is the unit-rate draw
divided by the rate: with one seed, every rate replays the same gaps scaled (common random
numbers across the rates of a sweep or a capacity search).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from workloads.traces.trace import Session

__all__ = ["at_once", "jittered", "poisson_arrivals"]


def poisson_arrivals(sessions: Sequence[Session], rate: float, seed: int = 0) -> list[Session]:
    """The sessions arriving as a Poisson process of ``rate`` sessions/s (first at 0), in
    trace order."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 sessions/s, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i, s in enumerate(sessions):
        if i:
            t += rng.expovariate(rate)
        out.append(replace(s, arrival_s=round(t, 3)))
    return out


def at_once(sessions: Sequence[Session]) -> list[Session]:
    return [replace(s, arrival_s=0.0) for s in sessions]


def jittered(sessions: Sequence[Session], max_shift_s: float, seed: int = 0) -> list[Session]:
    """Each session's arrival moved later by a uniform draw from [0, ``max_shift_s``] (to the
    millisecond, never earlier), drawn from its own id and ``seed``: a session moves the same
    whatever else the run holds. A subagent's session (``start_after``: its arrival is a delay
    after its parent's call) keeps its own: moving it would only ever delay its parent."""
    if max_shift_s < 0:
        raise ValueError(f"max_shift_s must be >= 0, got {max_shift_s}")

    def moved(s: Session) -> float:
        shift = max_shift_s * random.Random(f"{seed}/{s.session_id}").random()
        return max(s.arrival_s, round(s.arrival_s + shift, 3))

    return [s if s.start_after is not None else replace(s, arrival_s=moved(s)) for s in sessions]
