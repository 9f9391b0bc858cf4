"""``talaria replay --day HOURS``: a simulated cluster serving hours of Poisson sessions.

The planning question an operator asks before buying servers: with this many servers and
this session rate, what do sessions take, is the SLO held, and how busy is each server?

Sessions arrive as a Poisson process for ``hours`` (arrivals stop then; the sessions already
running are served to the end, so the run drains), each drawn with replacement (seeded) from
a pool: by default every session of the real Claude Code trace (both halves: this is a
planning run, not one of the suite's reported figures), models assigned as the suite assigns
them. One policy serves them on ``servers`` instances behind one router: Talaria at its one
configuration unless told otherwise.

The rate is ``sessions_per_hour`` per server when given, else ``load`` times the saturation
rate the suite's scenarios use: the baseline's burst throughput on one server (30 sessions
of the pool at t=0, sessions over makespan), times the servers.

Reported: SCT p50 / p95 / mean with bootstrap 95% intervals; the SLO of the suite's capacity
search (p95 within ``SLO_FACTOR`` times the same sessions' p95 each served alone); sessions
per hour served; per server, the sessions and calls it served, its modelled engine time
(steps, model switches, KV copies) as a share of the run (utilisation) and its switches;
and the simulator's own cost (the day's replay's wall and CPU seconds and calls per
CPU-second, the process's peak RSS).
"""

from __future__ import annotations

import math
import random
import resource
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from workloads.bounds.isolated import run_isolated
from workloads.replay.cluster import ClusterSpec, instance_ids
from workloads.replay.driver import ReplayResult, run_sim
from workloads.replay.systems import SYSTEMS, SystemConfig
from workloads.suite.capacity import CapacityConfig
from workloads.suite.run import BASELINE
from workloads.suite.scenarios import saturation_rate
from workloads.suite.stats import FIGURES, figure, interval, percentile
from workloads.traces.trace import Session

__all__ = ["DayConfig", "DayResult", "ServerDay", "day_json", "day_sessions", "format_day",
           "run_day", "saturation_per_server"]

SLO_FACTOR = CapacityConfig().slo_factor  # the suite's capacity search's SLO
SATURATION_SESSIONS = 30  # the baseline burst that sets the saturation rate (the suite's)


@dataclass(frozen=True)
class DayConfig:
    hours: float = 1.0
    load: float = 0.5  # fraction of the saturation rate (unused with sessions_per_hour)
    sessions_per_hour: float | None = None  # per server; None: load x saturation
    seed: int = 0

    def __post_init__(self) -> None:
        # finite too: an endless day, or an endless rate, draws sessions for ever
        if not 0 < self.hours < math.inf:
            raise ValueError(f"--day must be a finite number > 0 hours, got {self.hours}")
        if not 0 < self.load < math.inf:
            raise ValueError(f"--day-load must be a finite number > 0, got {self.load}")
        if self.sessions_per_hour is not None and not 0 < self.sessions_per_hour < math.inf:
            raise ValueError(f"--day-rate must be a finite number > 0 sessions/h, got "
                             f"{self.sessions_per_hour}")


@dataclass(frozen=True)
class ServerDay:
    instance_id: str
    sessions: int  # sessions whose first call it served
    calls: int
    busy_s: float  # modelled engine time: steps, switches, KV copies to and from host
    utilisation: float  # busy_s over the run's makespan
    switches: int


@dataclass(frozen=True)
class DayResult:
    policy: str
    setting: dict[str, Any]
    servers: int
    hours: float
    rate_per_s: float  # sessions/s over the whole cluster
    saturation_per_server: float | None  # sessions/s; None when the rate was given
    sessions: int
    calls: int
    failed_calls: int
    figures: dict[str, float]  # p50 / p95 / mean SCT, seconds
    ci95: dict[str, tuple[float, float]]
    isolated_p95_s: float
    makespan_s: float
    per_server: list[ServerDay]
    wall_s: float
    cpu_s: float
    peak_rss_mb: float

    @property
    def slo_s(self) -> float:
        return SLO_FACTOR * self.isolated_p95_s

    @property
    def slo_met(self) -> bool:
        return self.figures["p95"] <= self.slo_s

    @property
    def calls_per_cpu_s(self) -> float:
        return self.calls / self.cpu_s if self.cpu_s > 0 else 0.0


def day_sessions(pool: Sequence[Session], rate_per_s: float, hours: float,
                 seed: int = 0) -> list[Session]:
    """Every session that arrives in ``hours`` of a Poisson process at ``rate_per_s`` (the
    first at 0), each a draw with replacement from ``pool`` renamed ``day/<k>/<id>``."""
    if not pool:
        raise ValueError("a day needs a pool of at least one session")
    if not rate_per_s > 0:
        raise ValueError(f"the session rate must be > 0, got {rate_per_s}")
    horizon = hours * 3600.0
    rng = random.Random(f"day/{seed}")
    out: list[Session] = []
    t = 0.0
    while t < horizon:
        k, picked = len(out), pool[rng.randrange(len(pool))]
        out.append(replace(picked.renamed(lambda sid, k=k: f"day/{k}/{sid}"),
                           arrival_s=round(t, 3)))
        t += rng.expovariate(rate_per_s)
    return out


def saturation_per_server(pool: Sequence[Session], spec: ClusterSpec,
                          baseline: SystemConfig, seed: int = 0) -> float:
    """The baseline's burst throughput on one server, sessions/s: the suite's load 1.0."""
    rng = random.Random(f"day-saturation/{seed}")
    burst = [replace(pool[rng.randrange(len(pool))].renamed(lambda sid, k=k: f"sat/{k}/{sid}"),
                     arrival_s=0.0) for k in range(SATURATION_SESSIONS)]
    result = run_sim(burst, baseline, replace(spec, servers=1), seed=seed)
    return saturation_rate([(len(burst), result.makespan_s)])


def run_day(pool: Sequence[Session], system: SystemConfig, spec: ClusterSpec,
            config: DayConfig, *, baseline: SystemConfig | None = None,
            progress: bool = False) -> DayResult:
    """Draw the day's sessions and replay them on ``spec``'s cluster (see the module);
    ``baseline``: the row whose burst sets the saturation rate (default: the baseline at
    its own setting)."""
    saturation = None
    if config.sessions_per_hour is not None:
        rate = config.sessions_per_hour / 3600.0 * spec.servers
    else:
        saturation = saturation_per_server(pool, spec, baseline or SYSTEMS[BASELINE], config.seed)
        rate = config.load * saturation * spec.servers
    sessions = day_sessions(pool, rate, config.hours, config.seed)
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_sim(sessions, system, spec, seed=config.seed, progress=progress)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    isolated = [s.sct_s for s in run_isolated(sessions, spec).sessions]
    scts = [s.sct_s for s in result.sessions]
    return DayResult(
        policy=system.name, setting=dict(system.setting), servers=spec.servers,
        hours=config.hours, rate_per_s=rate, saturation_per_server=saturation,
        sessions=len(sessions), calls=len(result.calls), failed_calls=result.failed_calls,
        figures={f: figure(scts, f) for f in FIGURES},
        ci95={f: interval(scts, f, seed=config.seed) for f in FIGURES},
        isolated_p95_s=figure(isolated, "p95"), makespan_s=result.makespan_s,
        per_server=per_server(result, spec.servers), wall_s=wall, cpu_s=cpu,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def per_server(result: ReplayResult, servers: int) -> list[ServerDay]:
    """Each instance's share of ``result``: sessions by the instance of their first call."""
    calls = Counter(c.instance_id for c in result.calls)
    firsts = Counter(s.calls[0].instance_id for s in result.sessions if s.calls)
    totals = result.totals.by_instance if result.totals is not None else {}
    span = result.makespan_s
    out = []
    for iid in instance_ids(servers):
        t = totals.get(iid)
        busy = t.busy_s if t is not None else 0.0
        out.append(ServerDay(iid, firsts[iid], calls[iid], busy,
                             busy / span if span > 0 else 0.0, t.switches if t is not None else 0))
    return out


def _spread(values: Sequence[float]) -> str:
    return " / ".join(f"{percentile(values, q):.3g}" for q in (0, 10, 50, 90, 100))


def format_day(day: DayResult, pool_name: str) -> str:
    per_server_h = day.rate_per_s / day.servers * 3600
    how = ("given" if day.saturation_per_server is None else
           f"{day.rate_per_s / day.saturation_per_server / day.servers:g} of the baseline's "
           f"saturation, {day.saturation_per_server * 3600:.1f} sessions/h per server")
    f, ci = day.figures, day.ci95
    lines = [
        f"cluster day: {day.policy} at {day.setting} on {day.servers} servers, "
        f"{day.hours:g} h of Poisson sessions drawn from {pool_name}, "
        f"{per_server_h:.1f} sessions/h per server ({how})",
        f"sessions {day.sessions} ({day.sessions / day.hours / day.servers:.1f} per hour per "
        f"server drawn), calls {day.calls} ({day.failed_calls} failed), makespan "
        f"{day.makespan_s / 3600:.2f} h (arrivals stop at {day.hours:g} h)",
        "SCT s: " + ", ".join(f"{name} {f[name]:.1f} [{ci[name][0]:.1f}, {ci[name][1]:.1f}]"
                              for name in FIGURES),
        f"SLO (p95 <= {SLO_FACTOR:g} x the same sessions' isolated p95 "
        f"{day.isolated_p95_s:.1f} = {day.slo_s:.1f} s): {'met' if day.slo_met else 'MISSED'}",
        f"per server ({sum(1 for s in day.per_server if not s.calls)} of {day.servers} "
        "served no call), min / p10 / median / p90 / max:",
        f"  utilisation  {_spread([s.utilisation for s in day.per_server])}",
        f"  sessions     {_spread([float(s.sessions) for s in day.per_server])}",
        f"  calls        {_spread([float(s.calls) for s in day.per_server])}",
        f"  switches     {_spread([float(s.switches) for s in day.per_server])}",
        f"simulator: {day.wall_s:.0f} s wall, {day.cpu_s:.0f} s CPU, "
        f"{day.calls_per_cpu_s:.0f} calls per CPU-second, peak RSS {day.peak_rss_mb:.0f} MB",
    ]
    return "\n".join(lines)


def day_json(day: DayResult, pool_name: str) -> dict[str, Any]:
    return {
        "pool": pool_name, "policy": day.policy, "setting": day.setting,
        "servers": day.servers, "hours": day.hours, "sessions_per_s": day.rate_per_s,
        "saturation_per_server_per_s": day.saturation_per_server, "sessions": day.sessions,
        "calls": day.calls, "failed_calls": day.failed_calls,
        **{f"sct_{name}_s": value for name, value in day.figures.items()},
        "ci95": {name: list(v) for name, v in day.ci95.items()},
        "isolated_p95_s": day.isolated_p95_s, "slo_s": day.slo_s, "slo_met": day.slo_met,
        "makespan_s": day.makespan_s,
        "per_server": [vars(s) for s in day.per_server],
        "simulator": {"wall_s": day.wall_s, "cpu_s": day.cpu_s,
                      "calls_per_cpu_s": day.calls_per_cpu_s, "peak_rss_mb": day.peak_rss_mb},
    }
