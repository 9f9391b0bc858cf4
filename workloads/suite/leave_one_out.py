"""Does every mechanism pay? Talaria against each leave-one-out row in every suite scenario.

Each row is Talaria's one configuration (its ``fixed`` settings grid) with one mechanism off
(``LEAVE_ONE_OUT_ROWS``, and ``-lending``: the ladder's rung below Talaria). ``draws``
independent draws of the suite (seeds ``config.seed``, ``+1``, ...: other sessions, other
Poisson arrivals, and the Poisson rates from that draw's own baseline bursts) are pooled
per scenario, and every row replays the same sessions as Talaria, so the comparison is
paired: the ratio ``row / talaria - 1`` of each figure with a paired bootstrap 95%
interval over the pooled sessions (``paired_interval``).

A verdict per (scenario, row, figure): ``pays`` when the interval lies above 0 (the row
without the mechanism is slower), ``hurts`` when it lies below (faster without it: a
defect), ``neither`` otherwise (the difference is within what the draw of sessions
explains). At 95% two-sided, a mechanism with no effect at all would read ``hurts`` in
about 2.5% of comparisons if sessions were independent; they are not (one change to the
schedule moves every session at once), so a ``PLACEBO`` row runs beside the others:
Talaria itself with each arrival moved by up to a second. Its flags, either way, are what
the check reads where nothing changed; the summary prints them beside each row's.

Per scenario, the session bootstrap sees only which sessions were drawn, not the schedule's
own response to a change (one moved arrival reorders every later slot), so small effects
drown in per-scenario flags. ``suite_level`` asks the question once per row and figure over
the whole suite: the mean over scenarios of ``row / talaria - 1``, with a bootstrap 95%
interval over scenarios (each scenario's change, schedule and all, one observation;
scenarios are treated as independent, though a trace's scenarios share its sessions). The
placebo row is the check on that test too: where it is flagged, so would be nothing.

That interval does not cover a new draw of the whole suite: at 480 s, the layer-wise
restore's p95 read -1.3% [-2.2, -0.5] over draws 0 and 1 and +1.0% [+0.4, +1.5] over draws 2
and 3 (docs/benchmark.md). So with several draws each figure also keeps every draw's own
relative change (``per_draw``, each over that draw's sessions alone), and a suite-level
``pays`` or ``hurts`` stands only where every draw's mean over scenarios lies on its side of
0; otherwise the verdict is ``neither``, the draws disagreeing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from workloads.replay.systems import LADDER_LEAVE_ONE_OUT, LEAVE_ONE_OUT_ROWS, SystemConfig
from workloads.suite.run import (
    BASELINE,
    FIGURES,
    PLACEBO,
    PLACEBO_SHIFT_S,
    TALARIA,
    SuiteResult,
    SuiteSettings,
    run_suite,
)
from workloads.suite.scenarios import SuiteConfig
from workloads.suite.stats import figure, interval, paired_interval

__all__ = ["Comparison", "LOO_ROWS", "SuiteVerdict", "check_loo_rows", "comparisons_from_json",
           "compare_rows", "format_leave_one_out", "leave_one_out_json", "run_leave_one_out",
           "run_paired", "suite_level"]

LOO_ROWS: tuple[str, ...] = (*LEAVE_ONE_OUT_ROWS, *LADDER_LEAVE_ONE_OUT, PLACEBO)
_CHANCE = 0.025  # one tail of a 95% interval
_MARK = {"pays": "+", "hurts": "!", "neither": " "}  # a verdict in the printed tables


@dataclass(frozen=True)
class Comparison:
    scenario: str
    row: str
    figure: str
    talaria: float  # seconds, pooled over the draws
    value: float  # the row's, same sessions
    ci95: tuple[float, float]  # of value / talaria - 1
    per_draw: tuple[float, ...] = ()  # each draw's own value / talaria - 1 (several draws)

    @property
    def relative(self) -> float:
        return self.value / self.talaria - 1.0

    @property
    def verdict(self) -> str:
        return _verdict(self.ci95)


@dataclass(frozen=True)
class SuiteVerdict:
    """One row's figure over the whole suite: the mean over ``scenarios`` of
    ``row / talaria - 1``, and its bootstrap 95% interval over scenarios."""

    row: str
    figure: str
    scenarios: int
    relative: float
    ci95: tuple[float, float]
    per_draw: tuple[float, ...] = ()  # each draw's mean over scenarios (several draws)

    @property
    def verdict(self) -> str:
        """The interval's verdict, kept only where every draw agrees in sign."""
        verdict = _verdict(self.ci95)
        side = {"pays": 1.0, "hurts": -1.0}.get(verdict)
        if side is not None and any(side * d <= 0 for d in self.per_draw):
            return "neither"
        return verdict


def _verdict(ci95: tuple[float, float]) -> str:
    low, high = ci95
    return "pays" if low > 0 else "hurts" if high < 0 else "neither"


def suite_level(found: Sequence[Comparison], seed: int = 0) -> list[SuiteVerdict]:
    """Each row's figures over every scenario in ``found`` (see the module's docstring)."""
    out = []
    for row in dict.fromkeys(c.row for c in found):
        for f in FIGURES:
            mine = [c for c in found if c.row == row and c.figure == f]
            changes = [c.relative for c in mine]
            draws = min(len(c.per_draw) for c in mine)
            per_draw = tuple(sum(c.per_draw[d] for c in mine) / len(mine) for d in range(draws))
            out.append(SuiteVerdict(row, f, len(changes), sum(changes) / len(changes),
                                    interval(changes, "mean", seed=seed), per_draw))
    return out


def compare_rows(draws: Sequence[SuiteResult], rows: Sequence[str],
                 seed: int = 0) -> list[Comparison]:
    """Each row against Talaria in each scenario, the draws' sessions pooled in order (and,
    with several draws, each draw's own change)."""
    def scts(draw: SuiteResult, name: str, row: str, f: str) -> tuple[float, ...]:
        return draw.scenarios[name].rows[row].scts[f]

    out = []
    for name in draws[0].scenarios:
        for row in rows:
            for f in FIGURES:
                base = [v for draw in draws for v in scts(draw, name, TALARIA, f)]
                other = [v for draw in draws for v in scts(draw, name, row, f)]
                per_draw = tuple(
                    figure(scts(d, name, row, f), f) / figure(scts(d, name, TALARIA, f), f) - 1
                    for d in draws) if len(draws) > 1 else ()
                out.append(Comparison(name, row, f, figure(base, f), figure(other, f),
                                      paired_interval(base, other, f, seed=seed), per_draw))
    return out


def check_loo_rows(rows: Sequence[str]) -> None:
    """Refuse rows that are not leave-one-out rows, naming them and the known ones."""
    unknown = [r for r in rows if r not in LOO_ROWS]
    if unknown:
        raise ValueError(f"not leave-one-out rows: {', '.join(unknown)}; "
                         f"known: {', '.join(LOO_ROWS)}")


def run_leave_one_out(config: SuiteConfig, baseline_setting: Mapping[str, Any], *,
                      draws: int = 2, rows: Sequence[str] = LOO_ROWS, workers: int = 1,
                      progress: bool = False) -> list[Comparison]:
    """``draws`` suites of Talaria, ``rows`` and the baseline (its bursts at
    ``baseline_setting`` set the Poisson rates, as in the suite), compared."""
    check_loo_rows(rows)
    return run_paired(config, baseline_setting, rows, draws=draws, workers=workers,
                      progress=progress)


def run_paired(config: SuiteConfig, baseline_setting: Mapping[str, Any], rows: Sequence[str],
               *, draws: int = 1, workers: int = 1, progress: bool = False,
               systems: Mapping[str, SystemConfig] | None = None) -> list[Comparison]:
    """``draws`` suites of Talaria, ``rows`` (``systems``: those not in ``SYSTEMS``) and the
    baseline, on the same sessions, each row compared with Talaria."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    settings = SuiteSettings(fallback={BASELINE: dict(baseline_setting)})
    results = [run_suite(replace(config, seed=config.seed + d), settings,
                         rows=(BASELINE, *rows, TALARIA), workers=workers, progress=progress,
                         systems=systems, yardsticks=False)
               for d in range(draws)]
    return compare_rows(results, rows, seed=config.seed)


def format_leave_one_out(found: Sequence[Comparison], draws: int) -> str:
    rows = list(dict.fromkeys(c.row for c in found))
    scenarios = list(dict.fromkeys(c.scenario for c in found))
    width = max(len(s) for s in scenarios)
    lines = [f"leave-one-out: each row / talaria - 1 per figure (p50 / p95 / mean), same "
             f"sessions, {draws} draw(s) pooled; + : slower without the mechanism (it pays), "
             f"! : faster without it beyond the 95% interval (it hurts)"]
    lines.append(f"{'scenario':{width}s}  " + "  ".join(f"{r:>22s}" for r in rows))
    by_key = {(c.scenario, c.row, c.figure): c for c in found}
    for name in scenarios:
        cells = []
        for row in rows:
            parts = []
            for f in FIGURES:
                c = by_key[(name, row, f)]
                parts.append(f"{100 * c.relative:+4.0f}{_MARK[c.verdict]}")
            cells.append(f"{'/'.join(parts):>22s}")
        lines.append(f"{name:{width}s}  " + "  ".join(cells))
    lines.append("per row, over scenarios x figures: pays / neither / hurts (hurts expected "
                 "by chance alone at no effect, sessions independent)")
    for row in rows:
        mine = [c for c in found if c.row == row]
        count = {v: sum(c.verdict == v for c in mine) for v in ("pays", "neither", "hurts")}
        note = (f"  <- talaria, arrivals moved by up to {PLACEBO_SHIFT_S:g} s: what the check "
                "flags where nothing changed" if row == PLACEBO else "")
        lines.append(f"  {row:16s} {count['pays']:3d} / {count['neither']:3d} / "
                     f"{count['hurts']:3d} ({_CHANCE * len(mine):.1f}){note}")
    lines.append("per row, over the whole suite: the mean over scenarios of row / talaria - 1, "
                 "95% interval over scenarios (+ pays, ! hurts; either only where every "
                 "draw's own mean, in parentheses, agrees)")
    by_row: dict[str, list[SuiteVerdict]] = {}
    for v in suite_level(found):
        by_row.setdefault(v.row, []).append(v)
    for row, verdicts in by_row.items():
        lines.append(f"  {row:16s} " + "  ".join(
            f"{v.figure} {100 * v.relative:+5.1f}% [{100 * v.ci95[0]:+5.1f}, "
            f"{100 * v.ci95[1]:+5.1f}]{_MARK[v.verdict]}{_per_draw_note(v.per_draw)}" for v in verdicts))
    hurts = [c for c in found if c.verdict == "hurts"]
    lines.append("hurts: " + ("; ".join(
        f"{c.scenario} {c.row} {c.figure} {c.value:.0f} against {c.talaria:.0f} "
        f"({100 * c.ci95[0]:+.1f}% to {100 * c.ci95[1]:+.1f}%)" for c in hurts) or "none"))
    return "\n".join(lines)


def _per_draw_note(per_draw: Sequence[float]) -> str:
    return f" ({', '.join(f'{100 * d:+.1f}' for d in per_draw)})" if per_draw else ""


def leave_one_out_json(found: Sequence[Comparison], draws: int) -> dict[str, Any]:
    """``{"draws", "scenarios": {name: {row: {figure: {talaria_s, row_s, relative, ci95,
    per_draw, verdict}}}}, "suite": {row: {figure: {scenarios, relative, ci95, per_draw,
    verdict}}}}``."""
    scenarios: dict[str, Any] = {}
    for c in found:
        scenarios.setdefault(c.scenario, {}).setdefault(c.row, {})[c.figure] = {
            "talaria_s": c.talaria, "row_s": c.value, "relative": c.relative,
            "ci95": list(c.ci95), "per_draw": list(c.per_draw), "verdict": c.verdict}
    suite: dict[str, Any] = {}
    for v in suite_level(found):
        suite.setdefault(v.row, {})[v.figure] = {
            "scenarios": v.scenarios, "relative": v.relative, "ci95": list(v.ci95),
            "per_draw": list(v.per_draw), "verdict": v.verdict}
    return {"draws": draws, "scenarios": scenarios, "suite": suite}


def comparisons_from_json(data: Mapping[str, Any]) -> list[Comparison]:
    """The comparisons a ``leave_one_out_json`` document holds (a saved run, read back)."""
    return [Comparison(name, row, f, cell["talaria_s"], cell["row_s"],
                       (cell["ci95"][0], cell["ci95"][1]), tuple(cell.get("per_draw", ())))
            for name, rows in data["scenarios"].items()
            for row, figures in rows.items() for f, cell in figures.items()]
