"""Running the scenario suite: every row of every scenario at its settings, and the bound.

Talaria runs one configuration everywhere (``talaria.policies.config.TALARIA_SETTING``:
drained slots of at most 480 s, chosen over 120 / 240 / 960 s on the 18 development
scenarios, docs/constants.md). The baseline and each peer run, per scenario, at the setting that is best
in hindsight for each figure separately (``SuiteSettings``: the lowest p50, the lowest p95
and the lowest mean over the row's grid, found by ``tune_suite``); a figure is read from the
run at its own best setting. A row with no tuned settings for a scenario runs at its
default-trace setting, marked untuned.

Results keep each session's SCT (pooled over a burst scenario's runs), the figures with
bootstrap 95% intervals over sessions (``workloads.suite.stats``), and the bound for the same
sessions (``workloads.bounds.bound``, pooled order statistics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from talaria.policies.config import TALARIA_SETTING
from workloads.bounds.bound import LowerBound, lower_bound, pooled_bound
from workloads.bounds.isolated import run_isolated
from workloads.replay.driver import ReplayResult
from workloads.replay.jobs import Job, run_many
from workloads.replay.systems import LADDER_LEAVE_ONE_OUT, PEERS, SYSTEMS, SystemConfig
from workloads.suite.scenarios import (
    Scenario,
    SuiteConfig,
    burst_runs,
    poisson_run,
    saturation_rate,
    scenarios,
)
from workloads.suite.stats import FIGURES, figure, interval
from workloads.traces.arrivals import jittered
from workloads.traces.trace import Session

__all__ = ["FIGURES", "PLACEBO", "PLACEBO_SHIFT_S", "RowResult", "ScenarioResult", "SuiteResult",
           "SuiteSettings", "SUITE_ROWS", "TALARIA_SETTING", "run_suite", "setting_key", "system_row"]

BASELINE = "baseline"
TALARIA = "talaria"
SUITE_ROWS: tuple[str, ...] = (BASELINE, *PEERS, TALARIA)
# Talaria itself, each session arriving up to PLACEBO_SHIFT_S later (``jittered``; a burst's
# sessions then arrive over that second, not all at t=0): a change no policy should care
# about, run beside the leave-one-out rows so that what it moves is the paired check's own
# noise (one change to the schedule moves every session at once).
PLACEBO = "placebo"
PLACEBO_SHIFT_S = 1.0

Setting = dict[str, Any]


def system_row(row: str) -> str:
    """The row of ``SYSTEMS`` that ``row`` runs: Talaria's for the placebo, the ladder's rung
    for a leave-one-out row that is one (``-lending``), else itself."""
    return TALARIA if row == PLACEBO else LADDER_LEAVE_ONE_OUT.get(row, row)


def setting_key(setting: Mapping[str, Any]) -> str:
    return f"{setting['slot_close']}/{setting['slot_quantum_s']:g}s"


@dataclass
class SuiteSettings:
    """Per scenario name, per row, per figure: the setting to run (``tune_suite`` writes it);
    ``fallback``: per row, the setting used where a scenario has none (untuned)."""

    tuned: dict[str, dict[str, dict[str, Setting]]] = field(default_factory=dict)
    fallback: dict[str, Setting] = field(default_factory=dict)

    def saturation_setting(self) -> Setting:
        """The baseline's setting whose burst throughput is the saturation rate: its
        fallback, so that Poisson rates do not move while the baseline is tuned."""
        return dict(self.fallback.get(BASELINE) or SYSTEMS[BASELINE].setting)

    def for_row(self, scenario: str, row: str,
                system: SystemConfig | None = None) -> tuple[dict[str, Setting], bool]:
        """(figure -> setting, tuned?) for ``row`` in ``scenario`` (``system``: the row's
        own, where it is not one of ``SYSTEMS``)."""
        system = system or SYSTEMS[system_row(row)]
        if system.grid == "fixed":  # Talaria's one configuration: never tuned
            return {f: dict(system.setting) for f in FIGURES}, True
        chosen = self.tuned.get(scenario, {}).get(row)
        if chosen:
            return {f: dict(chosen[f]) for f in FIGURES}, True
        default = self.fallback.get(row) or system.setting
        return {f: dict(default) for f in FIGURES}, False


@dataclass
class RowResult:
    policy: str
    values: dict[str, float]  # figure -> seconds, each from its own setting's run
    ci95: dict[str, tuple[float, float]]
    settings: dict[str, Setting]  # figure -> the setting it ran at
    tuned: bool
    failed_calls: int = 0
    # figure -> all three figures of the run at that figure's setting: what a setting that
    # wins one figure costs at the others (``at_setting[f][f] == values[f]``)
    at_setting: dict[str, dict[str, float]] = field(default_factory=dict)
    # figure -> the SCTs of that figure's runs, ordered by (run, session id): two rows of one
    # scenario line up session by session (``workloads.suite.leave_one_out`` pairs them)
    scts: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # figure -> the fraction of server time that figure's runs kept an engine busy (modelled
    # engine time over makespan x servers, pooled over the runs): how loaded the servers were
    utilisation: dict[str, float] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    scenario: Scenario
    rows: dict[str, RowResult]
    bound: LowerBound | None  # None where the run compared rows only (``yardsticks=False``)
    isolated_p95_s: float | None  # each session alone: the SLO's yardstick (None: likewise)
    sessions: int
    saturation_rate: float | None = None  # sessions/s the Poisson rates are fractions of


@dataclass
class SuiteResult:
    config: SuiteConfig
    scenarios: dict[str, ScenarioResult]
    saturation: dict[str, float]  # "<trace>/<servers>srv" -> sessions/s


def _runs(scenario: Scenario, config: SuiteConfig,
          saturation: Mapping[str, float]) -> list[list[Session]]:
    if scenario.load is None:
        return burst_runs(scenario, config)
    return [poisson_run(scenario, config, saturation[_group(scenario)])]


def _group(scenario: Scenario) -> str:
    return f"{scenario.trace}/{scenario.servers}srv"


def _scenario_rows(scenario: Scenario, rows: Sequence[str], yardsticks: bool) -> list[str]:
    """The rows a scenario runs: without yardsticks the baseline runs only for the Poisson
    rates, so only in bursts, and only at its saturation setting."""
    if yardsticks or scenario.load is None:
        return list(rows)
    return [r for r in rows if r != BASELINE]


def _jobs(scenario: Scenario, runs: Sequence[Sequence[Session]], rows: Sequence[str],
          settings: SuiteSettings, config: SuiteConfig,
          systems: Mapping[str, SystemConfig] | None = None, yardsticks: bool = True,
          ) -> list[Job]:
    systems = systems or {}
    jobs = []
    spec = config.spec_for(scenario.servers)
    for row in _scenario_rows(scenario, rows, yardsticks):
        chosen, _ = settings.for_row(scenario.name, row, systems.get(row))
        if row == BASELINE and not yardsticks:  # a burst's (``_scenario_rows``), for the rate
            wanted = [settings.saturation_setting()]
        else:
            wanted = list(chosen.values())
            if row == BASELINE and scenario.load is None:
                wanted.append(settings.saturation_setting())
        for key in dict.fromkeys(setting_key(s) for s in wanted):
            setting = next(s for s in wanted if setting_key(s) == key)
            system = (systems.get(row) or SYSTEMS[system_row(row)]).with_setting(**setting)
            for r, sessions in enumerate(runs):
                if row == PLACEBO:
                    sessions = jittered(sessions, PLACEBO_SHIFT_S, seed=config.seed)
                jobs.append(Job((scenario.name, row, key, r), tuple(sessions), system, spec,
                                config.seed))
    return jobs


def _collect(scenario: Scenario, runs: Sequence[Sequence[Session]], rows: Sequence[str],
             settings: SuiteSettings, done: Mapping[Any, ReplayResult],
             config: SuiteConfig, saturation: float | None,
             systems: Mapping[str, SystemConfig] | None = None,
             yardsticks: bool = True) -> ScenarioResult:
    systems = systems or {}
    spec = config.spec_for(scenario.servers)
    out: dict[str, RowResult] = {}
    for row in rows:
        if row == BASELINE and not yardsticks:
            continue  # it ran in bursts only, at the saturation setting, for the rates
        chosen, tuned = settings.for_row(scenario.name, row, systems.get(row))
        values, cis, failed, profiles, kept, busy = {}, {}, 0, {}, {}, {}
        for name, setting in chosen.items():
            results = [done[(scenario.name, row, setting_key(setting), r)]
                       for r in range(len(runs))]
            # the intervals resample the sessions in the replay's order (the published
            # intervals stay as they were); ``kept`` sorts them by id for pairing
            scts = [s.sct_s for res in results for s in res.sessions]
            kept[name] = tuple(s.sct_s for res in results
                               for s in sorted(res.sessions, key=lambda s: s.session_id))
            profiles[name] = {f: figure(scts, f) for f in FIGURES}
            values[name] = profiles[name][name]
            cis[name] = interval(scts, name, seed=config.seed)
            failed = max(failed, sum(res.failed_calls for res in results))
            busy[name] = _utilisation(results, scenario.servers)
        out[row] = RowResult(row, values, cis, chosen, tuned, failed, profiles, kept, busy)
    sessions = sum(len(r) for r in runs)
    if not yardsticks:
        return ScenarioResult(scenario, out, None, None, sessions, saturation)
    bound = pooled_bound([lower_bound(run, spec) for run in runs])
    isolated = [s.sct_s for run in runs for s in run_isolated(run, spec).sessions]
    return ScenarioResult(scenario, out, bound, figure(isolated, "p95"), sessions, saturation)


def _utilisation(results: Sequence[ReplayResult], servers: int) -> float:
    busy = sum(r.totals.busy_s for r in results if r.totals is not None)
    span = sum(r.makespan_s for r in results) * servers
    return busy / span if span > 0 else 0.0


def run_suite(
    config: SuiteConfig, settings: SuiteSettings, *, rows: Sequence[str] = SUITE_ROWS,
    workers: int = 1, progress: bool = False, systems: Mapping[str, SystemConfig] | None = None,
    yardsticks: bool = True,
) -> SuiteResult:
    """Every scenario of ``config`` for ``rows`` (the baseline among them: its bursts set the
    Poisson rates). ``systems``: rows that are not ``SYSTEMS``' (a variant of Talaria under
    development, ``workloads.suite.develop``), by name; they run at the setting they carry
    unless ``settings`` names one. ``yardsticks=False`` is for runs that only compare rows
    with each other (leave-one-out, development): no bound, no isolated runs, and the
    baseline runs only its bursts at the saturation setting, for the rates, and is not
    among a scenario's rows."""
    systems = systems or {}
    if BASELINE not in rows:
        raise ValueError("the suite needs the baseline row: its bursts set the Poisson rates")
    unknown = [r for r in rows if r not in systems and system_row(r) not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}")
    all_scenarios = scenarios(config)
    saturation: dict[str, float] = {}
    results: dict[str, ScenarioResult] = {}
    for phase in ("burst", "poisson"):
        chosen = [s for s in all_scenarios if (s.load is None) == (phase == "burst")]
        runs = {s.name: _runs(s, config, saturation) for s in chosen}
        jobs = [j for s in chosen
                for j in _jobs(s, runs[s.name], rows, settings, config, systems, yardsticks)]
        done = run_many(jobs, workers, progress)
        for s in chosen:
            rate = saturation.get(_group(s)) if s.load is not None else None
            results[s.name] = _collect(s, runs[s.name], rows, settings, done, config, rate,
                                       systems, yardsticks)
            if s.load is None:
                base = settings.saturation_setting()
                makespans = [(len(run), done[(s.name, BASELINE, setting_key(base), r)].makespan_s)
                             for r, run in enumerate(runs[s.name])]
                saturation[_group(s)] = saturation_rate(makespans)
    ordered = {s.name: results[s.name] for s in all_scenarios}
    return SuiteResult(config, ordered, saturation)
