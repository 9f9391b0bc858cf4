"""The suite's headline table and its JSON.

One line per scenario: the bound, the baseline, the best other system (the baseline or a
peer, each at its best setting for that figure) and Talaria, for p50, p95 and mean, with
Talaria's bootstrap 95% interval, how much faster Talaria is than the best other (> 1: ahead)
and Talaria over the bound. A summary says in which scenarios Talaria is not ahead, whether
the best other row is faster beyond the paired 95% interval of the same sessions
(``behind``) or within it (``tie``: the draw of sessions explains the gap), and for each
figure it is not, what the winning row's setting gives at the other two figures (a
setting that wins one figure often pays for it at another: a burst's median bought with a
long slot held through tool gaps, at the tail's expense); and which of the settings run beat
Talaria at two figures or more at once. Under it, one margin per row, figure and split
(``margins``): the mean over the split's scenarios of ``row / talaria - 1``, with a
bootstrap 95% interval over scenarios, for the best other row, the baseline and each peer:
the headline read over every scenario at once rather than one scenario's luck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workloads.suite.run import (
    BASELINE,
    FIGURES,
    TALARIA,
    ScenarioResult,
    SuiteResult,
    setting_key,
)
from workloads.suite.stats import interval, paired_interval

__all__ = ["BEST_OTHER", "Gap", "Margin", "best_other", "format_margins", "format_suite", "gaps",
           "margins", "margins_json", "multi_figure_wins", "not_ahead", "setting_tradeoffs",
           "suite_below_bound", "suite_json"]

BEST_OTHER = "best other"  # the margins' row for the fastest other row, scenario by scenario


def best_other(result: ScenarioResult, figure: str) -> tuple[str, float]:
    """The row other than Talaria with the lowest ``figure`` (each at its best setting)."""
    others = [(r.values[figure], name) for name, r in result.rows.items() if name != TALARIA]
    value, name = min(others)
    return name, value


def not_ahead(result: ScenarioResult) -> list[str]:
    """The figures at which some other row is at least as fast as Talaria."""
    if TALARIA not in result.rows:
        return []
    mine = result.rows[TALARIA].values
    return [f for f in FIGURES if best_other(result, f)[1] <= mine[f]]


@dataclass(frozen=True)
class Gap:
    """A figure Talaria is not ahead at: the best other row's value over Talaria's, minus 1
    (<= 0), and its paired bootstrap 95% interval over the scenario's sessions (both rows
    replay the same sessions). ``behind`` when the whole interval is below 0. The best
    other row is the fastest of several rows and settings, chosen after the fact, so the
    interval is, if anything, kind to it."""

    figure: str
    other: str
    relative: float
    ci95: tuple[float, float]

    @property
    def verdict(self) -> str:
        return "behind" if self.ci95[1] < 0 else "tie"

    def describe(self) -> str:
        lo, hi = self.ci95
        return (f"{self.figure} {100 * self.relative:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}] "
                f"{self.verdict}")


def gaps(result: ScenarioResult, seed: int = 0) -> list[Gap]:
    """One ``Gap`` per figure of ``not_ahead``."""
    if TALARIA not in result.rows:
        return []
    mine = result.rows[TALARIA]
    out = []
    for f in not_ahead(result):
        other, value = best_other(result, f)
        theirs = result.rows[other].scts.get(f)
        ours = mine.scts.get(f)
        if not theirs or not ours or len(theirs) != len(ours):
            raise ValueError(f"{result.scenario.name} {f}: {other} and talaria do not hold the "
                             f"same sessions' SCTs, so they cannot be paired")
        out.append(Gap(f, other, value / mine.values[f] - 1.0,
                       paired_interval(ours, theirs, f, seed=seed)))
    return out


def setting_tradeoffs(result: ScenarioResult) -> list[str]:
    """One line per figure Talaria is not ahead at: the winning row and setting, and that
    setting's other two figures against Talaria's."""
    if TALARIA not in result.rows:
        return []
    mine = result.rows[TALARIA].values
    lines = []
    for f in not_ahead(result):
        other, value = best_other(result, f)
        row = result.rows[other]
        line = (f"{result.scenario.name} {f}: {other} at {setting_key(row.settings[f])} "
                f"{value:.0f} against {mine[f]:.0f}")
        profile = row.at_setting.get(f)
        if profile:
            rest = [g for g in FIGURES if g != f]
            line += (f"; at that setting its {' / '.join(rest)} are "
                     f"{' / '.join(f'{profile[g]:.0f}' for g in rest)} against talaria's "
                     f"{' / '.join(f'{mine[g]:.0f}' for g in rest)}")
        lines.append(line)
    return lines


def multi_figure_wins(result: ScenarioResult) -> list[str]:
    """The (row, setting) pairs, among the settings run, at least as fast as Talaria at two
    figures or more of the same run."""
    if TALARIA not in result.rows:
        return []
    mine = result.rows[TALARIA].values
    found = []
    for name, row in result.rows.items():
        if name == TALARIA:
            continue
        seen = set()
        for f, profile in row.at_setting.items():
            key = setting_key(row.settings[f])
            if key in seen:
                continue
            seen.add(key)
            wins = [g for g in FIGURES if profile[g] <= mine[g]]
            if len(wins) >= 2:
                found.append(f"{result.scenario.name}: {name} at {key} ({', '.join(wins)})")
    return found


@dataclass(frozen=True)
class Margin:
    """How much slower ``row`` is than Talaria over the ``split``'s scenarios at ``figure``:
    the mean over scenarios of ``row / talaria - 1`` (> 0: Talaria ahead; each row at its
    best setting for that figure), a bootstrap 95% interval over scenarios (each scenario's
    ratio one observation, its schedule's luck included), and in how many of them the row
    is at least as fast as Talaria."""

    split: str
    row: str
    figure: str
    scenarios: int
    relative: float
    ci95: tuple[float, float]
    not_behind: int


def margins(suite: SuiteResult, seed: int = 0) -> list[Margin]:
    """The best other row's, the baseline's and each peer's margin, per split and figure."""
    out = []
    results = [r for r in suite.scenarios.values() if TALARIA in r.rows]
    for split in dict.fromkeys(r.scenario.split for r in results):
        mine = [r for r in results if r.scenario.split == split]
        rows = [n for n in mine[0].rows if n != TALARIA and all(n in r.rows for r in mine)]
        for row in [BEST_OTHER, *rows]:
            for f in FIGURES:
                ratios = [(best_other(r, f)[1] if row == BEST_OTHER else r.rows[row].values[f])
                          / r.rows[TALARIA].values[f] - 1.0 for r in mine]
                out.append(Margin(split, row, f, len(ratios), sum(ratios) / len(ratios),
                                  interval(ratios, "mean", seed=seed),
                                  sum(x <= 0 for x in ratios)))
    return out


def format_margins(found: list[Margin]) -> str:
    lines = ["over each split's scenarios: row / talaria - 1 (mean over scenarios; 95% interval "
             "over scenarios; > 0: talaria ahead), and (n) the scenarios where the row is at "
             "least as fast as talaria"]
    keys = list(dict.fromkeys((m.split, m.row) for m in found))
    for split in dict.fromkeys(s for s, _ in keys):
        count = next(m.scenarios for m in found if m.split == split)
        lines.append(f"  {split} ({count} scenarios)")
        for row in [r for s, r in keys if s == split]:
            cells = [f"{m.figure} {100 * m.relative:+6.1f}% [{100 * m.ci95[0]:+6.1f}, "
                     f"{100 * m.ci95[1]:+6.1f}] ({m.not_behind})"
                     for m in found if m.split == split and m.row == row]
            lines.append(f"    {row:18s} " + "  ".join(cells))
    return "\n".join(lines)


def margins_json(found: list[Margin]) -> dict[str, Any]:
    """``{split: {row: {figure: {scenarios, relative, ci95, not_behind}}}}``."""
    out: dict[str, Any] = {}
    for m in found:
        out.setdefault(m.split, {}).setdefault(m.row, {})[m.figure] = {
            "scenarios": m.scenarios, "relative": m.relative, "ci95": list(m.ci95),
            "not_behind": m.not_behind}
    return out


def _bound(result: ScenarioResult, figure: str) -> float:
    b = result.bound
    return {"p50": b.sct_p50_s, "p95": b.sct_p95_s, "mean": b.sct_mean_s}[figure]


def suite_below_bound(suite: SuiteResult) -> list[str]:
    """Every (scenario, row, figure) read below the scenario's lower bound (more than
    rounding): a defect of the bound's proof or of the simulator, never a result."""
    out = []
    for name, res in suite.scenarios.items():
        if res.bound is None:
            continue
        for row, r in res.rows.items():
            for f in FIGURES:
                if r.values[f] < _bound(res, f) * (1 - 1e-6):
                    out.append(f"{name} {row} {f} {r.values[f]:.1f} < {_bound(res, f):.1f}")
    return out


def format_suite(suite: SuiteResult) -> str:
    head = ["scenario", "split", "n"]
    for f in FIGURES:
        head += [f"{f}: bound", "base", "best other", "talaria [95% CI]", "x other", "/bound"]
    head.append("busy")
    rows = [head]
    for name, res in suite.scenarios.items():
        line = [name, res.scenario.split, str(res.sessions)]
        for f in FIGURES:
            other, value = best_other(res, f)
            tal = res.rows.get(TALARIA)
            base = res.rows[BASELINE].values[f]
            mark = "" if res.rows[other].tuned else "*"
            line += [f"{_bound(res, f):.0f}", f"{base:.0f}", f"{value:.0f} {other}{mark}"]
            if tal is None:
                line += ["", "", ""]
                continue
            lo, hi = tal.ci95[f]
            line += [f"{tal.values[f]:.0f} [{lo:.0f}-{hi:.0f}]", f"{value / tal.values[f]:.2f}",
                     f"{tal.values[f] / _bound(res, f):.2f}"]
        busy = res.rows[TALARIA].utilisation.get("p50") if TALARIA in res.rows else None
        line.append("" if busy is None else f"{100 * busy:.0f}%")
        rows.append(line)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
           for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    found = {n: gaps(r, suite.config.seed) for n, r in suite.scenarios.items()}
    behind = [f"{n} ({', '.join(g.describe() for g in gs)})" for n, gs in found.items() if gs]
    every = [g for gs in found.values() for g in gs]
    beyond = sum(g.verdict == "behind" for g in every)
    out.append("")
    out.append("SCT in seconds. best other: the baseline or a peer, each at its best setting for "
               "that figure in that scenario (* untuned: no suite settings cached for it); "
               "x other: best other / talaria (> 1: talaria ahead); /bound: talaria over the "
               "lower bound (workloads.bounds.bound); busy: the share of server time "
               "talaria's engines were busy (modelled engine time over makespan x servers). "
               "Saturation (the baseline's burst throughput): "
               + ", ".join(f"{k} {v * 3600:.0f} sessions/h" for k, v in suite.saturation.items()))
    out.append("talaria is not ahead in (best other / talaria - 1, paired 95% interval over the "
               "same sessions; behind: beyond it, tie: within it): "
               + ("; ".join(behind) if behind else "none"))
    if every:
        out.append(f"  {len(every)} figure(s) not ahead: {beyond} behind beyond the interval, "
                   f"{len(every) - beyond} within it")
    below = suite_below_bound(suite)
    if below:
        out.append("!! below the lower bound (the bound is then not one; see "
                   "workloads/bounds/bound.py): " + "; ".join(below))
    tradeoffs = [line for r in suite.scenarios.values() for line in setting_tradeoffs(r)]
    if tradeoffs:
        out.append("what the winning settings cost at the other figures:")
        out.extend(f"  {line}" for line in tradeoffs)
    multi = [line for r in suite.scenarios.values() for line in multi_figure_wins(r)]
    out.append("settings run that are at least as fast as talaria at two figures or more at "
               "once: " + ("; ".join(multi) if multi else "none"))
    found_margins = margins(suite, suite.config.seed)
    if found_margins:
        out.append(format_margins(found_margins))
    return "\n".join(out)


def suite_json(suite: SuiteResult) -> dict[str, Any]:
    """``{name: {rows{policy: {sct_p50_s, sct_p95_s, sct_mean_s, ci95, setting}},
    lower_bound{...}, not_ahead{figure: {other, relative, ci95, verdict}}, ...}}``."""
    out: dict[str, Any] = {}
    for name, res in suite.scenarios.items():
        rows: dict[str, Any] = {}
        behind = {g.figure: {"other": g.other, "relative": g.relative, "ci95": list(g.ci95),
                             "verdict": g.verdict} for g in gaps(res, suite.config.seed)}
        for policy, r in res.rows.items():
            rows[policy] = {
                **{f"sct_{f}_s": r.values[f] for f in FIGURES},
                "ci95": {f"sct_{f}_s": list(r.ci95[f]) for f in FIGURES},
                "setting": {f: dict(r.settings[f]) for f in FIGURES},
                "tuned": r.tuned,
                "failed_calls": r.failed_calls,
                "utilisation": dict(r.utilisation),
                "at_setting": {f: {f"sct_{g}_s": v for g, v in prof.items()}
                               for f, prof in r.at_setting.items()},
            }
        b = res.bound
        out[name] = {
            "split": res.scenario.split, "servers": res.scenario.servers,
            "load": res.scenario.load, "sessions": res.sessions,
            "saturation_sessions_per_s": res.saturation_rate,
            "rows": rows,
            "lower_bound": {"sct_p50_s": b.sct_p50_s, "sct_p95_s": b.sct_p95_s,
                            "sct_mean_s": b.sct_mean_s, "binding": dict(b.binding)},
            "isolated_p95_s": res.isolated_p95_s,
            "not_ahead": behind,
        }
    return out

