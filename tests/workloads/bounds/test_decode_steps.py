"""The decode-step fact of the burst bound (``workloads.bounds.decode_steps``): it is the least
over every set of sessions, its premise holds in the cost model (an engine whose step cost
drops past its dense range included), and where it binds (sessions of three models decoding
at once on one server; a batch past the dense range) no row beats it; a subagent, timed from
its own start, is bounded by its critical path alone."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import orjson
import pytest

from engine.sim.cost_model import CostModel
from engine.sim.model_spec import DEFAULT_CATALOG, ModelSpec
from substrate.devices import server_preset, server_to_dict
from workloads.bounds.bound import GRID, _subset_bound, lower_bound, session_bounds
from workloads.bounds.decode_steps import decode_step_bound
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.systems import SYSTEMS
from workloads.suite.stats import percentile
from workloads.traces.trace import Call, CallRef, Session

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


def _dense_server(tmp_path: Path, dense: int = 64) -> str:
    """h200x8 with an engine that runs every MoE expert up to ``dense`` tokens, as `talaria
    calibrate` writes for a measured CPU (64): a step's cost drops just past that size."""
    server = server_to_dict(server_preset("h200x8"))
    server.update(name=f"h200x8-dense{dense}", efficiency={"moe_dense_max_tokens": dense})
    path = tmp_path / f"dense{dense}.json"
    path.write_bytes(orjson.dumps(server))
    return str(path)


def test_the_least_weights_read_is_the_least_over_every_step_size(tmp_path: Path) -> None:
    """The fact's premise: each step costs at least the least G over the sizes a step can
    take, here checked by brute force on a preset and on an engine whose G drops past its
    dense range (where G at one token is not the least)."""
    dense = _dense_server(tmp_path)
    for server in ("h200x8", dense):
        for model in DEFAULT_CATALOG:
            cost = CostModel(server_preset(server), ModelSpec.load(model), 8)
            reads = [cost.terms().weights(tokens) for tokens in range(1, 2049)]
            assert cost.least_weights_seconds(2048) == pytest.approx(min(reads)), (server, model)
    qwen = CostModel(server_preset(dense), ModelSpec.load("qwen3-235b-a22b"), 8)
    assert qwen.least_weights_seconds(2048) < qwen.terms().weights(1)


def test_a_batch_past_the_dense_range_does_not_beat_the_bound(tmp_path: Path) -> None:
    """65 long answers of one MoE model at once on the dense engine: their decode steps hold
    65 tokens, whose G is below G at one token; charged at one token's, the bound's last
    order statistic (430.2 s) stood above every row's (baseline 429.0 s: a review's case)."""
    spec = ClusterSpec(server=_dense_server(tmp_path), models=("qwen3-235b-a22b",))
    trace = [Session(f"s{i}", "qwen3-235b-a22b", (Call(16, 16001, None),)) for i in range(65)]
    bound = lower_bound(trace, spec)
    scts = sorted(s.sct_s for s in run_sim(trace, SYSTEMS["baseline"], spec).sessions)
    assert all(sct >= b for sct, b in zip(scts, bound.order_stats, strict=True))


@pytest.mark.parametrize("dense", [1, 64])
def test_a_call_batched_past_the_dense_range_does_not_beat_its_critical_path(
        tmp_path: Path, dense: int) -> None:
    """On the dense engine a step of a few tokens runs every expert, so a call batched with
    others can finish sooner than alone: two 2000-token answers together (dense range 1:
    bounded at 39.6 s, served in 16.0), or a 64-token prompt beside a 1-token one
    (calibrate's 64: one shared 65-token step). A second review's cases."""
    model = "qwen3-235b-a22b"
    spec = ClusterSpec(server=_dense_server(tmp_path, dense), models=(model,))
    if dense == 1:
        trace = [Session(f"s{i}", model, (Call(16, 2000, None),)) for i in range(2)]
    else:
        trace = [Session("w", model, (Call(16, 2, None),)),
                 Session("x", model, (Call(64, 1, None),), arrival_s=30.0),
                 Session("y", model, (Call(1, 1, None),), arrival_s=30.0)]
    bound = lower_bound(trace, spec)
    for name in ("baseline", "talaria", "vllm_sleep"):
        scts = sorted(s.sct_s for s in run_sim(trace, SYSTEMS[name], spec).sessions)
        assert all(x >= b for x, b in zip(scts, bound.order_stats, strict=True)), name
        assert percentile(scts, 50) >= bound.sct_p50_s, name
        assert sum(scts) / len(scts) >= bound.sct_mean_s, name


def test_a_subagent_is_bounded_by_its_own_path_from_its_own_start() -> None:
    """A subagent started by its parent's call is timed from that start: the burst's
    capacity facts do not hold it (before, its bound read 21.1 s where it ran in 14.2)."""
    trace = [Session("a", "qwen3-235b-a22b", (Call(100, 2000, None),)),
             Session("b", "glm-4.5-air", (Call(100, 2000, None),), parent_id="a",
                     start_after=CallRef("a", 0))]
    bound = lower_bound(trace, SPEC)
    crit = {s.session_id: s.critical_s for s in session_bounds(trace, SPEC)}
    assert bound.order_stats[-1] <= max(crit.values()) + 1e-9
    for name in ("baseline", "talaria", "aegaeon"):
        result = run_sim(trace, SYSTEMS[name], SPEC)
        scts = sorted(s.sct_s for s in result.sessions)
        assert all(sct >= b for sct, b in zip(scts, bound.order_stats, strict=True)), name
        assert sum(scts) / len(scts) >= bound.sct_mean_s, name


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
