"""The `talaria` command: the composition root that wires every part together.

It is the one module of ``talaria`` allowed to import ``router`` and ``workloads``
(DESIGN.md section 3); each subcommand imports what it needs when it runs, so
``talaria --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CPU_SPEC_PATH = "cpu_server.json"  # where `talaria calibrate` writes this machine's spec


def _cmd_make_models(args: argparse.Namespace) -> int:
    from engine.models.tiny import make_tiny_models

    paths = make_tiny_models(Path(args.dir), size=args.size, seed=args.seed)
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.library:
        from talaria.demo import run_demo

        run_demo(size=args.size, max_tokens=24 if args.max_tokens is None else args.max_tokens)
        return 0
    from talaria.demo_agent import run_agent_demo

    return run_agent_demo(args.url, max_tokens=128 if args.max_tokens is None else args.max_tokens)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from talaria.bench.calibrate import run_calibrate_command

    return run_calibrate_command(args.out, args.threads)


def _router_app(config: Any, urls: dict[str, str]) -> Any:
    """The router app for a ServeConfig and the instances' URLs (wired here: the
    composition root is the one place in ``talaria`` that imports ``router``)."""
    from router.app import RouterConfig, create_app
    from router.cors import CorsConfig
    from router.instances.deadlines import Deadlines
    from router.limits import RouterLimits
    from router.sessions.identity import SessionHeaders

    r = config.router
    headers = SessionHeaders(session=tuple(r.session_headers)) if r.session_headers else SessionHeaders()
    return create_app(
        RouterConfig(
            models=config.model_paths(), instances=urls, policy=r.policy, api_key=r.api_key,
            max_body_bytes=r.max_body_bytes, poll_interval_s=r.poll_interval_s,
            block_size=config.engine.block_size,
            max_model_lens=config.max_model_lens(),
            instance_key=r.instance_key,
            limits=RouterLimits(
                max_inflight_calls=r.max_inflight_calls,
                max_session_id_chars=r.max_session_id_chars,
                max_sessions=r.max_sessions,
                body_timeout_s=r.body_timeout_s,
            ),
            deadlines=Deadlines(first_token_s=r.first_token_timeout_s, stall_s=r.stall_timeout_s),
            tool_formats={n: m.tool_format for n, m in config.models.items() if m.tool_format},
            reasoning_parsers={n: m.reasoning_parser for n, m in config.models.items() if m.reasoning_parser},
            session_headers=headers, infer_sessions=r.infer_sessions,
            max_tokens_overflow=r.max_tokens_overflow,
            max_tokens_overflows={n: m.max_tokens_overflow for n, m in config.models.items()
                                  if m.max_tokens_overflow},
            drain_timeout_s=config.longest_drain_s(),
            stream_commit_s=r.stream_commit_s if r.stream_commit_s >= 0 else None,
            stream_keepalive_s=r.stream_keepalive_s,
            cors=CorsConfig(tuple(r.cors_origins)),
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="talaria", description="Session-aware serving of LLMs for coding agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-models", help="write small random-weight HF checkpoints")
    p.add_argument("dir", help="directory to write the models into")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny",
                   help="tiny (default: 2 layers of width 64) or small (8 of 512)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    p.set_defaults(func=_cmd_make_models)

    p = sub.add_parser("demo", help="an agent session against talaria serve on SmolLM2-135M "
                       "(--library: generate from the tiny models with the engine library)")
    p.add_argument("--url", help="a running talaria serve's OpenAI base URL (default: start one)")
    p.add_argument("--library", action="store_true",
                   help="generate from the tiny random-weight models in-process, no server")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="with --library")
    p.add_argument("--max-tokens", type=int,
                   help="tokens per reply (default 128; with --library 24)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("calibrate", help="measure this machine as a server spec the simulator "
                       "loads (--server path.json)")
    p.add_argument("--out", default=CPU_SPEC_PATH, help=f"default {CPU_SPEC_PATH}")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.set_defaults(func=_cmd_calibrate)

    from talaria.serving.cli import add_serve_commands
    from workloads.fidelity.cli import register as add_fidelity_command
    from workloads.replay_cli import register as add_replay_command

    add_serve_commands(sub, _router_app)
    add_replay_command(sub)
    add_fidelity_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"talaria {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an address that does not answer, a path that is not a folder
        print(f"talaria {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
