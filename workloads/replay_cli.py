"""``talaria replay``: the benchmark (simulated cluster) or a replay against a live router.

Simulated (default): every policy of ``--policies`` replays the trace on its own simulated
cluster under the virtual clock, each at its tuned slot-closing rule and quantum (cached in
``workloads/data/tuned_settings.json`` for the trace and cluster it was tuned on; ``--tune``
re-runs the grid and rewrites it), plus the two bounds (``ideal``, ``isolated``); prints the
table and where each session's time went, writes JSON (``--json``) and plots (``--plot``:
SCT distributions, and the time split as stacked bars). ``--sweep`` adds the load and
slot-quantum sweeps. Live (``--live URL``): replays the trace against a running router.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from talaria.arg_types import (
    check_output_path,
    float_above,
    float_at_least,
    int_at_least,
    positive_int,
)
from workloads.suite import cli as suite_cli
from workloads.suite import day_cli

__all__ = ["register", "run_replay_command"]

_LIVE_DEFAULTS: dict[str, Any] = {"time_scale": 1.0, "token_scale": 1.0, "live_vocab": 256,
                                  "api_key": None}
_BENCH_SERVERS = "1,16,64"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a session trace: the SCT benchmark",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="trace file: our JSONL, the shared real-trace JSONL, a "
                   "Mooncake JSONL with sessions, or CSV (default: the shipped 30-session trace)")
    p.add_argument("--servers", type=positive_int, default=1,
                   help="instances; the trace is replicated this many times (default 1)")
    p.add_argument("--server", default="h200x8",
                   help="server preset (h200x8 | h100x8) or a server JSON file (talaria calibrate)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size of an instance")
    p.add_argument("--policies", help="comma-separated policies (default: all)")
    p.add_argument("--json", dest="json_path", help="write the results as JSON here")
    p.add_argument("--plot", help="write the SCT distributions as a PNG here (and the "
                   "sweeps next to it as *_sweep.png)")
    p.add_argument("--sweep", action="store_true", help="also run the load and quantum sweeps")
    p.add_argument("--tune", action="store_true",
                   help="run every policy over its grid of slot-closing rules and quanta, "
                   "keep each one's best and write them to --settings (with --policies: "
                   "only those rows; the other rows' and the ideal bound's cached settings "
                   "for this trace and cluster are kept)")
    p.add_argument("--settings", default=None,
                   help="tuned settings file (default: workloads/data/tuned_settings.json)")
    p.add_argument("--fixed-settings", action="store_true",
                   help="run every row at the settings in --settings even when they were "
                   "tuned on another trace or cluster (the default trace's: fixed once, "
                   "not tuned for this one); the ideal bound keeps their schedules too")
    p.add_argument("--quanta", default=None, help="slot quanta for the sweeps and for --tune's "
                   "grids, e.g. 5,10,30 (default: the sweep's and each grid's own)")
    p.add_argument("--load-fractions", default=None,
                   help="Poisson rates as fractions of saturation, e.g. 0.25,0.5,1")
    p.add_argument("--workers", type=positive_int, default=2, help="processes (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float_at_least(0), default=1.0,
                   help="Zipf skew when a trace's models must be assigned catalog models")
    p.add_argument("--block-size", type=positive_int, default=128,
                   help="simulated KV block size (default 128: half the engine default's "
                   "bookkeeping; prefix reuse granular to 128 tokens)")
    p.add_argument("--fused-steps", type=positive_int, default=8,
                   help="simulated decode steps fused into one engine step")
    p.add_argument("--cut-fused-steps", action="store_true",
                   help="a call reaching an instance ends a fused decode step at the next step "
                   "boundary (engine.sim.fused): no arrival waits for fusion, so more steps "
                   "may fuse (e.g. --fused-steps 32) at the same fidelity; off by default, as "
                   "the cached tuned settings were chosen without it. With --bench-sim: each "
                   "server count also runs the default fusion first, for the ratio")
    p.add_argument("--no-staging", action="store_true",
                   help="drop the staging region from every policy (servers too small to "
                   "hold two copies of a model shard, e.g. h100x8 with qwen3-235b)")
    p.add_argument("--sleep-efficiency", type=float_above(0), default=None,
                   help="sleep/wake rate of the vLLM/SGLang peers as a fraction of a plain "
                   "host copy's here (default: vLLM's measured rate, 0.85 of it for a wake; "
                   "1.0: no dearer than the substrate's copy)")
    p.add_argument("--aegaeon-fixed-s", type=float_at_least(0), default=None,
                   help="Aegaeon's fixed cost per switch beyond the weight copy (default 0.15 s, "
                   "an assumption inside the paper's 'sub-second'): its sensitivity")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--strip-session-ids", action="store_true",
                   help="replay the first policy (default talaria) with session ids sent and "
                   "withheld (the router infers them): prints the calls matched and both SCTs")
    p.add_argument("--shared-prefix", type=int_at_least(0), default=0, metavar="TOKENS",
                   help="with --strip-session-ids: every session's first prompt starts with "
                   "this many shared tokens (an agent's system prompt and tools)")
    p.add_argument("--bench-sim", action="store_true",
                   help="benchmark the simulator instead: the first policy (default talaria) "
                   "on the trace replicated onto each of --bench-servers, each run in its own "
                   "process; prints simulated calls per second (wall and CPU) and peak RSS")
    p.add_argument("--bench-servers", default=_BENCH_SERVERS,
                   help="with --bench-sim: server counts, e.g. 1,16,64 (default)")
    day_cli.add_arguments(p)
    p.add_argument("--live", metavar="URL", help="replay against the router at URL instead")
    p.add_argument("--time-scale", type=float_at_least(0), default=_LIVE_DEFAULTS["time_scale"],
                   help="live: multiply arrivals and tool gaps by this")
    p.add_argument("--token-scale", type=float_above(0), default=_LIVE_DEFAULTS["token_scale"],
                   help="live: multiply token counts by this (calls beyond the context drop)")
    p.add_argument("--live-vocab", type=int_at_least(2), default=_LIVE_DEFAULTS["live_vocab"],
                   help="live: prompt token ids are drawn from [1, this)")
    p.add_argument("--max-sessions", type=positive_int, default=None, help="use the first N sessions")
    p.add_argument("--api-key", default=_LIVE_DEFAULTS["api_key"],
                   help="live: bearer key of the router")
    suite_cli.add_arguments(p)
    p.set_defaults(func=run_replay_command)


def _floats(text: str | None, default: tuple[float, ...], what: str) -> tuple[float, ...]:
    if text is None:
        return default
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{what} must be numbers > 0, got {text!r}")
    return values


def run_replay_command(args: argparse.Namespace) -> int:
    import structlog

    from workloads.replay.jobs import quiet_logs

    saved = structlog.get_config()
    quiet_logs()
    try:
        return _run(args)
    finally:
        structlog.configure(**saved)


def _run(args: argparse.Namespace) -> int:
    for out in (args.json_path, args.plot, args.tune and args.settings):  # now, not in an hour
        if out:
            check_output_path(out)
    suite_cli.check_suite_flags(args)  # each refused before the default trace's table
    day_cli.check_day_flags(args)
    _check_mode_flags(args)
    if args.develop:
        return _develop(args)
    if args.day is not None:
        return day_cli.run_day_command(args)
    if args.dev_traces is not None or args.dev_draws != 1:
        raise ValueError("--dev-traces and --dev-draws go with --develop")
    if args.trace:
        from workloads.traces.readers import load_any_trace

        sessions = load_any_trace(args.trace)
    else:
        from workloads.traces.generator import default_trace

        sessions = default_trace()
    if args.max_sessions is not None:
        sessions = sessions[: args.max_sessions]
    if args.live:
        return _live(args, sessions)
    return _simulate(args, sessions)


def _check_mode_flags(args: argparse.Namespace) -> None:
    """A flag of one mode without that mode would be ignored without a word: refused."""
    if not args.live and any(getattr(args, k) != v for k, v in _LIVE_DEFAULTS.items()):
        raise ValueError("--time-scale, --token-scale, --live-vocab and --api-key go with --live")
    if not args.bench_sim and args.bench_servers != _BENCH_SERVERS:
        raise ValueError("--bench-servers goes with --bench-sim")
    if not args.strip_session_ids and args.shared_prefix:
        raise ValueError("--shared-prefix goes with --strip-session-ids")


def _develop(args: argparse.Namespace) -> int:
    """``--develop``: variants of Talaria on the development scenarios (the baseline's bursts
    at its default-trace setting set the Poisson rates, as in the suite)."""
    from workloads.benchmark.report import write_json
    from workloads.benchmark.tuning import TUNED_PATH
    from workloads.replay.cluster import ClusterSpec

    if args.dev_draws < 1:
        raise ValueError(f"--dev-draws must be >= 1, got {args.dev_draws}")
    spec = ClusterSpec(server=args.server, tp=args.tp, block_size=args.block_size,
                       max_fused_decode_steps=args.fused_steps,
                       cut_fused_steps=args.cut_fused_steps)
    path = Path(args.settings) if args.settings else TUNED_PATH
    baseline = suite_cli.default_trace_settings(spec, path)["baseline"]
    text, data = suite_cli.run_develop(args, spec, baseline)
    print(text)
    if args.json_path:
        write_json(data, args.json_path)
    return 0


def _live(args: argparse.Namespace, sessions: list[Any]) -> int:
    from workloads.benchmark.plot import plot_sct
    from workloads.benchmark.report import benchmark, format_table, to_json, write_json
    from workloads.replay.driver import replicate
    from workloads.replay.live import run_live_replay

    sessions = replicate(sessions, args.servers)
    result, info = run_live_replay(
        sessions, args.live, time_scale=args.time_scale, token_scale=args.token_scale,
        vocab_size=args.live_vocab, seed=args.seed, progress=not args.no_progress,
        api_key=args.api_key, skew=args.skew,
    )
    setup = {"target": args.live, "sessions": len(sessions), "time_scale": args.time_scale,
             "token_scale": args.token_scale, **info}
    bench = benchmark([result], setup=setup)
    print(f"live replay of {len(sessions)} sessions against {args.live} "
          f"({info['dropped_calls']} calls dropped to fit the context, {info['retries']} "
          "calls re-sent after a failure)")
    print(format_table(bench))
    if args.json_path:
        write_json(to_json(bench), args.json_path)
    if args.plot and not plot_sct([result], args.plot):
        print("(plot skipped: matplotlib is not installed)", file=sys.stderr)
    return 1 if result.failed_calls else 0


def _simulate(args: argparse.Namespace, sessions: list[Any]) -> int:
    from workloads.benchmark.report import (
        BASELINE,
        benchmark,
        format_breakdown,
        format_table,
        to_json,
        write_json,
    )
    from workloads.benchmark.sweep import (
        DEFAULT_LOAD_FRACTIONS,
        DEFAULT_QUANTA,
        Job,
        best_quantum,
        run_load_sweep,
        run_many,
        run_quantum_sweep,
    )
    from workloads.benchmark.sweep_report import format_sweep, regime_summary, sweep_json
    from workloads.benchmark.tuning import (
        TUNE_COMMAND,
        TUNED_PATH,
        apply_settings,
        best_ideal,
        ideal_candidates,
        load_settings,
        save_settings,
        setup_key,
        tune,
    )
    from workloads.replay.cluster import ClusterSpec
    from workloads.replay.driver import replicate
    from workloads.replay.systems import ABLATIONS, PLACEMENT_ROW, check_fits, parse_policies
    from workloads.traces.assignment import assign_models, bundled_contexts

    wall = time.perf_counter()
    systems = parse_policies(args.policies)
    if args.policies is None and args.servers == 1:
        # One server is one instance: placement has nothing to choose, so this row would
        # equal talaria by construction. It is in the table at --servers > 1.
        systems = [s for s in systems if s.name != PLACEMENT_ROW]
    if args.no_staging:
        systems = [s.without_staging() for s in systems]
    if args.sleep_efficiency is not None:
        systems = [replace(s, sleep_wake_efficiency=args.sleep_efficiency)
                   if s.switch == "sleep_wake" else s for s in systems]
    if args.aegaeon_fixed_s is not None:
        systems = [replace(s, scale_up_fixed_s=args.aegaeon_fixed_s)
                   if s.switch == "scale_up" else s for s in systems]
    spec = ClusterSpec(servers=args.servers, server=args.server, tp=args.tp,
                       block_size=args.block_size, max_fused_decode_steps=args.fused_steps,
                       cut_fused_steps=args.cut_fused_steps)
    for s in systems:
        check_fits(s, s.engine_config(spec.server, spec.tp, block_size=spec.block_size),
                   spec.models)
    settings_path = Path(args.settings) if args.settings else TUNED_PATH
    if args.trace is None and args.policies is None and args.servers == 1:  # the suite runs
        suite_cli.check_settings_seed(args, spec, settings_path)
    quanta = _floats(args.quanta, DEFAULT_QUANTA, "--quanta")
    fractions = _floats(args.load_fractions, DEFAULT_LOAD_FRACTIONS, "--load-fractions")
    catalog = list(spec.models)
    if any(s.model not in catalog for s in sessions):
        sessions = assign_models(sessions, catalog, skew=args.skew, seed=args.seed,
                                 contexts=bundled_contexts(catalog))
        print(f"note: trace models are not in the catalog; assigned {catalog} with Zipf "
              f"skew {args.skew}", file=sys.stderr)
    if args.bench_sim:
        return _bench_sim(args, sessions, systems, spec)
    sessions = replicate(sessions, args.servers)
    progress = not args.no_progress
    if args.strip_session_ids:
        from workloads.replay.session_check import check_inference, format_check

        chosen = systems[0] if args.policies else parse_policies("talaria")[0]
        check = check_inference(sessions, chosen, spec, seed=args.seed,
                                shared_prefix_tokens=args.shared_prefix, progress=progress)
        print(format_check(check))
        return 1 if check.with_ids.failed_calls or check.without_ids.failed_calls else 0
    calls = sum(s.num_calls for s in sessions)
    print(f"replay: {len(sessions)} sessions, {calls} calls on {args.servers} x {args.server} "
          f"(TP={args.tp}), models {catalog}", flush=True)
    key = setup_key(sessions, spec, args.seed)
    if args.tune:
        kept = load_settings(key, settings_path) if args.policies else None
        tuned = tune(sessions, systems, spec, seed=args.seed, workers=args.workers,
                     progress=progress, quanta=quanta if args.quanta else None,
                     with_ideal=kept is None or not kept.ideal)
        if kept is not None:
            tuned = kept.merged(tuned)
        save_settings(tuned, key, settings_path)
        print(f"wrote the tuned settings to {settings_path}")
        source = f"tuned now (redo: {TUNE_COMMAND})"
    else:
        tuned = load_settings(key, settings_path)
        source = (f"tuned, from {settings_path} (redo: {TUNE_COMMAND})" if tuned else
                  f"each policy's own, ideal untuned (no tuned settings for this trace and "
                  f"cluster in {settings_path}; {TUNE_COMMAND} makes them)")
        fixed = load_settings(None, settings_path) if tuned is None and args.fixed_settings \
            else None
        if fixed is not None:
            tuned = fixed
            source = (f"fixed: tuned on another trace or cluster, from {settings_path}, "
                      "not for this one")
    systems = apply_settings(systems, tuned.settings if tuned else {})
    candidates, family = ideal_candidates(tuned)
    jobs = [Job(s.name, tuple(sessions), s, spec, args.seed) for s in systems]
    jobs.append(Job("__lower_bound__", tuple(sessions), None, spec, args.seed))
    for schedule in candidates:
        jobs.append(Job(("__ideal__", schedule), tuple(sessions), None, spec, args.seed,
                        ideal=schedule))
    done = run_many(jobs, args.workers, progress)
    lower = done.pop("__lower_bound__")
    ideals = best_ideal({s: done[("__ideal__", s)] for s in candidates})
    ideal = {key: done[("__ideal__", s)] for key, s in ideals.items()}
    ideal_setting: dict[str, Any] = {key: {"schedule": s.name} for key, s in ideals.items()}
    ideal_setting["family"] = family
    results = [done[s.name] for s in systems]
    extra: dict[str, Any] = {}
    best: dict[str, Any] = {}
    sweeps = []
    if args.sweep:
        qsweep = run_quantum_sweep(sessions, spec, quanta, [s for s in systems if s.name in ABLATIONS],
                                   seed=args.seed, workers=args.workers, progress=progress)
        lsweep = run_load_sweep(sessions, systems, spec, fractions, seed=args.seed,
                                workers=args.workers, progress=progress,
                                all_at_once={r.policy: r for r in results}
                                if all(s.arrival_s == 0 for s in sessions) else None)
        sweeps = [lsweep, qsweep]
        if any(s.name == BASELINE for s in systems):
            best = best_quantum(qsweep)
        extra["sweeps"] = {"load": sweep_json(lsweep), "quantum": sweep_json(qsweep)}
    setup = {"trace": args.trace or "default", "sessions": len(sessions), "calls": calls,
             "servers": args.servers, "server": args.server, "tp": args.tp,
             "models": catalog, "block_size": args.block_size,
             "fused_decode_steps": args.fused_steps, "seed": args.seed,
             "cut_fused_steps": args.cut_fused_steps,
             "no_staging": args.no_staging, "sleep_efficiency": args.sleep_efficiency,
             "aegaeon_fixed_s": args.aegaeon_fixed_s,
             "settings": source}
    from workloads.bounds.bound import lower_bound

    bench = benchmark(results, lower, best, setup, ideal=ideal, bound=lower_bound(sessions, spec),
                      settings={**{s.name: s.setting for s in systems}, "ideal": ideal_setting})
    print(format_table(bench))
    print()
    print(format_breakdown(bench))
    print(f"\nsettings: {source}")
    for sweep in sweeps:
        print()
        print(format_sweep(sweep))
    if sweeps:
        print()
        print(regime_summary(sweeps[0]))
    if args.trace is None and args.policies is None and args.servers == 1:
        fallback = suite_cli.default_trace_settings(spec, settings_path, args.fixed_settings)
        suite = suite_cli.run_from_args(args, spec, fallback)
        if suite is not None:
            print()
            print(suite[0])
            extra.update(suite[1])
    if args.json_path:
        write_json(to_json(bench, extra), args.json_path)
        print(f"wrote {args.json_path}")
    if args.plot:
        _plots(args.plot, results, [ideal["p50"], lower], bench, sweeps)
    print(f"wall {time.perf_counter() - wall:.1f} s", file=sys.stderr)
    failed = sum(r.failed_calls for r in [*results, lower, *ideal.values()])
    return 1 if failed else 0


def _bench_sim(args: argparse.Namespace, sessions: list[Any], systems: list[Any],
               spec: Any) -> int:
    from workloads.benchmark.tuning import apply_settings, load_settings
    from workloads.replay.cluster import ClusterSpec
    from workloads.replay.sim_bench import bench_sim, parse_server_counts
    from workloads.replay.systems import parse_policies

    servers = parse_server_counts(args.bench_servers, "--bench-servers")
    chosen = systems[0] if args.policies else parse_policies("talaria")[0]
    tuned = load_settings(None, Path(args.settings)) if args.settings else load_settings(None)
    chosen = apply_settings([chosen], tuned.settings if tuned else {})[0]
    calls = sum(s.num_calls for s in sessions)
    print(f"simulator speed: {chosen.name} at {chosen.setting}, {len(sessions)} sessions "
          f"({calls} calls) per server, replicated onto {servers} servers of {args.server} "
          "(one process per run)", flush=True)
    reference = None
    if spec.cut_fused_steps:  # against the default fusion, in the same run
        reference = replace(spec, cut_fused_steps=False,
                            max_fused_decode_steps=ClusterSpec().max_fused_decode_steps)
        print(f"each server count twice: the reference (fused steps "
              f"{reference.max_fused_decode_steps}, uncut), then this spec (fused steps "
              f"{spec.max_fused_decode_steps}, cut by arrivals)", flush=True)
    rows = bench_sim(sessions, chosen, spec, servers, seed=args.seed, reference=reference)
    return 1 if any(r.failed_calls for r in rows) else 0


def _plots(path_text: str, results: list[Any], bounds: list[Any], bench: Any,
           sweeps: list[Any]) -> None:
    from workloads.benchmark.plot import plot_breakdown, plot_sct
    from workloads.benchmark.sweep_report import plot_sweeps

    path = Path(path_text)
    if not plot_sct(results, path, bounds):
        print("(plots skipped: matplotlib is not installed)", file=sys.stderr)
        return
    split_path = path.with_name(path.stem + "_split" + path.suffix)
    plot_breakdown(bench, split_path)
    print(f"wrote {path} and {split_path}")
    if sweeps:
        sweep_path = path.with_name(path.stem + "_sweep" + path.suffix)
        plot_sweeps(sweeps, sweep_path)
        print(f"wrote {sweep_path}")
