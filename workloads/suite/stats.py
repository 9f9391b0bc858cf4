"""The suite's figures of a set of session completion times, and their bootstrap intervals.

``figure``: p50 and p95 (``percentile``: linear between order statistics)
and the mean. ``interval``: the 2.5th and 97.5th percentiles of the figure over
``BOOTSTRAP_SAMPLES`` resamples of the sessions with replacement (seeded): how much the
figure owes to which sessions happened to be drawn. ``paired_interval``: the same for the
ratio of two systems' figures over the same sessions, each resample drawing the same
sessions for both, so what the draw does to both cancels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["BOOTSTRAP_SAMPLES", "FIGURES", "figure", "interval", "paired_interval", "percentile"]

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
    low, high = np.percentile(_stat(draws, name), [2.5, 97.5])
    return float(low), float(high)


def paired_interval(base: Sequence[float], other: Sequence[float], name: str, seed: int = 0,
                    samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float]:
    """The bootstrap 95% interval of ``figure(other) / figure(base) - 1``, where ``base[i]``
    and ``other[i]`` are the same session's SCT under two systems: each resample takes the
    same sessions from both."""
    if len(base) != len(other) or not base:
        raise ValueError(f"a paired interval needs two equal, non-empty lists, got "
                         f"{len(base)} and {len(other)} values")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), size=(samples, len(base)))
    a = _stat(np.asarray(base, dtype=float)[picks], name)
    b = _stat(np.asarray(other, dtype=float)[picks], name)
    low, high = np.percentile(b / a - 1.0, [2.5, 97.5])
    return float(low), float(high)


def _stat(draws: np.ndarray, name: str) -> np.ndarray:
    """``figure`` of each row of ``draws``."""
    if name == "mean":
        return draws.mean(axis=1)
    return np.percentile(draws, _QUANTILE[name], axis=1, method="linear")
