"""Capacity at an SLO, and its inverse: the servers a session rate needs.

The SLO: a run's p95 session completion time is at most ``slo_factor`` times the p95 of the
same sessions each served alone on an idle cluster (``run_isolated``).

Capacity (per row, per server count): the highest Poisson session rate at which the row meets
the SLO. Every probe replays the same sessions (one draw of ``sessions`` from the trace) with
the same exponential gaps scaled to the probe's rate (``poisson_arrivals`` at one seed), so
probes differ only in the rate. The
search (``RateSearch``): loads (fractions of the baseline's saturation rate on those servers,
``workloads.suite.scenarios``) doubling from 1.0 until one misses, or halving while 1.0 and below miss;
then ``bisections`` geometric bisections of the bracket. The capacity is the bracket's lower
end: a rate that was run and met the SLO. ``at_least``: the ladder's top met it;
``at_most``: its bottom missed it (the capacity is below the lowest load run).

Servers needed (per row, ``ServerSearch``): the fewest servers on which the same sessions,
arriving at a given rate, meet the SLO: from a first guess (the rate over the row's capacity
on one server, rounded up), halving while counts meet or doubling while they miss (up to
``max_servers``), then bisecting between the last count that missed and the first that met.

Probes of every row and server count run in rounds, each round's probes in parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workloads.bounds.isolated import run_isolated
from workloads.replay.cluster import ClusterSpec
from workloads.replay.jobs import Job, run_many
from workloads.replay.systems import SYSTEMS
from workloads.suite.stats import figure
from workloads.traces.arrivals import poisson_arrivals
from workloads.traces.trace import Session

__all__ = ["CapacityConfig", "Probe", "RateSearch", "ServerSearch", "rate_capacity",
           "servers_needed"]

Setting = dict[str, Any]


@dataclass(frozen=True)
class CapacityConfig:
    slo_factor: float = 2.0
    start_load: float = 1.0
    lowest_load: float = 0.125
    highest_load: float = 8.0
    bisections: int = 3
    max_servers: int = 16

    def __post_init__(self) -> None:
        if not (0 < self.lowest_load <= self.start_load <= self.highest_load):
            raise ValueError("loads must satisfy 0 < lowest <= start <= highest")
        if self.slo_factor <= 0 or self.bisections < 0 or self.max_servers < 1:
            raise ValueError("slo_factor > 0, bisections >= 0 and max_servers >= 1 needed")


@dataclass(frozen=True)
class Probe:
    point: float  # a load (fraction of saturation) or a server count
    p95_s: float
    slo_s: float

    @property
    def met(self) -> bool:
        return self.p95_s <= self.slo_s

    def as_list(self) -> list[float]:
        """As the JSON's ``probes`` rows hold it: [point, p95, SLO]."""
        return [self.point, self.p95_s, self.slo_s]


@dataclass
class RateSearch:
    """The highest load meeting the SLO: ``met`` holds below a boundary (loads only rise
    past the highest that met and stay below the lowest that missed)."""

    config: CapacityConfig
    ok: float | None = None  # the highest load that met
    miss: float | None = None  # the lowest load that missed
    bisected: int = 0
    probes: list[Probe] = field(default_factory=list)

    def next_point(self) -> float | None:
        c = self.config
        if self.ok is None and self.miss is None:
            return c.start_load
        if self.miss is None:
            assert self.ok is not None
            up = self.ok * 2
            return up if up <= c.highest_load * (1 + 1e-9) else None
        if self.ok is None:
            down = self.miss / 2
            return down if down >= c.lowest_load * (1 - 1e-9) else None
        return math.sqrt(self.ok * self.miss) if self.bisected < c.bisections else None

    def record(self, probe: Probe) -> None:
        if self.ok is not None and self.miss is not None:
            self.bisected += 1
        self.probes.append(probe)
        if probe.met:
            self.ok = probe.point if self.ok is None else max(self.ok, probe.point)
        else:
            self.miss = probe.point if self.miss is None else min(self.miss, probe.point)

    def result(self, saturation: float) -> dict[str, Any]:
        """The highest load that met; where none did, the lowest that missed (``at_most``:
        the capacity is below it), a load run either way."""
        load = self.ok if self.ok is not None else self.miss
        assert load is not None, "no probe recorded"
        return {"sessions_per_s": load * saturation, "load": load,
                "at_least": self.miss is None, "at_most": self.ok is None,
                "probes": [p.as_list() for p in self.probes]}


@dataclass
class ServerSearch:
    """The fewest servers meeting the SLO at a fixed rate: ``met`` holds from a count up.
    Probes ``start`` first (an estimate), then halves while counts meet or doubles while
    they miss (within 1 and ``max_servers``), then bisects the bracket."""

    config: CapacityConfig
    start: int = 1
    ok: int | None = None  # the fewest servers that met
    miss: int | None = None  # the most servers that missed
    probes: list[Probe] = field(default_factory=list)

    def next_point(self) -> int | None:
        top = self.config.max_servers
        if self.ok is None and self.miss is None:
            return max(1, min(self.start, top))
        if self.ok is None:
            assert self.miss is not None
            return min(self.miss * 2, top) if self.miss < top else None
        if self.miss is None:
            return self.ok // 2 if self.ok > 1 else None
        return (self.ok + self.miss) // 2 if self.ok - self.miss > 1 else None

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        n = int(probe.point)
        if probe.met:
            self.ok = n if self.ok is None else min(self.ok, n)
        else:
            self.miss = n if self.miss is None else max(self.miss, n)

    def result(self) -> dict[str, Any]:
        return {"servers": self.ok if self.ok is not None else self.config.max_servers,
                "more_than": self.ok is None,
                "probes": [p.as_list() for p in self.probes]}


def _first_guess(rate: float, per_server: float | None) -> int:
    if not per_server or per_server <= 0:
        return 1
    return max(1, math.ceil(rate / per_server - 1e-9))


def _slo(sessions: Sequence[Session], spec: ClusterSpec, factor: float) -> float:
    return factor * figure([s.sct_s for s in run_isolated(sessions, spec).sessions], "p95")


def _search_rounds(searches: dict[Any, Any], jobs_for: Callable[[Any, Any], list[Job]],
                   slo_for: Callable[[Any], float], workers: int, progress: bool) -> None:
    """Probe every search's next point, a round at a time, until none has one. A point runs
    at each of its search's settings (``jobs_for``: keys ``(search, point, i)``); the probe
    keeps the lowest p95, the row at its best among them."""
    while True:
        points = {key: s.next_point() for key, s in searches.items()}
        jobs = [job for key, p in points.items() if p is not None for job in jobs_for(key, p)]
        if not jobs:
            return
        done = run_many(jobs, workers, progress)
        best: dict[Any, tuple[Any, float]] = {}
        for job in jobs:
            key, point = job.key[0], job.key[1]
            p95 = figure([s.sct_s for s in done[job.key].sessions], "p95")
            if key not in best or p95 < best[key][1]:
                best[key] = (point, p95)
        for key, (point, p95) in best.items():
            searches[key].record(Probe(point, p95, slo_for(key)))


def rate_capacity(
    rows: Sequence[str], sessions: Sequence[Session], spec_for: Callable[[int], ClusterSpec],
    servers: Sequence[int], saturation: Callable[[int], float],
    settings_for: Callable[[str, int], Sequence[Setting]],
    config: CapacityConfig = CapacityConfig(),
    *, seed: int = 0, workers: int = 1, progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """``{servers: {row: {sessions_per_s, load, at_least, at_most, probes}}}`` for the same
    ``sessions`` on each server count (``saturation(n)``: the rate load 1.0 means there).
    ``settings_for(row, n)``: the settings a probe runs the row at on ``n`` servers; it
    keeps the lowest p95 of them (``_search_rounds``)."""
    slos = {n: _slo(sessions, spec_for(n), config.slo_factor) for n in servers}
    searches = {(row, n): RateSearch(config) for n in servers for row in rows}

    def jobs_for(key: tuple[str, int], load: float) -> list[Job]:
        row, n = key
        arriving = tuple(poisson_arrivals(sessions, load * saturation(n), seed))
        return [Job((key, load, i), arriving, SYSTEMS[row].with_setting(**setting), spec_for(n),
                    seed) for i, setting in enumerate(settings_for(row, n))]

    _search_rounds(searches, jobs_for, lambda key: slos[key[1]], workers, progress)
    return {str(n): {row: searches[(row, n)].result(saturation(n)) for row in rows}
            for n in servers}


def servers_needed(
    rows: Sequence[str], sessions: Sequence[Session], spec_for: Callable[[int], ClusterSpec],
    rate: float, settings_for: Callable[[str], Sequence[Setting]],
    config: CapacityConfig = CapacityConfig(),
    *, estimate: Mapping[str, float] | None = None, seed: int = 0, workers: int = 1,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """``{row: {servers, more_than, probes}}``: the fewest servers meeting the SLO with
    ``sessions`` arriving at ``rate`` sessions/s (``more_than``: not even ``max_servers``).
    ``estimate``: per row, its capacity on one server (sessions/s), where the search starts
    (rate over it, rounded up); else at one server."""
    slo = _slo(sessions, spec_for(1), config.slo_factor)
    arriving = tuple(poisson_arrivals(sessions, rate, seed))
    searches = {row: ServerSearch(config, start=_first_guess(rate, (estimate or {}).get(row)))
                for row in rows}

    def jobs_for(row: str, n: float) -> list[Job]:
        return [Job((row, int(n), i), arriving, SYSTEMS[row].with_setting(**setting),
                    spec_for(int(n)), seed) for i, setting in enumerate(settings_for(row))]

    _search_rounds(searches, jobs_for, lambda _row: slo, workers, progress)
    return {row: searches[row].result() for row in rows}
