"""The bounds and the time split: on random small traces no row beats ``ideal`` or
``isolated`` at any of its settings; every session's split adds up to its SCT."""

from __future__ import annotations

import random

import pytest

from engine.sim.model_spec import DEFAULT_CATALOG
from talaria.instance.device import DeviceSchedule
from workloads.breakdown import PARTS, session_parts
from workloads.cluster import ClusterSpec
from workloads.ideal import ideal_schedules, run_ideal
from workloads.lower_bound import run_lower_bound
from workloads.replay import ReplayResult, run_sim
from workloads.report import own_durations, percentile, summarize
from workloads.systems import SYSTEMS, SystemConfig
from workloads.trace import Call, Session

SPEC = ClusterSpec()


def _random_trace(seed: int) -> list[Session]:
    """2-6 sessions over the three models, 2-6 growing calls each, random gaps and arrivals."""
    rng = random.Random(seed)
    sessions = []
    for i in range(rng.randint(2, 6)):
        tokens, calls = rng.randint(500, 20_000), []
        n = rng.randint(2, 6)
        for k in range(n):
            out = rng.randint(5, 400)
            gap = None if k == n - 1 else round(rng.expovariate(0.5), 2)
            calls.append(Call(tokens, out, gap))
            tokens += out + rng.randint(100, 5000)
        sessions.append(Session(f"s{i}", rng.choice(DEFAULT_CATALOG), tuple(calls),
                                arrival_s=round(rng.uniform(0, 10), 2)))
    return sessions


def _p(result: ReplayResult) -> tuple[float, float]:
    scts = [s.sct_s for s in result.sessions]
    return percentile(scts, 50), percentile(scts, 95)


def _settings(system: SystemConfig) -> list[dict[str, object]]:
    q = 2.0 if system.grid == "preempt" else 10.0
    return [{"slot_close": rule, "slot_quantum_s": q} for rule in ("empty", "drained", "quantum")]


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_no_row_beats_the_bounds_on_random_small_traces(seed: int) -> None:
    trace = _random_trace(seed)
    schedules = ideal_schedules(quanta=(2.0, 10.0))
    ideal = [_p(run_ideal(trace, SPEC, s)) for s in schedules]
    ideal50, ideal95 = min(p for p, _ in ideal), min(p for _, p in ideal)
    iso50, iso95 = _p(run_lower_bound(trace, SPEC))
    assert ideal50 >= iso50 * (1 - 1e-9) and ideal95 >= iso95 * (1 - 1e-9)
    for name, system in SYSTEMS.items():
        for setting in _settings(system):
            p50, p95 = _p(run_sim(trace, system.with_setting(**setting), SPEC))
            where = f"{name} at {setting} on trace {seed}"
            assert p50 >= ideal50 * (1 - 1e-9) and p95 >= ideal95 * (1 - 1e-9), where
            assert p50 >= iso50 * (1 - 1e-9) and p95 >= iso95 * (1 - 1e-9), where


def test_shared_device_never_runs_two_models_at_once() -> None:
    """Whatever the schedule, the ideal's GPU time adds up: no model's steps overlap
    another's, so with every session of both models always busy the makespan is at least
    the sum of each model's work alone."""
    glm = [Session(f"g{i}", "glm-4.5-air", (Call(4000, 300, None),)) for i in range(2)]
    mistral = [Session(f"m{i}", "mistral-large-2407", (Call(4000, 300, None),)) for i in range(2)]
    alone = {m: max(s.sct_s for s in run_lower_bound(group, SPEC).sessions)
             for m, group in (("g", glm), ("m", mistral))}
    for schedule in (DeviceSchedule(), DeviceSchedule("slots", "drained", 1.0)):
        result = run_ideal(glm + mistral, SPEC, schedule)
        assert result.makespan_s >= (alone["g"] + alone["m"]) * (1 - 1e-9)


def test_each_sessions_time_split_adds_up_to_its_sct() -> None:
    trace = _random_trace(3) + _random_trace(5)
    trace = [Session(f"{s.session_id}-{i}", s.model, s.calls, arrival_s=s.arrival_s)
             for i, s in enumerate(trace)]
    own = own_durations(run_lower_bound(trace, SPEC))
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
    from workloads.report import Benchmark, PolicyStats, below_bounds, format_table

    def stats(name: str, p50: float, p95: float) -> PolicyStats:
        return PolicyStats(name, 1, 1, 0, p50, p95, p50, 0.0, 0.0, p95, 0, 0, 0, 0, 0, 0.0)

    bench = Benchmark({"good": stats("good", 300.0, 800.0), "odd": stats("odd", 250.0, 800.0)},
                      stats("isolated", 175.0, 541.0), {}, {}, stats("ideal", 276.0, 702.0))
    assert below_bounds(bench) == ["odd p50 250.0 < ideal 276.0"]
    assert "!! below a bound" in format_table(bench)
