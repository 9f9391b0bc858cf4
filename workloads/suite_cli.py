"""``talaria replay``'s scenario suite: its arguments, its run, and capacity at the SLO.

``--suite full`` runs ``SuiteConfig()`` (every trace x burst and four Poisson loads x one and
four servers, 120 sessions a scenario); ``quick`` the same traces and servers at loads 0.5
and 1.0 with 60 sessions a scenario; ``off`` none. ``--tune-suite`` first runs the baseline's
and every peer's grid in every scenario (``workloads.suite_tuning``; ``--tune-servers``: only
the scenarios on those server counts).

Capacity at the SLO (``capacity``): per row and server count, the highest Poisson rate at
which the p95 SCT stays within ``SLO_FACTOR`` times the p95 of the same sessions alone, read
off the suite's load points of the ``CAPACITY_TRACE`` scenarios (linear between the last
load that meets it and the first that does not; at least the highest load when all do).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from workloads.cluster import ClusterSpec
from workloads.suite import SuiteConfig
from workloads.suite_report import format_suite, suite_json
from workloads.suite_run import SUITE_ROWS, SuiteResult, run_suite
from workloads.suite_tuning import load_suite_settings, tune_suite

__all__ = ["CAPACITY_TRACE", "SLO_FACTOR", "add_arguments", "capacity", "format_capacity",
           "run_from_args"]

SLO_FACTOR = 2.0
CAPACITY_TRACE = "claude-code"
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
    p.add_argument("--tune-servers", default=None,
                   help="with --tune-suite: tune only the scenarios on these server counts, "
                   "e.g. 1 (the cache keeps the other scenarios' settings)")


def run_from_args(args: argparse.Namespace, spec: ClusterSpec,
                  fallback: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The suite's printed table and its JSON (``scenarios``, ``capacity``), or None when
    ``--suite off``."""
    if args.suite == "off":
        return None
    config = replace(_SIZES[args.suite], seed=args.seed,
                     spec=replace(spec, servers=1))
    if args.tune_suite:
        servers = (None if args.tune_servers is None
                   else tuple(int(n) for n in args.tune_servers.split(",")))
        settings = tune_suite(config, fallback, workers=args.workers,
                              progress=not args.no_progress, servers=servers)
    else:
        settings = load_suite_settings(config, fallback)
    suite = run_suite(config, settings, rows=SUITE_ROWS, workers=args.workers,
                      progress=not args.no_progress)
    caps = capacity(suite)
    text = format_suite(suite) + "\n\n" + format_capacity(caps)
    return text, {"scenarios": suite_json(suite), "capacity": caps}


def capacity(suite: SuiteResult, trace: str = CAPACITY_TRACE) -> dict[str, Any]:
    """``{servers: {row: {"sessions_per_s", "load", "at_least", "at_most"}}}`` from the
    suite's load points: linear between the last load that meets the SLO and the first that
    does not; ``at_least`` when every load meets it (the highest load), ``at_most`` when none
    does (the lowest load: the capacity is below it)."""
    out: dict[str, Any] = {}
    for servers in suite.config.servers:
        points = sorted((r.scenario.load, r) for r in suite.scenarios.values()
                        if r.scenario.trace == trace and r.scenario.servers == servers
                        and r.scenario.load is not None)
        if not points:
            continue
        rate = points[0][1].saturation_rate or 0.0
        per_row: dict[str, Any] = {}
        for row in points[0][1].rows:
            ok_load, at_least = 0.0, False
            previous: tuple[float, float] | None = None  # (load, p95 / slo)
            for load, res in points:
                ratio = res.rows[row].values["p95"] / (SLO_FACTOR * res.isolated_p95_s)
                if ratio <= 1.0:
                    ok_load, at_least, previous = load, True, (load, ratio)
                    continue
                if previous is not None:
                    lo, r_lo = previous
                    ok_load = lo + (load - lo) * (1.0 - r_lo) / (ratio - r_lo)
                at_least = False
                break
            at_most = previous is None
            if at_most:
                ok_load = points[0][0]
            per_row[row] = {"sessions_per_s": ok_load * rate, "load": ok_load,
                            "at_least": at_least, "at_most": at_most}
        out[str(servers)] = per_row
    return out


def format_capacity(caps: dict[str, Any]) -> str:
    lines = [f"capacity at the SLO (p95 SCT <= {SLO_FACTOR:g} x the sessions' p95 alone), "
             f"{CAPACITY_TRACE} sessions, from the suite's Poisson loads:"]
    for servers, rows in caps.items():
        best = max((v["sessions_per_s"], r) for r, v in rows.items() if r != "talaria")
        for row, v in rows.items():
            mark = ">=" if v["at_least"] else "<" if v["at_most"] else ""
            lines.append(f"  {servers} server(s)  {row:20s} {mark}{v['sessions_per_s'] * 3600:7.1f} "
                         f"sessions/h ({mark}{v['load']:.2f} of saturation)")
        tal = rows.get("talaria")
        if tal is not None and best[0] > 0:
            bound = ">=" if tal["at_least"] and not rows[best[1]]["at_least"] else ""
            lines.append(f"  {servers} server(s)  talaria / best other ({best[1]}): "
                         f"{bound}{tal['sessions_per_s'] / best[0]:.2f}x")
    return "\n".join(lines)
