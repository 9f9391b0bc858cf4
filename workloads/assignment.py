"""Which of our models each session of a trace uses: Zipf-like popularity, exact shares."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace

from workloads.trace import Session

__all__ = ["apportion", "assign_models", "popularity_weights"]


def popularity_weights(num_models: int, skew: float) -> list[float]:
    """Zipf-like popularity: model i (0-based) gets weight 1 / (i + 1) ** skew, normalised.
    ``skew = 0`` is uniform."""
    if num_models < 1:
        raise ValueError("need at least one model")
    if skew < 0 or not math.isfinite(skew):
        raise ValueError(f"skew must be a finite number >= 0, got {skew}")
    raw = [1.0 / (i + 1) ** skew for i in range(num_models)]
    total = sum(raw)
    return [w / total for w in raw]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integer counts proportional to ``weights`` (largest remainder)."""
    if total < 0:
        raise ValueError("total must be >= 0")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("weights must be non-negative and not all zero")
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def assign_models(
    sessions: Sequence[Session], models: Sequence[str], skew: float = 1.0, seed: int = 0
) -> list[Session]:
    """Give each session one of ``models`` (first = most popular). Session counts per model are
    the Zipf-like shares of :func:`popularity_weights` rounded by largest remainder, so the skew
    is exact; which session gets which model is a seeded shuffle. Order is kept. A child
    session (``parent_id``, a subagent) is not counted: it takes its root session's model."""
    if not models:
        raise ValueError("assign_models needs at least one model")
    if len(set(models)) != len(models):
        raise ValueError(f"models must be distinct, got {list(models)}")
    roots = [s for s in sessions if s.parent_id is None]
    counts = apportion(len(roots), popularity_weights(len(models), skew))
    labels = [m for m, n in zip(models, counts, strict=True) for _ in range(n)]
    random.Random(seed).shuffle(labels)
    model = {s.session_id: m for s, m in zip(roots, labels, strict=True)}
    parent = {s.session_id: s.parent_id for s in sessions}

    def root_model(sid: str) -> str:
        seen = set()
        while parent.get(sid) is not None and sid not in seen:
            seen.add(sid)
            sid = parent[sid]  # type: ignore[assignment]
        return model[sid]

    return [replace(s, model=root_model(s.session_id)) for s in sessions]
