"""The load and slot-quantum sweeps (their replays run as ``workloads.replay.jobs``):

- load: the trace with all sessions at once, then with Poisson arrivals at rates that are
  fractions of a saturation rate. The saturation rate is the rate at which the cluster
  completes sessions when all arrive at once under the reference system (``talaria``, else
  the first policy): sessions / makespan of that run. Above it, sessions queue up.
- quantum: the ablation ladder (every system with a round quantum) at each slot quantum, all
  sessions at once. The peers switch on demand and are not swept. The baseline's best quantum
  (lowest p50, and separately lowest p95) is what "speedup vs the best-quantum baseline"
  divides by, so no speedup rests on a badly tuned baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workloads.benchmark.report import BASELINE
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import ReplayResult
from workloads.replay.jobs import Job, run_many
from workloads.replay.systems import ABLATIONS, SystemConfig
from workloads.suite.stats import percentile
from workloads.traces.arrivals import at_once, poisson_arrivals
from workloads.traces.trace import Session

__all__ = [
    "LoadPoint",
    "SweepResult",
    "run_load_sweep",
    "run_quantum_sweep",
    "best_quantum",
    "DEFAULT_QUANTA",
    "DEFAULT_LOAD_FRACTIONS",
    "REFERENCE_SPEEDUP",
]

DEFAULT_QUANTA: tuple[float, ...] = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
DEFAULT_LOAD_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
REFERENCE_SPEEDUP = {"p50": 5.3, "p95": 2.6}  # DESIGN.md section 1


# --- load -----------------------------------------------------------------------------------
@dataclass
class LoadPoint:
    label: str  # "all" or "poisson 0.012/s (0.50 sat)"
    rate: float | None  # sessions/s; None: all at once
    fraction: float | None  # of the saturation rate


@dataclass
class SweepResult:
    kind: str  # "load" | "quantum"
    points: list[Any]  # LoadPoint or quantum seconds
    results: dict[tuple[int, str], ReplayResult] = field(default_factory=dict)  # (point, policy)
    saturation_rate: float | None = None

    def stat(self, point: int, policy: str, q: float) -> float:
        r = self.results[(point, policy)]
        return percentile([s.sct_s for s in r.sessions], q)

    def policies(self) -> list[str]:
        seen: list[str] = []
        for _, name in self.results:
            if name not in seen:
                seen.append(name)
        return seen

    def point_label(self, i: int) -> str:
        p = self.points[i]
        return p.label if isinstance(p, LoadPoint) else f"q={p:g}s"


def run_load_sweep(
    sessions: Sequence[Session], systems: Sequence[SystemConfig], spec: ClusterSpec,
    fractions: Sequence[float] = DEFAULT_LOAD_FRACTIONS, *, seed: int = 0, workers: int = 1,
    progress: bool = False, all_at_once: dict[str, ReplayResult] | None = None,
) -> SweepResult:
    """``all_at_once``: results of the all-at-once point already run (reused, not rerun)."""
    base = at_once(sessions)
    names = [s.name for s in systems]
    done = dict(all_at_once or {})
    missing = [s for s in systems if s.name not in done]
    first = run_many([Job(s.name, tuple(base), s, spec, seed) for s in missing], workers, progress)
    done.update(first)
    ref = "talaria" if "talaria" in done else names[0]
    sat = len(base) / done[ref].makespan_s
    sweep = SweepResult("load", [LoadPoint("all at once", None, None)], saturation_rate=sat)
    for name in names:
        sweep.results[(0, name)] = done[name]
    jobs = []
    for i, frac in enumerate(fractions, start=1):
        rate = frac * sat
        sweep.points.append(LoadPoint(f"poisson {rate:.4g}/s ({frac:g} sat)", rate, frac))
        arrivals = tuple(poisson_arrivals(base, rate, seed))
        jobs += [Job((i, s.name), arrivals, s, spec, seed) for s in systems]
    sweep.results.update(run_many(jobs, workers, progress))
    return sweep


# --- quantum --------------------------------------------------------------------------------
def run_quantum_sweep(
    sessions: Sequence[Session], spec: ClusterSpec, quanta: Sequence[float] = DEFAULT_QUANTA,
    systems: Sequence[SystemConfig] | None = None, *, seed: int = 0, workers: int = 1,
    progress: bool = False,
) -> SweepResult:
    systems = list(systems) if systems is not None else list(ABLATIONS.values())
    base = tuple(at_once(sessions))
    sweep = SweepResult("quantum", list(quanta))
    jobs = [Job((i, s.name), base, s.with_quantum(q), spec, seed)
            for i, q in enumerate(quanta) for s in systems]
    sweep.results.update(run_many(jobs, workers, progress))
    return sweep


def best_quantum(sweep: SweepResult, policy: str = BASELINE) -> dict[str, tuple[float, float]]:
    """{"p50": (quantum, p50 SCT), "p95": (quantum, p95 SCT)}: the policy's best points."""
    out: dict[str, tuple[float, float]] = {}
    for key, q in (("p50", 50.0), ("p95", 95.0)):
        scored = [(sweep.stat(i, policy, q), sweep.points[i]) for i in range(len(sweep.points))
                  if (i, policy) in sweep.results]
        if scored:
            value, quantum = min(scored)
            out[key] = (quantum, value)
    return out
