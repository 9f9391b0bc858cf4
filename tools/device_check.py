"""The live replay on a GPU against the simulator (one part of a device session's check;
``tools/device_check.sh`` runs it after ``tests/gpu`` and ``make bench``).

The fidelity replay (``workloads.fidelity.replays``: the first sessions of the default
trace scaled to the small tiny models) served live by ``talaria serve`` with its one
instance on ``--device``, and simulated with ``--server``'s physics (default h200x8, the
preset every simulated row of ``make replay`` runs on, at TP=1). Prints the live and
simulated SCT p50 / p95 per policy and what each side counted, and writes ``--json``.

Run: ``PYTHONPATH=. python3 tools/device_check.py --device cuda:0``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import orjson

from engine.sim.model_spec import ModelSpec
from talaria.paths import ensure_tiny_models
from workloads.fidelity.replays import (
    ReplaySetup,
    compare,
    fidelity_trace,
    format_replay_table,
    replay_pair,
)
from workloads.replay.jobs import quiet_logs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--server", default="h200x8")
    parser.add_argument("--policies", default="baseline,talaria")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    quiet_logs()  # the simulated side's instances log every switch at info
    setup = ReplaySetup(sessions=args.sessions, time_scale=args.time_scale, device=args.device)
    models = ensure_tiny_models("small")
    catalog = {name: ModelSpec.from_hf_config(path, name) for name, path in models.items()}
    sessions = fidelity_trace(setup, catalog)
    print(f"live replay on {args.device} against the simulator's {args.server}: "
          f"{len(sessions)} sessions, {sum(s.num_calls for s in sessions)} calls, tokens "
          f"x{setup.token_scale}, time x{setup.time_scale}, small tiny models", flush=True)
    rows = {}
    start = time.perf_counter()
    for policy in args.policies.split(","):
        live, simulated = replay_pair(setup, policy, sessions, server=args.server,
                                      models=models)
        rows[policy] = compare(live, simulated)
    print(format_replay_table(rows))
    print(f"(replays took {time.perf_counter() - start:.0f} s)")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 1 if any(r["live_failed_calls"] for r in rows.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
