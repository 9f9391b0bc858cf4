"""The suite's figures of a set of session completion times, and their bootstrap intervals.

``figure``: p50 and p95 (``percentile``: linear between order statistics)
and the mean. ``interval``: the 2.5th and 97.5th percentiles of the figure over
``BOOTSTRAP_SAMPLES`` resamples of the sessions with replacement (seeded): how much the
figure owes to which sessions happened to be drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["BOOTSTRAP_SAMPLES", "FIGURES", "figure", "interval", "percentile"]

FIGURES: tuple[str, ...] = ("p50", "p95", "mean")
BOOTSTRAP_SAMPLES = 1000
_QUANTILE = {"p50": 50.0, "p95": 95.0}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def figure(scts: Sequence[float], name: str) -> float:
    if name == "mean":
        return sum(scts) / len(scts)
    return percentile(scts, _QUANTILE[name])


def interval(scts: Sequence[float], name: str, seed: int = 0,
             samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float]:
    """The bootstrap 95% interval of ``figure(scts, name)``."""
    if not scts:
        raise ValueError("an interval needs at least one value")
    values = np.asarray(scts, dtype=float)
    rng = np.random.default_rng(seed)
    draws = values[rng.integers(0, len(values), size=(samples, len(values)))]
    if name == "mean":
        stats = draws.mean(axis=1)
    else:
        stats = np.percentile(draws, _QUANTILE[name], axis=1, method="linear")
    low, high = np.percentile(stats, [2.5, 97.5])
    return float(low), float(high)
