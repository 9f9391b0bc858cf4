"""Argument parsing for `talaria serve`, `talaria instance` and `talaria router`.

The router app factory is passed in by the composition root (``talaria.cli``), the one
module of ``talaria`` that may import ``router``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from talaria.serving.serve import RouterFactory

__all__ = ["add_serve_commands"]


def add_serve_commands(sub: argparse._SubParsersAction, router_factory: RouterFactory) -> None:
    p = sub.add_parser("serve", help="run the router and one process per instance")
    p.add_argument("--config", help="TOML serve config (default: SmolLM2-135M-Instruct and the "
                   "tiny models, one CPU instance)")
    p.add_argument("--port", type=int, help="router port (overrides [router].port; 0: free)")
    p.add_argument("--tiny-only", action="store_true",
                   help="without --config: serve the tiny models alone, not SmolLM2-135M")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=lambda a: _serve(a, router_factory))

    p = sub.add_parser("instance", help="run one instance of a serve config")
    p.add_argument("--config", required=True, help="TOML (or JSON) serve config")
    p.add_argument("--id", required=True, help="which [[instances]] entry to run")
    p.add_argument("--ready-file", help="write {id, pid, url} here once serving")
    p.add_argument("--parent-pid", type=int, help="exit when this process exits")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT (`talaria serve` holds the port reserved)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_instance)

    p = sub.add_parser("router", help="run the router alone over running instances")
    p.add_argument("--config", required=True, help="TOML serve config (instance ports fixed)")
    p.add_argument("--port", type=int, help="router port (overrides [router].port)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=lambda a: _router(a, router_factory))


def _serve(args: argparse.Namespace, router_factory: RouterFactory) -> int:
    from talaria.log_setup import configure_logging
    from talaria.serving.config import load_serve_config
    from talaria.serving.serve import serve

    configure_logging(args.log_level, process="serve")
    config = load_serve_config(args.config, real_model=not args.tiny_only)
    if args.port is not None:
        config.router.port = args.port
        config.with_defaults()  # re-validates the port
    return serve(config, router_factory, log_level=args.log_level)


def _instance(args: argparse.Namespace) -> int:
    from talaria.log_setup import configure_logging
    from talaria.serving.config import load_serve_config
    from talaria.serving.instance_main import die_with_parent, run_instance

    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    configure_logging(args.log_level, process="instance", instance=args.id)
    config = load_serve_config(args.config, instance_id=args.id)
    ready = Path(args.ready_file) if args.ready_file else None
    return run_instance(config, args.id, ready, args.reuse_port, announce=args.parent_pid is None)


def _router(args: argparse.Namespace, router_factory: RouterFactory) -> int:
    from talaria.log_setup import configure_logging
    from talaria.serving.config import load_serve_config
    from talaria.serving.serve import run_router

    configure_logging(args.log_level, process="router")
    config = load_serve_config(args.config)
    if args.port is not None:
        config.router.port = args.port
        config.with_defaults()
    return run_router(config, router_factory)
