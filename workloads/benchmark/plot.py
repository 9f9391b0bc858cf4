"""The benchmark's plots: SCT distributions, and where each session's time went as stacked
bars. matplotlib is optional: without it the plots are skipped (the functions return False),
the tables and the JSON are unaffected."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workloads.benchmark.breakdown import PARTS
from workloads.benchmark.report import Benchmark
from workloads.replay.driver import ReplayResult

__all__ = ["plot_sct", "plot_breakdown"]


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_sct(
    results: Sequence[ReplayResult], path: str | Path,
    bounds: Sequence[ReplayResult] = (), title: str = "Session completion time",
) -> bool:
    """Write the SCT distributions (empirical CDFs) as a PNG, bounds dashed."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in [*results, *bounds]:
        scts = sorted(s.sct_s for s in r.sessions)
        ys = [(i + 1) / len(scts) for i in range(len(scts))]
        ax.step(scts, ys, "--" if r in bounds else "-", where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("SCT (s, log scale)")
    ax.set_ylabel("share of sessions")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_breakdown(bench: Benchmark, path: str | Path) -> bool:
    """Write each row's mean time split per session as stacked horizontal bars."""
    plt = _pyplot()
    if plt is None:
        return False
    rows = [st for st in [*bench.policies.values(), bench.ideal, bench.isolated]
            if st is not None and st.breakdown]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    names = [st.name for st in rows]
    left = [0.0] * len(rows)
    for part in PARTS:
        widths = [st.breakdown[part] for st in rows]
        ax.barh(names, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per session")
    ax.set_title("Where each session's time goes")
    ax.legend(fontsize=7, ncol=len(PARTS), loc="lower center", bbox_to_anchor=(0.5, 1.06))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
