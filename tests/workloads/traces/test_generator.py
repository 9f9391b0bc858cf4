"""The SWE-bench session generator: shape of the default trace, statistics against the real
trace's figures (README of /work/shared/traces) for a fixed seed, arrivals, determinism."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import replace

import orjson
import pytest

from engine.sim.model_spec import DEFAULT_CATALOG
from workloads.traces.arrivals import jittered
from workloads.traces.generator import (
    CALIBRATION_PATH,
    DEFAULT_MODELS,
    DEFAULT_TRACE_PATH,
    MIN_TOOL_RESULT_TOKENS,
    Calibration,
    QuantileTable,
    default_trace,
    fit_calibration,
    generate_trace,
    tool_class,
)
from workloads.traces.readers import read_real_trace, real_trace_path
from workloads.traces.trace import CallRef, Session, dumps_trace


def share(values: list[float], below: float) -> float:
    return sum(v < below for v in values) / len(values)


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[round(q * 100) - 1]


@pytest.fixture(scope="module")
def big() -> list[Session]:
    """A large trace for the statistics (mean calls per session as in the real trace)."""
    return generate_trace(num_sessions=400, total_calls=400 * 43, seed=11)


def test_default_trace_shape() -> None:
    sessions = default_trace()
    assert len(sessions) == 30
    assert sum(s.num_calls for s in sessions) == 960
    assert Counter(s.model for s in sessions) == {
        "qwen3-235b-a22b": 16, "glm-4.5-air": 8, "mistral-large-2407": 6,
    }
    assert all(s.arrival_s == 0.0 for s in sessions)
    assert DEFAULT_MODELS == DEFAULT_CATALOG  # the cost model's default catalog, same order


def test_shipped_default_trace_is_what_the_generator_produces() -> None:
    assert DEFAULT_TRACE_PATH.read_bytes() == dumps_trace(generate_trace())


@pytest.mark.skipif(not real_trace_path().exists(), reason="shared real trace not present")
def test_shipped_calibration_is_fitted_from_the_real_trace() -> None:
    fitted = fit_calibration(read_real_trace()).to_dict()
    assert orjson.loads(CALIBRATION_PATH.read_bytes()) == orjson.loads(orjson.dumps(fitted))


def test_calibration_tables_carry_the_real_trace_statistics() -> None:
    cal = Calibration.load()
    assert cal.calls_per_session.at(0.5) == pytest.approx(38, rel=0.03)
    assert cal.first_input_tokens.at(0.5) == pytest.approx(13_600, rel=0.01)
    assert cal.output_tokens.at(0.5) == pytest.approx(113, rel=0.01)
    assert sum(cal.tool_class_share.values()) == pytest.approx(1.0)
    assert cal.tool_gap_s["fast"].at(0.5) < 0.1 < 1.0 < cal.tool_gap_s["bash"].at(0.5)
    assert cal.tool_gap_s["subagent"].at(0.5) > 30


def test_quantile_table_inverts() -> None:
    table = QuantileTable(tuple(float(10 + i) for i in range(101)))
    assert table.at(0.0) == 10 and table.at(1.0) == 110
    for u in (0.013, 0.5, 0.9871):
        assert table.cdf(table.at(u)) == pytest.approx(u, abs=1e-9)
    with pytest.raises(ValueError, match="non-decreasing"):
        QuantileTable(tuple(float(100 - i) for i in range(101)))


def test_tool_class() -> None:
    assert tool_class(("Read", "Task")) == "subagent"
    assert tool_class(("Bash", "Edit")) == "bash"
    assert tool_class(("Grep",)) == "fast" and tool_class(()) == "fast"


def test_sessions_grow_by_their_output_and_a_tool_result(big: list[Session]) -> None:
    for s in big:
        for a, b in zip(s.calls, s.calls[1:], strict=False):
            assert b.input_tokens >= a.input_tokens + a.output_tokens + MIN_TOOL_RESULT_TOKENS
            assert a.tool_gap_s is not None and a.tool_gap_s >= 0
        assert s.calls[-1].tool_gap_s is None


def test_statistics_match_the_real_trace(big: list[Session]) -> None:
    calls = [c for s in big for c in s.calls]
    assert len(calls) == 400 * 43
    assert statistics.median(s.num_calls for s in big) == pytest.approx(38, rel=0.1)
    assert statistics.median(s.calls[0].input_tokens for s in big) == pytest.approx(13_600, rel=0.05)
    outputs = [c.output_tokens for c in calls]
    assert statistics.median(outputs) == pytest.approx(113, rel=0.1)
    assert quantile(outputs, 0.9) == pytest.approx(556, rel=0.1)
    # Prompts by turn follow the real medians (t10 27.6k, t20 36.3k, t30 43.9k); carrying every
    # output token into the next prompt puts them up to ~10% higher.
    for turn, real in ((5, 21_800), (10, 27_600), (20, 36_300), (30, 43_900)):
        median = statistics.median(s.calls[turn - 1].input_tokens for s in big if s.num_calls >= turn)
        assert real * 0.93 <= median <= real * 1.15, (turn, median)
    growth = [b.input_tokens - a.input_tokens for s in big for a, b in zip(s.calls, s.calls[1:],
                                                                          strict=False)]
    assert 431 <= statistics.median(growth) <= 431 * 1.3
    gaps = [c.tool_gap_s for c in calls if c.tool_gap_s is not None]
    # bimodal: most gaps are file tools (tens of ms), a quarter are Bash runs of seconds
    assert share(gaps, 0.1) == pytest.approx(0.58, abs=0.04)
    assert share(gaps, 1.0) == pytest.approx(0.68, abs=0.04)
    assert share(gaps, 5.0) == pytest.approx(0.75, abs=0.04)
    assert share(gaps, 30.0) == pytest.approx(0.989, abs=0.01)
    assert statistics.median(gaps) == pytest.approx(0.051, rel=0.25)
    assert quantile(gaps, 0.9) == pytest.approx(9.1, rel=0.15)
    tools = Counter(t for c in calls for t in c.tools)
    assert tools["Bash"] > tools["Read"] > tools["Task"] > 0


def test_generation_is_seeded() -> None:
    assert generate_trace(seed=5) == generate_trace(seed=5)
    assert generate_trace(seed=5) != generate_trace(seed=6)


def test_exact_call_totals_for_other_sizes() -> None:
    for n, total in ((1, 2), (7, 500), (50, 101)):
        sessions = generate_trace(num_sessions=n, total_calls=total, seed=1)
        assert len(sessions) == n and sum(s.num_calls for s in sessions) == total
        assert min(s.num_calls for s in sessions) >= 2


def test_poisson_arrivals() -> None:
    sessions = generate_trace(300, 300 * 4, arrival="poisson", rate=0.5, seed=2)
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / (len(arrivals) - 1)
    assert mean_gap == pytest.approx(2.0, rel=0.15)


def test_jittered_moves_each_session_by_its_own_draw() -> None:
    sessions = generate_trace(40, 40 * 4, arrival="poisson", rate=0.5, seed=2)
    moved = jittered(sessions, 1.0, seed=3)
    shifts = [m.arrival_s - s.arrival_s for s, m in zip(sessions, moved, strict=True)]
    assert all(-1e-9 <= d <= 1.0 + 1e-9 for d in shifts) and len(set(shifts)) > 30
    assert [m.session_id for m in moved] == [s.session_id for s in sessions]
    # a session's shift depends on its id and the seed, not on which others run with it
    alone = jittered(list(reversed(sessions[:5])), 1.0, seed=3)
    assert {s.session_id: s.arrival_s for s in alone} == {
        m.session_id: m.arrival_s for m in moved[:5]}
    assert jittered(sessions, 1.0, seed=4) != moved
    assert jittered(sessions, 0.0, seed=3) == sessions
    child = replace(sessions[1], start_after=CallRef(sessions[0].session_id, 0), arrival_s=2.5)
    assert jittered([sessions[0], child], 1.0, seed=3)[1] == child  # a delay after its parent
    with pytest.raises(ValueError, match="max_shift_s"):
        jittered(sessions, -0.5)


def test_model_skew_is_configurable() -> None:
    sessions = generate_trace(models=["a", "b"], skew=0.0, seed=4)
    assert Counter(s.model for s in sessions) == {"a": 15, "b": 15}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_sessions": 0}, "num_sessions must be >= 1"),
        ({"num_sessions": 30, "total_calls": 59}, "below 2 calls for each of 30 sessions"),
        ({"arrival": "burst"}, "arrival must be 'all' or 'poisson'"),
        ({"arrival": "poisson"}, "needs a finite rate > 0"),
        ({"arrival": "poisson", "rate": -1.0}, "needs a finite rate > 0"),
        ({"rate": 1.0}, "only meaningful with arrival='poisson'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_trace(**kwargs)


def test_a_custom_calibration_drives_the_generator() -> None:
    cal = Calibration.load()
    flat = QuantileTable(tuple([5_000.0] * 101))
    custom = Calibration(
        calls_per_session=cal.calls_per_session,
        first_input_tokens=flat,
        growth_tokens=cal.growth_tokens,
        output_tokens=cal.output_tokens,
        tool_gap_s=cal.tool_gap_s,
        tool_class_share=cal.tool_class_share,
        tool_names=cal.tool_names,
    )
    sessions = generate_trace(calibration=custom, seed=random.Random(0).randrange(100))
    assert {s.calls[0].input_tokens for s in sessions} == {5_000}


def test_default_sessions_fit_their_models_context_windows() -> None:
    from engine.sim.model_spec import ModelSpec

    for s in default_trace():
        longest = s.calls[-1].input_tokens + s.calls[-1].output_tokens
        assert longest <= ModelSpec.load(s.model).max_position_embeddings, s.session_id


def test_the_generator_writes_another_trace_where_asked(tmp_path) -> None:
    from workloads.traces.generator import main
    from workloads.traces.trace import load_trace

    out = tmp_path / "other.jsonl"
    main(["--out", str(out), "--seed", "7", "--skew", "1.5", "--sessions", "6", "--calls", "60"])
    sessions = load_trace(out)
    assert len(sessions) == 6 and sum(s.num_calls for s in sessions) == 60
    assert sessions == generate_trace(6, 60, skew=1.5, seed=7)
    assert sessions != generate_trace(6, 60, skew=1.5, seed=8)
    with pytest.raises(SystemExit, match="num_sessions must be >= 1"):
        main(["--out", str(out), "--sessions", "0"])
