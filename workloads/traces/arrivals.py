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

__all__ = ["at_once", "poisson_arrivals"]


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
