"""Continuum's KV time-to-live: how long to pin a session's KV on the device after a call that
ends in a tool call (Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent
Scheduling with KV Cache Time-to-Live", arXiv 2511.02230).

    tau* = argmax_tau  P(gap <= tau) * (T * eta + reload) - tau

``P`` is the empirical CDF of tool-call durations (gaps); ``reload`` what rebuilding the KV
costs if it is evicted (here: prefilling the session's prefix); ``T`` the recent queueing
delay a returning call would suffer without its pin (a sliding window); ``eta`` its
"memoryfulness" in [-1, 1]. Cold start: fewer than ``MIN_SAMPLES`` gaps seen -> gaps assumed
exponential with mean 1 s and eta = 1, as the paper does. Pinning pays nothing when the best
value is not positive: then tau* = 0 (no pin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["MIN_SAMPLES", "continuum_ttl"]

MIN_SAMPLES = 10  # gaps needed before their empirical CDF replaces the cold-start prior
_COLD_START_MEAN_GAP_S = 1.0


def continuum_ttl(
    gaps: Sequence[float], reload_s: float, queue_delay_s: float, eta: float = 1.0
) -> float:
    """tau* in seconds (0: do not pin)."""
    if reload_s < 0 or queue_delay_s < 0:
        raise ValueError("reload and queueing delay must be >= 0")
    if not -1.0 <= eta <= 1.0:
        raise ValueError(f"eta must be in [-1, 1], got {eta}")
    benefit = queue_delay_s * eta + reload_s
    if benefit <= 0:
        return 0.0
    best_tau, best_value = 0.0, 0.0
    if len(gaps) >= MIN_SAMPLES:
        ordered = sorted(gaps)
        n = len(ordered)
        for i, tau in enumerate(ordered):
            if i + 1 < n and ordered[i + 1] == tau:
                continue  # the CDF reaches its value at the last of equal samples
            value = (i + 1) / n * benefit - tau
            if value > best_value:
                best_tau, best_value = tau, value
        return best_tau
    # Exponential prior: P(tau) = 1 - exp(-tau / mean); the argmax is where its density
    # equals 1 / benefit, i.e. tau = mean * ln(benefit / mean) when that is positive.
    mean = _COLD_START_MEAN_GAP_S
    if benefit <= mean:
        return 0.0
    tau = mean * math.log(benefit / mean)
    value = (1.0 - math.exp(-tau / mean)) * benefit - tau
    return tau if value > 0 else 0.0
