"""The lower bound: no schedule under the simulator's physics beats it at p50, p95 or mean.

Two facts hold in every schedule of every system the simulator runs (``workloads.bounds.call_work``
proves each per call):

1. *Critical path.* A session's calls run one after another with its tool gaps between them,
   and no call finishes sooner than ``critical_seconds`` after it is sent; so a session's SCT
   is at least ``crit_i`` = the sum of its calls' critical times and its gaps.
2. *Capacity.* Each server runs one step at a time, and a step costs at least the sum of
   ``WorkModel`` coefficients over the tokens it holds, for any (lam, theta). So the sessions
   whose calls are all done by time t had at most ``m * t`` seconds of server work among
   them on ``m`` servers: ``sum_i w_i <= m * t`` with ``w_i`` each session's least work.

From these, bounds on the k-th smallest SCT (order statistics) follow, and from those the
percentiles (interpolated between order statistics, as ``workloads.benchmark.report.percentile`` does:
a non-negative mix of lower bounds is one) and the mean (the mean of the order statistics):

- any arrivals: the k-th smallest SCT is at least the k-th smallest ``crit_i``;
- all sessions arriving together (a burst), SCT is completion time, and the k sessions that
  finish first finish no sooner than the larger of their largest ``crit`` and their summed
  work over ``m``: the k-th SCT is at least the least of that over every set of k sessions
  (``_subset_bound``); and, as a step decodes for one model and a session decodes one
  token a step, their models' decode steps are counted apart and each step's fixed cost
  once (``workloads.bounds.decode_steps``, a third fact that takes the first two further);
- any arrivals, the mean: completion times are at least those of preemptive SRPT on one
  machine of speed ``m`` with each session released at its arrival and sized ``w_i`` (SRPT
  completes at least as many jobs as any schedule by every time: Schrage, "A proof of the
  optimality of the shortest remaining processing time discipline", Oper. Res. 16, 1968),
  and each at least arrival + ``crit_i``: order statistic by order statistic, the larger.

Each (lam, theta) of ``GRID`` gives valid bounds; each order statistic takes the largest.
The simulator's virtual clock runs a timer up to ``VIRTUAL_CLOCK_RESOLUTION_S`` early, so
each step and gap of the critical path is taken that much shorter. The bound assumes what
the replay does: a prompt shares tokens only with its own session's earlier calls (and a
subagent's with the call it continues), so nothing else could be cached for it; and a call's
answer is the one the replay gets, the trace's cut at the ``max_tokens`` it asks for
(``AGENT_MAX_TOKENS``) and at its model's context (``call_work.answer_tokens``): a 57,811-token
answer in mini-swe-agent's trace is 32,000 tokens in the replay, and counting it whole put
one session's critical path 105 s above the SCT a schedule reached.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.sim.config import SimEngineConfig
from engine.sim.cost_model import CostModel
from substrate.devices import server_preset
from talaria.clock import VIRTUAL_CLOCK_RESOLUTION_S
from workloads.bounds.call_work import (
    WorkModel,
    call_shapes,
    critical_seconds,
    replayed_lengths,
    step_fixed_seconds,
)
from workloads.bounds.decode_steps import DECODE_LAMS, decode_step_bound
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import AGENT_MAX_TOKENS, call_contexts
from workloads.suite.stats import percentile
from workloads.traces.trace import Session

__all__ = ["GRID", "LowerBound", "SessionBound", "lower_bound", "pooled_bound", "session_bounds",
           "step_floors"]

# (lam, shares): lam weighs compute against memory; shares split a step's fixed cost by
# tokens, by decodes and by decode context (``workloads.bounds.call_work.WorkModel``).
_SHARES = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0),
           (0.5, 0.5, 0.0), (0.5, 0.0, 0.5), (0.0, 0.5, 0.5))
GRID: tuple[tuple[float, tuple[float, float, float]], ...] = tuple(
    (lam / 10.0, shares) for lam in range(11) for shares in _SHARES)


@dataclass(frozen=True)
class SessionBound:
    session_id: str
    arrival_s: float
    critical_s: float  # least SCT: the calls' critical paths and the tool gaps
    work_s: tuple[float, ...]  # least server work, one per GRID point
    model: str = ""
    decodes: int = 0  # decode steps: each call's output tokens after its first
    token_work_s: tuple[float, ...] = ()  # token terms with no step's G, one per DECODE_LAMS


@dataclass
class LowerBound:
    """Lower bounds on the SCT percentiles and mean of any schedule of the trace, and which
    fact gives each (``critical path`` or ``capacity``)."""

    sct_p50_s: float
    sct_p95_s: float
    sct_mean_s: float
    binding: dict[str, str] = field(default_factory=dict)
    order_stats: list[float] = field(default_factory=list)  # k-th smallest SCT's bound
    order_sources: list[str] = field(default_factory=list)  # which fact gives each


def session_bounds(
    sessions: Sequence[Session], spec: ClusterSpec,
    grid: Sequence[tuple[float, tuple[float, float, float]]] = GRID,
) -> list[SessionBound]:
    config = SimEngineConfig()
    budget = spec.max_num_batched_tokens or config.max_num_batched_tokens
    seqs = spec.max_num_seqs or config.max_num_seqs
    catalog = spec.catalog()
    server = server_preset(spec.server)
    costs = {name: CostModel(server, model, spec.tp) for name, model in catalog.items()}
    # A session has one call in flight at a time, so a step of a model decodes for at most
    # as many sessions as use that model.
    users = {name: sum(1 for s in sessions if s.model == name) for name in costs}
    # The most KV a model can have on the device: all memory but its own weights.
    room = {name: cost.kv_capacity_tokens() for name, cost in costs.items()}
    models = {name: [WorkModel.of(cost, max(1, min(seqs, users[name])), budget, room[name],
                                  lam, shares)
                     for lam, shares in grid]
              for name, cost in costs.items()}
    terms = {name: [WorkModel.token_terms(cost, budget, lam) for lam in DECODE_LAMS]
             for name, cost in costs.items()}
    context = call_contexts(spec)
    lengths = replayed_lengths(sessions, AGENT_MAX_TOKENS, context)
    continued = {(c.prefix_from.session_id, c.prefix_from.call) for s in sessions
                 for c in s.calls
                 if c.prefix_from is not None and c.prefix_from.session_id != s.session_id}
    out = []
    tick = VIRTUAL_CLOCK_RESOLUTION_S
    for s in sessions:
        cost, work = costs[s.model], models[s.model]
        critical = 0.0
        totals = [0.0] * len(work)
        tokens = [0.0] * len(DECODE_LAMS)
        decodes = 0
        for shape in call_shapes(s, spec.block_size, lengths, max_tokens=AGENT_MAX_TOKENS,
                                 context=context[s.model], continued=continued):
            steps = math.ceil(shape.new_tokens / budget) + max(0, shape.output - 1)
            critical += critical_seconds(cost, shape, budget) - steps * tick
            decodes += max(0, shape.output - 1)
            for i, model in enumerate(work):
                totals[i] += model.call_seconds(shape)
            for i, model in enumerate(terms[s.model]):
                tokens[i] += model.call_seconds(shape)
        gaps = [c.tool_gap_s or 0.0 for c in s.calls[:-1]]
        critical += sum(max(0.0, g - tick) for g in gaps)
        out.append(SessionBound(s.session_id, s.arrival_s, max(0.0, critical), tuple(totals),
                                s.model, decodes, tuple(tokens)))
    return out


def step_floors(spec: ClusterSpec) -> list[dict[str, float]]:
    """Per ``DECODE_LAMS`` point, each model's least G over the step sizes its engine takes
    (1 to ``max_num_batched_tokens`` tokens) less the clock's resolution
    (``workloads.bounds.decode_steps``)."""
    budget = spec.max_num_batched_tokens or SimEngineConfig().max_num_batched_tokens
    server = server_preset(spec.server)
    costs = {name: CostModel(server, model, spec.tp) for name, model in spec.catalog().items()}
    least = {name: (cost.terms(), cost.least_weights_seconds(budget))
             for name, cost in costs.items()}
    return [{name: step_fixed_seconds(t, lam, weights) - VIRTUAL_CLOCK_RESOLUTION_S
             for name, (t, weights) in least.items()} for lam in DECODE_LAMS]


def lower_bound(sessions: Sequence[Session], spec: ClusterSpec) -> LowerBound:
    """The bound for ``sessions`` replayed on ``spec``'s cluster. A session that starts after
    another's call (a subagent's ``start_after``, or a first call that ``waits_for`` one) is
    timed from that start, which the schedule sets, so its steps need not fall inside the
    window the capacity facts give it: its critical path alone bounds it, the capacity facts
    take the others, and the two parts are pooled (``pooled_bound``: each part's sorted SCTs
    are at least its bounds, so the union's are)."""
    if not sessions:
        raise ValueError("the bound needs at least one session")
    later = {s.session_id for s in sessions if s.start_after is not None or s.calls[0].waits_for}
    bounds = session_bounds(sessions, spec)
    parts = []
    if len(later) < len(bounds):
        parts.append(_capacity_bound([b for b in bounds if b.session_id not in later], spec))
    if later:
        crit = sorted(b.critical_s for b in bounds if b.session_id in later)
        parts.append(LowerBound(
            percentile(crit, 50), percentile(crit, 95), sum(crit) / len(crit),
            dict.fromkeys(("p50", "p95", "mean"), "critical path"), crit,
            ["critical path"] * len(crit)))
    return pooled_bound(parts)


def _capacity_bound(bounds: Sequence[SessionBound], spec: ClusterSpec) -> LowerBound:
    """Every fact of the module doc over sessions timed from their arrivals."""
    servers = spec.servers
    crit = sorted(b.critical_s for b in bounds)
    stats = list(crit)
    source = ["critical path"] * len(crit)
    burst = len({b.arrival_s for b in bounds}) == 1
    mean_bound = sum(crit) / len(crit)
    mean_source = "critical path"
    for i in range(len(GRID)):
        work = [b.work_s[i] for b in bounds]
        if burst:
            capacity = _subset_bound([b.critical_s for b in bounds], work, servers)
            for k, value in enumerate(capacity):
                if value > stats[k]:
                    stats[k], source[k] = value, "capacity"
        completions = _srpt_completions([b.arrival_s for b in bounds], work, servers)
        ends = sorted(b.arrival_s + b.critical_s for b in bounds)
        total = sum(max(c, e) for c, e in zip(completions, ends, strict=True))
        mean = (total - sum(b.arrival_s for b in bounds)) / len(bounds)
        if mean > mean_bound:
            mean_bound, mean_source = mean, "capacity"
    if burst:
        for i, floors in enumerate(step_floors(spec)):
            steps = decode_step_bound(
                [b.critical_s for b in bounds], [b.model for b in bounds],
                [b.decodes for b in bounds], [b.token_work_s[i] for b in bounds], floors,
                servers)
            for k, value in enumerate(steps):
                if value > stats[k]:
                    stats[k], source[k] = value, "capacity"
        burst_mean = sum(stats) / len(stats)
        if burst_mean >= mean_bound:
            mean_bound = burst_mean
            mean_source = "capacity" if "capacity" in source else "critical path"
    return LowerBound(
        sct_p50_s=percentile(stats, 50), sct_p95_s=percentile(stats, 95), sct_mean_s=mean_bound,
        binding={"p50": _binding(stats, source, 50), "p95": _binding(stats, source, 95),
                 "mean": mean_source},
        order_stats=stats,
        order_sources=source,
    )


def pooled_bound(bounds: Sequence[LowerBound]) -> LowerBound:
    """The bound of independent runs' sessions taken together: each run's SCTs, sorted, are
    at least its order-statistic bounds one by one, so the union's are at least the union's
    bounds; the mean is the runs' means weighted by their sessions."""
    if not bounds:
        raise ValueError("nothing to pool")
    if len(bounds) == 1:
        return bounds[0]
    pairs = sorted((v, src) for b in bounds
                   for v, src in zip(b.order_stats, b.order_sources, strict=True))
    stats, sources = [v for v, _ in pairs], [src for _, src in pairs]
    sizes = [len(b.order_stats) for b in bounds]
    mean = sum(b.sct_mean_s * n for b, n in zip(bounds, sizes, strict=True)) / sum(sizes)
    means = {b.binding["mean"] for b in bounds}
    return LowerBound(
        percentile(stats, 50), percentile(stats, 95), mean,
        {"p50": _binding(stats, sources, 50), "p95": _binding(stats, sources, 95),
         "mean": "capacity" if "capacity" in means else "critical path"},
        stats, sources)


def _binding(stats: list[float], source: list[str], q: float) -> str:
    pos = q / 100 * (len(stats) - 1)
    return source[min(len(stats) - 1, math.ceil(pos))]


def _subset_bound(critical: Sequence[float], work: Sequence[float], servers: int) -> list[float]:
    """For k = 1..n: the least, over sets S of k sessions, of max(max crit over S, sum of
    work over S / servers). With sessions sorted by crit, a set whose largest crit is the
    j-th's is at best the j-th with the k - 1 least-work sessions before it, so the bound is
    ``min over j >= k of max(crit_j, (k smallest work among the first j) / servers)``; the
    first term grows with j and the second does not, so the minimum sits where they cross
    (binary search)."""
    order = np.argsort(np.asarray(critical, dtype=float), kind="stable")
    crit = np.asarray(critical, dtype=float)[order]
    w = np.asarray(work, dtype=float)[order]
    n = len(crit)
    out = []
    for k in range(1, n + 1):
        lo, hi = k, n  # the smallest j whose crit reaches the capacity term
        while lo < hi:
            mid = (lo + hi) // 2
            c, cap = _subset_terms(crit, w, k, mid, servers)
            if c >= cap:
                hi = mid
            else:
                lo = mid + 1
        best = max(_subset_terms(crit, w, k, lo, servers))
        if lo > k:
            best = min(best, max(_subset_terms(crit, w, k, lo - 1, servers)))
        out.append(best)
    return out


def _subset_terms(crit: np.ndarray, work: np.ndarray, k: int, j: int,
                  servers: int) -> tuple[float, float]:
    """The j-th crit, and the k least work among the first j sessions over ``servers``."""
    part = np.partition(work[:j], k - 1)[:k] if j > k else work[:j]
    return float(crit[j - 1]), float(part.sum()) / servers


def _srpt_completions(arrivals: Sequence[float], work: Sequence[float], servers: int) -> list[float]:
    """Completion times (sorted) of preemptive shortest-remaining-work-first on one machine of
    speed ``servers``, each job released at its arrival."""
    jobs = sorted(zip(arrivals, work, strict=True))
    ready: list[float] = []  # remaining work (in machine-seconds)
    done: list[float] = []
    now = 0.0
    i = 0
    while i < len(jobs) or ready:
        if not ready:
            now = max(now, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= now:
            heapq.heappush(ready, jobs[i][1])
            i += 1
        remaining = heapq.heappop(ready)
        next_arrival = jobs[i][0] if i < len(jobs) else math.inf
        finish = now + remaining / servers
        if finish <= next_arrival:
            now = finish
            done.append(now)
        else:
            heapq.heappush(ready, remaining - (next_arrival - now) * servers)
            now = next_arrival
    return done
