"""Running many simulated replays: (sessions, system) jobs run sequentially or on a process
pool, each independent (its own virtual loop, cluster and engines), results by job key."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from workloads.bounds.shared_device import DeviceSchedule
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import ReplayResult, run_sim
from workloads.replay.systems import SystemConfig
from workloads.traces.trace import Session

__all__ = ["Job", "quiet_logs", "run_many"]


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
        from workloads.bounds.oracle import run_ideal

        return job.key, run_ideal(job.sessions, job.spec, job.ideal, seed=job.seed,
                                  progress=progress)
    if job.system is None:
        from workloads.bounds.isolated import run_isolated

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
