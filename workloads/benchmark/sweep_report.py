"""The sweeps as tables, JSON, a plot, and where the reference's speedups are reproduced."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workloads.benchmark.report import BASELINE
from workloads.benchmark.sweep import REFERENCE_SPEEDUP, LoadPoint, SweepResult

__all__ = ["format_sweep", "sweep_json", "regime_summary", "plot_sweeps"]


def format_sweep(sweep: SweepResult) -> str:
    """One row per policy; per point, ``p50/p95`` SCT in seconds."""
    title = "Load sweep" if sweep.kind == "load" else "Slot-quantum sweep (all sessions at once)"
    if sweep.saturation_rate is not None:
        title += f" (saturation rate {sweep.saturation_rate:.4g} sessions/s)"
    labels = [sweep.point_label(i) for i in range(len(sweep.points))]
    rows = [["policy"] + labels]
    for name in sweep.policies():
        row = [name]
        for i in range(len(sweep.points)):
            if (i, name) in sweep.results:
                row.append(f"{sweep.stat(i, name, 50):.0f}/{sweep.stat(i, name, 95):.0f}")
            else:
                row.append("-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title + ": SCT p50/p95 (s)"]
    for k, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                           zip(r[1:], widths[1:], strict=True)]))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sweep_json(sweep: SweepResult) -> dict[str, Any]:
    points = []
    for i, p in enumerate(sweep.points):
        entry: dict[str, Any] = {"label": sweep.point_label(i)}
        if isinstance(p, LoadPoint):
            entry.update(rate_sessions_per_s=p.rate, saturation_fraction=p.fraction)
        else:
            entry["slot_quantum_s"] = p
        entry["policies"] = {
            name: {"sct_p50_s": sweep.stat(i, name, 50), "sct_p95_s": sweep.stat(i, name, 95),
                   "failed_calls": sweep.results[(i, name)].failed_calls}
            for name in sweep.policies() if (i, name) in sweep.results
        }
        points.append(entry)
    return {"kind": sweep.kind, "saturation_rate": sweep.saturation_rate, "points": points}


def regime_summary(sweep: SweepResult, policy: str = "talaria") -> str:
    """Per load point, ``policy``'s p50/p95 speedups over the baseline next to the
    reference's (5.3x / 2.6x), and the point closest to it."""
    names = sweep.policies()
    if BASELINE not in names or policy not in names:
        return f"(regime: needs both {BASELINE!r} and {policy!r} in the sweep)"
    lines = [f"{policy} vs {BASELINE} per load point (reference: p50 "
             f"{REFERENCE_SPEEDUP['p50']}x, p95 {REFERENCE_SPEEDUP['p95']}x):"]
    best: tuple[float, str] | None = None
    for i in range(len(sweep.points)):
        if (i, BASELINE) not in sweep.results or (i, policy) not in sweep.results:
            continue
        s50 = sweep.stat(i, BASELINE, 50) / sweep.stat(i, policy, 50)
        s95 = sweep.stat(i, BASELINE, 95) / sweep.stat(i, policy, 95)
        label = sweep.point_label(i)
        lines.append(f"  {label}: p50 {s50:.2f}x, p95 {s95:.2f}x")
        # Distance in log space from the reference pair.
        d = abs(math.log(s50 / REFERENCE_SPEEDUP["p50"])) + abs(math.log(s95 / REFERENCE_SPEEDUP["p95"]))
        if best is None or d < best[0]:
            best = (d, label)
    if best is not None:
        lines.append(f"  closest to the reference: {best[1]}")
    return "\n".join(lines)


def plot_sweeps(sweeps: Sequence[SweepResult], path: str | Path) -> bool:
    """p50 and p95 SCT per policy across each sweep's points; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(sweeps), 2, figsize=(12, 4.5 * len(sweeps)), squeeze=False)
    for row, sweep in zip(axes, sweeps, strict=True):
        xs = list(range(len(sweep.points)))
        labels = [sweep.point_label(i) for i in xs]
        for ax, q in zip(row, (50, 95), strict=True):
            for name in sweep.policies():
                pts = [(i, sweep.stat(i, name, q)) for i in xs if (i, name) in sweep.results]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, rotation=20, fontsize=7)
            ax.set_yscale("log")
            ax.set_ylabel(f"SCT p{q} (s)")
            ax.set_title(f"{sweep.kind} sweep: p{q}")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
