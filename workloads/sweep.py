"""Running many simulated replays, and the load and slot-quantum sweeps.

:func:`run_many` runs (sessions, system) jobs sequentially or on a process pool (each job is
independent: its own virtual loop, cluster and engines). The sweeps:

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

import logging
import random
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from workloads.cluster import ClusterSpec
from workloads.replay import ReplayResult, run_sim
from workloads.report import BASELINE
from workloads.shared_device import DeviceSchedule
from workloads.suite_stats import percentile
from workloads.systems import ABLATIONS, SystemConfig
from workloads.trace import Session

__all__ = [
    "Job",
    "run_many",
    "poisson_arrivals",
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


def quiet_logs() -> None:
    """Only warnings and errors from the system's structlog loggers, on stderr."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


@dataclass(frozen=True)
class Job:
    key: Any  # the caller's label for this run
    sessions: tuple[Session, ...]
    system: SystemConfig | None  # None: a bound (the isolated one, or ``ideal``'s)
    spec: ClusterSpec
    seed: int = 0
    ideal: DeviceSchedule | None = None  # with no system: the ideal bound at this schedule


def _run_job(job: Job, progress: bool = False) -> tuple[Any, ReplayResult]:
    if job.system is None and job.ideal is not None:
        from workloads.ideal import run_ideal

        return job.key, run_ideal(job.sessions, job.spec, job.ideal, seed=job.seed,
                                  progress=progress)
    if job.system is None:
        from workloads.lower_bound import run_isolated

        return job.key, run_isolated(job.sessions, job.spec)
    return job.key, run_sim(job.sessions, job.system, job.spec, seed=job.seed, progress=progress)


def run_many(
    jobs: Sequence[Job], workers: int = 1, progress: bool = False,
    on_done: Callable[[Any, ReplayResult], None] | None = None,
) -> dict[Any, ReplayResult]:
    """Run the jobs; with ``workers`` > 1 on a process pool. Returns results by job key."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    keys = [j.key for j in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("job keys must be unique")
    out: dict[Any, ReplayResult] = {}
    if workers == 1 or len(jobs) == 1:
        for job in jobs:
            key, result = _run_job(job, progress)
            out[key] = result
            if on_done is not None:
                on_done(key, result)
        return {k: out[k] for k in keys}
    bar = _job_bar(len(jobs), progress)
    with ProcessPoolExecutor(max_workers=workers, initializer=quiet_logs) as pool:
        futures = [pool.submit(_run_job, job) for job in jobs]
        for fut in futures:
            key, result = fut.result()
            out[key] = result
            bar.update(1)
            if on_done is not None:
                on_done(key, result)
    bar.close()
    return {k: out[k] for k in keys}


def _job_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="runs", unit="run", file=sys.stderr, leave=False,
                disable=not enabled)


# --- load -----------------------------------------------------------------------------------
def poisson_arrivals(sessions: Sequence[Session], rate: float, seed: int = 0) -> list[Session]:
    """The sessions arriving as a Poisson process of ``rate`` sessions/s (first at 0), in
    trace order."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 sessions/s, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i, s in enumerate(sessions):
        if i:
            t += rng.expovariate(rate)
        out.append(replace(s, arrival_s=round(t, 3)))
    return out


def at_once(sessions: Sequence[Session]) -> list[Session]:
    return [replace(s, arrival_s=0.0) for s in sessions]


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
