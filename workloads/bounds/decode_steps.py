"""A third fact for bursts: a step decodes for one model only, and a session decodes one token
a step.

The additive capacity fact (``workloads.bounds.bound``) lets each decode share its step's
fixed cost G with every other session of its model, as if they all decoded together, and
lets sessions of different models overlap freely in the server's time. In a burst (every
session arriving at 0) neither holds for the sessions that finish first. Take any set Q of
sessions that all finish by time x:

- a session has one call in flight and a call decodes one token a step, so the steps that
  decode for Q's sessions of model M number at least the most decode steps one of them takes,
  ``max d_i`` over those sessions (``d_i``: each call's output tokens after its first, which
  the prefill's last chunk samples, summed over the session's calls);
- a step holds one model's tokens, and costs at least G_M, the least fixed cost of a step of
  1 to ``max_num_batched_tokens`` tokens (``call_work.step_fixed_seconds`` at
  ``CostModel.least_weights_seconds``: G grows with a step's tokens, but for an engine that
  runs every MoE expert for small batches, whose G drops just past that range), plus what
  its tokens and rows add (``WorkModel.token_terms``: additive over calls, ``v_i`` a
  session's sum), less the virtual clock's resolution, as a timer fires up to that early
  (``talaria.clock``);
- every step that serves Q runs inside [0, x], and each server runs one step at a time, so
  those steps take at most ``servers * x``.

So ``sum over models M of (G_M - tick) * max d_i over Q's sessions of M + sum over Q of
v_i <= servers * x``, and ``x >= crit_i`` for each session of Q; the k-th smallest SCT is at
least the least x that some k sessions allow. Each ``lam`` of ``DECODE_LAMS`` (compute
weighed against memory, as in ``call_work``) gives a valid bound.

It is a fact of the simulator's engine, where a step's tokens add to its cost. The oracle
schedule's machine (``workloads.bounds.oracle``) runs one engine per session, those of a
model side by side, so a batch there costs what its longest member's step costs alone: its
sessions' token terms do not add up, and it may read below this fact (a crafted burst in
``tests/workloads/bounds/test_decode_steps.py`` does, by 0.04%).

Computing it: with sessions sorted by crit, a set whose largest crit is the j-th's draws from
the first j. Among those, the least work of r sessions of model M is
``h_M(r) = min over t of (G_M * d_(t) + the r least v among M's t least-d sessions)``
(t: where the set's largest d sits); the least work of k sessions is the min-plus
convolution of the ``h_M`` over models; the k-th bound is the least, over j >= k, of
``max(crit_j, least work of k among the first j / servers)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["DECODE_LAMS", "decode_step_bound"]

DECODE_LAMS: tuple[float, ...] = tuple(lam / 10.0 for lam in range(11))


def decode_step_bound(
    critical: Sequence[float], models: Sequence[str], decodes: Sequence[int],
    token_work: Sequence[float], step_floor: Mapping[str, float], servers: int,
) -> list[float]:
    """For k = 1..n, a lower bound on the k-th smallest SCT of a burst of these sessions:
    ``critical`` each one's critical path, ``models`` its model, ``decodes`` its decode
    steps, ``token_work`` its token terms ``v_i``; ``step_floor`` each model's least cost
    of a step, tick taken off (``G_M - tick``); ``servers`` the servers' count."""
    n = len(critical)
    if not n == len(models) == len(decodes) == len(token_work):
        raise ValueError("one critical path, model, decode count and token work per session")
    order = np.argsort(np.asarray(critical, dtype=float), kind="stable")
    crit = np.asarray(critical, dtype=float)[order]
    names = [models[i] for i in order]
    steps = np.asarray(decodes, dtype=float)[order]
    work = np.asarray(token_work, dtype=float)[order]
    best = np.full(n, np.inf)
    members: dict[str, list[int]] = {}
    by_model: dict[str, np.ndarray] = {}  # h_M over each model's sessions among the first j
    for j in range(1, n + 1):
        model = names[j - 1]
        mine = members.setdefault(model, [])
        mine.append(j - 1)
        by_model[model] = _least_work(steps[mine], work[mine], max(0.0, step_floor[model]))
        least = np.zeros(1)  # least[k]: the least work of k sessions among the first j
        for name in sorted(by_model):
            least = _min_plus(least, by_model[name])
        value = np.maximum(crit[j - 1], least[1:] / servers)
        best[:j] = np.minimum(best[:j], value)
    return [float(v) for v in best]


def _least_work(steps: np.ndarray, work: np.ndarray, floor: float) -> np.ndarray:
    """h(r) for r = 0..len: the least ``floor * max steps + sum work`` over sets of r of
    one model's sessions."""
    n = len(steps)
    by_steps = np.argsort(steps, kind="stable")
    steps, work = steps[by_steps], work[by_steps]
    rows = np.full((n, n), np.inf)  # row t: the work of the t + 1 fewest-step sessions
    lower = np.tril_indices(n)
    rows[lower] = work[lower[1]]
    rows.sort(axis=1)
    totals = floor * steps[:, None] + np.cumsum(rows, axis=1)
    return np.concatenate(([0.0], totals.min(axis=0)))


def _min_plus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c[k] = min over i + j = k of a[i] + b[j]."""
    if len(a) < len(b):
        a, b = b, a
    out = np.full(len(a) + len(b) - 1, np.inf)
    for i, value in enumerate(b):
        np.minimum(out[i:i + len(a)], a + value, out=out[i:i + len(a)])
    return out
