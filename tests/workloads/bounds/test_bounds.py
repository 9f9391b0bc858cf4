"""The bounds and the time split: on random small traces no row at any of its settings, no
ideal schedule and no random policy beats the lower bound (``workloads.bounds.bound``) at p50, p95 or
mean, nor ``ideal`` or ``isolated``; the closed-form isolated run is the simulated one; every
session's split adds up to its SCT."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.sim.model_spec import DEFAULT_CATALOG
from workloads.benchmark.breakdown import PARTS, session_parts
from workloads.benchmark.report import own_durations, summarize
from workloads.bounds.bound import (
    LowerBound,
    _srpt_completions,
    _subset_bound,
    lower_bound,
    session_bounds,
)
from workloads.bounds.isolated import run_isolated, simulate_isolated
from workloads.bounds.oracle import ideal_schedules, run_ideal
from workloads.bounds.shared_device import DeviceSchedule
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import AGENT_MAX_TOKENS, ReplayResult, run_sim
from workloads.replay.systems import SYSTEMS, SystemConfig
from workloads.suite.stats import percentile
from workloads.traces.trace import Call, CallRef, Session

SPEC = ClusterSpec()


def _random_trace(seed: int, burst: bool = False, sessions_at_most: int = 6) -> list[Session]:
    """2-6 sessions over the three models, 2-6 growing calls each, random gaps and arrivals
    (``burst``: all at 0)."""
    rng = random.Random(seed)
    sessions = []
    for i in range(rng.randint(2, sessions_at_most)):
        tokens, calls = rng.randint(500, 20_000), []
        n = rng.randint(2, 6)
        for k in range(n):
            out = rng.randint(5, 400)
            gap = None if k == n - 1 else round(rng.expovariate(0.5), 2)
            calls.append(Call(tokens, out, gap))
            tokens += out + rng.randint(100, 5000)
        sessions.append(Session(f"s{i}", rng.choice(DEFAULT_CATALOG), tuple(calls),
                                arrival_s=0.0 if burst else round(rng.uniform(0, 10), 2)))
    return sessions


def _stats(result: ReplayResult) -> tuple[float, float, float]:
    scts = [s.sct_s for s in result.sessions]
    return percentile(scts, 50), percentile(scts, 95), sum(scts) / len(scts)


def _assert_not_below(result: ReplayResult, bound: LowerBound, where: str) -> None:
    p50, p95, mean = _stats(result)
    assert p50 >= bound.sct_p50_s, f"{where}: p50 {p50} < bound {bound.sct_p50_s}"
    assert p95 >= bound.sct_p95_s, f"{where}: p95 {p95} < bound {bound.sct_p95_s}"
    assert mean >= bound.sct_mean_s, f"{where}: mean {mean} < bound {bound.sct_mean_s}"


def _random_policy(rng: random.Random, system: SystemConfig) -> SystemConfig:
    """``system`` with random mechanisms off, demotion (an option off in every preset)
    randomly on, and a random slot rule and quantum."""
    mechanisms = ("session_prefill", "soft_reservations", "session_priority",
                  "priority_switch", "lend_staging")
    changed = {m: False for m in mechanisms if rng.random() < 0.4}
    if not changed.get("session_priority", True):
        changed["priority_switch"] = False
    changed["kv_demotion"] = rng.random() < 0.4
    return system.with_policy(
        **changed, slot_close=rng.choice(("empty", "drained", "quantum")),
        slot_quantum_s=rng.choice((0.5, 2.0, 10.0, 60.0)))


def _p(result: ReplayResult) -> tuple[float, float]:
    scts = [s.sct_s for s in result.sessions]
    return percentile(scts, 50), percentile(scts, 95)


def _settings(system: SystemConfig) -> list[dict[str, object]]:
    q = 2.0 if system.grid == "preempt" else 10.0
    return [{"slot_close": rule, "slot_quantum_s": q} for rule in ("empty", "drained", "quantum")]


@pytest.mark.parametrize(("seed", "burst"), [(1, False), (4, False), (7, True)])
def test_no_row_beats_the_bounds_on_random_small_traces(seed: int, burst: bool) -> None:
    trace = _random_trace(seed, burst)
    bound = lower_bound(trace, SPEC)
    schedules = ideal_schedules(quanta=(2.0, 10.0))
    ideal_runs = [run_ideal(trace, SPEC, s) for s in schedules]
    for schedule, run in zip(schedules, ideal_runs, strict=True):
        _assert_not_below(run, bound, f"ideal {schedule.name} on trace {seed}")
    ideal = [_p(run) for run in ideal_runs]
    ideal50, ideal95 = min(p for p, _ in ideal), min(p for _, p in ideal)
    iso50, iso95 = _p(run_isolated(trace, SPEC))
    assert ideal50 >= iso50 * (1 - 1e-9) and ideal95 >= iso95 * (1 - 1e-9)
    rng = random.Random(seed)
    for name, system in SYSTEMS.items():
        runs = [system.with_setting(**setting) for setting in _settings(system)]
        runs.append(_random_policy(rng, system))
        for variant in runs:
            result = run_sim(trace, variant, SPEC)
            p50, p95 = _p(result)
            where = f"{name} at {variant.setting} on trace {seed}"
            _assert_not_below(result, bound, where)
            assert p50 >= ideal50 * (1 - 1e-9) and p95 >= ideal95 * (1 - 1e-9), where
            assert p50 >= iso50 * (1 - 1e-9) and p95 >= iso95 * (1 - 1e-9), where


def test_the_capacity_argument_binds_in_a_crowded_burst_and_holds() -> None:
    """Twelve sessions of one model at once, no tool gaps: the server's capacity, not any
    session's own path, bounds the median; no row gets below it."""
    calls = (Call(8000, 600, 0.0), Call(9000, 600, 0.0), Call(10000, 600, None))
    trace = [Session(f"s{i}", "qwen3-235b-a22b", calls) for i in range(12)]
    bound = lower_bound(trace, SPEC)
    assert bound.binding["p50"] == "capacity" and bound.binding["mean"] == "capacity"
    assert bound.sct_p50_s > max(s.critical_s for s in session_bounds(trace, SPEC))
    for name in ("baseline", "talaria", "vllm_sleep", "aegaeon"):
        _assert_not_below(run_sim(trace, SYSTEMS[name], SPEC), bound, name)


def test_subset_bound_is_the_least_over_every_set() -> None:
    rng = random.Random(3)
    for _ in range(20):
        n, servers = rng.randint(1, 7), rng.randint(1, 3)
        crit = [rng.uniform(0, 10) for _ in range(n)]
        work = [rng.uniform(0, 10) for _ in range(n)]
        got = _subset_bound(crit, work, servers)
        for k in range(1, n + 1):
            brute = min(max(max(crit[i] for i in subset), sum(work[i] for i in subset) / servers)
                        for subset in itertools.combinations(range(n), k))
            assert got[k - 1] == pytest.approx(brute)


def test_srpt_completes_as_many_jobs_as_any_order_by_every_time() -> None:
    """Preemptive SRPT against every non-preemptive order of the same jobs (one machine)."""
    rng = random.Random(5)
    for _ in range(20):
        n, servers = rng.randint(1, 5), rng.randint(1, 2)
        arrivals = [rng.choice((0.0, rng.uniform(0, 5))) for _ in range(n)]
        work = [rng.uniform(0.1, 5) for _ in range(n)]
        srpt = _srpt_completions(arrivals, work, servers)
        for order in itertools.permutations(range(n)):
            now, ends = 0.0, []
            for i in order:
                now = max(now, arrivals[i]) + work[i] / servers
                ends.append(now)
            assert all(a <= b + 1e-9 for a, b in zip(srpt, sorted(ends), strict=True))


def test_closed_form_isolated_is_the_simulated_one() -> None:
    trace = _random_trace(2) + [
        Session("long", "glm-4.5-air", (Call(20_000, 40, 1.0), Call(31_000, 900, None)))]
    closed = run_isolated(trace, SPEC)
    simulated = simulate_isolated(trace, SPEC)
    for a, b in zip(closed.sessions, simulated.sessions, strict=True):
        assert a.session_id == b.session_id
        for x, y in zip(a.calls, b.calls, strict=True):
            steps = 2 + x.output_tokens  # the virtual clock's resolution per timer
            assert x.done_s - x.sent_s == pytest.approx(y.done_s - y.sent_s, abs=steps * 1e-6)
            assert x.ttft_s == pytest.approx(y.ttft_s, abs=4e-6)


def test_an_answer_longer_than_the_replay_asks_for_counts_as_the_replay_gets_it() -> None:
    """The replay asks for ``AGENT_MAX_TOKENS``, so the simulated answer ends there however
    long the trace's is; counting the trace's whole answer put a session's critical path
    above what a schedule reached (mini-swe-agent's 57,811-token answer)."""
    long = AGENT_MAX_TOKENS + 8_000
    trace = [Session("long", "glm-4.5-air",
                     (Call(2_000, long, 1.0), Call(2_000 + long + 500, 50, None)))]
    served = run_sim(trace, SYSTEMS["talaria"], SPEC)
    assert served.sessions[0].calls[0].output_tokens == AGENT_MAX_TOKENS
    [alone] = session_bounds(trace, SPEC)
    assert served.sessions[0].sct_s >= alone.critical_s
    assert served.sessions[0].sct_s < alone.critical_s * 1.05  # the same answer, not a shorter
    closed, simulated = run_isolated(trace, SPEC), simulate_isolated(trace, SPEC)
    assert [c.output_tokens for c in closed.sessions[0].calls] == [AGENT_MAX_TOKENS, 50]
    assert closed.sessions[0].sct_s == pytest.approx(simulated.sessions[0].sct_s, rel=1e-4)
    # the next call finds the answer the replay got cached, not the trace's
    assert served.sessions[0].calls[1].cached_tokens >= 2_000 + AGENT_MAX_TOKENS - SPEC.block_size


def test_a_prompt_that_starts_with_an_earlier_call_than_the_last_stays_above_the_bound() -> None:
    """The trace format lets a call's prompt start with any earlier call of its session
    (``prefix_from``), and the bound's docstring counts a session's earlier calls as what a
    prompt may find cached; here every long prompt restarts from call 0 after a short side
    call, and the engine finds call 0's blocks each time."""
    calls = [Call(30_000, 20, 0.0)]
    for i in range(4):
        calls.append(Call(200, 20, 0.0, prefix_from=CallRef("s", 0), prefix_tokens=100))
        calls.append(Call(30_100 + i, 20, 0.0 if i < 3 else None, prefix_from=CallRef("s", 0)))
    trace = [Session("s", "glm-4.5-air", tuple(calls))]
    served = run_sim(trace, SYSTEMS["baseline"], SPEC)
    assert served.sessions[0].calls[2].cached_tokens >= 29_000  # call 0's prefix, found
    _assert_not_below(served, lower_bound(trace, SPEC), "baseline")


@pytest.mark.parametrize("parent_next_first", [True, False])
def test_a_subagent_continuing_a_call_that_ends_on_a_block_edge_stays_above_the_bound(
        parent_next_first: bool) -> None:
    """A call of 1000 + 24 tokens ends on a block edge (8 x 128), and another session's
    prompt continues it: whichever of the parent's next call and the subagent prefills it
    second finds its last token computed, one block more than a session alone finds (a
    review's cases: both read below the bound before, on every row)."""
    model = "qwen3-235b-a22b"
    spec = ClusterSpec(models=(model,))
    if parent_next_first:  # the subagent starts after the parent's next call
        trace = [Session("p", model, (Call(1000, 24, 1.0), Call(1100, 1, None))),
                 Session("c", model, (Call(8024, 1, None, prefix_from=CallRef("p", 0),
                                           waits_for=(CallRef("p", 0),)),),
                         parent_id="p", start_after=CallRef("p", 1))]
    else:  # the subagent prefills first, during the parent's tool gap
        trace = [Session("w", model, (Call(16, 2, None),)),
                 Session("p", model, (Call(1000, 24, 10.0), Call(8024, 1, None)),
                         arrival_s=30.0),
                 Session("c", model, (Call(1100, 1, None, prefix_from=CallRef("p", 0)),),
                         parent_id="p", start_after=CallRef("p", 0))]
    bound = lower_bound(trace, spec)
    for name in ("baseline", "talaria", "vllm_sleep"):
        served = run_sim(trace, SYSTEMS[name], spec)
        scts = sorted(s.sct_s for s in served.sessions)
        assert all(x >= b for x, b in zip(scts, bound.order_stats, strict=True)), name
        _assert_not_below(served, bound, name)


def test_shared_device_never_runs_two_models_at_once() -> None:
    """Whatever the schedule, the ideal's GPU time adds up: no model's steps overlap
    another's, so with every session of both models always busy the makespan is at least
    the sum of each model's work alone."""
    glm = [Session(f"g{i}", "glm-4.5-air", (Call(4000, 300, None),)) for i in range(2)]
    mistral = [Session(f"m{i}", "mistral-large-2407", (Call(4000, 300, None),)) for i in range(2)]
    alone = {m: max(s.sct_s for s in run_isolated(group, SPEC).sessions)
             for m, group in (("g", glm), ("m", mistral))}
    for schedule in (DeviceSchedule(), DeviceSchedule("slots", "drained", 1.0)):
        result = run_ideal(glm + mistral, SPEC, schedule)
        assert result.makespan_s >= (alone["g"] + alone["m"]) * (1 - 1e-9)


def test_each_sessions_time_split_adds_up_to_its_sct() -> None:
    trace = _random_trace(3) + _random_trace(5)
    trace = [Session(f"{s.session_id}-{i}", s.model, s.calls, arrival_s=s.arrival_s)
             for i, s in enumerate(trace)]
    own = own_durations(run_isolated(trace, SPEC))
    runs = [run_sim(trace, SYSTEMS[name].with_setting(slot_close="drained", slot_quantum_s=5.0),
                    SPEC)
            for name in ("baseline", "talaria", "vllm_sleep_lmcache", "sglang_hicache",
                         "aegaeon")]
    runs.append(run_ideal(trace, SPEC))
    for result in runs:
        for session in result.sessions:
            parts = session_parts(session.calls, own.get(session.session_id))
            assert set(parts) == set(PARTS)
            # queue and slot_wait are residuals, so the sum below holds by construction; what
            # can fail is a negative residual: the instance accounting more time than the
            # call took, or a call's own compute and KV rebuild exceeding its service.
            assert all(v >= -1e-6 * session.sct_s for v in parts.values()), parts
            assert sum(parts.values()) == pytest.approx(session.sct_s, rel=0.01)
            assert parts["own"] == pytest.approx(sum(own[session.session_id].values()))
            assert parts["tool_gaps"] == pytest.approx(
                sum(c.tool_gap_s or 0.0 for c in next(
                    s for s in trace if s.session_id == session.session_id).calls[:-1]),
                abs=1e-6)
        stats = summarize(result, own)
        assert sum(stats.breakdown.values()) == pytest.approx(stats.sct_mean_s, rel=0.01)
        for model, mean in stats.breakdown_per_model.items():
            scts = [s.sct_s for s in result.sessions if s.model == model]
            assert sum(mean.values()) == pytest.approx(sum(scts) / len(scts), rel=0.01)
    switched = summarize(runs[0], own).breakdown
    assert switched["switch"] > 0 and switched["recompute"] > 0  # baseline drops KV
    assert summarize(runs[2], own).breakdown["restore"] > 0  # LMCache restores it


def test_the_report_flags_a_row_below_a_bound() -> None:
    from workloads.benchmark.report import Benchmark, PolicyStats, below_bounds, format_table

    def stats(name: str, p50: float, p95: float) -> PolicyStats:
        return PolicyStats(name, 1, 1, 0, p50, p95, p50, 0.0, 0.0, p95, 0, 0, 0, 0, 0, 0.0)

    bound = LowerBound(260.0, 700.0, 200.0, {"p50": "capacity", "p95": "critical path",
                                             "mean": "capacity"}, [260.0])
    bench = Benchmark({"good": stats("good", 300.0, 800.0), "odd": stats("odd", 250.0, 800.0)},
                      stats("isolated", 175.0, 541.0), {}, {}, stats("oracle", 276.0, 702.0),
                      bound)
    assert below_bounds(bench) == ["odd p50 250.0 < lower bound 260.0"]
    assert "!! below a bound" in format_table(bench)
