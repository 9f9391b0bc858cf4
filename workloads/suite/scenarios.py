"""The scenario suite behind ``make replay``'s headline: traces x arrivals x servers.

Traces (``SUITE_TRACES``), each marked as one the project develops on (``dev``: constants and
rules were chosen looking at it) or reports on (``report``: not looked at while tuning):

- ``generated-7``, ``generated-11``: the session generator (``workloads.traces.generator``) at seeds
  7 and 11 with Zipf skews 1.5 and 2.0 (report). The shipped default trace (seed 0, skew 1)
  is a development trace: it keeps the full per-row table.
- ``claude-code``: the real Claude Code trace's report half (``workloads.traces.split``);
  its other half is for development.
- ``miniswe``: mini-swe-agent's development sessions (``miniswe-dev.jsonl``), another agent:
  bash only, short prompts (dev; the held-out sessions of that source are not in the repo).

``DEV_TRACES`` are development traces outside the headline, for ``workloads.suite.develop``
(trying a constant or rule where the report never looks): the real trace's development half
(``claude-code-dev``) and the generator at seeds 3, 5 and 13 (skews 2.0, 1.5, 2.0).
``TRACES`` is both; a ``SuiteConfig`` may name any of them.

Arrivals: a burst (every session of a run at t=0, ``sessions_per_server`` per server; runs
pooled to ``pooled_sessions`` sessions), and Poisson arrivals of ``pooled_sessions`` sessions
at fractions ``loads`` of the saturation rate, which is the baseline's burst throughput on
the same servers (sessions over makespan, over its burst runs): 1.0 loads the baseline to its
capacity. Servers: ``servers`` instances behind one router.

Every run draws its sessions from its trace with its own seed (sampling with replacement
where a trace has fewer), and assigns catalog models with Zipf skew 1 where the trace has
none, as the replay does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from workloads.replay.cluster import ClusterSpec
from workloads.traces.arrivals import poisson_arrivals
from workloads.traces.assignment import assign_models, bundled_contexts
from workloads.traces.generator import generate_trace
from workloads.traces.readers import TRACES_DIR, read_real_trace
from workloads.traces.split import dev_half, report_half
from workloads.traces.trace import Session, load_trace

__all__ = ["DEV_TRACES", "SUITE_TRACES", "TRACES", "Scenario", "SuiteConfig", "TraceSource",
           "burst_runs", "draw_sessions", "poisson_run", "pool_sessions", "scenarios"]


@dataclass(frozen=True)
class TraceSource:
    name: str
    split: str  # "dev" or "report"
    description: str
    load: Callable[[], list[Session]]  # every session the trace offers (models unassigned ok)


def _generated(seed: int, skew: float) -> Callable[[], list[Session]]:
    def load() -> list[Session]:
        # a pool larger than any run draws: 240 sessions at the default's 32 calls each
        return generate_trace(num_sessions=240, total_calls=240 * 32, skew=skew, seed=seed)
    return load


def _claude_code() -> list[Session]:
    return report_half(read_real_trace())


def _claude_code_dev() -> list[Session]:
    return dev_half(read_real_trace())


def _miniswe() -> list[Session]:
    return load_trace(TRACES_DIR / "miniswe-dev.jsonl")


SUITE_TRACES: dict[str, TraceSource] = {t.name: t for t in (
    TraceSource("generated-7", "report", "generated, seed 7, Zipf skew 1.5", _generated(7, 1.5)),
    TraceSource("generated-11", "report", "generated, seed 11, Zipf skew 2.0",
                _generated(11, 2.0)),
    TraceSource("claude-code", "report", "real Claude Code sessions, report half",
                _claude_code),
    TraceSource("miniswe", "dev", "mini-swe-agent sessions (development set)", _miniswe),
)}
DEV_TRACES: dict[str, TraceSource] = {t.name: t for t in (
    TraceSource("claude-code-dev", "dev", "real Claude Code sessions, development half",
                _claude_code_dev),
    TraceSource("generated-3", "dev", "generated, seed 3, Zipf skew 2.0", _generated(3, 2.0)),
    TraceSource("generated-5", "dev", "generated, seed 5, Zipf skew 1.5", _generated(5, 1.5)),
    TraceSource("generated-13", "dev", "generated, seed 13, Zipf skew 2.0", _generated(13, 2.0)),
)}
TRACES: dict[str, TraceSource] = {**SUITE_TRACES, **DEV_TRACES}


@dataclass(frozen=True)
class Scenario:
    trace: str
    servers: int
    load: float | None = None  # fraction of saturation; None: a burst

    @property
    def name(self) -> str:
        arrivals = "burst" if self.load is None else f"poisson-{self.load:g}"
        return f"{self.trace}/{arrivals}/{self.servers}srv"

    @property
    def split(self) -> str:
        return TRACES[self.trace].split


@dataclass(frozen=True)
class SuiteConfig:
    traces: tuple[str, ...] = tuple(SUITE_TRACES)
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    servers: tuple[int, ...] = (1, 4)
    sessions_per_server: int = 30  # a burst run's sessions on each server
    pooled_sessions: int = 120  # sessions a scenario's SCTs rest on
    seed: int = 0
    spec: ClusterSpec = field(default_factory=ClusterSpec)

    def __post_init__(self) -> None:
        unknown = set(self.traces) - set(TRACES)
        if unknown:
            raise ValueError(f"unknown suite trace(s) {sorted(unknown)}; known: "
                             f"{', '.join(TRACES)}")
        if not self.traces or not self.servers:
            raise ValueError("the suite needs at least one trace and one server count")
        if any(not 0 < f for f in self.loads) or any(n < 1 for n in self.servers):
            raise ValueError("loads must be > 0 and server counts >= 1")
        if self.sessions_per_server < 1 or self.pooled_sessions < 1:
            raise ValueError("sessions_per_server and pooled_sessions must be >= 1")

    def spec_for(self, servers: int) -> ClusterSpec:
        return replace(self.spec, servers=servers)


def scenarios(config: SuiteConfig) -> list[Scenario]:
    """Every scenario, bursts first (their baseline runs set the Poisson rates)."""
    out = [Scenario(t, n) for t in config.traces for n in config.servers]
    out += [Scenario(t, n, f) for t in config.traces for n in config.servers for f in config.loads]
    return out


def pool_sessions(sessions: Sequence[Session], models: Sequence[str]) -> list[Session]:
    """A trace's sessions as runs draw them: each on its own (no subagent links: a drawn
    copy has no parent to wait for), catalog ``models`` assigned with Zipf skew 1 where the
    trace names others."""
    pool = list(sessions)
    if any(s.model not in models for s in pool):
        pool = assign_models(pool, list(models), skew=1.0, seed=0,
                             contexts=bundled_contexts(models))
    return [s.alone() for s in pool]


@lru_cache(maxsize=16)  # every trace of TRACES (9) for one catalog
def _pool(trace: str, models: tuple[str, ...]) -> tuple[Session, ...]:
    return tuple(pool_sessions(TRACES[trace].load(), models))


def draw_sessions(trace: str, count: int, seed: int, spec: ClusterSpec, tag: str) -> list[Session]:
    """``count`` sessions of ``trace`` (seeded; with replacement beyond the trace's size),
    renamed ``<tag>/<k>/<id>`` so that draws never share a session id."""
    pool = _pool(trace, tuple(spec.models))
    rng = random.Random(f"{trace}/{tag}/{seed}")
    picks = (rng.sample(range(len(pool)), count) if count <= len(pool)
             else [rng.randrange(len(pool)) for _ in range(count)])
    return [replace(pool[i].renamed(lambda sid, k=k: f"{tag}/{k}/{sid}"), arrival_s=0.0)
            for k, i in enumerate(picks)]


def burst_runs(scenario: Scenario, config: SuiteConfig) -> list[list[Session]]:
    """A burst scenario's runs: each ``sessions_per_server`` per server, all at t=0, enough
    runs to pool ``pooled_sessions`` sessions."""
    per_run = config.sessions_per_server * scenario.servers
    runs = max(1, math.ceil(config.pooled_sessions / per_run))
    return [draw_sessions(scenario.trace, per_run, config.seed, config.spec, f"burst{scenario.servers}-{r}")
            for r in range(runs)]


def poisson_run(scenario: Scenario, config: SuiteConfig, saturation: float) -> list[Session]:
    """A Poisson scenario's one run: ``pooled_sessions`` sessions arriving at ``load`` times
    the ``saturation`` rate (sessions/s)."""
    assert scenario.load is not None
    sessions = draw_sessions(scenario.trace, config.pooled_sessions, config.seed, config.spec,
                     f"poisson{scenario.servers}-{scenario.load:g}")
    return poisson_arrivals(sessions, scenario.load * saturation, seed=config.seed)


def saturation_rate(burst_makespans: Sequence[tuple[int, float]]) -> float:
    """Sessions per second over burst runs given as (sessions, makespan) pairs."""
    sessions = sum(n for n, _ in burst_makespans)
    seconds = sum(t for _, t in burst_makespans)
    if sessions < 1 or not seconds > 0:
        raise ValueError("a saturation rate needs burst runs with sessions and a makespan")
    return sessions / seconds
