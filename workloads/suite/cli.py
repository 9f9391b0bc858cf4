"""``talaria replay``'s scenario suite: its arguments, its run, and capacity at the SLO.

``--suite full`` runs ``SuiteConfig()`` (every trace x burst and four Poisson loads x one and
four servers, 120 sessions a scenario); ``quick`` the same traces and servers at loads 0.5
and 1.0 with 60 sessions a scenario; ``off`` none. ``--tune-suite`` first runs the baseline's
and every peer's grid in every scenario (``workloads.suite.tuning``; ``--tune-servers``: only
the scenarios on those server counts). ``--leave-one-out DRAWS`` runs, instead of the peers
and capacity, Talaria against each of its leave-one-out rows and a placebo
(``workloads.suite.leave_one_out``). ``--settings-seed S`` runs every tuned row at the
settings chosen on seed S's draw, on ``--seed``'s sessions: whether a setting picked in
hindsight carries to other sessions of the same scenario.

Capacity at the SLO (``workloads.suite.capacity``), on the ``CAPACITY_TRACE``'s report
sessions: per row, the highest Poisson rate at which the p95 SCT stays within ``SLO_FACTOR``
times the same sessions' p95 alone, searched on one server (quick suite: two bisections) or
on one and four (full: three), each probe running a row at each of its p95 settings of the
trace's Poisson scenarios (one per load) and keeping the best; and per row the servers needed at one rate: the capacity trace's saturation rate
on the suite's largest server count (the baseline's burst throughput there), the load at
which that many baseline servers are just busy, each probe running the row at its p95
settings of the trace's Poisson scenarios on every server count.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from talaria.arg_types import positive_int
from workloads.benchmark.tuning import apply_settings, load_settings, setup_key
from workloads.replay.cluster import ClusterSpec
from workloads.replay.systems import SYSTEMS
from workloads.suite.capacity import CapacityConfig, rate_capacity, servers_needed
from workloads.suite.develop import (
    DEV_SUITE_TRACES,
    format_development,
    parse_variant,
    run_development,
)
from workloads.suite.leave_one_out import (
    LOO_ROWS,
    check_loo_rows,
    format_leave_one_out,
    leave_one_out_json,
    run_leave_one_out,
)
from workloads.suite.report import format_suite, margins, margins_json, suite_json
from workloads.suite.run import (
    BASELINE,
    PLACEBO_SHIFT_S,
    SUITE_ROWS,
    TALARIA,
    SuiteResult,
    SuiteSettings,
    run_suite,
)
from workloads.suite.scenarios import Scenario, SuiteConfig, draw_sessions
from workloads.suite.tuning import SUITE_SETTINGS_PATH, load_suite_settings, tune_suite

__all__ = ["CAPACITY_SESSIONS", "CAPACITY_TRACE", "SLO_FACTOR", "add_arguments", "capacity",
           "check_settings_seed", "check_suite_flags", "default_trace_settings",
           "format_capacity", "parse_loo_rows", "parse_suite_rows", "parse_tune_servers",
           "run_develop", "run_from_args", "suite_settings", "tune_rows"]

SLO_FACTOR = 2.0
CAPACITY_TRACE = "claude-code"
CAPACITY_SESSIONS = 60  # sessions a capacity probe replays (the quick suite's per scenario)
_SIZES = {
    "full": SuiteConfig(),
    "quick": SuiteConfig(loads=(0.5, 1.0), pooled_sessions=60),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=("full", "quick", "off"), default="quick",
                   help="the scenario suite after the default trace's table (full: "
                   "every trace x burst and Poisson at 0.25-1.0 of saturation x 1 and 4 "
                   "servers; quick, the default: loads 0.5 and 1.0, 60 sessions a scenario)")
    p.add_argument("--tune-suite", action="store_true",
                   help="first tune the baseline and every peer in every scenario of the "
                   "suite, per figure (writes workloads/data/suite_settings.json)")
    p.add_argument("--leave-one-out", type=positive_int, default=0, metavar="DRAWS",
                   help="instead of the peers and capacity: Talaria against each of its "
                   f"leave-one-out rows and a placebo (itself, arrivals moved by up to "
                   f"{PLACEBO_SHIFT_S:g} s) in every suite scenario, DRAWS independent draws "
                   "pooled, with paired 95%% intervals (workloads.suite.leave_one_out)")
    p.add_argument("--loo-rows", default=None, metavar="ROWS",
                   help="with --leave-one-out: only these of its rows, comma-separated "
                   f"(default all: {', '.join(LOO_ROWS)}; write --loo-rows=-sp,placebo, as the "
                   "rows begin with a dash); Talaria and the baseline always run")
    p.add_argument("--suite-rows", default=None, metavar="ROWS",
                   help="only these rows of the suite and its capacity search, "
                   f"comma-separated (default all: {', '.join(SUITE_ROWS)}); the baseline "
                   "and talaria always run (the baseline's bursts set the Poisson rates); with "
                   "--tune-suite only the rows named are tuned, the others keep the cache's "
                   "settings (a row whose code or router changed)")
    p.add_argument("--tune-new-points", action="store_true",
                   help="with --tune-suite: run only the grid points the cache records no run "
                   "of (e.g. a quantum added to SUITE_QUANTA), keeping its best values for the "
                   "rest; sound only while the rows' code is what made them")
    p.add_argument("--tune-servers", default=None,
                   help="with --tune-suite: tune only the scenarios on these server counts, "
                   "e.g. 1 (the cache keeps the other scenarios' settings)")
    p.add_argument("--develop", action="append", default=None, metavar="VARIANT",
                   help="instead of everything else: try a variant of Talaria "
                   "(ROW:field=value,..., e.g. talaria:min_slot_factor=20) against it in every "
                   "development scenario, on the same sessions (repeat for several; "
                   "workloads.suite.develop)")
    p.add_argument("--dev-traces", default=None, metavar="TRACES",
                   help="with --develop: only these development traces, comma-separated "
                   f"(default all: {', '.join(DEV_SUITE_TRACES)})")
    p.add_argument("--settings-seed", type=int, default=None, metavar="SEED",
                   help="run the suite's rows at the settings tuned on this seed's draw "
                   "(default: --seed's own): with --seed 1 --settings-seed 0 the baseline "
                   "and every peer run seed 1's draw (other arrivals; sessions drawn anew "
                   "from the same trace, so some recur) at the settings chosen in hindsight "
                   "on seed 0's, a held-out check of that choice")
    p.add_argument("--dev-draws", type=int, default=1, metavar="DRAWS",
                   help="with --develop: independent draws of the scenarios, pooled (default 1)")


def check_suite_flags(args: argparse.Namespace) -> None:
    """The suite modes' flags, refused before anything runs where they cannot act: each
    would be ignored without a word, or refused only after the default trace's table."""
    if args.loo_rows is not None:
        if not args.leave_one_out:
            raise ValueError("--loo-rows chooses rows of --leave-one-out, which is not given")
        parse_loo_rows(args.loo_rows)
    elsewhere = (args.live or args.bench_sim or args.strip_session_ids)  # no suite runs there
    if args.suite_rows is not None:
        if (args.leave_one_out or args.develop or args.suite == "off" or args.trace
                or args.policies or args.servers != 1 or args.day is not None or elsewhere):
            raise ValueError("--suite-rows chooses rows of the suite's table, which runs "
                             "only on the embedded traces; it takes no --leave-one-out, "
                             "--develop, --suite off, --trace, --policies, --servers, --day, "
                             "--live, --bench-sim or --strip-session-ids")
        parse_suite_rows(args.suite_rows)
    if args.tune_new_points and not args.tune_suite:
        raise ValueError("--tune-new-points goes with --tune-suite")
    if args.settings_seed is not None and (
            args.tune_suite or args.leave_one_out or args.develop or args.day is not None
            or args.suite == "off" or args.trace or args.policies or args.servers != 1
            or args.live or args.bench_sim or args.strip_session_ids):
        raise ValueError("--settings-seed runs the suite's tuned rows at another draw's "
                         "settings: it takes no --tune-suite, --leave-one-out, --develop, "
                         "--day, --suite off, --trace, --policies, --servers, --live, "
                         "--bench-sim or --strip-session-ids")
    if args.develop and (args.trace or args.policies or args.servers != 1 or args.leave_one_out
                         or args.tune_suite or args.suite != "quick" or args.day is not None
                         or elsewhere):
        raise ValueError("--develop runs the development scenarios: it takes no --trace, "
                         "--policies, --servers, --leave-one-out, --tune-suite, --suite, "
                         "--day, --live, --bench-sim or --strip-session-ids")
    if args.leave_one_out and (args.trace or args.policies or args.servers != 1
                               or args.suite == "off" or elsewhere):
        raise ValueError("--leave-one-out runs the suite's own scenarios: it takes no "
                         "--trace, --policies, --servers, --suite off, --live, --bench-sim "
                         "or --strip-session-ids")
    if args.tune_suite and args.leave_one_out:
        raise ValueError("--leave-one-out runs Talaria's one setting: no --tune-suite")
    if args.tune_suite and (args.suite == "off" or args.trace or args.policies
                            or args.servers != 1 or args.day is not None or elsewhere):
        raise ValueError("--tune-suite tunes the suite's scenarios, which run only on the "
                         "embedded traces: it takes no --suite off, --trace, --policies, "
                         "--servers, --day, --live, --bench-sim or --strip-session-ids")
    if args.tune_servers is not None:
        if not args.tune_suite:
            raise ValueError("--tune-servers goes with --tune-suite")
        parse_tune_servers(args.tune_servers, args.suite)


def parse_tune_servers(text: str, suite: str) -> tuple[int, ...]:
    """``--tune-servers``' server counts, each one the ``suite`` size's, none twice."""
    known = _SIZES[suite].servers
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        counts = ()
    if not counts or len(set(counts)) != len(counts) or not set(counts) <= set(known):
        raise ValueError(f"--tune-servers must be comma-separated server counts of the suite "
                         f"({', '.join(map(str, known))}), got {text!r}")
    return counts


def parse_suite_rows(text: str) -> tuple[str, ...]:
    """``--suite-rows``' rows in the suite's order, the baseline and Talaria among them;
    an unknown row is refused, naming the known ones."""
    named = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in named if r not in SUITE_ROWS]
    if unknown:
        raise ValueError(f"--suite-rows: not rows of the suite: {', '.join(unknown)}; "
                         f"known: {', '.join(SUITE_ROWS)}")
    wanted = {BASELINE, TALARIA, *named}
    return tuple(r for r in SUITE_ROWS if r in wanted)


def tune_rows(text: str) -> tuple[str, ...]:
    """With ``--tune-suite``, the rows ``--suite-rows`` names that are tuned (Talaria is not:
    it runs one configuration); the baseline alone when it names none."""
    named = parse_suite_rows(text)
    picked = [r.strip() for r in text.split(",") if r.strip()]
    return tuple(r for r in named if r in picked and r != TALARIA) or (BASELINE,)


def parse_loo_rows(text: str) -> tuple[str, ...]:
    """``--loo-rows``' rows, checked (known, none twice, at least one)."""
    rows = tuple(r.strip() for r in text.split(",") if r.strip())
    if not rows:
        raise ValueError(f"--loo-rows names no row; choose from {', '.join(LOO_ROWS)}")
    check_loo_rows(rows)
    if len(set(rows)) != len(rows):
        raise ValueError(f"--loo-rows names a row twice: {', '.join(rows)}")
    return rows


def default_trace_settings(spec: ClusterSpec, path: Path,
                           fixed: bool = False) -> dict[str, dict[str, Any]]:
    """Each row's setting as tuned on the default trace for ``spec`` at the default seed (0;
    a row's own where none was): the suite's fallback for a scenario with no tuned settings,
    and the baseline's sets the Poisson rates (its burst throughput is load 1.0). Read at seed
    0 whatever ``--seed`` is, so that another seed draws other sessions and arrivals at rates
    defined the same way (until 2026-12-05 ``--seed 1`` found no tuned entry and measured
    saturation at the baseline's own setting, drained / 480 s, whose bursts drain ~30% more
    sessions an hour than at its tuned quantum / 480 s). ``fixed`` (``--fixed-settings``):
    with no entry for ``spec``, whatever ``path`` holds, as the default trace's table reads it."""
    from workloads.traces.generator import default_trace

    tuned = load_settings(setup_key(default_trace(), spec, 0), path)
    if tuned is None and fixed:
        tuned = load_settings(None, path)
    systems = apply_settings(list(SYSTEMS.values()), tuned.settings if tuned else {})
    return {s.name: dict(s.setting) for s in systems}


def run_develop(args: argparse.Namespace, spec: ClusterSpec,
                baseline_setting: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``--develop``: the variants against Talaria in the development scenarios at the quick
    suite's sizes on ``spec``'s servers; the printed comparison and its JSON (``develop``: as
    ``leave_one_out``'s)."""
    traces = (DEV_SUITE_TRACES if args.dev_traces is None
              else tuple(t.strip() for t in args.dev_traces.split(",") if t.strip()))
    variants = [parse_variant(v) for v in args.develop]
    config = replace(_SIZES["quick"], traces=traces, seed=args.seed,
                     spec=replace(spec, servers=1))
    found = run_development(config, variants, baseline_setting, draws=args.dev_draws,
                            workers=args.workers, progress=not args.no_progress)
    return (format_development(found, args.dev_draws),
            {"develop": leave_one_out_json(found, args.dev_draws)})


def run_from_args(args: argparse.Namespace, spec: ClusterSpec,
                  fallback: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The suite's printed table and its JSON (``scenarios``, ``capacity``), or None when
    ``--suite off``."""
    if args.suite == "off":
        return None
    config = _suite_config(args, spec)
    if args.leave_one_out:
        rows = LOO_ROWS if args.loo_rows is None else parse_loo_rows(args.loo_rows)
        found = run_leave_one_out(config, SuiteSettings(fallback=fallback).saturation_setting(),
                                  draws=args.leave_one_out, rows=rows, workers=args.workers,
                                  progress=not args.no_progress)
        return (format_leave_one_out(found, args.leave_one_out),
                {"leave_one_out": leave_one_out_json(found, args.leave_one_out)})
    if args.tune_suite:
        servers = (None if args.tune_servers is None
                   else parse_tune_servers(args.tune_servers, args.suite))
        settings = tune_suite(config, fallback, workers=args.workers,
                              progress=not args.no_progress, servers=servers,
                              new_points_only=args.tune_new_points,
                              rows=None if args.suite_rows is None else tune_rows(args.suite_rows))
    else:
        settings = suite_settings(config, fallback, args.settings_seed)
    rows = SUITE_ROWS if args.suite_rows is None else parse_suite_rows(args.suite_rows)
    suite = run_suite(config, settings, rows=rows, workers=args.workers,
                      progress=not args.no_progress)
    quick = args.suite == "quick"
    caps = capacity(suite, settings, rows=rows, workers=args.workers,
                    progress=not args.no_progress,
                    search_servers=(1,) if quick else (1, 4),
                    config=CapacityConfig(slo_factor=SLO_FACTOR, bisections=2 if quick else 3))
    text = format_suite(suite) + "\n\n" + format_capacity(caps)
    found: dict[str, Any] = {"scenarios": suite_json(suite), "capacity": caps,
                             "margins": margins_json(margins(suite, config.seed))}
    if args.settings_seed is not None and args.settings_seed != config.seed:
        text = (f"held out: every tuned row runs seed {config.seed}'s sessions at the settings "
                f"chosen on seed {args.settings_seed}'s\n\n{text}")
        found["settings_seed"] = args.settings_seed
    return text, found


def _suite_config(args: argparse.Namespace, spec: ClusterSpec) -> SuiteConfig:
    return replace(_SIZES[args.suite], seed=args.seed, spec=replace(spec, servers=1))


def check_settings_seed(args: argparse.Namespace, spec: ClusterSpec, path: Path) -> None:
    """``--settings-seed``'s draw must be in the suite's cache (``suite_settings``): refused
    before the default trace's table, not once it has run."""
    if args.settings_seed is not None and args.suite != "off":
        suite_settings(_suite_config(args, spec),
                       default_trace_settings(spec, path, args.fixed_settings),
                       args.settings_seed)


def suite_settings(config: SuiteConfig, fallback: dict[str, dict[str, Any]],
                   settings_seed: int | None, path: Path = SUITE_SETTINGS_PATH) -> SuiteSettings:
    """The cached settings ``config``'s suite runs at: those tuned on ``config``'s own draw,
    or with ``settings_seed`` on that seed's draw of the same scenarios (a held-out run: the
    sessions and arrivals are ``config.seed``'s, the settings were chosen without them).
    A ``settings_seed`` whose draw has no scenario cached is refused: every row would run
    untuned under a held-out heading."""
    tuned_on = config if settings_seed is None else replace(config, seed=settings_seed)
    settings = load_suite_settings(tuned_on, fallback, path)
    if settings_seed is not None and not settings.tuned:
        raise ValueError(f"--settings-seed {settings_seed}: {path} holds no settings tuned on "
                         f"seed {settings_seed}'s draw of the --suite's scenarios on this "
                         f"cluster (--tune-suite --seed {settings_seed} makes them)")
    return settings


def capacity(suite: SuiteResult, settings: SuiteSettings, *, sessions: int = CAPACITY_SESSIONS,
             config: CapacityConfig | None = None, search_servers: Sequence[int] = (1, 4),
             rows: Sequence[str] = SUITE_ROWS, workers: int = 1,
             progress: bool = False) -> dict[str, Any]:
    """``{"trace", "sessions", "slo_factor", "servers": {n: {row: ...}}, "servers_needed":
    {"sessions_per_s", "at_servers", "rows": {row: ...}}}`` (``workloads.suite.capacity``):
    capacity on the suite's server counts among ``search_servers``; the servers needed at the
    rate the largest suite cluster's baseline drains, each row's search starting from its
    capacity on the fewest servers."""
    config = config or CapacityConfig(slo_factor=SLO_FACTOR)
    trace, cfg = CAPACITY_TRACE, suite.config
    drawn = draw_sessions(trace, sessions, cfg.seed, cfg.spec, "capacity")
    saturation = {n: suite.saturation[f"{trace}/{n}srv"] for n in cfg.servers}

    def settings_for(row: str, n: int) -> list[dict[str, Any]]:
        """The row's p95 settings in the suite's scenarios of ``trace`` on ``n`` servers, one
        per load, each once: a probe runs the row at each and keeps the best, so a peer's
        capacity (near half load for most) is not judged at saturation's setting alone."""
        found: list[dict[str, Any]] = []
        for load in sorted(cfg.loads, reverse=True):
            setting = settings.for_row(Scenario(trace, n, load).name, row)[0]["p95"]
            if setting not in found:
                found.append(setting)
        return found

    def every_setting(row: str) -> list[dict[str, Any]]:
        """The row's p95 settings in the trace's scenarios on every server count, the
        largest cluster's first, each once: a servers-needed probe runs anywhere from one
        server up, so a setting the row took on one server may serve it best there too
        (with the largest cluster's settings alone, vLLM + LMCache and Autellix ran their
        7.5 s slots at the higher rate, which serves it worse: stop 70)."""
        found: list[dict[str, Any]] = []
        for n in sorted(cfg.servers, reverse=True):
            found += [s for s in settings_for(row, n) if s not in found]
        return found

    servers = tuple(n for n in cfg.servers if n in search_servers) or (min(cfg.servers),)
    rates = rate_capacity(rows, drawn, cfg.spec_for, servers, saturation.__getitem__,
                          settings_for, config, seed=cfg.seed, workers=workers,
                          progress=progress)
    largest = max(cfg.servers)
    one = rates[str(min(servers))]
    guess = {row: one[row]["sessions_per_s"] / min(servers) for row in rows}
    needed = servers_needed(rows, drawn, cfg.spec_for, saturation[largest],
                            every_setting, config, estimate=guess,
                            seed=cfg.seed, workers=workers, progress=progress)
    return {"trace": trace, "sessions": sessions, "slo_factor": config.slo_factor,
            "servers": rates,
            "servers_needed": {"sessions_per_s": saturation[largest], "at_servers": largest,
                               "rows": needed}}


def _ratio_mark(mine: dict[str, Any], other: dict[str, Any]) -> str:
    """How ``mine``'s capacity over ``other``'s relates to the printed ratio: ``>=`` when only
    its numerator may be more (``at_least``) or its denominator less (``at_most``), ``<=``
    for the reverse, ``?`` when both ways (the ratio of two open ends is unknown)."""
    more = mine["at_least"] or other["at_most"]
    less = mine["at_most"] or other["at_least"]
    return "?" if more and less else ">=" if more else "<=" if less else ""


def format_capacity(caps: dict[str, Any]) -> str:
    lines = [f"capacity at the SLO (p95 SCT <= {caps['slo_factor']:g} x the same sessions' p95 "
             f"alone), {caps['trace']}, {caps['sessions']} sessions a probe:"]
    for servers, rows in caps["servers"].items():
        best = max((v["sessions_per_s"], r) for r, v in rows.items() if r != "talaria")
        for row, v in rows.items():
            mark = ">=" if v["at_least"] else "<" if v["at_most"] else ""
            lines.append(f"  {servers} server(s)  {row:20s} {mark}{v['sessions_per_s'] * 3600:7.1f} "
                         f"sessions/h ({mark}{v['load']:.2f} of saturation)")
        tal = rows.get("talaria")
        if tal is not None and best[0] > 0:
            bound = _ratio_mark(tal, rows[best[1]])
            lines.append(f"  {servers} server(s)  talaria / best other ({best[1]}): "
                         f"{bound}{tal['sessions_per_s'] / best[0]:.2f}x")
    need = caps["servers_needed"]
    lines.append(f"servers needed for {need['sessions_per_s'] * 3600:.1f} sessions/h (what "
                 f"{need['at_servers']} baseline servers drain in a burst), same SLO:")
    for row, v in need["rows"].items():
        lines.append(f"  {row:20s} {'>' if v['more_than'] else ''}{v['servers']}")
    return "\n".join(lines)
