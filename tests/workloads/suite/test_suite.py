"""The scenario suite: its scenarios and draws, figures and intervals, the headline's
reading of rows, and one small suite end to end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from substrate import devices
from workloads.bounds.bound import LowerBound, pooled_bound
from workloads.replay.cluster import ClusterSpec, ClusterTotals
from workloads.replay.driver import CallRecord, ReplayResult, SessionResult
from workloads.suite.report import (
    BEST_OTHER,
    best_other,
    format_suite,
    gaps,
    margins,
    margins_json,
    multi_figure_wins,
    not_ahead,
    setting_tradeoffs,
    suite_below_bound,
    suite_json,
)
from workloads.suite.run import (
    TALARIA_SETTING,
    RowResult,
    ScenarioResult,
    SuiteResult,
    SuiteSettings,
    _jobs,
    _utilisation,
    run_suite,
    setting_key,
)
from workloads.suite.scenarios import (
    SUITE_TRACES,
    Scenario,
    SuiteConfig,
    burst_runs,
    draw_sessions,
    poisson_run,
    saturation_rate,
    scenarios,
)
from workloads.suite.stats import FIGURES, figure, interval
from workloads.suite.tuning import SUITE_SETTINGS_PATH, suite_key
from workloads.traces.split import dev_half, in_report_half, report_half


def test_scenarios_list_bursts_first_and_name_each_one() -> None:
    config = SuiteConfig(traces=("miniswe", "claude-code"), loads=(0.5, 1.0), servers=(1, 4))
    listed = scenarios(config)
    assert len(listed) == 2 * 2 * 3
    assert all(s.load is None for s in listed[:4]) and all(s.load is not None for s in listed[4:])
    assert Scenario("miniswe", 4, 0.5).name == "miniswe/poisson-0.5/4srv"
    assert Scenario("claude-code", 1).name == "claude-code/burst/1srv"
    assert Scenario("miniswe", 1).split == "dev" and Scenario("claude-code", 1).split == "report"
    with pytest.raises(ValueError, match="unknown suite trace"):
        SuiteConfig(traces=("nope",))


def test_burst_runs_pool_enough_sessions_with_distinct_ids() -> None:
    config = SuiteConfig(traces=("miniswe",), sessions_per_server=5, pooled_sessions=12)
    one = burst_runs(Scenario("miniswe", 1), config)
    assert [len(r) for r in one] == [5, 5, 5]  # three runs of 5 pool 15 >= 12
    ids = [s.session_id for r in one for s in r]
    assert len(ids) == len(set(ids))
    assert all(s.arrival_s == 0.0 for r in one for s in r)
    four = burst_runs(Scenario("miniswe", 4), config)
    assert [len(r) for r in four] == [20]
    assert [s.session_id for s in burst_runs(Scenario("miniswe", 1), config)[0]] == \
        [s.session_id for s in one[0]]  # seeded


def test_poisson_run_arrives_at_the_given_fraction_of_saturation() -> None:
    config = SuiteConfig(traces=("miniswe",), pooled_sessions=200)
    run = poisson_run(Scenario("miniswe", 1, 0.5), config, saturation=0.1)
    assert len(run) == 200
    arrivals = [s.arrival_s for s in run]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    rate = (len(run) - 1) / arrivals[-1]
    assert rate == pytest.approx(0.05, rel=0.2)
    assert saturation_rate([(30, 600.0), (30, 400.0)]) == pytest.approx(0.06)


def test_the_real_trace_splits_in_two_fixed_halves() -> None:
    from workloads.traces.readers import read_real_trace

    sessions = read_real_trace()
    dev, report = dev_half(sessions), report_half(sessions)
    assert len(dev) + len(report) == len(sessions) and min(len(dev), len(report)) > 60
    assert {s.session_id for s in dev}.isdisjoint(s.session_id for s in report)
    assert all(in_report_half(s.session_id) for s in report)


def test_figures_and_their_bootstrap_intervals() -> None:
    scts = [float(v) for v in range(1, 101)]
    assert figure(scts, "p50") == pytest.approx(50.5)
    assert figure(scts, "mean") == pytest.approx(50.5)
    for name in ("p50", "p95", "mean"):
        lo, hi = interval(scts, name)
        assert lo <= figure(scts, name) <= hi
        assert hi - lo > 0
    assert interval([7.0] * 10, "p95") == (7.0, 7.0)


def test_pooled_bound_takes_the_union_of_order_statistics() -> None:
    a = LowerBound(2.0, 3.0, 2.0, {"p50": "critical path", "p95": "capacity",
                                   "mean": "capacity"}, [1.0, 3.0], ["critical path", "capacity"])
    b = LowerBound(5.0, 6.0, 5.0, {"p50": "critical path", "p95": "critical path",
                                   "mean": "critical path"}, [4.0, 6.0],
                   ["critical path", "critical path"])
    pooled = pooled_bound([a, b])
    assert pooled.order_stats == [1.0, 3.0, 4.0, 6.0]
    assert pooled.sct_p50_s == pytest.approx(3.5)
    assert pooled.sct_mean_s == pytest.approx(3.5)
    assert pooled.binding["mean"] == "capacity"


def _row(name: str, p50: float, p95: float, mean: float, tuned: bool = True,
         scts: tuple[float, ...] = (1.0,)) -> RowResult:
    """A row whose figures are given, holding ``scts`` as every figure's sessions."""
    values = {"p50": p50, "p95": p95, "mean": mean}
    return RowResult(name, values, {k: (v, v) for k, v in values.items()},
                     {k: {"slot_close": "drained", "slot_quantum_s": 60.0} for k in values}, tuned,
                     scts={k: scts for k in values})


def _scenario(load: float | None, rows: dict[str, RowResult], iso95: float = 100.0,
              rate: float | None = 0.01) -> ScenarioResult:
    bound = LowerBound(50.0, 90.0, 60.0, {"p50": "critical path", "p95": "critical path",
                                          "mean": "capacity"}, [50.0], ["critical path"])
    return ScenarioResult(Scenario("claude-code", 1, load), rows, bound, iso95, 10, rate)


def test_the_headline_reads_the_best_other_row_per_figure() -> None:
    rows = {"baseline": _row("baseline", 100, 400, 200, scts=(100.0,)),
            "aegaeon": _row("aegaeon", 120, 300, 190),
            "talaria": _row("talaria", 110, 290, 150, scts=(110.0,))}
    rows["talaria"].utilisation = {"p50": 0.834, "p95": 0.834, "mean": 0.834}
    res = _scenario(None, rows)
    assert best_other(res, "p50") == ("baseline", 100)
    assert best_other(res, "p95") == ("aegaeon", 300)
    assert not_ahead(res) == ["p50"]
    suite = SuiteResult(SuiteConfig(traces=("claude-code",)), {res.scenario.name: res},
                        {"claude-code/1srv": 0.01})
    text = format_suite(suite)
    assert "claude-code/burst/1srv (p50 -9.1% [-9.1, -9.1] behind)" in text
    head, _, line = text.splitlines()[:3]
    assert head.split()[-1] == "busy" and line.split()[-1] == "83%"
    data = suite_json(suite)["claude-code/burst/1srv"]
    assert data["rows"]["talaria"]["sct_p95_s"] == 290
    assert data["rows"]["talaria"]["utilisation"]["p50"] == 0.834
    assert data["lower_bound"]["sct_mean_s"] == 60.0


def test_a_row_below_the_bound_is_flagged_as_a_defect() -> None:
    rows = {"baseline": _row("baseline", 100, 400, 200), "talaria": _row("talaria", 110, 290, 150)}
    res = _scenario(None, rows)
    suite = SuiteResult(SuiteConfig(traces=("claude-code",)), {res.scenario.name: res},
                        {"claude-code/1srv": 0.01})
    assert suite_below_bound(suite) == [] and "below the lower bound" not in format_suite(suite)
    rows["talaria"] = _row("talaria", 110, 89.0, 150)  # the bound's p95 is 90 s
    assert suite_below_bound(suite) == ["claude-code/burst/1srv talaria p95 89.0 < 90.0"]
    assert "!! below the lower bound" in format_suite(suite)


def test_margins_read_every_scenario_of_a_split_at_once() -> None:
    def scenario(trace: str, load: float, base: float, peer: float) -> ScenarioResult:
        rows = {"baseline": _row("baseline", base, 2 * base, base),
                "aegaeon": _row("aegaeon", peer, 2 * peer, peer),
                "talaria": _row("talaria", 100, 200, 100)}
        return ScenarioResult(Scenario(trace, 1, load), rows, _scenario(load, rows).bound,
                              100.0, 10, 0.01)

    # report: the baseline 10-30% slower, once faster; the best other row is the faster of
    # the two in each scenario. dev: one scenario, the baseline 50% slower.
    report = [scenario("claude-code", 0.5, 110, 150), scenario("claude-code", 1.0, 130, 120),
              scenario("generated-7", 0.5, 120, 140), scenario("generated-7", 1.0, 95, 200)]
    dev = [scenario("miniswe", 1.0, 150, 160)]
    suite = SuiteResult(SuiteConfig(), {r.scenario.name: r for r in [*report, *dev]}, {})
    found = {(m.split, m.row, m.figure): m for m in margins(suite)}
    best = found[("report", BEST_OTHER, "p50")]
    assert best.scenarios == 4 and best.not_behind == 1
    assert best.relative == pytest.approx((0.10 + 0.20 + 0.20 - 0.05) / 4)
    assert best.ci95[0] < best.relative < best.ci95[1]
    base = found[("report", "baseline", "mean")]
    assert base.relative == pytest.approx((0.10 + 0.30 + 0.20 - 0.05) / 4)
    assert found[("report", "aegaeon", "p95")].relative == pytest.approx(0.525)
    assert found[("report", "aegaeon", "p95")].not_behind == 0
    only = found[("dev", BEST_OTHER, "p95")]
    assert only.scenarios == 1 and only.relative == pytest.approx(0.5)
    assert only.ci95 == (pytest.approx(0.5), pytest.approx(0.5))
    line = next(ln for ln in format_suite(suite).splitlines() if ln.strip().startswith("aegaeon"))
    assert "p95  +52.5%" in line and line.endswith("(0)")
    data = margins_json(margins(suite))
    assert data["dev"]["baseline"]["p50"]["relative"] == pytest.approx(0.5)
    assert set(data["report"]) == {BEST_OTHER, "baseline", "aegaeon"}


def test_the_summary_says_what_a_winning_setting_costs_at_the_other_figures() -> None:
    long_slot = {"slot_close": "quantum", "slot_quantum_s": 960.0}
    baseline = _row("baseline", 100, 400, 200)
    baseline.settings["p50"] = long_slot
    baseline.at_setting = {"p50": {"p50": 100, "p95": 500, "mean": 250},
                           "p95": {"p50": 130, "p95": 400, "mean": 210},
                           "mean": {"p50": 130, "p95": 400, "mean": 200}}
    talaria = _row("talaria", 110, 290, 150)
    res = _scenario(None, {"baseline": baseline, "talaria": talaria})
    assert setting_tradeoffs(res) == [
        "claude-code/burst/1srv p50: baseline at quantum/960s 100 against 110; at that setting "
        "its p95 / mean are 500 / 250 against talaria's 290 / 150"]
    assert multi_figure_wins(res) == []
    # a setting as fast as talaria at p50 and mean in the same run is listed once, by setting
    baseline.at_setting["p50"]["mean"] = 150
    assert multi_figure_wins(res) == ["claude-code/burst/1srv: baseline at quantum/960s (p50, mean)"]
    suite = SuiteResult(SuiteConfig(traces=("claude-code",)), {res.scenario.name: res},
                        {"claude-code/1srv": 0.01})
    text = format_suite(suite)
    assert "at that setting its p95 / mean are 500 / 150" in text
    assert "once: claude-code/burst/1srv: baseline at quantum/960s (p50, mean)\n" in text
    profile = suite_json(suite)["claude-code/burst/1srv"]["rows"]["baseline"]["at_setting"]["p50"]
    assert profile == {"sct_p50_s": 100, "sct_p95_s": 500, "sct_mean_s": 150}


def test_a_gap_is_behind_only_beyond_the_paired_interval_of_the_same_sessions() -> None:
    sessions = tuple(float(v) for v in range(100, 140))
    # every session 10% faster under the baseline: behind, whatever the draw
    faster = tuple(v / 1.1 for v in sessions)
    res = _scenario(None, {"baseline": _row("baseline", figure(faster, "p50"), 1e9, 1e9,
                                            scts=faster),
                           "talaria": _row("talaria", figure(sessions, "p50"), 1.0, 1.0,
                                           scts=sessions)})
    (gap,) = gaps(res)
    assert (gap.figure, gap.other, gap.verdict) == ("p50", "baseline", "behind")
    assert gap.relative == pytest.approx(1 / 1.1 - 1)
    assert gap.ci95[1] < 0
    # the same SCTs dealt to other sessions: the median ties, and a gap that owes
    # everything to which session got which time is within the interval
    shuffled = sessions[::-1]
    res.rows["baseline"] = _row("baseline", figure(shuffled, "p50"), 1e9, 1e9, scts=shuffled)
    (gap,) = gaps(res)
    assert gap.verdict == "tie" and gap.ci95[0] < 0 < gap.ci95[1]
    suite = SuiteResult(SuiteConfig(traces=("claude-code",)), {res.scenario.name: res},
                        {"claude-code/1srv": 0.01})
    assert "1 figure(s) not ahead: 0 behind beyond the interval, 1 within it" in format_suite(suite)
    assert suite_json(suite)["claude-code/burst/1srv"]["not_ahead"]["p50"]["verdict"] == "tie"
    # rows that do not hold the same sessions cannot be paired
    res.rows["baseline"] = _row("baseline", 1.0, 1e9, 1e9, scts=(1.0, 2.0))
    with pytest.raises(ValueError, match="cannot be paired"):
        gaps(res)


def test_suite_key_changes_with_what_tuning_depends_on() -> None:
    assert suite_key(SuiteConfig()) == suite_key(SuiteConfig())
    # the scenarios themselves are named in the cache, not in its key
    assert suite_key(SuiteConfig()) == suite_key(SuiteConfig(servers=(1,), loads=(0.5,)))
    assert suite_key(SuiteConfig()) != suite_key(SuiteConfig(pooled_sessions=60))
    assert suite_key(SuiteConfig()) != suite_key(SuiteConfig(seed=1))
    # cutting fused steps changes the physics the settings were tuned under
    cut = SuiteConfig(spec=ClusterSpec(cut_fused_steps=True))
    assert suite_key(SuiteConfig()) != suite_key(cut)


def test_settings_tuned_under_other_prices_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys of both caches hold the server's numbers: a preset priced anew (its host
    link shared or not) reads its old settings as untuned, under the same name."""
    from workloads.benchmark.tuning import setup_key
    from workloads.traces.generator import default_trace

    before = suite_key(SuiteConfig()), setup_key(default_trace(), ClusterSpec(), 0)
    server = devices.SERVERS["h200x8"]
    monkeypatch.setitem(devices.SERVERS, "h200x8", dataclasses.replace(server, host_link_share=1.0))
    after = suite_key(SuiteConfig()), setup_key(default_trace(), ClusterSpec(), 0)
    assert before[0] != after[0] and before[1] != after[1]
    monkeypatch.setitem(devices.SERVERS, "h200x8", server)
    assert (suite_key(SuiteConfig()), setup_key(default_trace(), ClusterSpec(), 0)) == before


def test_the_cached_suite_settings_match_the_quick_suite() -> None:
    """The shipped cache was tuned for ``make replay``'s quick suite at the default cluster
    (a spec option left at its default adds nothing to the key), so ``make replay`` finds it."""
    cached = orjson.loads(SUITE_SETTINGS_PATH.read_bytes())
    assert cached["suite_key"] == suite_key(SuiteConfig(loads=(0.5, 1.0), pooled_sessions=60))


def test_held_out_settings_are_another_draws_tuned_ones() -> None:
    """``--settings-seed``: a suite on seed 1's draw runs at the settings tuned on seed 0's
    (the shipped cache), where without it seed 1 finds none and every row reads untuned."""
    from workloads.suite.cli import suite_settings

    quick = SuiteConfig(loads=(0.5, 1.0), pooled_sessions=60)
    own = suite_settings(quick, {}, None)
    other_draw = dataclasses.replace(quick, seed=1)
    assert own.tuned and suite_settings(other_draw, {}, None).tuned == {}
    held_out = suite_settings(other_draw, {}, 0)
    assert held_out.tuned == own.tuned
    name = "generated-11/poisson-0.5/4srv"
    assert held_out.for_row(name, "baseline") == (own.tuned[name]["baseline"], True)


def test_held_out_settings_with_none_cached_for_that_draw_are_refused(tmp_path: Path) -> None:
    """``--settings-seed`` on a draw the cache holds no settings for would run every row
    untuned under a "held out" heading: refused, whatever ``--seed`` is."""
    from workloads.suite.cli import suite_settings

    quick = SuiteConfig(loads=(0.5, 1.0), pooled_sessions=60)
    with pytest.raises(ValueError, match="--settings-seed 5"):
        suite_settings(dataclasses.replace(quick, seed=1), {}, 5)
    with pytest.raises(ValueError, match="--settings-seed 0"):
        suite_settings(SuiteConfig(), {}, 0)  # the cache is the quick suite's
    with pytest.raises(ValueError, match="--settings-seed 0"):
        suite_settings(quick, {}, 0, tmp_path / "suite_settings.json")
    assert suite_settings(dataclasses.replace(quick, seed=1), {}, None).tuned == {}


def test_settings_seed_is_refused_up_front_where_no_suite_runs_at_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the suite's tuned rows do not run, ``--settings-seed`` would be silently ignored
    (or refused only after the default trace's table): refused before anything runs."""
    from talaria.cli import main
    from workloads import replay_cli
    from workloads.suite import day_cli

    def ran(*args: object, **kwargs: object) -> int:
        raise AssertionError("ran instead of refusing")

    for name in ("_simulate", "_develop", "_live"):
        monkeypatch.setattr(replay_cli, name, ran)
    monkeypatch.setattr(day_cli, "run_day_command", ran)
    for flags in (["--suite", "off"], ["--policies", "talaria"], ["--servers", "2"],
                  ["--tune-suite"], ["--leave-one-out", "1"], ["--day", "1"],
                  ["--develop", "talaria:min_slot_factor=20"], ["--live", "http://x"],
                  ["--bench-sim"], ["--strip-session-ids"]):
        assert main(["replay", "--settings-seed", "0", *flags]) == 2, flags
        assert "--settings-seed" in capsys.readouterr().err
    monkeypatch.setattr(replay_cli, "_simulate", lambda *args, **kwargs: 0)
    assert main(["replay", "--seed", "1", "--settings-seed", "0"]) == 0  # the held-out run


def test_a_small_suite_runs_end_to_end() -> None:
    config = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=2,
                         pooled_sessions=4)
    settings = SuiteSettings(fallback={"baseline": {"slot_close": "quantum",
                                                    "slot_quantum_s": 60.0}})
    result = run_suite(config, settings, rows=("baseline", "talaria"))
    assert list(result.scenarios) == ["miniswe/burst/1srv", "miniswe/poisson-1/1srv"]
    burst = result.scenarios["miniswe/burst/1srv"]
    assert burst.sessions == 4 and not burst.rows["baseline"].tuned
    assert burst.rows["talaria"].settings["p50"] == TALARIA_SETTING
    for row in burst.rows.values():  # each figure's own run, read at all three figures
        assert all(row.at_setting[f][f] == row.values[f] for f in ("p50", "p95", "mean"))
    talaria = burst.rows["talaria"].at_setting  # one setting: one run, the same profile
    assert talaria["p50"] == talaria["p95"] == talaria["mean"]
    assert result.saturation["miniswe/1srv"] > 0
    for res in result.scenarios.values():
        for row in res.rows.values():
            assert row.failed_calls == 0
            assert row.values["p50"] >= res.bound.sct_p50_s
            assert row.values["p95"] >= res.bound.sct_p95_s
            assert row.values["mean"] >= res.bound.sct_mean_s
            assert all(0.0 < row.utilisation[f] <= 1.0 for f in FIGURES)
    # comparing rows only (leave-one-out, development): the same rows, session by session,
    # at the same rates, without the bound, the isolated runs or the baseline's row
    compared = run_suite(config, settings, rows=("baseline", "talaria"), yardsticks=False)
    assert compared.saturation == result.saturation
    for name, res in compared.scenarios.items():
        assert res.bound is None and res.isolated_p95_s is None
        assert list(res.rows) == ["talaria"]
        assert res.rows["talaria"].scts == result.scenarios[name].rows["talaria"].scts


def test_utilisation_pools_engine_time_over_every_runs_makespan_and_server() -> None:
    def result(busy: float, end: float) -> ReplayResult:
        call = CallRecord(index=0, sent_s=0.0, first_token_s=1.0, done_s=end,
                          prompt_tokens=1, output_tokens=1, reusable_tokens=0)
        return ReplayResult("talaria", [SessionResult("s", "m", 0.0, [call])],
                            ClusterTotals(busy_s=busy))

    assert _utilisation([result(30.0, 100.0), result(10.0, 100.0)], servers=2) == 0.1
    assert _utilisation([result(50.0, 100.0)], servers=1) == 0.5


def test_without_yardsticks_the_baseline_runs_its_bursts_at_the_saturation_setting_only() -> None:
    config = SuiteConfig(traces=("miniswe",), servers=(1,))
    run = list(draw_sessions("miniswe", 4, 0, config.spec, "t"))
    burst, poisson = Scenario("miniswe", 1, None), Scenario("miniswe", 1, 1.0)
    tuned = {"slot_close": "quantum", "slot_quantum_s": 10.0}
    settings = SuiteSettings(
        tuned={s.name: {"baseline": {f: tuned for f in FIGURES}} for s in (burst, poisson)},
        fallback={"baseline": {"slot_close": "quantum", "slot_quantum_s": 60.0}})

    def keys(scenario: Scenario, yardsticks: bool) -> set[tuple[str, str]]:
        return {(j.key[1], j.key[2]) for j in _jobs(scenario, [run], ("baseline", "talaria"),
                                                    settings, config, yardsticks=yardsticks)}

    talaria = ("talaria", setting_key(TALARIA_SETTING))
    assert keys(burst, True) == {("baseline", "quantum/10s"), ("baseline", "quantum/60s"), talaria}
    assert keys(burst, False) == {("baseline", "quantum/60s"), talaria}
    assert keys(poisson, True) == {("baseline", "quantum/10s"), talaria}
    assert keys(poisson, False) == {talaria}


def _small_grid(monkeypatch: pytest.MonkeyPatch, rows: tuple[str, ...]) -> None:
    """Tune only ``rows`` over quantum slots of 10 and 200 s (and their fallbacks)."""
    from workloads.suite import tuning as suite_tuning

    monkeypatch.setattr(suite_tuning, "SUITE_QUANTA", (10.0, 200.0))
    monkeypatch.setattr(suite_tuning, "SUITE_RULES", ("quantum",))
    monkeypatch.setattr(suite_tuning, "TUNED_ROWS", rows)


def test_tuning_keeps_each_figures_best_setting_and_the_next_run_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    from workloads.suite import tuning as suite_tuning

    _small_grid(monkeypatch, ("baseline", "vllm_sleep"))
    config = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=3,
                         pooled_sessions=3)
    fallback = {"baseline": {"slot_close": "quantum", "slot_quantum_s": 60.0}}
    path = tmp_path / "suite.json"
    tuned = suite_tuning.tune_suite(config, fallback, path=path)
    data = orjson.loads(path.read_bytes())
    assert data["suite_key"] == suite_key(config)
    for scenario, rows in data["settings"].items():
        for row, by_figure in rows.items():
            for name, setting in by_figure.items():
                # the grid, and the baseline's default-trace setting (not on the grid)
                assert setting["slot_quantum_s"] in ((10.0, 200.0, 60.0) if row == "baseline"
                                                     else (10.0, 200.0))
                assert tuned.for_row(scenario, row) == (by_figure, True)
                value = data["values"][scenario][row][name]
                others = run_suite(config, SuiteSettings(
                    {scenario: {row: {f: setting for f in ("p50", "p95", "mean")}}}, fallback),
                    rows=("baseline", row) if row != "baseline" else ("baseline",))
                assert others.scenarios[scenario].rows[row].values[name] == pytest.approx(value)
            break  # one row re-run is enough to show the values are the runs'
        break
    loaded = suite_tuning.load_suite_settings(config, fallback, path)
    assert loaded.tuned == data["settings"]
    other = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=2,
                        pooled_sessions=2)
    assert suite_tuning.load_suite_settings(other, fallback, path).tuned == {}


def test_a_rows_grid_holds_its_default_trace_setting() -> None:
    from workloads.suite.tuning import _grid

    plain = _grid("baseline")
    assert {"slot_close": "quantum", "slot_quantum_s": 480.0} not in plain
    with_it = _grid("baseline", {"slot_close": "quantum", "slot_quantum_s": 480})
    assert with_it == [*plain, {"slot_close": "quantum", "slot_quantum_s": 480.0}]
    assert _grid("baseline", plain[0]) == plain  # already on it: not twice


def test_tuning_some_server_counts_keeps_the_other_scenarios_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    from workloads.suite import tuning as suite_tuning

    _small_grid(monkeypatch, ("baseline",))
    config = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1, 2), sessions_per_server=2,
                         pooled_sessions=2)
    fallback = {"baseline": {"slot_close": "quantum", "slot_quantum_s": 60.0}}
    path = tmp_path / "suite.json"
    with pytest.raises(ValueError, match="not in the suite"):
        suite_tuning.tune_suite(config, fallback, path=path, servers=(4,))
    suite_tuning.tune_suite(config, fallback, path=path, servers=(2,))
    first = orjson.loads(path.read_bytes())["settings"]
    assert set(first) == {"miniswe/burst/2srv", "miniswe/poisson-1/2srv"}
    both = suite_tuning.tune_suite(config, fallback, path=path, servers=(1,))
    data = orjson.loads(path.read_bytes())
    assert set(data["settings"]) == set(first) | {"miniswe/burst/1srv", "miniswe/poisson-1/1srv"}
    assert {k: data["settings"][k] for k in first} == first
    assert both.tuned == data["settings"]
    # a suite of one server count loads only its own scenarios' settings
    one = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=2,
                      pooled_sessions=2)
    assert set(suite_tuning.load_suite_settings(one, fallback, path).tuned) == {
        "miniswe/burst/1srv", "miniswe/poisson-1/1srv"}


def test_every_suite_trace_fits_its_models_contexts() -> None:
    """Each session of each suite and development trace, as the suite assigns it, fits its model's context
    at its longest call (generated seed 11 once put a 132k-token session on a 131k model,
    which the replay refuses)."""
    from engine.sim.model_spec import DEFAULT_CATALOG, ModelSpec
    from workloads.suite.scenarios import _pool

    contexts = {m: ModelSpec.load(m).max_position_embeddings for m in DEFAULT_CATALOG}
    from workloads.suite.scenarios import TRACES

    assert set(SUITE_TRACES) < set(TRACES)  # the development traces too (make develop)
    for name in TRACES:
        for s in _pool(name, DEFAULT_CATALOG):
            longest = max(c.input_tokens + c.output_tokens for c in s.calls)
            assert longest <= contexts[s.model], (name, s.session_id, s.model, longest)


def test_a_stopped_tuning_resumes_at_its_next_grid_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    from workloads.suite import tuning as suite_tuning

    _small_grid(monkeypatch, ("baseline",))
    config = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=2,
                         pooled_sessions=2)
    fallback = {"baseline": {"slot_close": "quantum", "slot_quantum_s": 60.0}}  # 3 grid points
    clean = tmp_path / "clean.json"
    suite_tuning.tune_suite(config, fallback, path=clean)

    passes: list[float] = []
    real_run = suite_tuning.run_suite

    def run_then_stop(cfg: SuiteConfig, settings: SuiteSettings, **kw: object) -> object:
        quantum = next(iter(settings.tuned.values()))["baseline"]["p50"]["slot_quantum_s"]
        if len(passes) == 2:
            raise KeyboardInterrupt  # stopped during the third pass
        passes.append(quantum)
        return real_run(cfg, settings, **kw)

    path = tmp_path / "suite.json"
    monkeypatch.setattr(suite_tuning, "run_suite", run_then_stop)
    with pytest.raises(KeyboardInterrupt):
        suite_tuning.tune_suite(config, fallback, path=path)
    partial = tmp_path / "suite.partial.json"
    assert not path.exists() and orjson.loads(partial.read_bytes())["passes"] == 2

    passes.clear()
    monkeypatch.setattr(suite_tuning, "run_suite", lambda cfg, settings, **kw: (
        passes.append(next(iter(settings.tuned.values()))["baseline"]["p50"]["slot_quantum_s"])
        or real_run(cfg, settings, **kw)))
    suite_tuning.tune_suite(config, fallback, path=path)
    assert passes == [60.0]  # only the pass not done: the default-trace setting
    assert not partial.exists()
    assert orjson.loads(path.read_bytes()) == orjson.loads(clean.read_bytes())
    # another grid does not read a checkpoint made for this one
    checkpoint = suite_tuning._Checkpoint(partial, config, {"baseline": [{"q": 1}]})
    checkpoint.save(1, {"x": {}})
    other = suite_tuning._Checkpoint(partial, config, {"baseline": [{"q": 2}]})
    assert other.load() == (0, {}) and checkpoint.load() == (1, {"x": {}})
