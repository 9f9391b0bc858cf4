"""``talaria fidelity`` (behind ``make fidelity``): the simulator checked against the live
engine on this machine.

1. The server spec: ``--server FILE`` if it exists, else ``talaria calibrate`` now (written
   to FILE, default ``cpu_server.json``; ``--recalibrate`` measures again anyway).
2. Step time: the cost model with that spec against the live engine's measured steps
   (``talaria.bench.step_fidelity``): median and p90 relative error, by regime, the worst
   points and their terms.
3. Replay: the same small trace live (``talaria serve`` per policy + the live replay client)
   and simulated with that spec (``workloads.fidelity``): SCT p50 / p95 per policy, the
   counts both sides report, and the ranking of the policies on each side.
4. The real model (unless ``--no-real-model``): steps 2 and 3 again with SmolLM2-135M-Instruct,
   which the calibration never saw, its step times in their own table and the replay with the
   dense model's sessions on it (``--real-policies``, default talaria).
Prints both tables and writes ``--json`` (default ``fidelity.json``). Every timing carries
the load average it was measured under: on a shared machine they are noisy, so rerun it on
an idle one.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import orjson

from workloads.fidelity import ReplaySetup

__all__ = ["register", "run_fidelity_command"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="the simulator against the live engine on this machine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="cpu_server.json",
                   help="calibrated server spec (made now when the file does not exist)")
    p.add_argument("--recalibrate", action="store_true", help="calibrate even if --server exists")
    p.add_argument("--json", dest="json_path", default="fidelity.json")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per step-time point")
    p.add_argument("--policies", default="baseline,+host_kv,talaria")
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


def run_fidelity_command(args: argparse.Namespace) -> int:
    import structlog
    import torch

    from talaria.bench.calibrate import calibrate_here, write_spec
    from workloads.sweep import quiet_logs

    wall = time.perf_counter()
    saved_logs = structlog.get_config()
    quiet_logs()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"threads_per_rank": args.threads, "load_average": {"start": _load()}}
    try:
        spec_path = Path(args.server)
        if args.recalibrate or not spec_path.is_file():
            print(f"== calibrating this machine (load average {_load()})", flush=True)
            server, info = calibrate_here(args.threads)
            write_spec(server, info, spec_path)
            print(f"wrote {spec_path}", flush=True)
        out["server"] = str(spec_path)
        if not args.skip_steps and not args.real_model_only:
            out["step_time"] = _step_time(spec_path, args.repeats)
            out["load_average"]["after_step_time"] = _load()
        if not args.skip_replay and not args.real_model_only:
            setup = ReplaySetup(sessions=args.sessions, kv_blocks=args.kv_blocks)
            out["replay"] = _replay(spec_path, args.policies.split(","), args.threads, setup)
            out["load_average"]["after_replay"] = _load()
        if not args.no_real_model:
            out["real_model"] = _real_model_run(spec_path, args)
            out["load_average"]["after_real_model"] = _load()
    finally:
        torch.set_num_threads(saved_threads)
        structlog.configure(**saved_logs)
    out["wall_s"] = round(time.perf_counter() - wall, 1)
    Path(args.json_path).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(f"\nwrote {args.json_path}; wall {out['wall_s']:.0f} s; load average {_load()}")
    failed = sum(int(r["live_failed_calls"] + r["sim_failed_calls"])
                 for r in out.get("replay", {}).values())
    return 1 if failed else 0


def _step_time(spec_path: Path, repeats: int) -> dict[str, Any]:
    from substrate.devices import load_server
    from talaria.bench.step_fidelity import default_cases, format_table, run_cases, summarize
    from talaria.paths import ensure_tiny_models

    print(f"\n== step time: predicted vs measured (load average {_load()})", flush=True)
    results = run_cases(default_cases(), load_server(spec_path), ensure_tiny_models,
                        repeats=repeats, log=lambda line: print(line, flush=True))
    print(format_table(results))
    return summarize(results)


def _real_model_run(spec_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Step time and replay with SmolLM2-135M-Instruct, apart from the tiny models' tables
    (the calibration never saw it: this is where the spec is checked off its fitting set)."""
    from substrate.devices import load_server
    from talaria.bench.step_fidelity import format_table, real_model_cases, run_cases, summarize
    from talaria.paths import ensure_tiny_models
    from talaria.real_model import CATALOG_NAME, ensure_real_model, missing_reason
    from workloads.fidelity import real_model_map

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
        out["replay"] = _replay(spec_path, args.real_policies.split(","), args.threads, setup,
                                models, real_model_map(CATALOG_NAME))
    return out


def _replay(
    spec_path: Path, policies: list[str], threads: int, setup: ReplaySetup,
    models: dict[str, Path] | None = None, model_map: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    from engine.sim.model_spec import ModelSpec
    from talaria.paths import ensure_tiny_models
    from workloads.fidelity import (
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
    rows = {}
    for policy in policies:
        live, simulated = replay_pair(setup, policy.strip(), sessions, server=str(spec_path),
                                      models=models, threads=threads,
                                      log=lambda line: print(line, flush=True))
        rows[policy.strip()] = compare(live, simulated)
    print(format_replay_table(rows))
    return rows
