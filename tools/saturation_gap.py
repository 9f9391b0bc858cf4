"""Where Talaria's distance to the lower bound at one-server saturation lies: its copies, or
its schedule.

For each trace (development traces by default), one server, Poisson arrivals at the
saturation rate (the baseline's burst throughput, as the suite defines it; the quick suite's
60-session draw), this prints each figure (p50 / p95 / mean SCT) over the lower bound for:

- ``talaria``: Talaria's one configuration on the preset server;
- ``talaria, free host link``: the same on ``workloads/data/servers/h200x8-free-host-link.json``,
  the preset with every host copy (weights from host, staging, KV offloads and restores)
  priced at nanoseconds. That is the limit of any residency mechanism (every model
  resident, one device KV pool shared by them): what is left above the bound is not copies;
- ``oracle, best of N``: each figure's best over the oracle machine's schedules
  (``workloads.bounds.oracle``: every model resident, switches and KV free, perfect batching
  within a model), each figure from whichever schedule is best at it.

The saturation rate is measured on the preset server, so both Talaria rows replay the same
arrivals. Run from the repository root:
``.venv/bin/python tools/saturation_gap.py [--traces miniswe,claude-code-dev] [--no-oracle]``
(about a minute a trace without the oracle, five with it, on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workloads.benchmark.tuning import TUNED_PATH  # noqa: E402
from workloads.bounds.bound import lower_bound  # noqa: E402
from workloads.bounds.oracle import ideal_schedules, run_ideal  # noqa: E402
from workloads.replay.driver import ReplayResult, run_sim  # noqa: E402
from workloads.replay.jobs import quiet_logs  # noqa: E402
from workloads.replay.systems import SYSTEMS  # noqa: E402
from workloads.suite.cli import default_trace_settings  # noqa: E402
from workloads.suite.develop import DEV_SUITE_TRACES  # noqa: E402
from workloads.suite.scenarios import (  # noqa: E402
    Scenario,
    SuiteConfig,
    burst_runs,
    poisson_run,
    saturation_rate,
)
from workloads.suite.stats import percentile  # noqa: E402

FREE_LINK_SERVER = str(REPO / "workloads" / "data" / "servers" / "h200x8-free-host-link.json")

Figures = tuple[float, float, float]


def figures(result: ReplayResult) -> Figures:
    """p50, p95 and mean session completion time."""
    scts = sorted(s.sct_s for s in result.sessions)
    return percentile(scts, 50), percentile(scts, 95), sum(scts) / len(scts)


def one_server_saturation(trace: str, config: SuiteConfig) -> tuple[float, list]:
    """(sessions/s, the Poisson run at load 1.0) on one server of ``config.spec``."""
    spec = config.spec_for(1)
    baseline = SYSTEMS["baseline"].with_setting(**default_trace_settings(spec, TUNED_PATH)["baseline"])
    bursts = burst_runs(Scenario(trace, 1), config)
    rate = saturation_rate([(len(run), run_sim(run, baseline, spec, seed=config.seed).makespan_s)
                            for run in bursts])
    return rate, poisson_run(Scenario(trace, 1, 1.0), config, rate)


def gap_rows(trace: str, config: SuiteConfig, oracle: bool) -> tuple[float, Figures,
                                                                     dict[str, Figures]]:
    """(rate, the bound's figures, each row's figures) for ``trace``."""
    spec = config.spec_for(1)
    rate, run = one_server_saturation(trace, config)
    bound = lower_bound(run, spec)
    rows = {
        "talaria": figures(run_sim(run, SYSTEMS["talaria"], spec, seed=config.seed)),
        "talaria, free host link": figures(
            run_sim(run, SYSTEMS["talaria"], replace(spec, server=FREE_LINK_SERVER),
                    seed=config.seed)),
    }
    if oracle:
        schedules = ideal_schedules()
        each = [figures(run_ideal(run, spec, s, seed=config.seed)) for s in schedules]
        rows[f"oracle, best of {len(schedules)}"] = (
            min(f[0] for f in each), min(f[1] for f in each), min(f[2] for f in each))
    return rate, (bound.sct_p50_s, bound.sct_p95_s, bound.sct_mean_s), rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=",".join(DEV_SUITE_TRACES),
                        help="comma-separated suite traces (default: the development ones)")
    parser.add_argument("--sessions", type=int, default=60, help="sessions a scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-oracle", action="store_true", help="skip the oracle's schedules")
    args = parser.parse_args(argv)
    quiet_logs()
    config = SuiteConfig(pooled_sessions=args.sessions, seed=args.seed)
    print("one server, Poisson at saturation: p50 / p95 / mean SCT (s), then over the bound")
    for trace in filter(None, (t.strip() for t in args.traces.split(","))):
        config = replace(config, traces=(trace,))
        rate, bound, rows = gap_rows(trace, config, oracle=not args.no_oracle)
        print(f"{trace}: {3600 * rate:.1f} sessions/h, bound "
              + " / ".join(f"{b:.1f}" for b in bound))
        for name, got in rows.items():
            ratios = ", ".join(f"{g / b:.2f}" for g, b in zip(got, bound, strict=True))
            print(f"  {name:28s} " + " / ".join(f"{g:.1f}" for g in got) + f"   ({ratios})",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
