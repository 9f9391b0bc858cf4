"""A cluster's day (``workloads.suite.day``): the draw of a day's sessions, the per-server
accounting against the run's own records, and the CLI's refusals."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from talaria.cli import build_parser, main
from workloads.replay.cluster import ClusterSpec
from workloads.replay.systems import SYSTEMS
from workloads.suite.day import (
    SLO_FACTOR,
    DayConfig,
    day_json,
    day_sessions,
    format_day,
    run_day,
)
from workloads.suite.scenarios import pool_sessions
from workloads.traces.generator import generate_trace
from workloads.traces.trace import Session


def _pool(spec: ClusterSpec, sessions: int = 6, calls: int = 18) -> list[Session]:
    return pool_sessions(generate_trace(num_sessions=sessions, total_calls=calls,
                                        models=list(spec.models), seed=5), spec.models)


def test_a_days_sessions_arrive_inside_the_hours_as_draws_from_the_pool() -> None:
    pool = _pool(ClusterSpec())
    by_id = {s.session_id: s for s in pool}
    day = day_sessions(pool, rate_per_s=0.05, hours=2.0, seed=3)
    arrivals = [s.arrival_s for s in day]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] < 7200.0
    assert 0.05 * 7200 * 0.8 < len(day) < 0.05 * 7200 * 1.2  # 360 expected, sd 19
    assert len({s.session_id for s in day}) == len(day)
    for k, s in enumerate(day):
        prefix, index, original = s.session_id.split("/", 2)
        assert (prefix, int(index)) == ("day", k)
        assert s.calls == by_id[original].calls and s.model == by_id[original].model
    assert len({s.session_id.split("/", 2)[2] for s in day}) == len(pool)  # every one drawn
    assert day_sessions(pool, 0.05, 2.0, seed=3) == day
    again = day_sessions(pool, 0.05, 2.0, seed=4)
    assert [s.arrival_s for s in again] != arrivals
    with pytest.raises(ValueError, match="rate"):
        day_sessions(pool, 0.0, 1.0)
    with pytest.raises(ValueError, match="pool"):
        day_sessions([], 0.1, 1.0)


def test_the_pool_drops_subagent_links_and_assigns_catalog_models() -> None:
    spec = ClusterSpec()
    parent = generate_trace(num_sessions=2, total_calls=4, models=["elsewhere"], seed=1)
    child = replace(parent[1], parent_id=parent[0].session_id)
    pool = pool_sessions([parent[0], child], spec.models)
    assert all(s.model in spec.models for s in pool)
    assert all(s.parent_id is None and s.start_after is None for s in pool)


def test_a_small_day_accounts_every_call_and_every_engine_second_to_a_server() -> None:
    spec = ClusterSpec(servers=2)
    config = DayConfig(hours=0.05, sessions_per_hour=60.0, seed=1)
    day = run_day(_pool(spec), SYSTEMS["talaria"], spec, config)
    assert day.saturation_per_server is None
    assert day.rate_per_s == pytest.approx(60.0 / 3600 * 2)
    assert day.failed_calls == 0 and day.sessions >= 1
    assert [s.instance_id for s in day.per_server] == ["i0", "i1"]
    assert sum(s.calls for s in day.per_server) == day.calls
    assert sum(s.sessions for s in day.per_server) == day.sessions
    for s in day.per_server:
        assert 0.0 <= s.utilisation <= 1.0
        assert s.utilisation == pytest.approx(s.busy_s / day.makespan_s)
        assert (s.busy_s > 0) == (s.calls > 0)
    lo, hi = day.ci95["p50"]
    assert lo <= day.figures["p50"] <= hi
    assert day.slo_s == pytest.approx(SLO_FACTOR * day.isolated_p95_s)
    assert day.slo_met == (day.figures["p95"] <= day.slo_s)
    assert day.figures["p50"] > 0 and day.calls_per_cpu_s > 0
    data = day_json(day, "pool")
    assert data["calls"] == day.calls and len(data["per_server"]) == 2
    assert data["slo_met"] == day.slo_met
    text = format_day(day, "pool")
    assert "given" in text and "utilisation" in text
    idle = sum(1 for s in day.per_server if s.calls == 0)
    assert f"({idle} of 2 served no call)" in text


def test_a_day_at_a_load_takes_its_rate_from_the_baselines_burst() -> None:
    spec = ClusterSpec(servers=1)
    config = DayConfig(hours=0.02, load=0.5, seed=2)
    day = run_day(_pool(spec, sessions=4, calls=8), SYSTEMS["talaria"], spec, config)
    assert day.saturation_per_server is not None and day.saturation_per_server > 0
    assert day.rate_per_s == pytest.approx(0.5 * day.saturation_per_server)
    assert "of the baseline's saturation" in format_day(day, "pool")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["replay", *argv])


# --day, --day-load and --day-rate out of range: refused as they are parsed
# (tests/workloads/test_replay_float_flags.py)
@pytest.mark.parametrize("argv, message", [
    (("--day", "1", "--bench-sim"), "takes no --live"),
    (("--day", "1", "--sweep"), "takes no --live"),
    (("--day", "1", "--day-setting", "bogus/60"), "RULE/QUANTUM"),
])
def test_the_day_command_refuses_what_it_cannot_run(argv: tuple[str, ...], message: str) -> None:
    args = _args(*argv)
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_the_day_command_prints_and_writes_each_servers_share(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "day.json"
    rc = main(["replay", "--day", "0.03", "--day-rate", "90", "--servers", "2",
               "--max-sessions", "4", "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "cluster day: talaria" in text and "swe-claude-code.jsonl (4 sessions)" in text
    data = orjson.loads(out.read_bytes())["day"]
    assert data["servers"] == 2 and data["failed_calls"] == 0
    assert sum(s["calls"] for s in data["per_server"]) == data["calls"] > 0
    assert data["sessions_per_s"] == pytest.approx(90 / 3600 * 2)


def test_the_report_counts_the_servers_that_served_nothing() -> None:
    from workloads.suite.day import DayResult, ServerDay

    servers = [ServerDay("i0", 3, 90, 500.0, 0.5, 4), ServerDay("i1", 0, 0, 0.0, 0.0, 0),
               ServerDay("i2", 0, 0, 0.0, 0.0, 0)]
    day = DayResult("talaria", {}, 3, 1.0, 0.001, None, 3, 90, 0,
                    {"p50": 10.0, "p95": 30.0, "mean": 12.0},
                    {f: (1.0, 40.0) for f in ("p50", "p95", "mean")}, 20.0, 1000.0, servers,
                    1.0, 1.0, 100.0)
    text = format_day(day, "pool")
    assert "(2 of 3 served no call)" in text and "MISSED" not in text
    assert "utilisation  0 / 0 / 0 / 0.4 / 0.5" in text
