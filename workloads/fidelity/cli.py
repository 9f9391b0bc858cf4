"""``talaria fidelity`` (behind ``make fidelity``): the simulator checked against the live
engine on this machine.

1. Step time, in ``--rounds`` rounds (``talaria.bench.fidelity_rounds``), one process, one
   torch thread setting: ``talaria calibrate``, then the cost model with that calibration
   against the live engine's measured steps (``talaria.bench.step_fidelity``). The spec
   kept is each constant's median over the rounds, written to ``--server`` (default
   ``cpu_server.json``) with the conditions it was measured under; the error is each
   point's median step over the rounds priced with it; the spread says how far the rounds
   were apart.
2. Replay: the same small trace live (``talaria serve`` per policy + the live replay client)
   and simulated with that spec (``workloads.fidelity.replays``): SCT p50 / p95 per policy, the
   counts both sides report, and the ranking of the policies on each side.
3. The real model (unless ``--no-real-model``): steps 1 and 2 again with SmolLM2-135M-Instruct,
   which the calibration never saw, its step times in their own table and the replay with the
   dense model's sessions on it (``--real-policies``, default talaria).
With ``--skip-steps`` the replay reuses ``--server`` only if it was measured under this
machine's present conditions (``talaria.bench.calibration_conditions``; ``--recalibrate``:
never), else calibrates once first. Prints one closing table (``workloads.fidelity.summary``:
the errors, the spread, what the other processes used of the CPUs and the load during the
run, the ranking live and simulated) and writes ``--json`` (default ``fidelity.json``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from talaria.arg_types import check_output_path
from workloads.fidelity.replays import ReplaySetup

__all__ = ["check_args", "register", "run_fidelity_command"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="the simulator against the live engine on this machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="cpu_server.json",
                   help="where the calibrated server spec is written (and read with "
                        "--skip-steps when its conditions hold)")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --skip-steps: calibrate even if --server holds")
    p.add_argument("--rounds", type=int, default=3,
                   help="calibration + step-time rounds (default 3)")
    p.add_argument("--json", dest="json_path", default="fidelity.json",
                   help="where the results are written (default fidelity.json)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps per step-time point (default 3)")
    p.add_argument("--policies", default="baseline,+host_kv,talaria",
                   help="comma-separated policies replayed live and simulated: presets "
                   "talaria serve runs (default baseline,+host_kv,talaria)")
    p.add_argument("--sessions", type=int, default=ReplaySetup.sessions,
                   help=f"sessions of the replay (default {ReplaySetup.sessions})")
    p.add_argument("--kv-blocks", type=int, default=ReplaySetup.kv_blocks,
                   help=f"KV blocks per model on both sides (default {ReplaySetup.kv_blocks}; "
                        "fewer puts the KV under pressure)")
    p.add_argument("--skip-steps", action="store_true", help="no step-time comparison")
    p.add_argument("--skip-replay", action="store_true", help="no replay comparison")
    p.add_argument("--no-real-model", action="store_true",
                   help="leave out the run with the real model (SmolLM2-135M-Instruct)")
    p.add_argument("--real-policies", default="talaria",
                   help="policies of the real model's replay (default talaria)")
    p.add_argument("--real-model-only", action="store_true",
                   help="only the run with the real model (after calibrating if needed)")
    p.set_defaults(func=run_fidelity_command)


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything is measured or written: a run takes most of an
    hour, and its policies are served live (a ``talaria serve`` preset) and simulated."""
    from talaria.policies.config import PRESETS
    from workloads.replay.systems import system

    for flag in ("rounds", "threads", "repeats", "sessions", "kv_blocks"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag, text in (("--policies", args.policies), ("--real-policies", args.real_policies)):
        for name in (p.strip() for p in text.split(",")):
            try:
                system(name)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
            if name not in PRESETS:
                raise ValueError(f"{flag}: {name!r} cannot be served live (talaria serve's "
                                 f"presets: {', '.join(PRESETS)})")
    if args.real_model_only and args.no_real_model:
        raise ValueError("--real-model-only and --no-real-model leave nothing to run")
    if args.skip_steps and args.skip_replay:  # the real model's run skips both too
        raise ValueError("--skip-steps and --skip-replay leave nothing to compare (talaria "
                         "calibrate measures the server spec alone)")
    for out in (args.json_path, args.server):
        check_output_path(out)


def run_fidelity_command(args: argparse.Namespace) -> int:
    import structlog
    import torch

    from talaria.bench.machine_load import CpuUse, LoadWatch, cpu_sample
    from workloads.fidelity.summary import failed_calls, format_summary
    from workloads.replay.jobs import quiet_logs

    check_args(args)
    wall = time.perf_counter()
    saved_logs = structlog.get_config()
    quiet_logs()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    from talaria.bench.timing import clock_for

    out: dict[str, Any] = {"threads_per_rank": args.threads, "rounds": args.rounds,
                           "cpus": os.cpu_count() or 1, "clock": clock_for(args.threads).name,
                           "load_average": {"start": _load()}, "cpu_use": {}}
    start = cpu_sample()
    try:
        with LoadWatch() as watch:
            spec_path = Path(args.server)
            if not args.skip_steps and not args.real_model_only:
                out["step_time"] = _step_time(spec_path, args)
                out["load_average"]["after_step_time"] = _load()
            else:
                out["calibration"] = _reuse_or_calibrate(spec_path, args)
            steps_done = cpu_sample()
            out["cpu_use"]["calibration_and_steps"] = CpuUse.between(start, steps_done).to_dict()
            out["server"] = str(spec_path)
            if not args.skip_replay and not args.real_model_only:
                setup = ReplaySetup(sessions=args.sessions, kv_blocks=args.kv_blocks)
                out["replay"], out["cpu_use"]["replay"] = _replay(
                    spec_path, args.policies.split(","), args.threads, setup)
                out["load_average"]["after_replay"] = _load()
            if not args.no_real_model:
                out["real_model"] = _real_model_run(spec_path, args)
                out["load_average"]["after_real_model"] = _load()
        out["load_watch"] = watch.summary()
    finally:
        torch.set_num_threads(saved_threads)
        structlog.configure(**saved_logs)
    out["cpu_use"]["run"] = CpuUse.between(start, cpu_sample()).to_dict()
    out["wall_s"] = round(time.perf_counter() - wall, 1)
    Path(args.json_path).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print("\n" + format_summary(out))
    print(f"\nwrote {args.json_path} and {args.server}")
    return 1 if failed_calls(out) else 0


def _step_time(spec_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from engine.sim.model_spec import ModelSpec
    from talaria.bench.calibrate import calibrate_here, write_spec
    from talaria.bench.calibration_conditions import current_conditions
    from talaria.bench.fidelity_rounds import (
        format_spread,
        median_server,
        pooled_results,
        run_rounds,
        spread,
    )
    from talaria.bench.step_fidelity import (
        PointResult,
        default_cases,
        format_table,
        price,
        run_cases,
        summarize,
    )
    from talaria.bench.timing import clock_for
    from talaria.paths import ensure_tiny_models

    def log(line: str) -> None:
        print(line, flush=True)

    def priced(results: Sequence[PointResult], server: Any) -> list[PointResult]:
        case = results[0].case
        spec = ModelSpec.from_hf_config(ensure_tiny_models(case.size)[case.model], case.model)
        return price(case, spec, [r.measured for r in results], server)

    conditions = current_conditions(args.threads, clock_for(args.threads).name)
    print(f"== {args.rounds} rounds of calibration + step time (load average {_load()})",
          flush=True)
    rounds = run_rounds(
        args.rounds, lambda: calibrate_here(args.threads, log=log),
        lambda server: run_cases(default_cases(), server, ensure_tiny_models,
                                 repeats=args.repeats, log=log), log=log)
    server = median_server([r.server for r in rounds])
    gap = spread(rounds)
    info = {**rounds[-1].info, "conditions": conditions.to_dict(), "rounds": args.rounds,
            "per_round": [r.info for r in rounds], "constant_spread": gap["constant_spread"]}
    write_spec(server, info, spec_path)
    pooled = pooled_results(rounds, server, priced)
    print(f"\n== step time over {args.rounds} rounds: each point's median step, priced with "
          f"the median calibration ({spec_path})")
    print(format_table(pooled))
    print(format_spread(gap))
    return {**summarize(pooled), "spread": gap}


def _reuse_or_calibrate(spec_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from talaria.bench.calibrate import calibrate_here, write_spec
    from talaria.bench.calibration_conditions import current_conditions, reusable_spec
    from talaria.bench.timing import clock_for

    now = current_conditions(args.threads, clock_for(args.threads).name)
    reasons = ["--recalibrate"] if args.recalibrate else reusable_spec(spec_path, now)
    if not reasons:
        print(f"== reusing {spec_path}: measured under this machine's present conditions")
        return {"reused": True, "reasons": []}
    print(f"== calibrating this machine (load average {_load()}): not reusing {spec_path}: "
          + "; ".join(reasons), flush=True)
    server, info = calibrate_here(args.threads, log=lambda line: print(line, flush=True))
    write_spec(server, info, spec_path)
    return {"reused": False, "reasons": reasons}


def _real_model_run(spec_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Step time and replay with SmolLM2-135M-Instruct, apart from the tiny models' tables
    (the calibration never saw it: this is where the spec is checked off its fitting set)."""
    from substrate.devices import load_server
    from talaria.bench.step_fidelity import format_table, real_model_cases, run_cases, summarize
    from talaria.paths import ensure_tiny_models
    from talaria.real_model import CATALOG_NAME, ensure_real_model, missing_reason
    from workloads.fidelity.replays import real_model_map

    path = ensure_real_model()
    if path is None:
        print(f"\n== the real model's run: skipped, {missing_reason()}")
        return {"skipped": missing_reason()}
    out: dict[str, Any] = {"model": CATALOG_NAME}
    if not args.skip_steps:
        print(f"\n== step time on {CATALOG_NAME}: predicted vs measured (load average "
              f"{_load()})", flush=True)
        results = run_cases(real_model_cases(CATALOG_NAME), load_server(spec_path),
                            lambda _size: {CATALOG_NAME: path}, repeats=args.repeats,
                            log=lambda line: print(line, flush=True))
        print(format_table(results))
        out["step_time"] = summarize(results)
    if not args.skip_replay:
        small = ensure_tiny_models("small")
        models = {"tiny-qwen3-moe": small["tiny-qwen3-moe"], "tiny-qwen3": small["tiny-qwen3"],
                  CATALOG_NAME: path}
        setup = ReplaySetup(sessions=args.sessions, kv_blocks=args.kv_blocks)
        out["replay"], out["cpu_use"] = _replay(spec_path, args.real_policies.split(","),
                                                args.threads, setup, models,
                                                real_model_map(CATALOG_NAME))
    return out


def _replay(
    spec_path: Path, policies: list[str], threads: int, setup: ReplaySetup,
    models: dict[str, Path] | None = None, model_map: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    from engine.sim.model_spec import ModelSpec
    from talaria.bench.machine_load import CpuUse, cpu_sample
    from talaria.paths import ensure_tiny_models
    from workloads.fidelity.replays import (
        MODEL_MAP,
        compare,
        fidelity_trace,
        format_replay_table,
        replay_pair,
    )

    models = models if models is not None else ensure_tiny_models("small")
    catalog = {name: ModelSpec.from_hf_config(path, name) for name, path in models.items()}
    sessions = fidelity_trace(setup, catalog, model_map if model_map is not None else MODEL_MAP)
    print(f"\n== replay on {', '.join(models)}: {len(sessions)} sessions, "
          f"{sum(s.num_calls for s in sessions)} calls, "
          f"tokens x{setup.token_scale}, time x{setup.time_scale}, {setup.kv_blocks} KV "
          f"blocks per model, live and simulated "
          f"(load average {_load()})", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    use: dict[str, Any] = {}
    for policy in (p.strip() for p in policies):
        before = cpu_sample()
        live, simulated = replay_pair(setup, policy, sessions, server=str(spec_path),
                                      models=models, threads=threads,
                                      log=lambda line: print(line, flush=True))
        use[policy] = CpuUse.between(before, cpu_sample()).to_dict()
        rows[policy] = compare(live, simulated)
    print(format_replay_table(rows))
    return {"rows": rows, "sessions": len(sessions)}, use
