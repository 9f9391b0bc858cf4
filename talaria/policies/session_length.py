"""How many more calls a coding-agent session is expected to make, from how many it has made.

A prior on the number of calls per session (its quantiles), fixed once for all traces: the
SWE-bench Claude Code sessions of the real trace's development half (83 sessions,
``workloads.traces.split``; the report half, which the benchmark's headline shows, is not in
it). Policies must not read ``workloads``, so the table is written here and a test
(``tests/policies/test_session_length.py``) holds it equal to the trace's. Between two
quantiles the number of calls is linear in the quantile, so the expected residual is exact
for that piecewise-linear distribution.

The prior's mean residual life falls as a session goes on: a fresh session is expected to make
about 42 more calls, one that has made 40 about 25, one that has made 100 about 9. A session
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

# Calls per session at percentiles 0, 1, ..., 100 (the real trace's development half).
SWE_AGENT_CALLS: tuple[float, ...] = (
    2.0, 2.0, 3.28, 4.92, 6.0, 6.2, 7.84, 8.74, 9.0, 9.38, 10.6, 13.02, 13.84, 14.0, 14.0,
    14.0, 14.12, 14.94, 15.76, 16.0, 16.4, 17.44, 19.0, 19.0, 19.68, 20.0, 20.32, 21.0, 21.0,
    22.56, 23.6, 24.42, 25.24, 26.06, 26.88, 27.0, 27.52, 28.34, 29.16, 29.98, 31.6, 32.0,
    32.44, 33.26, 34.0, 34.0, 34.72, 35.54, 36.72, 38.0, 38.0, 40.46, 41.0, 41.46, 42.28, 43.1,
    43.92, 44.0, 44.0, 44.38, 45.6, 48.02, 48.84, 49.66, 50.96, 52.0, 52.36, 54.82, 55.0, 55.0,
    55.4, 56.88, 60.08, 61.72, 62.0, 62.0, 62.64, 64.0, 64.0, 64.78, 65.0, 65.42, 66.24, 67.12,
    68.76, 69.0, 69.0, 69.68, 71.16, 71.98, 81.6, 84.62, 85.88, 87.78, 90.16, 91.8, 97.04,
    101.7, 106.52, 112.98, 122.0,
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
        cached = self._cache.get(calls_done)  # keyed by calls_done: ranking asks per call
        if cached is None:
            if calls_done < 0:
                raise ValueError(f"calls_done must be >= 0, got {calls_done}")
            k = min(calls_done, int(self.quantiles[-1]))
            cached = self._cache[calls_done] = max(1.0, _residual(self.quantiles, float(k)))
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
