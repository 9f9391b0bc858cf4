"""``talaria replay --day HOURS``: its arguments and its run (``workloads.suite.day``, and
with ``--day-capacity`` ``workloads.suite.day_capacity``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from talaria.arg_types import float_above

if TYPE_CHECKING:
    from workloads.replay.cluster import ClusterSpec
    from workloads.replay.systems import SystemConfig
    from workloads.suite.day import DayConfig
    from workloads.traces.trace import Session

__all__ = ["DAY_LOAD", "add_arguments", "check_day_flags", "run_day_command"]

DAY_LOAD = 0.5  # --day-load's default: half the baseline's saturation


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--day", type=float_above(0), default=None, metavar="HOURS",
                   help="a cluster's day instead: HOURS of Poisson sessions drawn from the "
                   "trace (default: the real Claude Code trace) on --servers instances, the "
                   "first policy (default talaria); prints SCT, the SLO, sessions/h and each "
                   "server's utilisation (workloads.suite.day)")
    p.add_argument("--day-load", type=float_above(0), default=DAY_LOAD,
                   help="with --day: the rate as a fraction of the baseline's saturation "
                   "(default 0.5)")
    p.add_argument("--day-rate", type=float_above(0), default=None, metavar="SESSIONS_PER_HOUR",
                   help="with --day: sessions per hour per server instead of --day-load")
    p.add_argument("--day-capacity", action="store_true",
                   help="with --day: instead of one rate, search each policy's (default "
                   "talaria,baseline) highest rate per server that holds the SLO for the "
                   "HOURS (workloads.suite.day_capacity)")
    p.add_argument("--day-setting", default=None, metavar="RULE/QUANTUM",
                   help="with --day: the slot rule and quantum of every policy but "
                   "Talaria (which runs its one configuration), e.g. drained/60 (default: "
                   "each one's setting tuned on the default trace)")


def check_day_flags(args: argparse.Namespace) -> None:
    """``--day``'s own flags without ``--day``, which would be ignored: refused."""
    if args.day_capacity and args.day is None:
        raise ValueError("--day-capacity searches a cluster's day: give --day HOURS")
    if args.day is None and (args.day_load != DAY_LOAD or args.day_rate is not None
                             or args.day_setting is not None):
        raise ValueError("--day-load, --day-rate and --day-setting go with --day")


def run_day_command(args: argparse.Namespace) -> int:
    """``--day``: one run, or with ``--day-capacity`` the search."""
    from workloads.benchmark.tuning import apply_settings, load_settings
    from workloads.replay.cluster import ClusterSpec
    from workloads.replay.systems import parse_policies
    from workloads.suite.day import DayConfig, day_json, format_day, run_day
    from workloads.suite.run import TALARIA
    from workloads.suite.scenarios import pool_sessions
    from workloads.traces.readers import load_any_trace, read_real_trace, real_trace_path

    if (args.live or args.bench_sim or args.leave_one_out or args.sweep or args.tune
            or args.strip_session_ids):
        raise ValueError("--day runs a simulated cluster of its own: it takes no --live, "
                         "--bench-sim, --leave-one-out, --sweep, --tune or "
                         "--strip-session-ids")
    if args.day_capacity and args.day_rate is not None:
        raise ValueError("--day-capacity searches the rate itself: it takes no --day-rate")
    config = DayConfig(args.day, args.day_load, args.day_rate, args.seed)
    spec = ClusterSpec(servers=args.servers, server=args.server, tp=args.tp,
                       block_size=args.block_size, max_fused_decode_steps=args.fused_steps,
                       cut_fused_steps=args.cut_fused_steps)
    trace = args.trace or str(real_trace_path())
    pool = pool_sessions(load_any_trace(args.trace) if args.trace else read_real_trace(),
                         spec.models)
    if args.max_sessions is not None:
        pool = pool[: args.max_sessions]
    tuned = load_settings(None, Path(args.settings)) if args.settings else load_settings(None)
    default = "talaria,baseline" if args.day_capacity else "talaria"
    wanted = parse_policies(args.policies or default)
    *chosen_all, baseline = apply_settings([*wanted, parse_policies("baseline")[0]],
                                           tuned.settings if tuned else {})
    if args.day_setting is not None:
        rule, _, quantum = args.day_setting.partition("/")
        try:
            setting = dict(slot_close=rule, slot_quantum_s=float(quantum))
            baseline.with_setting(**setting)  # refused here when malformed
        except ValueError as exc:
            raise ValueError(f"--day-setting takes RULE/QUANTUM, e.g. drained/60, got "
                             f"{args.day_setting!r} ({exc})") from None
        if all(c.name == TALARIA for c in chosen_all):
            raise ValueError("--day-setting sets the other policies: Talaria runs its one "
                             "configuration")
        chosen_all = [c if c.name == TALARIA else c.with_setting(**setting) for c in chosen_all]
    name = f"{Path(trace).name} ({len(pool)} sessions)"
    if args.day_capacity:
        return _day_capacity(args, pool, chosen_all, spec, config, baseline, name)
    chosen = chosen_all[0]
    day = run_day(pool, chosen, spec, config, baseline=baseline, progress=not args.no_progress)
    print(format_day(day, name))
    if args.json_path:
        from workloads.benchmark.report import write_json

        write_json({"day": day_json(day, name)}, args.json_path)
        print(f"wrote {args.json_path}")
    return 1 if day.failed_calls else 0


def _day_capacity(args: argparse.Namespace, pool: list[Session], systems: list[SystemConfig],
                  spec: ClusterSpec, config: DayConfig, baseline: SystemConfig,
                  name: str) -> int:
    from workloads.suite.day_capacity import day_capacity, day_capacity_json, format_day_capacity

    saturation, found = day_capacity(pool, systems, spec, config, baseline=baseline,
                                     workers=args.workers, progress=not args.no_progress)
    print(format_day_capacity(found, saturation, spec.servers, config.hours, name))
    if args.json_path:
        from workloads.benchmark.report import write_json

        write_json({"day_capacity": day_capacity_json(found, saturation, spec.servers,
                                                      config.hours, name)}, args.json_path)
        print(f"wrote {args.json_path}")
    return 0
