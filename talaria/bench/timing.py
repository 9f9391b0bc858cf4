"""The clock and the statistic the calibration and the step-time check time things with.

Both use the same ones, so that a rate the calibration reads off a micro-benchmark and a
step the check measures are the same kind of figure:
- the clock: the calling thread's CPU time (``time.thread_time``) where the work runs on that
  thread alone (one torch thread, one process: torch runs a one-thread op inline), else the
  wall clock. CPU time does not count the time the thread waits descheduled, so on a shared
  machine it is what the work takes on a core of its own (what an idle machine's wall clock
  reads), not what the other processes left of it; the wall clock counts both.
- the statistic: the median of a few repeats (after one warm-up), the time a typical run
  takes, which is what a replay's steps add up to (the fastest run is an outlier by
  definition, and how far it lies below the rest depends on how many runs were taken).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Clock", "THREAD_CPU", "WALL", "clock_for", "median_seconds"]


@dataclass(frozen=True)
class Clock:
    name: str
    read: Callable[[], float]


THREAD_CPU = Clock("thread_cpu", time.thread_time)
WALL = Clock("wall", time.perf_counter)


def clock_for(threads: int, ranks: int = 1) -> Clock:
    """The calling thread's CPU time for work of one torch thread in one process (its
    time on a core of its own); the wall clock for more threads (their time is not the
    caller's) or more ranks (a step also waits for the others)."""
    if threads < 1 or ranks < 1:
        raise ValueError(f"threads and ranks must be >= 1, got {threads} and {ranks}")
    return THREAD_CPU if threads == 1 and ranks == 1 else WALL


def median_seconds(fn: Callable[[], object], repeats: int = 5, clock: Clock = WALL) -> float:
    """The median of ``repeats`` runs of ``fn`` on ``clock``, after one warm-up."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    fn()
    times = []
    for _ in range(repeats):
        start = clock.read()
        fn()
        times.append(clock.read() - start)
    return statistics.median(times)
