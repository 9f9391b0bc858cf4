"""``talaria replay --day HOURS --day-capacity``: the session rate a cluster holds at the SLO.

The number an operator buys servers by, at cluster scale: per policy, the highest Poisson
session rate per server at which ``servers`` instances serving ``hours`` of sessions (a
cluster's day, ``workloads.suite.day``) keep p95 SCT within ``SLO_FACTOR`` times the p95 of
the same sessions each served alone. The search is the suite's (``RateSearch``): loads, as
fractions of the baseline's one-server burst throughput, doubling from ``start_load`` until
one misses (or halving while the lowest misses), then geometric bisections; the capacity is
the highest load that was run and met. Every probe draws its day at its own rate from the
same seeded stream: the picks and the exponential gaps come from the same random numbers,
so a faster probe's first sessions are a slower one's with their arrivals pulled in. Each
probe's SLO is its own sessions' (their isolated p95, replayed once per load whichever
policies probe it). The probes of every policy run a round at a time, in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from workloads.replay.cluster import ClusterSpec
from workloads.replay.jobs import Job, run_many
from workloads.replay.systems import SystemConfig
from workloads.suite.capacity import CapacityConfig, Probe, RateSearch
from workloads.suite.day import SLO_FACTOR, DayConfig, day_sessions, saturation_per_server
from workloads.suite.stats import figure
from workloads.traces.trace import Session

__all__ = ["DAY_CAPACITY", "DayCapacity", "day_capacity", "day_capacity_json",
           "format_day_capacity"]

# The suite's search, capped at 4x saturation: a day far past it only grows its queue.
DAY_CAPACITY = replace(CapacityConfig(), highest_load=4.0)


@dataclass(frozen=True)
class DayCapacity:
    policy: str
    setting: dict[str, Any]
    load: float  # the highest load that met the SLO (the lowest tried when none did)
    sessions_per_hour: float  # per server, at ``load``
    at_least: bool  # the highest load tried met it: the capacity may be more
    at_most: bool  # the lowest load tried missed it: the capacity is less
    probes: list[Probe]  # point: load; p95 and SLO in seconds


def day_capacity(
    pool: Sequence[Session], systems: Sequence[SystemConfig], spec: ClusterSpec,
    config: DayConfig, *, baseline: SystemConfig, search: CapacityConfig = DAY_CAPACITY,
    workers: int = 1, progress: bool = False,
) -> tuple[float, list[DayCapacity]]:
    """(the saturation rate per server in sessions/s, each system's capacity); see the
    module. ``config.load`` and ``config.sessions_per_hour`` are not used: the search sets
    the rate."""
    saturation = saturation_per_server(pool, spec, baseline, config.seed)
    searches = {s.name: RateSearch(search) for s in systems}
    by_name = {s.name: s for s in systems}
    slos: dict[float, float] = {}  # by load: every policy probing it replays the same sessions
    while True:
        points = {name: load for name, s in searches.items()
                  if (load := s.next_point()) is not None}
        if not points:
            break
        jobs = []
        for load in dict.fromkeys(points.values()):
            sessions = tuple(day_sessions(pool, load * saturation * spec.servers, config.hours,
                                          config.seed))
            jobs += [Job((name, load), sessions, by_name[name], spec, config.seed)
                     for name, at in points.items() if at == load]
            if load not in slos:
                jobs.append(Job(("isolated", load), sessions, None, spec, config.seed))
        done = run_many(jobs, workers, progress)
        for load in dict.fromkeys(points.values()):
            if load not in slos:
                alone = [s.sct_s for s in done[("isolated", load)].sessions]
                slos[load] = SLO_FACTOR * figure(alone, "p95")
        for name, load in points.items():
            p95 = figure([s.sct_s for s in done[(name, load)].sessions], "p95")
            searches[name].record(Probe(load, p95, slos[load]))
    out = []
    for name, s in searches.items():
        found = s.result(saturation)
        out.append(DayCapacity(name, dict(by_name[name].setting), found["load"],
                               found["sessions_per_s"] * 3600, found["at_least"],
                               found["at_most"], list(s.probes)))
    return saturation, out


def format_day_capacity(found: Sequence[DayCapacity], saturation: float, servers: int,
                        hours: float, pool_name: str) -> str:
    lines = [f"capacity at the SLO (p95 <= {SLO_FACTOR:g} x the same sessions' isolated p95) "
             f"on {servers} servers, {hours:g} h of Poisson sessions from {pool_name}; load 1.0 "
             f"= the baseline's burst throughput, {saturation * 3600:.1f} sessions/h per server",
             f"{'policy':18s} {'setting':22s} {'sessions/h/server':>18s} {'load':>6s}  probes "
             "(load: p95 / SLO s)"]
    for c in found:
        bound = ">= " if c.at_least else ("< " if c.at_most else "")
        setting = ", ".join(f"{v}" for v in c.setting.values()) or "-"
        probes = "; ".join(f"{p.point:.3g}: {p.p95_s:.0f} / {p.slo_s:.0f}"
                           + ("" if p.met else " missed") for p in c.probes)
        lines.append(f"{c.policy:18s} {setting:22s} {bound + f'{c.sessions_per_hour:.1f}':>18s} "
                     f"{c.load:6.3g}  {probes}")
    return "\n".join(lines)


def day_capacity_json(found: Sequence[DayCapacity], saturation: float, servers: int,
                      hours: float, pool_name: str) -> dict[str, Any]:
    return {"pool": pool_name, "servers": servers, "hours": hours, "slo_factor": SLO_FACTOR,
            "saturation_per_server_per_s": saturation,
            "policies": {c.policy: {"setting": c.setting, "load": c.load,
                                    "sessions_per_hour_per_server": c.sessions_per_hour,
                                    "at_least": c.at_least, "at_most": c.at_most,
                                    "probes": [p.as_list() for p in c.probes]}
                         for c in found}}
