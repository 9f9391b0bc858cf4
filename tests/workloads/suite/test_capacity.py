"""Capacity at the SLO and servers needed (``workloads.suite.capacity``): the searches' brackets on
known boundaries, common arrivals across rates, and a small search end to end."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from workloads.replay.cluster import ClusterSpec
from workloads.suite.capacity import (
    CapacityConfig,
    Probe,
    RateSearch,
    ServerSearch,
    rate_capacity,
    servers_needed,
)
from workloads.suite.cli import format_capacity
from workloads.suite.scenarios import draw_sessions
from workloads.traces.arrivals import poisson_arrivals


def _drive(search: RateSearch | ServerSearch, met: Callable[[float], bool]) -> list[float]:
    seen = []
    while (point := search.next_point()) is not None:
        seen.append(point)
        search.record(Probe(point, 1.0 if met(point) else 3.0, 2.0))
    return seen


def test_rate_search_brackets_then_bisects_below_the_boundary() -> None:
    search = RateSearch(CapacityConfig(bisections=3))
    seen = _drive(search, lambda load: load <= 1.7)
    assert seen[:2] == [1.0, 2.0]
    assert seen[2] == pytest.approx(2 ** 0.5)
    assert len(seen) == 5  # two ladder probes, three bisections
    result = search.result(saturation=0.01)
    assert 1.41 < result["load"] <= 1.7 and result["load"] in seen
    assert result["sessions_per_s"] == pytest.approx(result["load"] * 0.01)
    assert not result["at_least"] and not result["at_most"]
    assert min(p for p in seen if p > 1.7) == pytest.approx(search.miss)


def test_rate_search_says_at_least_and_at_most_at_the_ladders_ends() -> None:
    config = CapacityConfig(lowest_load=0.25, highest_load=4.0)
    high = RateSearch(config)
    assert _drive(high, lambda _load: True) == [1.0, 2.0, 4.0]
    assert high.result(1.0)["at_least"] and high.result(1.0)["load"] == 4.0
    low = RateSearch(config)
    assert _drive(low, lambda _load: False) == [1.0, 0.5, 0.25]
    assert low.result(1.0)["at_most"] and low.result(1.0)["load"] == 0.25


def test_a_search_that_never_meets_reports_the_lowest_load_it_ran() -> None:
    """A lowest load off the halving ladder (0.1: the ladder runs 0.125 and stops) is never
    run: ``< 0.1`` would claim what no probe showed; the lowest load that missed is what the
    search knows the capacity is below."""
    low = RateSearch(CapacityConfig(lowest_load=0.1))
    seen = _drive(low, lambda _load: False)
    assert seen == [1.0, 0.5, 0.25, 0.125]
    result = low.result(2.0)
    assert result["at_most"] and result["load"] == 0.125 and result["load"] in seen
    assert result["sessions_per_s"] == 0.25


def test_talaria_over_the_best_other_is_marked_by_both_rows_flags() -> None:
    """The ratio of two capacities is exact only where both are: a best other row at the
    ladder's top (``>=``) makes the ratio at most what is printed, and both there leaves it
    unknown."""
    def caps(talaria: tuple[float, bool, bool], other: tuple[float, bool, bool]) -> str:
        rows = {name: {"sessions_per_s": v, "load": v, "at_least": hi, "at_most": lo,
                       "probes": []} for name, (v, hi, lo) in (("aegaeon", other),
                                                               ("talaria", talaria))}
        return format_capacity({"trace": "t", "sessions": 1, "slo_factor": 2.0,
                                "servers": {"1": rows}, "servers_needed": {
                                    "sessions_per_s": 1.0, "at_servers": 1, "rows": {}}})

    def ratio(text: str) -> str:
        return next(ln for ln in text.splitlines() if "best other" in ln).split(": ")[-1]

    assert ratio(caps((2.0, False, False), (1.0, False, False))) == "2.00x"
    assert ratio(caps((8.0, True, False), (1.0, False, False))) == ">=8.00x"
    assert ratio(caps((4.0, False, False), (8.0, True, False))) == "<=0.50x"
    assert ratio(caps((8.0, True, False), (8.0, True, False))) == "?1.00x"
    assert ratio(caps((0.125, False, True), (1.0, False, False))) == "<=0.12x"
    assert ratio(caps((1.0, False, False), (0.125, False, True))) == ">=8.00x"


def test_server_search_finds_the_fewest_servers_that_meet() -> None:
    search = ServerSearch(CapacityConfig(max_servers=16))
    seen = _drive(search, lambda n: n >= 5)
    assert seen == [1, 2, 4, 8, 6, 5]
    assert search.result()["servers"] == 5 and not search.result()["more_than"]
    never = ServerSearch(CapacityConfig(max_servers=10))
    assert _drive(never, lambda _n: False) == [1, 2, 4, 8, 10]
    assert never.result() == {"servers": 10, "more_than": True,
                              "probes": [[n, 3.0, 2.0] for n in (1, 2, 4, 8, 10)]}
    one = ServerSearch(CapacityConfig())
    assert _drive(one, lambda _n: True) == [1]
    # from a first guess: down while it meets, then the bracket
    guessed = ServerSearch(CapacityConfig(max_servers=16), start=8)
    assert _drive(guessed, lambda n: n >= 5) == [8, 4, 6, 5]
    assert guessed.result()["servers"] == 5
    high = ServerSearch(CapacityConfig(max_servers=16), start=40)
    assert _drive(high, lambda n: n >= 3) == [16, 8, 4, 2, 3]


def test_the_first_guess_is_the_rate_over_one_servers_capacity() -> None:
    from workloads.suite.capacity import _first_guess

    assert _first_guess(0.1, 0.025) == 4
    assert _first_guess(0.1, 0.03) == 4
    assert _first_guess(0.1, None) == 1 and _first_guess(0.1, 0.0) == 1
    assert _first_guess(0.01, 0.05) == 1


def test_every_rate_replays_the_same_gaps_scaled() -> None:
    sessions = draw_sessions("miniswe", 6, 0, ClusterSpec(), "t")
    slow, fast = poisson_arrivals(sessions, 0.5, seed=3), poisson_arrivals(sessions, 2.0, seed=3)
    assert slow[0].arrival_s == fast[0].arrival_s == 0.0
    for a, b in zip(slow[1:], fast[1:], strict=True):
        assert a.session_id == b.session_id
        assert a.arrival_s == pytest.approx(4 * b.arrival_s, abs=0.01)
    assert [s.arrival_s for s in slow] == sorted(s.arrival_s for s in slow)
    with pytest.raises(ValueError):
        poisson_arrivals(sessions, 0.0, seed=0)


def test_a_small_capacity_search_runs_end_to_end() -> None:
    spec = ClusterSpec()
    sessions = draw_sessions("miniswe", 4, 0, spec, "t")
    config = CapacityConfig(start_load=1.0, lowest_load=0.5, highest_load=2.0, bisections=1,
                            max_servers=2)
    setting = {"slot_close": "drained", "slot_quantum_s": 240.0}
    slow = {"slot_close": "quantum", "slot_quantum_s": 960.0}  # a slot held through the gaps
    asked: list[tuple[str, int]] = []

    def settings_for(row: str, n: int) -> list[dict[str, object]]:
        asked.append((row, n))
        return [slow, setting] if row == "baseline" else [setting]

    rates = rate_capacity(("baseline", "talaria"), sessions, lambda n: ClusterSpec(servers=n),
                          (1,), lambda _n: 0.01, settings_for, config)
    alone = rate_capacity(("baseline",), sessions, lambda n: ClusterSpec(servers=n),
                          (1,), lambda _n: 0.01, lambda _row, _n: [setting], config)
    slow_alone = rate_capacity(("baseline",), sessions, lambda n: ClusterSpec(servers=n),
                               (1,), lambda _n: 0.01, lambda _row, _n: [slow], config)
    # a probe at two settings keeps the lower p95 of the two runs, probe by probe
    compared = [(p95, q1, q2) for (point, p95, _), (p1, q1, _), (p2, q2, _) in zip(
        rates["1"]["baseline"]["probes"], alone["1"]["baseline"]["probes"],
        slow_alone["1"]["baseline"]["probes"], strict=False) if point == p1 == p2]
    assert compared and any(q1 != q2 for _, q1, q2 in compared)
    assert all(p95 == min(q1, q2) for p95, q1, q2 in compared)
    assert {row for row, _ in asked} == {"baseline", "talaria"}
    for row in ("baseline", "talaria"):
        r = rates["1"][row]
        met = [p for p, p95, slo in r["probes"] if p95 <= slo]
        assert r["load"] == (max(met) if met else config.lowest_load)
        assert r["at_most"] == (not met)
    need = servers_needed(("talaria",), sessions, lambda n: ClusterSpec(servers=n), 0.05,
                          lambda _row: [setting], config)["talaria"]
    assert need["servers"] in (1, 2)
    assert need["more_than"] == all(p95 > slo for _, p95, slo in need["probes"])
    text = format_capacity({"trace": "miniswe", "sessions": 4, "slo_factor": 2.0,
                            "servers": rates,
                            "servers_needed": {"sessions_per_s": 0.05, "at_servers": 1,
                                               "rows": {"talaria": need}}})
    assert "talaria / best other (baseline)" in text and "servers needed for 180.0" in text


def test_the_suites_capacity_searches_one_server_and_sizes_the_cluster() -> None:
    from workloads.suite.cli import capacity
    from workloads.suite.run import SuiteSettings, run_suite
    from workloads.suite.scenarios import SuiteConfig

    config = SuiteConfig(traces=("claude-code",), loads=(1.0,), servers=(1, 2),
                         sessions_per_server=2, pooled_sessions=2)
    settings = SuiteSettings(fallback={"baseline": {"slot_close": "quantum",
                                                    "slot_quantum_s": 60.0}})
    suite = run_suite(config, settings, rows=("baseline", "talaria"))
    caps = capacity(suite, settings, sessions=3, rows=("baseline", "talaria"),
                    search_servers=(1,), config=CapacityConfig(
                        lowest_load=0.5, highest_load=2.0, bisections=0, max_servers=2))
    assert set(caps["servers"]) == {"1"}  # the two-server search is not asked for
    for row in ("baseline", "talaria"):
        one = caps["servers"]["1"][row]
        assert one["sessions_per_s"] == pytest.approx(
            one["load"] * suite.saturation["claude-code/1srv"])
    need = caps["servers_needed"]
    assert need["at_servers"] == 2
    assert need["sessions_per_s"] == suite.saturation["claude-code/2srv"]
    for row, v in need["rows"].items():
        assert 1 <= v["servers"] <= 2 and v["probes"], row


def test_servers_needed_probes_every_p95_setting_the_row_took_on_any_server_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A servers-needed probe runs from one server up, so the row may take the p95 setting of
    any of the trace's scenarios: the largest cluster's first, then the one-server ones."""
    import workloads.suite.cli as cli
    from workloads.suite.run import SuiteResult, SuiteSettings
    from workloads.suite.scenarios import Scenario, SuiteConfig

    config = SuiteConfig(traces=("claude-code",), loads=(0.5, 1.0), servers=(1, 4))
    setting = {n: {load: {"slot_close": "drained", "slot_quantum_s": q}
                   for load, q in ((0.5, 60.0 * n), (1.0, 7.5 if n == 4 else 60.0))}
               for n in (1, 4)}
    figures = ("p50", "p95", "mean")
    tuned = {Scenario("claude-code", n, load).name: {"baseline": {f: setting[n][load]
                                                                  for f in figures}}
             for n in (1, 4) for load in (0.5, 1.0)}
    suite = SuiteResult(config, {}, {"claude-code/1srv": 0.01, "claude-code/4srv": 0.04})
    seen: dict[str, list[dict[str, object]]] = {}

    def rate_capacity(rows: tuple[str, ...], *_args: object, **_kw: object) -> dict[str, object]:
        return {"1": {row: {"sessions_per_s": 0.01} for row in rows}}

    def servers_needed(rows: tuple[str, ...], _sessions: object, _spec_for: object, _rate: float,
                       settings_for: Callable[[str], list[dict[str, object]]], *_a: object,
                       **_kw: object) -> dict[str, object]:
        seen.update({row: settings_for(row) for row in rows})
        return {row: {"servers": 1} for row in rows}

    monkeypatch.setattr(cli, "rate_capacity", rate_capacity)
    monkeypatch.setattr(cli, "servers_needed", servers_needed)
    monkeypatch.setattr(cli, "draw_sessions", lambda *_a, **_kw: [])
    cli.capacity(suite, SuiteSettings(tuned=tuned), rows=("baseline",))
    assert seen["baseline"] == [
        {"slot_close": "drained", "slot_quantum_s": 7.5},  # 4 servers, load 1.0
        {"slot_close": "drained", "slot_quantum_s": 240.0},  # 4 servers, load 0.5
        {"slot_close": "drained", "slot_quantum_s": 60.0},  # 1 server, both loads
    ]
