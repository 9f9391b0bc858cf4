"""Capacity at the SLO of a cluster's day (``workloads.suite.day_capacity``): the probes'
own SLOs, the search's answer, the draw shared between rates, and the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import pytest

from talaria.cli import build_parser, main
from workloads.bounds.isolated import run_isolated
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.systems import SYSTEMS
from workloads.suite.capacity import CapacityConfig
from workloads.suite.day import SLO_FACTOR, DayConfig, day_sessions
from workloads.suite.day_capacity import day_capacity, format_day_capacity
from workloads.suite.scenarios import pool_sessions
from workloads.suite.stats import figure
from workloads.traces.generator import generate_trace


def _pool(spec: ClusterSpec) -> list:
    return pool_sessions(generate_trace(num_sessions=6, total_calls=18,
                                        models=list(spec.models), seed=5), spec.models)


def test_a_faster_days_first_sessions_are_a_slower_ones_pulled_in() -> None:
    pool = _pool(ClusterSpec())
    slow = day_sessions(pool, 0.01, 1.0, seed=2)
    fast = day_sessions(pool, 0.02, 1.0, seed=2)
    assert len(fast) > len(slow)
    for a, b in zip(slow, fast, strict=False):
        assert a.session_id == b.session_id and a.calls == b.calls
        assert b.arrival_s == pytest.approx(a.arrival_s / 2, abs=2e-3)


def test_each_policy_gets_the_highest_load_that_met_its_probes_own_slo() -> None:
    spec = ClusterSpec(servers=1)
    pool = _pool(spec)
    config = DayConfig(hours=0.1, seed=1)
    search = CapacityConfig(start_load=1.0, lowest_load=0.25, highest_load=2.0, bisections=1)
    baseline = SYSTEMS["baseline"]
    saturation, found = day_capacity(pool, [SYSTEMS["talaria"], baseline], spec, config,
                                     baseline=baseline, search=search)
    assert saturation > 0 and [c.policy for c in found] == ["talaria", "baseline"]
    for c in found:
        met = [p.point for p in c.probes if p.met]
        assert c.load == (max(met) if met else search.lowest_load)
        assert c.sessions_per_hour == pytest.approx(c.load * saturation * 3600)
        assert c.at_least == all(p.met for p in c.probes if p.point == max(
            q.point for q in c.probes))
        assert c.probes[0].point == 1.0
    # a probe, replayed by hand: its p95 and its own sessions' SLO
    probe = found[0].probes[0]
    sessions = day_sessions(pool, probe.point * saturation, config.hours, config.seed)
    run = run_sim(sessions, SYSTEMS["talaria"], spec, seed=config.seed)
    assert probe.p95_s == figure([s.sct_s for s in run.sessions], "p95")
    alone = figure([s.sct_s for s in run_isolated(sessions, spec).sessions], "p95")
    assert probe.slo_s == pytest.approx(SLO_FACTOR * alone)
    text = format_day_capacity(found, saturation, 1, 0.1, "pool")
    assert "talaria" in text and "baseline" in text and "sessions/h/server" in text


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["replay", *argv])


@pytest.mark.parametrize("argv, message", [
    (("--day-capacity",), "give --day HOURS"),
    (("--day", "1", "--day-capacity", "--day-rate", "10"), "takes no --day-rate"),
    (("--day", "1", "--day-setting", "drained/60"), "Talaria runs its one configuration"),
])
def test_the_capacity_command_refuses_what_it_cannot_run(argv: tuple[str, ...],
                                                         message: str) -> None:
    args = _args(*argv)
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_the_capacity_command_prints_and_writes_every_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap.json"
    rc = main(["replay", "--day", "0.05", "--day-capacity", "--max-sessions", "3",
               "--day-setting", "drained/60", "--workers", "1", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    assert "capacity at the SLO" in capsys.readouterr().out
    data = orjson.loads(out.read_bytes())["day_capacity"]
    assert set(data["policies"]) == {"talaria", "baseline"} and data["servers"] == 1
    # the setting is the baseline's; Talaria keeps its one configuration
    assert data["policies"]["baseline"]["setting"] == {"slot_close": "drained",
                                                       "slot_quantum_s": 60.0}
    assert data["policies"]["talaria"]["setting"]["slot_quantum_s"] == 480.0
    for row in data["policies"].values():
        assert row["probes"] and row["sessions_per_hour_per_server"] > 0
