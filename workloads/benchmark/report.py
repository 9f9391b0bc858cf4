"""Benchmark statistics, the printed tables and the JSON file (plots: ``report_plot``).

Per policy: the setting it ran at; SCT p50 / p95 / mean; per-call TTFT p50 / p95; model
switches; prompt tokens recomputed (KV an earlier call of the session had computed, prefilled
again) vs restored from host vs served from the device prefix cache; speedups of p50 and p95
SCT against the baseline (and against the baseline at its best slot quantum, when a quantum
sweep ran); p50 and p95 as multiples of the lower bound (``workloads.bounds.bound``: a proof that no
schedule does better) and of ``isolated`` (each session alone); the oracle schedule (the best
of a family of heuristic schedules on an idealised machine, ``workloads.bounds.oracle``) as a row; and
where each session's time went (``workloads.benchmark.breakdown``), mean per session, overall and per
model.
Percentiles interpolate linearly between order statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from workloads.benchmark.breakdown import PARTS, session_parts
from workloads.bounds.bound import LowerBound
from workloads.replay.driver import ReplayResult
from workloads.suite.stats import percentile

__all__ = [
    "PolicyStats",
    "Benchmark",
    "own_durations",
    "summarize",
    "format_table",
    "format_breakdown",
    "to_json",
    "write_json",
]

BASELINE = "baseline"
IDEAL_ROW = "oracle"


@dataclass
class PolicyStats:
    name: str
    sessions: int
    calls: int
    failed_calls: int
    sct_p50_s: float
    sct_p95_s: float
    sct_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    makespan_s: float
    switches: int | None
    tokens_prefilled: int
    tokens_recomputed: int
    tokens_restored: int
    tokens_device_cached: int
    wall_s: float
    speedup_p50: float | None = None  # baseline p50 / this p50
    speedup_p95: float | None = None
    speedup_p50_best_q: float | None = None  # best-quantum baseline p50 / this p50
    speedup_p95_best_q: float | None = None
    p50_over_bound: float | None = None
    p95_over_bound: float | None = None
    mean_over_bound: float | None = None
    p50_over_isolated: float | None = None
    p95_over_isolated: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    setting: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=dict)  # mean seconds per session
    breakdown_per_model: dict[str, dict[str, float]] = field(default_factory=dict)


OwnDurations = dict[str, dict[int, float]]  # session id -> call index -> seconds alone


def own_durations(isolated: ReplayResult) -> OwnDurations:
    """Each call's duration in the isolated run: what it takes with its session alone."""
    return {s.session_id: {c.index: c.done_s - c.sent_s for c in s.calls}
            for s in isolated.sessions}


def _mean_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    return {p: sum(r[p] for r in rows) / len(rows) for p in PARTS} if rows else {}


def summarize(
    result: ReplayResult, own: OwnDurations | None = None, setting: Mapping[str, Any] | None = None,
    *, is_isolated: bool = False,
) -> PolicyStats:
    """``own``: every call's duration alone (the isolated run), for the time split."""
    scts = [s.sct_s for s in result.sessions]
    parts = [session_parts(s.calls, None if is_isolated else (own or {}).get(s.session_id))
             for s in result.sessions]
    by_model: dict[str, list[dict[str, float]]] = {}
    for s, p in zip(result.sessions, parts, strict=True):
        by_model.setdefault(s.model, []).append(p)
    calls = result.calls
    ttfts = [c.ttft_s for c in calls if c.ttft_s is not None]
    cached = sum(c.cached_tokens for c in calls)
    restored = sum(c.restored_tokens for c in calls)
    totals = result.totals
    return PolicyStats(
        name=result.policy,
        sessions=len(result.sessions),
        calls=len(calls),
        failed_calls=result.failed_calls,
        sct_p50_s=percentile(scts, 50),
        sct_p95_s=percentile(scts, 95),
        sct_mean_s=sum(scts) / len(scts),
        ttft_p50_s=percentile(ttfts, 50) if ttfts else math.nan,
        ttft_p95_s=percentile(ttfts, 95) if ttfts else math.nan,
        makespan_s=result.makespan_s,
        switches=totals.switches if totals is not None else None,
        tokens_prefilled=sum(c.prompt_tokens for c in calls) - cached,
        tokens_recomputed=sum(c.recomputed_tokens for c in calls),
        tokens_restored=restored,
        tokens_device_cached=cached - restored,
        wall_s=result.wall_s,
        counters=dict(totals.counters) if totals is not None else {},
        setting=dict(setting or {}),
        breakdown=_mean_parts(parts),
        breakdown_per_model={m: _mean_parts(rows) for m, rows in sorted(by_model.items())},
    )


@dataclass
class Benchmark:
    """Every policy's stats, the isolated row, the oracle schedule's row, the lower bound, and
    (after a quantum sweep) the baseline's best quantum for p50 and for p95."""

    policies: dict[str, PolicyStats]
    isolated: PolicyStats | None = None
    best_quantum: dict[str, Any] = field(default_factory=dict)  # {"p50": (q, s), "p95": ...}
    setup: dict[str, Any] = field(default_factory=dict)
    ideal: PolicyStats | None = None
    bound: LowerBound | None = None

    def __post_init__(self) -> None:
        self.relate()

    def relate(self) -> None:
        base = self.policies.get(BASELINE)
        iso = self.isolated
        best50 = self.best_quantum.get("p50")
        best95 = self.best_quantum.get("p95")
        bounds = [b for b in (self.ideal, iso) if b is not None]
        for st in [*self.policies.values(), *bounds]:
            if base is not None:
                st.speedup_p50 = _ratio(base.sct_p50_s, st.sct_p50_s)
                st.speedup_p95 = _ratio(base.sct_p95_s, st.sct_p95_s)
            if best50 is not None:
                st.speedup_p50_best_q = _ratio(best50[1], st.sct_p50_s)
            if best95 is not None:
                st.speedup_p95_best_q = _ratio(best95[1], st.sct_p95_s)
            if iso is not None:
                st.p50_over_isolated = _ratio(st.sct_p50_s, iso.sct_p50_s)
                st.p95_over_isolated = _ratio(st.sct_p95_s, iso.sct_p95_s)
            if self.bound is not None:
                st.p50_over_bound = _ratio(st.sct_p50_s, self.bound.sct_p50_s)
                st.p95_over_bound = _ratio(st.sct_p95_s, self.bound.sct_p95_s)
                st.mean_over_bound = _ratio(st.sct_mean_s, self.bound.sct_mean_s)


def benchmark(
    results: Sequence[ReplayResult], isolated: ReplayResult | None = None,
    best_quantum: Mapping[str, Any] | None = None, setup: Mapping[str, Any] | None = None,
    ideal: Mapping[str, ReplayResult] | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    bound: LowerBound | None = None,
) -> Benchmark:
    """``settings``: the setting each policy ran at (printed beside it; for the oracle, by
    percentile). ``ideal``: the oracle schedule's run best at p50 (``"p50"``) and the one
    best at p95 (``"p95"``; the same run when one is best at both). ``bound``: the lower
    bound (``workloads.bounds.bound``)."""
    own = own_durations(isolated) if isolated is not None else None
    settings = settings or {}
    ideal_stats = None
    if ideal:
        ideal_stats = summarize(ideal["p50"], own, settings.get(IDEAL_ROW))
        ideal_stats.name = IDEAL_ROW
        ideal_stats.sct_p95_s = percentile([s.sct_s for s in ideal["p95"].sessions], 95)
    return Benchmark(
        {r.policy: summarize(r, own, settings.get(r.policy)) for r in results},
        summarize(isolated, is_isolated=True) if isolated is not None else None,
        dict(best_quantum or {}),
        dict(setup or {}),
        ideal_stats,
        bound,
    )


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else None


# --- table ----------------------------------------------------------------------------------
def _fmt(value: float | int | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def format_setting(setting: Mapping[str, Any]) -> str:
    """``{"slot_close": "drained", "slot_quantum_s": 30.0}`` -> ``drained/30s``; the ideal's
    ``{"p50": {"schedule": "las"}, "p95": {"schedule": "fair"}}`` -> ``las|fair``."""
    if "p50" in setting:
        parts = [str(setting[k]["schedule"]) for k in ("p50", "p95")]
        return parts[0] if parts[0] == parts[1] else "|".join(parts)
    if "slot_close" in setting:
        return f"{setting['slot_close']}/{setting['slot_quantum_s']:g}s"
    return "-"


def _layout(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _all_rows(bench: Benchmark) -> list[tuple[PolicyStats, bool]]:
    rows = [(st, False) for st in bench.policies.values()]
    rows += [(b, True) for b in (bench.ideal, bench.isolated) if b is not None]
    return rows


def format_table(bench: Benchmark) -> str:
    """The benchmark as a fixed-width text table (one row per policy, then the bounds)."""
    has_best = any(st.speedup_p50_best_q is not None for st in bench.policies.values())
    head = ["policy", "setting", "SCT p50", "SCT p95", "x p50", "x p95"]
    if has_best:
        head += ["x p50 bq", "x p95 bq"]
    head += ["p50/bound", "p95/bound", "p50/iso", "p95/iso", "TTFT p50", "switch", "recomp",
             "restored", "dev-hit", "fail"]
    rows = [head]
    for st, bound in _all_rows(bench):
        r = [st.name, format_setting(st.setting) if st.setting else "", _fmt(st.sct_p50_s, ".1f"),
             _fmt(st.sct_p95_s, ".1f"), "" if bound else _fmt(st.speedup_p50, ".2f"),
             "" if bound else _fmt(st.speedup_p95, ".2f")]
        if has_best:
            r += ["" if bound else _fmt(st.speedup_p50_best_q, ".2f"),
                  "" if bound else _fmt(st.speedup_p95_best_q, ".2f")]
        r += [_fmt(st.p50_over_bound, ".2f"), _fmt(st.p95_over_bound, ".2f"),
              _fmt(st.p50_over_isolated, ".2f"), _fmt(st.p95_over_isolated, ".2f"),
              _fmt(st.ttft_p50_s, ".2f"), _fmt(st.switches, "d"), _tokens(st.tokens_recomputed),
              _tokens(st.tokens_restored), _tokens(st.tokens_device_cached), str(st.failed_calls)]
        rows.append(r)
    if bench.bound is not None:
        b = bench.bound
        rows.append(["lower bound", f"{b.binding['p50']}|{b.binding['p95']}",
                     _fmt(b.sct_p50_s, ".1f"), _fmt(b.sct_p95_s, ".1f"), "", "",
                     *([""] * (2 if has_best else 0)), "1.00", "1.00",
                     _fmt(_ratio(b.sct_p50_s, bench.isolated.sct_p50_s) if bench.isolated else None, ".2f"),
                     _fmt(_ratio(b.sct_p95_s, bench.isolated.sct_p95_s) if bench.isolated else None, ".2f"),
                     "", "", "", "", "", ""])
    notes = [
        "SCT/TTFT in seconds; setting: slot-closing rule / quantum the row ran at (empty: "
        "close when its queue is empty; drained: and none of its calls in flight; quantum: "
        "only at the quantum); x p50/x p95: speedup vs baseline; p50/bound, p95/iso...: "
        "multiples of the lower bound and of isolated; switch: model switches (first loads not "
        "counted); recomp: "
        "prompt tokens recomputed though an earlier call had their KV; restored: from host "
        "KV; dev-hit: from the device prefix cache",
    ]
    if has_best:
        q50, q95 = bench.best_quantum["p50"][0], bench.best_quantum["p95"][0]
        notes.append(f"bq: vs the baseline at its best slot quantum ({q50:g} s for p50, "
                     f"{q95:g} s for p95)")
    if bench.bound is not None:
        notes.append("lower bound: no schedule under the simulator's physics does better "
                     "(workloads.bounds.bound; setting: what binds p50|p95, each session's critical "
                     "path or the server's capacity)")
    if bench.ideal is not None:
        family = (bench.ideal.setting or {}).get("family")
        of = f" of {family}" if family else ""
        notes.append("oracle: an oracle schedule, not a bound: every model resident with "
                     "unlimited KV, free switches, GPU steps time-shared between models, "
                     f"perfect batching within each; the best of its schedules{of} per "
                     "percentile (setting: the one best at p50|p95)")
    if bench.isolated is not None:
        notes.append("isolated: each session alone, its model resident, no contention")
    below = below_bounds(bench)
    if below:
        notes.append("!! below a bound (the bound is then not one; see workloads/bounds/bound.py): "
                     + "; ".join(below))
    return "\n".join(_layout(rows) + [""] + notes)


def below_bounds(bench: Benchmark) -> list[str]:
    """Rows whose p50, p95 or mean beats the lower bound or the isolated row (more than
    rounding): a defect of the bound's proof or of the simulator."""
    out = []
    for st in [*bench.policies.values(), *([bench.ideal] if bench.ideal else [])]:
        for name, bound in (("lower bound", bench.bound), ("isolated", bench.isolated)):
            if bound is None:
                continue
            for q, mine, theirs in (("p50", st.sct_p50_s, bound.sct_p50_s),
                                    ("p95", st.sct_p95_s, bound.sct_p95_s),
                                    ("mean", st.sct_mean_s, bound.sct_mean_s)):
                if name == "isolated" and q == "mean":
                    continue
                if mine < theirs * (1 - 1e-6):
                    out.append(f"{st.name} {q} {mine:.1f} < {name} {theirs:.1f}")
    return out


_PART_HEADS = {"own": "own", "queue": "queue", "slot_wait": "slot", "switch": "switch",
               "recompute": "recomp", "restore": "restore", "tool_gaps": "gaps"}


def format_breakdown(bench: Benchmark) -> str:
    """Where each session's time went: mean seconds per session, by part, per row."""
    rows = [["policy", "SCT mean", *(_PART_HEADS[p] for p in PARTS)]]
    for st, _bound in _all_rows(bench):
        if st.breakdown:
            rows.append([st.name, _fmt(st.sct_mean_s, ".1f"),
                         *(_fmt(round(st.breakdown[p], 1) + 0.0, ".1f") for p in PARTS)])
    notes = [
        "mean seconds per session; own: its calls alone; queue: behind calls of its own model; "
        "slot: waiting for its model's slot; switch: model switches; recomp: KV rebuilt by "
        "recompute; restore: KV restored from host; gaps: tool gaps. Each row adds up to its "
        "SCT mean.",
    ]
    return "\n".join(_layout(rows) + [""] + notes)


# --- JSON -----------------------------------------------------------------------------------
_KEYS = ("sessions", "calls", "failed_calls", "sct_p50_s", "sct_p95_s", "sct_mean_s",
         "ttft_p50_s", "ttft_p95_s", "makespan_s", "switches", "tokens_prefilled",
         "tokens_recomputed", "tokens_restored", "tokens_device_cached", "speedup_p50",
         "speedup_p95", "speedup_p50_best_q", "speedup_p95_best_q", "p50_over_bound",
         "p95_over_bound", "mean_over_bound", "p50_over_isolated", "p95_over_isolated", "wall_s",
         "counters", "setting")


def _stats_dict(st: PolicyStats) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _KEYS:
        value = getattr(st, key)
        out[key] = None if isinstance(value, float) and not math.isfinite(value) else value
    out["breakdown"] = {"mean": st.breakdown, "per_model": st.breakdown_per_model}
    return out


def _bound_dict(b: LowerBound) -> dict[str, Any]:
    return {"sct_p50_s": b.sct_p50_s, "sct_p95_s": b.sct_p95_s, "sct_mean_s": b.sct_mean_s,
            "binding": dict(b.binding)}


def to_json(bench: Benchmark, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "setup": bench.setup,
        "policies": {name: _stats_dict(st) for name, st in bench.policies.items()},
        "lower_bound": _bound_dict(bench.bound) if bench.bound else None,
        "isolated": _stats_dict(bench.isolated) if bench.isolated else None,
        "oracle": _stats_dict(bench.ideal) if bench.ideal else None,
    }
    if bench.best_quantum:
        data["baseline_best_quantum"] = {
            k: {"slot_quantum_s": q, "sct_s": s} for k, (q, s) in bench.best_quantum.items()
        }
    if extra:
        data.update(extra)
    return data


def write_json(data: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
