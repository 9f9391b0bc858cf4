"""The leave-one-out check: paired intervals, verdicts, and a small run end to end."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from talaria.policies.config import preset
from workloads.bounds.bound import LowerBound
from workloads.replay.systems import SYSTEMS
from workloads.suite.leave_one_out import (
    LOO_ROWS,
    Comparison,
    compare_rows,
    comparisons_from_json,
    format_leave_one_out,
    leave_one_out_json,
    run_leave_one_out,
    suite_level,
)
from workloads.suite.run import (
    PLACEBO,
    PLACEBO_SHIFT_S,
    TALARIA,
    TALARIA_SETTING,
    RowResult,
    ScenarioResult,
    SuiteResult,
    SuiteSettings,
    _jobs,
)
from workloads.suite.scenarios import Scenario, SuiteConfig, draw_sessions
from workloads.suite.stats import FIGURES, figure, paired_interval


def test_a_paired_interval_cancels_what_the_draw_does_to_both() -> None:
    rng = random.Random(0)
    base = [rng.uniform(10, 1000) for _ in range(60)]
    assert paired_interval(base, base, "p95") == (0.0, 0.0)
    low, high = paired_interval(base, [v * 1.1 for v in base], "mean")
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # the same values, shuffled: no longer the same sessions, so the ratio spreads
    shuffled = base[:]
    rng.shuffle(shuffled)
    low, high = paired_interval(base, shuffled, "mean")
    assert low < -0.05 and high > 0.05
    with pytest.raises(ValueError, match="equal"):
        paired_interval(base, base[:-1], "p50")


def _row(name: str, scts: list[float]) -> RowResult:
    values = {f: figure(scts, f) for f in FIGURES}
    setting = {"slot_close": "drained", "slot_quantum_s": 240.0}
    return RowResult(name, values, {f: (v, v) for f, v in values.items()},
                     {f: setting for f in FIGURES}, True, scts={f: tuple(scts) for f in FIGURES})


def _draw(seed: int) -> SuiteResult:
    rng = random.Random(seed)
    talaria = [rng.uniform(100, 900) for _ in range(40)]
    rows = {"talaria": _row("talaria", talaria),
            "-sp": _row("-sp", [v * 1.3 for v in talaria]),  # slower without it: pays
            "-host_kv": _row("-host_kv", [v * 0.8 for v in talaria]),  # faster: hurts
            # up and down by turns: no difference on the whole
            "-staging": _row("-staging", [v + (30 if i % 2 else -30)
                                          for i, v in enumerate(talaria)])}
    bound = LowerBound(1.0, 1.0, 1.0, {}, [1.0], ["critical path"])
    scenario = Scenario("miniswe", 1, 1.0)
    return SuiteResult(SuiteConfig(), {scenario.name: ScenarioResult(scenario, rows, bound,
                                                                     100.0, 40)}, {})


def test_each_row_reads_pays_hurts_or_neither_over_pooled_draws() -> None:
    found = compare_rows([_draw(1), _draw(2)], ["-sp", "-host_kv", "-staging"])
    verdict = {(c.row, c.figure): c.verdict for c in found}
    assert all(verdict[("-sp", f)] == "pays" for f in FIGURES)
    assert all(verdict[("-host_kv", f)] == "hurts" for f in FIGURES)
    assert verdict[("-staging", "mean")] == "neither"
    sp = next(c for c in found if c.row == "-sp" and c.figure == "mean")
    assert sp.relative == pytest.approx(0.3)
    pooled = [*_draw(1).scenarios["miniswe/poisson-1/1srv"].rows["talaria"].scts["mean"],
              *_draw(2).scenarios["miniswe/poisson-1/1srv"].rows["talaria"].scts["mean"]]
    assert sp.talaria == pytest.approx(figure(pooled, "mean"))
    text = format_leave_one_out(found, 2)
    assert "hurts: miniswe/poisson-1/1srv -host_kv p50" in text
    data = leave_one_out_json(found, 2)["scenarios"]["miniswe/poisson-1/1srv"]
    assert data["-sp"]["p95"]["verdict"] == "pays"


def test_a_small_leave_one_out_runs_paired_end_to_end() -> None:
    config = SuiteConfig(traces=("miniswe",), loads=(1.0,), servers=(1,), sessions_per_server=2,
                         pooled_sessions=4)
    found = run_leave_one_out(config, {"slot_close": "quantum", "slot_quantum_s": 60.0},
                              draws=2, rows=("-placement",))
    assert {c.scenario for c in found} == {"miniswe/burst/1srv", "miniswe/poisson-1/1srv"}
    # one server leaves placement one choice: the same SCTs session by session, which
    # the paired interval shows as exactly none only if the sessions line up
    for c in found:
        assert c.value == c.talaria and c.ci95 == (0.0, 0.0) and c.verdict == "neither"
    with pytest.raises(ValueError, match="not leave-one-out rows"):
        run_leave_one_out(config, {"slot_close": "empty", "slot_quantum_s": 30.0},
                          rows=("baseline",))


def test_the_placebo_is_talaria_on_the_same_sessions_each_arriving_up_to_a_second_later() -> None:
    config = SuiteConfig(traces=("miniswe",), servers=(1,))
    scenario = Scenario("miniswe", 1, 1.0)
    run = [replace(s, arrival_s=10.0 * k)
           for k, s in enumerate(draw_sessions("miniswe", 12, 0, config.spec, "t"))]
    jobs = {j.key[1]: j for j in _jobs(scenario, [run], (TALARIA, PLACEBO), SuiteSettings(),
                                       config)}
    talaria, placebo = jobs[TALARIA], jobs[PLACEBO]
    assert placebo.system == talaria.system == SYSTEMS[TALARIA].with_setting(**TALARIA_SETTING)
    assert [s.session_id for s in placebo.sessions] == [s.session_id for s in run]
    assert talaria.sessions == tuple(run)
    shifts = [p.arrival_s - s.arrival_s for s, p in zip(run, placebo.sessions, strict=True)]
    assert all(0.0 <= d <= PLACEBO_SHIFT_S + 1e-9 for d in shifts) and max(shifts) > 0.0
    assert [replace(p, arrival_s=s.arrival_s) for s, p in zip(run, placebo.sessions,
                                                              strict=True)] == run


def test_lending_left_out_runs_the_ladder_rung_below_talaria_on_the_same_sessions() -> None:
    """``-lending`` is not built twice: the check runs the ladder's ``+priority_switch`` under
    the leave-one-out name, at Talaria's setting, on Talaria's sessions."""
    assert "-lending" in LOO_ROWS and "+priority_switch" not in LOO_ROWS
    config = SuiteConfig(traces=("miniswe",), servers=(1,))
    run = list(draw_sessions("miniswe", 6, 0, config.spec, "t"))
    jobs = {j.key[1]: j for j in _jobs(Scenario("miniswe", 1, 1.0), [run],
                                       (TALARIA, "-lending"), SuiteSettings(), config)}
    lending, talaria = jobs["-lending"], jobs[TALARIA]
    assert lending.system == SYSTEMS["+priority_switch"].with_setting(**TALARIA_SETTING)
    assert lending.system.policy.with_(name="") == preset("-lending").with_(name="")
    assert not lending.system.policy.lend_staging and talaria.system.policy.lend_staging
    assert lending.sessions == talaria.sessions == tuple(run)


def test_the_summary_sets_the_placebo_apart() -> None:
    draw = _draw(1)
    rows = draw.scenarios["miniswe/poisson-1/1srv"].rows
    rows[PLACEBO] = _row(PLACEBO, list(rows["talaria"].scts["mean"]))
    found = compare_rows([draw], ["-sp", PLACEBO])
    placebo_line = next(line for line in format_leave_one_out(found, 1).splitlines()
                        if line.strip().startswith(PLACEBO))
    assert "0 /   3 /   0" in placebo_line and "nothing changed" in placebo_line


def _suite(changes: dict[str, list[float]]) -> list[Comparison]:
    """Comparisons whose own (per-scenario) intervals are too wide to flag anything."""
    return [Comparison(f"s{i}", row, f, 100.0, 100.0 * (1 + change), (change - 0.1, change + 0.1))
            for row, values in changes.items() for i, change in enumerate(values)
            for f in FIGURES]


def test_the_suite_level_finds_a_small_effect_that_no_scenario_shows_alone() -> None:
    rng = random.Random(3)
    steady = [0.02 + rng.uniform(-0.01, 0.01) for _ in range(24)]  # 1-3% slower in each
    swinging = [0.05 if i % 2 else -0.05 for i in range(24)]  # +5, -5, ...: no effect
    harmful = [-v for v in steady]
    found = _suite({"-sp": steady, "-staging": swinging, "-host_kv": harmful})
    assert all(c.verdict == "neither" for c in found)
    verdict = {(v.row, v.figure): v for v in suite_level(found)}
    sp = verdict[("-sp", "p95")]
    assert sp.verdict == "pays" and sp.scenarios == 24
    assert sp.relative == pytest.approx(sum(steady) / 24)
    assert sp.ci95[0] > 0.01 and sp.ci95[1] < 0.03
    assert verdict[("-staging", "mean")].verdict == "neither"
    assert verdict[("-staging", "mean")].relative == pytest.approx(0.0)
    assert verdict[("-host_kv", "p50")].verdict == "hurts"
    text = format_leave_one_out(found, 1)
    line = next(ln for ln in text.split("over the whole suite")[1].splitlines()
                if ln.strip().startswith("-sp"))
    assert "p50  +2.0%" in line and line.rstrip().endswith("+")


def test_a_saved_run_reads_back_to_the_same_comparisons_and_suite_verdicts() -> None:
    found = compare_rows([_draw(1), _draw(2)], ["-sp", "-host_kv", "-staging"])
    data = leave_one_out_json(found, 2)
    assert comparisons_from_json(data) == found
    assert data["suite"]["-sp"]["mean"] == {"scenarios": 1, "relative": pytest.approx(0.3),
                                            "ci95": [pytest.approx(0.3), pytest.approx(0.3)],
                                            "per_draw": [pytest.approx(0.3)] * 2,
                                            "verdict": "pays"}
    assert data["suite"]["-host_kv"]["p50"]["verdict"] == "hurts"


def test_a_suite_verdict_stands_only_where_every_draw_agrees() -> None:
    # each draw's own change, scenario by scenario: -sp 1.3x in the first, 0.9x in the second
    first, second = _draw(1), _draw(2)
    rows = second.scenarios["miniswe/poisson-1/1srv"].rows
    rows["-sp"] = _row("-sp", [v * 0.9 for v in rows["talaria"].scts["mean"]])
    sp = next(c for c in compare_rows([first, second], ["-sp"]) if c.figure == "mean")
    assert sp.per_draw == (pytest.approx(0.3), pytest.approx(-0.1))
    assert compare_rows([first], ["-sp"])[0].per_draw == ()
    # over the suite: the interval says pays (or hurts), the draws decide whether it stands
    rng = random.Random(5)
    steady = [0.02 + rng.uniform(-0.005, 0.005) for _ in range(24)]

    def verdicts(per_draw: tuple[float, ...], sign: float = 1.0) -> set[str]:
        found = [replace(c, per_draw=tuple(sign * d for d in per_draw))
                 for c in _suite({"-sp": [sign * v for v in steady]})]
        return {v.verdict for v in suite_level(found)}

    assert verdicts(()) == {"pays"} and verdicts((), -1.0) == {"hurts"}
    assert verdicts((0.03, 0.01)) == {"pays"} and verdicts((0.03, 0.01), -1.0) == {"hurts"}
    assert verdicts((0.05, -0.01)) == {"neither"} and verdicts((0.05, -0.01), -1.0) == {"neither"}
    assert verdicts((0.04, 0.0)) == {"neither"}
    found = [replace(c, per_draw=(0.05, -0.01)) for c in _suite({"-sp": steady})]
    line = next(ln for ln in format_leave_one_out(found, 2).split("over the whole suite")[1]
                .splitlines() if ln.strip().startswith("-sp"))
    assert "(+5.0, -1.0)" in line and not line.rstrip().endswith("+")
    assert leave_one_out_json(found, 2)["suite"]["-sp"]["p95"]["per_draw"] == [
        pytest.approx(0.05), pytest.approx(-0.01)]
