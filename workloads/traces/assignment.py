"""Which of our models each session of a trace uses: Zipf-like popularity, exact shares."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from engine.sim.model_spec import ModelSpec, catalog
from workloads.traces.trace import Session

__all__ = ["apportion", "assign_models", "bundled_contexts", "popularity_weights"]


def bundled_contexts(models: Sequence[str]) -> dict[str, int]:
    """The context length of each of ``models`` that is a bundled model config."""
    known = set(catalog())
    return {m: ModelSpec.load(m).max_position_embeddings for m in models if m in known}


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
    sessions: Sequence[Session], models: Sequence[str], skew: float = 1.0, seed: int = 0,
    contexts: Mapping[str, int] | None = None,
) -> list[Session]:
    """Give each session one of ``models`` (first = most popular). Session counts per model are
    the Zipf-like shares of :func:`popularity_weights` rounded by largest remainder, so the skew
    is exact; which session gets which model is a seeded shuffle. Order is kept. A child
    session (``parent_id``, a subagent) is not counted: it takes its root session's model.

    ``contexts`` (model -> context tokens; a model not named holds anything): a session whose
    longest call (prompt + output, its subagents' included) outgrows the model the shuffle
    gave it swaps models with the first session that each of the two models holds, so the
    counts stay exact; ValueError if there is none."""
    if not models:
        raise ValueError("assign_models needs at least one model")
    if len(set(models)) != len(models):
        raise ValueError(f"models must be distinct, got {list(models)}")
    roots = [s for s in sessions if s.parent_id is None]
    counts = apportion(len(roots), popularity_weights(len(models), skew))
    labels = [m for m, n in zip(models, counts, strict=True) for _ in range(n)]
    random.Random(seed).shuffle(labels)
    parent = {s.session_id: s.parent_id for s in sessions}

    def root_of(sid: str) -> str:
        seen = set()
        while parent.get(sid) is not None and sid not in seen:
            seen.add(sid)
            sid = parent[sid]  # type: ignore[assignment]
        return sid

    if contexts:
        _fit_contexts(roots, labels, sessions, root_of, contexts)
    model = {s.session_id: m for s, m in zip(roots, labels, strict=True)}
    return [replace(s, model=model[root_of(s.session_id)]) for s in sessions]


def _fit_contexts(roots: Sequence[Session], labels: list[str], sessions: Sequence[Session],
                  root_of: Callable[[str], str], contexts: Mapping[str, int]) -> None:
    """Swap ``labels`` (one per root, in place) until every root's family fits its model."""
    need: dict[str, int] = {}
    for s in sessions:
        longest = max((c.input_tokens + c.output_tokens for c in s.calls), default=0)
        root = root_of(s.session_id)
        need[root] = max(need.get(root, 0), longest)

    def fits(i: int, label: str) -> bool:
        return need[roots[i].session_id] <= contexts.get(label, need[roots[i].session_id])

    for i in range(len(roots)):
        if fits(i, labels[i]):
            continue
        j = next((j for j in range(len(roots)) if labels[j] != labels[i]
                  and fits(i, labels[j]) and fits(j, labels[i])), None)
        if j is None:
            raise ValueError(f"session {roots[i].session_id!r} needs {need[roots[i].session_id]} "
                             f"tokens of context: no swap puts it on a model that holds it")
        labels[i], labels[j] = labels[j], labels[i]
