"""One instance process: build its multi-model engine, serve the instance app on its port.

``talaria instance`` runs this; ``talaria serve`` starts one such process per instance. The
engine starts its own tensor-parallel workers (if any) and stops them when it is shut down.
When the process is ready it writes ``ready_file`` (JSON: id, pid, url) atomically, so the
parent learns the port it got (port 0 picks a free one). SIGINT / SIGTERM drain and stop.
Every route of its API needs ``[router].instance_key``, or when the config has none the key
in the environment variable ``INSTANCE_KEY_ENV`` (how ``talaria serve`` passes the one it
generates; the variable is removed once read, so the engine's workers do not inherit it). When
the admission loop gives up (engine faults in a row) the process exits with status 1, and
when an engine operation wedges (the instance's watchdog, ``engine_op_timeout_s``) it exits
at once with status 1; either way its supervisor starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from talaria.clock import new_live_loop
from talaria.protocol.http import JsonErrorRunner
from talaria.serving.addresses import http_url
from talaria.serving.config import ConfigError, InstanceEntry, ServeConfig
from talaria.serving.signals import ShutdownSignals

if TYPE_CHECKING:
    from talaria.instance.instance import Instance

log = structlog.get_logger("talaria.serving.instance_main")

__all__ = ["INSTANCE_KEY_ENV", "build_engine", "run_instance", "die_with_parent"]

INSTANCE_KEY_ENV = "TALARIA_INSTANCE_KEY"


def build_engine(config: ServeConfig, entry: InstanceEntry) -> Any:
    """The instance's live MultiModelEngine over the whole catalog."""
    from engine.multi_model.engine import MultiModelConfig, MultiModelEngine
    from substrate.arena import ArenaAllocationError

    lens = {m.max_model_len for m in config.models.values()}
    kwargs: dict[str, Any] = dict(
        device=entry.device,
        dtype=config.engine.dtype,
        block_size=config.engine.block_size,
        kv_bytes=entry.kv_bytes,
        num_kv_blocks=entry.kv_blocks,
        host_kv_bytes=entry.host_kv_bytes,
        staging=entry.staging,
        staging_region=entry.staging_region,
        max_num_batched_tokens=config.engine.max_num_batched_tokens,
        max_num_seqs=config.engine.max_num_seqs,
        # One cap for the engine only when every model names the same; the server
        # enforces each model's own cap on every prompt.
        max_model_len=lens.pop() if len(lens) == 1 else None,
        attention_backend=config.engine.attention_backend,
        seed=config.engine.seed,
        cuda_graphs=config.engine.cuda_graphs,
    )
    accepted = {f.name for f in dataclasses.fields(MultiModelConfig)}
    if "tensor_parallel_size" in accepted:
        kwargs["tensor_parallel_size"] = entry.tensor_parallel_size
    elif entry.tensor_parallel_size != 1:
        raise ConfigError(
            f"instance {entry.id!r}: tensor_parallel_size={entry.tensor_parallel_size}, but this "
            "build's multi-model engine runs on one device only"
        )
    try:
        return MultiModelEngine(config.model_paths(), MultiModelConfig(**kwargs))
    except ArenaAllocationError as exc:
        raise ConfigError(f"instance {entry.id!r}: {exc}; its KV region is its [[instances]] "
                          f"{'kv_bytes' if entry.kv_bytes is not None else 'kv_blocks'}") from exc


def run_instance(
    config: ServeConfig, instance_id: str, ready_file: Path | None = None, reuse_port: bool = False,
    announce: bool = True,
) -> int:
    """Serve one instance until SIGINT/SIGTERM (a second one cuts its drain short); returns
    the exit status. ``reuse_port``: bind with SO_REUSEPORT, beside the socket by which
    `talaria serve` holds the port for it. ``announce``: say on stderr what each signal does
    (off under `talaria serve`, which says it for the whole server)."""
    from talaria.instance.instance import Instance
    from talaria.serving.instance_server import (
        InstanceServerSettings,
        create_instance_app,
        engine_limits,
    )

    entry = config.instance(instance_id)
    key = config.router.instance_key or os.environ.pop(INSTANCE_KEY_ENV, None)
    if not key:
        raise ConfigError(
            f"[router].instance_key is not set (nor {INSTANCE_KEY_ENV}): the instance's API needs "
            "the secret the router sends (`talaria serve` generates one; set it when starting "
            "instances by hand)"
        )
    log.info("instance.building", instance=instance_id, device=entry.device,
             models=list(config.models), tp=entry.tensor_parallel_size)
    engine = build_engine(config, entry)
    try:
        instance = Instance(instance_id, engine, config.policy_config())
        settings = InstanceServerSettings(
            limits=engine_limits(engine, config.max_model_lens()),
            drain_timeout_s=entry.drain_timeout_s,
            key=key,
            body_timeout_s=config.router.body_timeout_s,
        )
        app = create_instance_app(instance, settings)
        with asyncio.Runner(loop_factory=new_live_loop) as runner:
            failed = runner.run(_serve(app, entry, ready_file, instance, reuse_port, announce))
        if instance.hung.is_set() and instance.executor.busy is not None:
            # wedged while stopping (``Instance.stop``): the engine thread cannot be joined,
            # nor the engine shut down under it; leave without either
            log.error("instance.engine_wedged_exit", instance=entry.id)
            os._exit(1)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
    log.info("instance.exit", instance=instance_id, failed=failed)
    return 1 if failed else 0


async def _serve(
    app: web.Application, entry: InstanceEntry, ready_file: Path | None, instance: Instance,
    reuse_port: bool = False, announce: bool = True,
) -> bool:
    """Serve until a signal (returns False) or until the admission loop gives up (True)."""
    signals = ShutdownSignals(f"talaria instance {entry.id}", entry.drain_timeout_s,
                              announce=announce).install()
    signals.attach(app)
    stop = signals.stop
    # Draining is ours (on_shutdown, bounded by drain_timeout_s); aiohttp only waits a little
    # for handlers that are still writing their last event.
    runner = JsonErrorRunner(app, shutdown_timeout=5.0, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, entry.host, entry.port, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            raise ValueError(
                f"instance {entry.id!r} cannot listen on {entry.host}:{entry.port}: {exc}"
            ) from exc
        port = int(runner.addresses[-1][1])  # the real port when 0 asked for a free one
        url = http_url(entry.host, port)
        log.info("instance.ready", instance=entry.id, url=url)
        if ready_file is not None:
            _write_atomic(ready_file, {"id": entry.id, "pid": os.getpid(), "url": url})
        stopped = asyncio.ensure_future(stop.wait())
        loop_ended = asyncio.ensure_future(instance.wait_until_stopped())
        hung = asyncio.ensure_future(instance.hung.wait())
        await asyncio.wait({stopped, loop_ended, hung}, return_when=asyncio.FIRST_COMPLETED)
        if instance.hung.is_set():
            # The engine thread is stuck in an operation nothing can interrupt, and shutting
            # down would wait for it: leave now, so the supervisor starts a fresh process.
            log.error("instance.engine_wedged_exit", instance=entry.id)
            os._exit(1)
        failed = not stop.is_set()
        for task in (stopped, loop_ended, hung):
            task.cancel()
        if failed:
            log.error("instance.loop_failed", instance=entry.id)
        log.info("instance.stopping", instance=entry.id)
        return failed
    finally:
        await runner.cleanup()


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(orjson.dumps(data))
    os.replace(tmp, path)


def die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGTERM when the parent exits (even if it is killed), so a crashed
    ``talaria serve`` never leaves instances behind; exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        raise SystemExit(f"the parent process {parent_pid} is gone")
