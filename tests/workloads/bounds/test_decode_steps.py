"""The decode-step fact of the burst bound (``workloads.bounds.decode_steps``): it is the least
over every set of sessions, its premise holds in the cost model, and where it binds (sessions
of three models decoding at once on one server) no row beats it."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.sim.cost_model import CostModel
from engine.sim.model_spec import DEFAULT_CATALOG
from workloads.bounds.bound import GRID, _subset_bound, lower_bound, session_bounds
from workloads.bounds.decode_steps import decode_step_bound
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.systems import SYSTEMS
from workloads.suite.stats import percentile
from workloads.traces.trace import Call, Session

SPEC = ClusterSpec()


def test_decode_step_bound_is_the_least_over_every_set() -> None:
    rng = random.Random(11)
    for _ in range(40):
        n, servers = rng.randint(1, 7), rng.randint(1, 3)
        models = [rng.choice("abc") for _ in range(n)]
        crit = [rng.uniform(0, 10) for _ in range(n)]
        decodes = [rng.randint(0, 50) for _ in range(n)]
        work = [rng.uniform(0, 5) for _ in range(n)]
        floor = {m: rng.uniform(0, 0.3) for m in "abc"}
        got = decode_step_bound(crit, models, decodes, work, floor, servers)
        for k in range(1, n + 1):
            brute = min(
                max(max(crit[i] for i in subset),
                    (sum(floor[m] * max((decodes[i] for i in subset if models[i] == m),
                                        default=0) for m in "abc")
                     + sum(work[i] for i in subset)) / servers)
                for subset in itertools.combinations(range(n), k))
            assert got[k - 1] == pytest.approx(brute), (k, models, crit, decodes, work)


def test_a_step_costs_more_for_holding_more_tokens() -> None:
    """The fact's premise: G(T), a step's cost beyond its tokens' own terms, is least at one
    token (the weights a step reads never fall as it holds more tokens)."""
    for model in DEFAULT_CATALOG:
        terms = CostModel.from_names(model=model).terms()
        reads = [terms.weights(tokens) for tokens in range(1, 2049)]
        assert all(b >= a for a, b in itertools.pairwise(reads)), model


def test_three_models_decoding_at_once_wait_for_each_other_and_no_row_beats_it() -> None:
    """One long answer and three short ones per model, all at once, one server: the long
    answers' decode steps cannot share a step, so the last of them finishes no sooner than
    the three decodes one after another, well past any one's own critical path and past the
    additive capacity fact (which shares each decode step's fixed cost among the four
    sessions of its model). The oracle machine is not checked: its engines of one model run
    side by side, so its short sessions' prefills cost no time beside the long decode, which
    no step of the simulator's engine allows (``workloads.bounds.decode_steps``)."""
    trace = [Session(f"{model}/{k}", model, (Call(2000, 3000 if k == 0 else 5, None),))
             for model in DEFAULT_CATALOG for k in range(4)]
    bound = lower_bound(trace, SPEC)
    sessions = session_bounds(trace, SPEC)
    crit = [s.critical_s for s in sessions]
    additive = max(_subset_bound(crit, [s.work_s[i] for s in sessions], SPEC.servers)[-1]
                   for i in range(len(GRID)))
    assert bound.order_stats[-1] > 1.5 * max(crit)
    assert bound.order_stats[-1] > 1.5 * additive
    assert bound.binding["p95"] == "capacity"
    checked = [run_sim(trace, SYSTEMS[name], SPEC)
               for name in ("baseline", "talaria", "vllm_sleep", "aegaeon", "autellix")]
    for result in checked:
        scts = sorted(s.sct_s for s in result.sessions)
        assert percentile(scts, 95) >= bound.sct_p95_s, result.policy
        assert percentile(scts, 50) >= bound.sct_p50_s, result.policy
        assert sum(scts) / len(scts) >= bound.sct_mean_s, result.policy
        assert scts[-1] >= bound.order_stats[-1], result.policy
