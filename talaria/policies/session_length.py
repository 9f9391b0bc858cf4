"""How many more calls a coding-agent session is expected to make, from how many it has made.

A prior on the number of calls per session (its quantiles), fixed once for all traces: the
SWE-bench Claude Code sessions of the shared real trace (179 sessions; the same table as
``workloads/data/swe_calibration.json``'s ``calls_per_session``, repeated here because policies
must not read ``workloads``). Between two quantiles the number of calls is linear in the
quantile, so the expected residual is exact for that piecewise-linear distribution.

The prior's mean residual life falls as a session goes on: a fresh session is expected to make
about 43 more calls, one that has made 40 about 27, one that has made 100 about 16. A session
that has made more calls is nearer its end, so "fewest expected remaining calls first" is the
shortest-expected-remaining-work rule on this distribution, and it serves the most advanced
sessions first: the opposite of least-attained-service, which is right only when the
remaining work grows with the work done (a decreasing hazard).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

__all__ = ["SWE_AGENT_CALLS", "SessionLengthPrior", "swe_agent_prior"]

# Calls per session at percentiles 0, 1, ..., 100 (179 real SWE-bench agent sessions).
SWE_AGENT_CALLS: tuple[float, ...] = (
    2.0, 2.78, 3.0, 3.34, 6.0, 6.0, 8.0, 9.0, 9.24, 10.04, 12.8, 13.58, 14.0, 14.0, 14.92,
    15.0, 16.0, 16.0, 16.0, 16.82, 18.0, 18.38, 19.0, 19.0, 19.0, 19.5, 20.0, 20.06, 21.0,
    21.62, 22.0, 22.18, 23.96, 25.0, 25.52, 26.0, 26.08, 27.0, 27.0, 28.0, 28.2, 29.0, 30.0,
    30.54, 31.32, 32.1, 33.88, 34.0, 34.44, 36.22, 38.0, 38.0, 39.68, 41.0, 42.0, 42.0, 43.0,
    43.46, 44.0, 44.02, 45.0, 46.0, 46.72, 48.14, 49.92, 52.0, 52.48, 53.26, 54.0, 54.82,
    55.0, 56.0, 58.0, 58.0, 59.72, 60.0, 61.28, 62.0, 62.0, 64.0, 64.4, 65.18, 66.0, 66.74,
    67.0, 69.0, 69.08, 70.86, 75.84, 82.84, 85.4, 87.98, 90.0, 94.16, 99.64, 104.7, 111.88,
    113.32, 119.88, 124.64, 145.0,
)


@dataclass(frozen=True)
class SessionLengthPrior:
    """A distribution of calls per session given by its quantiles at evenly spaced
    probabilities (the first at 0, the last at 1), nondecreasing."""

    quantiles: tuple[float, ...]
    _cache: dict[int, float] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        q = self.quantiles
        if len(q) < 2:
            raise ValueError("a session-length prior needs at least two quantiles")
        if any(b < a for a, b in zip(q, q[1:], strict=False)) or q[0] < 0:
            raise ValueError("session-length quantiles must be >= 0 and nondecreasing")

    def expected_remaining(self, calls_done: int) -> float:
        """E[N - k | N > k] for k = ``calls_done``: the calls a session that has made k is
        still expected to make (k beyond the prior's largest value: its last stretch's
        residual, never less than one call)."""
        if calls_done < 0:
            raise ValueError(f"calls_done must be >= 0, got {calls_done}")
        k = min(calls_done, int(self.quantiles[-1]))
        cached = self._cache.get(k)
        if cached is None:
            cached = self._cache[k] = max(1.0, _residual(self.quantiles, float(k)))
        return cached


def _residual(q: Sequence[float], k: float) -> float:
    """Mean of N - k over N > k, N uniform in quantile between consecutive knots."""
    du = 1.0 / (len(q) - 1)
    mass = 0.0
    total = 0.0
    for a, b in zip(q, q[1:], strict=False):
        if b <= k:
            continue
        lo = max(a, k)  # the part of this segment above k, as a fraction of it
        frac = 1.0 if a >= k else (b - k) / (b - a)
        mass += frac * du
        total += frac * du * ((lo + b) / 2.0 - k)
    if mass <= 0.0:
        return 1.0
    return total / mass


@lru_cache(maxsize=1)
def swe_agent_prior() -> SessionLengthPrior:
    return SessionLengthPrior(SWE_AGENT_CALLS)
