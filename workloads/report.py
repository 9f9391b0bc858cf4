"""Benchmark statistics, the printed table, the JSON file and the SCT plot.

Per policy: SCT p50 / p95 / mean; per-call TTFT p50 / p95; model switches; prompt tokens
recomputed (KV an earlier call of the session had computed, prefilled again) vs restored from
host vs served from the device prefix cache; speedups of p50 and p95 SCT against the round
baseline (and against the baseline at its best slot quantum, when a quantum sweep ran); and
p50 SCT over the isolated lower bound's p50. Percentiles interpolate linearly between order
statistics. matplotlib is optional: without it the plot is skipped with a note, the table and
the JSON are unaffected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from workloads.replay import ReplayResult

__all__ = [
    "PolicyStats",
    "Benchmark",
    "percentile",
    "summarize",
    "format_table",
    "to_json",
    "write_json",
    "plot_sct",
]

BASELINE = "baseline"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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
    p50_over_lower_bound: float | None = None
    counters: dict[str, int] = field(default_factory=dict)


def summarize(result: ReplayResult) -> PolicyStats:
    scts = [s.sct_s for s in result.sessions]
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
    )


@dataclass
class Benchmark:
    """Every policy's stats, the lower bound, and (after a quantum sweep) the baseline's
    best quantum for p50 and for p95."""

    policies: dict[str, PolicyStats]
    lower_bound: PolicyStats | None = None
    best_quantum: dict[str, Any] = field(default_factory=dict)  # {"p50": (q, s), "p95": ...}
    setup: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.relate()

    def relate(self) -> None:
        base = self.policies.get(BASELINE)
        lb = self.lower_bound
        best50 = self.best_quantum.get("p50")
        best95 = self.best_quantum.get("p95")
        for st in self.policies.values():
            if base is not None:
                st.speedup_p50 = _ratio(base.sct_p50_s, st.sct_p50_s)
                st.speedup_p95 = _ratio(base.sct_p95_s, st.sct_p95_s)
            if best50 is not None:
                st.speedup_p50_best_q = _ratio(best50[1], st.sct_p50_s)
            if best95 is not None:
                st.speedup_p95_best_q = _ratio(best95[1], st.sct_p95_s)
            if lb is not None:
                st.p50_over_lower_bound = _ratio(st.sct_p50_s, lb.sct_p50_s)


def benchmark(
    results: Sequence[ReplayResult], lower_bound: ReplayResult | None = None,
    best_quantum: Mapping[str, Any] | None = None, setup: Mapping[str, Any] | None = None,
) -> Benchmark:
    return Benchmark(
        {r.policy: summarize(r) for r in results},
        summarize(lower_bound) if lower_bound is not None else None,
        dict(best_quantum or {}),
        dict(setup or {}),
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


def format_table(bench: Benchmark) -> str:
    """The benchmark as a fixed-width text table (one row per policy, then the bound)."""
    has_best = any(st.speedup_p50_best_q is not None for st in bench.policies.values())
    head = ["policy", "SCT p50", "SCT p95", "mean", "TTFT p50", "TTFT p95", "switch",
            "recomp", "restored", "dev-hit", "x p50", "x p95"]
    if has_best:
        head += ["x p50 bq", "x p95 bq"]
    head += ["p50/LB", "fail"]
    rows = [head]

    def row(st: PolicyStats, bound: bool = False) -> list[str]:
        r = [
            st.name, _fmt(st.sct_p50_s, ".1f"), _fmt(st.sct_p95_s, ".1f"),
            _fmt(st.sct_mean_s, ".1f"), _fmt(st.ttft_p50_s, ".2f"), _fmt(st.ttft_p95_s, ".2f"),
            _fmt(st.switches, "d"), _tokens(st.tokens_recomputed), _tokens(st.tokens_restored),
            _tokens(st.tokens_device_cached),
            "" if bound else _fmt(st.speedup_p50, ".2f"),
            "" if bound else _fmt(st.speedup_p95, ".2f"),
        ]
        if has_best:
            r += ["" if bound else _fmt(st.speedup_p50_best_q, ".2f"),
                  "" if bound else _fmt(st.speedup_p95_best_q, ".2f")]
        r += ["1.00" if bound else _fmt(st.p50_over_lower_bound, ".2f"), str(st.failed_calls)]
        return r

    for st in bench.policies.values():
        rows.append(row(st))
    if bench.lower_bound is not None:
        rows.append(row(bench.lower_bound, bound=True))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [
        "SCT/TTFT in seconds; switch: model switches (first loads not counted); recomp: "
        "prompt tokens recomputed though an earlier call had their KV; restored: from host "
        "KV; dev-hit: from the device prefix cache; x p50/x p95: speedup vs baseline",
    ]
    if has_best:
        q50, q95 = bench.best_quantum["p50"][0], bench.best_quantum["p95"][0]
        notes.append(f"bq: vs the baseline at its best slot quantum ({q50:g} s for p50, "
                     f"{q95:g} s for p95)")
    if bench.lower_bound is not None:
        notes.append("LB (isolated): each session alone, its model resident, no contention")
    return "\n".join(lines + [""] + notes)


# --- JSON -----------------------------------------------------------------------------------
_KEYS = ("sessions", "calls", "failed_calls", "sct_p50_s", "sct_p95_s", "sct_mean_s",
         "ttft_p50_s", "ttft_p95_s", "makespan_s", "switches", "tokens_prefilled",
         "tokens_recomputed", "tokens_restored", "tokens_device_cached", "speedup_p50",
         "speedup_p95", "speedup_p50_best_q", "speedup_p95_best_q", "p50_over_lower_bound",
         "wall_s", "counters")


def _stats_dict(st: PolicyStats) -> dict[str, Any]:
    out = {}
    for key in _KEYS:
        value = getattr(st, key)
        out[key] = None if isinstance(value, float) and not math.isfinite(value) else value
    return out


def to_json(bench: Benchmark, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "setup": bench.setup,
        "policies": {name: _stats_dict(st) for name, st in bench.policies.items()},
        "lower_bound": _stats_dict(bench.lower_bound) if bench.lower_bound else None,
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


# --- plot -----------------------------------------------------------------------------------
def plot_sct(
    results: Sequence[ReplayResult], path: str | Path, lower_bound: ReplayResult | None = None,
    title: str = "Session completion time",
) -> bool:
    """Write the SCT distributions (empirical CDFs) as a PNG; False when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    series = list(results) + ([lower_bound] if lower_bound is not None else [])
    for r in series:
        scts = sorted(s.sct_s for s in r.sessions)
        ys = [(i + 1) / len(scts) for i in range(len(scts))]
        style = "k--" if r is lower_bound else "-"
        ax.step(scts, ys, style, where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("SCT (s, log scale)")
    ax.set_ylabel("share of sessions")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
