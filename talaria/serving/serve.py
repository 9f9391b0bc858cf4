"""`talaria serve`: the router in this process, one child process per instance.

Start-up: the router's address is checked first (it listens only once every instance is
up, so a port already taken would otherwise show only after every model loaded).
Instances asking for port 0 get a free port, held by this process (a socket bound
with SO_REUSEPORT, never listening) until it ends, so nothing else can take it before the
instance binds it, nor while the instance restarts; the instance binds it beside that
socket (``--reuse-port``), which alone receives its connections. The resolved config, without its
keys, is written as JSON to a private temp dir (the dir 0700, the file 0600); each instance is
``python -P -m talaria.cli instance --config that.json --id ID --ready-file ...`` (``-P``:
the working directory is not on its import path, so a stray module there cannot shadow one it
imports); when every
ready file is there (progress on stderr) and each instance answers ``/health``, the router
app (built by the injected ``router_factory``: ``talaria`` does not import ``router``, the
composition root does) listens and ``ROUTER_READY <url>`` is printed on stdout, followed by
one ``INSTANCE <id> <pid> <url>`` line per instance.

Shut-down (SIGINT / SIGTERM): the router stops taking connections and gives the calls in
flight the instances' longest ``drain_timeout_s`` (the router app's own drain), every
instance gets SIGTERM (it drains with its own timeout), stragglers get SIGKILL after
``kill_after_s``; the temp dir is removed. A second signal cuts the drains short: the calls
still in flight end at once, told the server is shutting down, and each instance gets
SIGTERM and then SIGINT, its second signal, which cuts its own (``talaria.serving.signals``;
two signals of one kind sent at once may merge into one); a signal that comes while serve
waits for its instances, its router gone, hurries them the same, and one after that
SIGKILLs them. Each child runs in a
session of its own, so a terminal's Ctrl-C reaches this process alone and the instances
keep serving the router's drain. Children also die with this process (PR_SET_PDEATHSIG),
so even a killed ``serve`` leaves nothing behind. An instance that dies
while serving is restarted with backoff (``talaria.serving.supervisor``); meanwhile the
router marks it down and places its sessions elsewhere, and re-adds it once it answers again.

The router and the instances share a secret (``[router].instance_key``, generated here when
the config has none): every instance route requires it. It reaches each instance in its
environment (``INSTANCE_KEY_ENV``), never on disk, so a ``serve`` killed with SIGKILL (no
clean-up runs) leaves no key behind; the router's ``api_key`` stays in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import structlog
from aiohttp import web

from talaria.clock import new_live_loop
from talaria.protocol.http import JsonErrorRunner
from talaria.serving.addresses import http_url, socket_family
from talaria.serving.config import ServeConfig
from talaria.serving.instance_main import INSTANCE_KEY_ENV
from talaria.serving.preflight import check_engine_names, check_host_kv, check_tensor_parallel
from talaria.serving.signals import ShutdownSignals
from talaria.serving.supervisor import Supervisor

log = structlog.get_logger("talaria.serving.serve")

__all__ = ["RouterFactory", "InstanceProcess", "serve", "run_router", "instance_urls",
           "instance_command"]

RouterFactory = Callable[[ServeConfig, dict[str, str]], web.Application]

_PROGRESS_EVERY_S = 2.0


@dataclass
class InstanceProcess:
    id: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    url: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()


def instance_urls(config: ServeConfig) -> dict[str, str]:
    """Instance URLs from the config (for a router started alone: ports must be fixed)."""
    urls: dict[str, str] = {}
    for i, entry in enumerate(config.instances):
        if entry.port == 0:
            raise ValueError(
                f"[instances][{i}].port is 0: a router started alone needs each instance's "
                "fixed port (start them with `talaria instance` first)"
            )
        urls[entry.id] = http_url(entry.host, entry.port)
    return urls


def serve(
    config: ServeConfig,
    router_factory: RouterFactory,
    start_timeout_s: float = 600.0,
    kill_after_s: float | None = None,
    log_level: str = "info",
) -> int:
    """Run instances and router until SIGINT/SIGTERM; returns the exit status. ``log_level``:
    the instances' (``talaria serve --log-level``, which sets this process's own)."""
    check_engine_names(config)
    check_host_kv(config)
    config.convert_gguf_models()
    for name, path in config.model_paths().items():
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"model {name!r}: no config.json in {path!r}")
    check_tensor_parallel(config)
    _check_router_address(config.router.host, config.router.port)
    workdir = Path(tempfile.mkdtemp(prefix="talaria-serve-"))  # private: mode 0700
    reserved = _reserve_ports(config)
    if config.router.instance_key is None:
        config.router.instance_key = secrets.token_urlsafe(32)
    config_file = workdir / "serve.json"
    _write_private(config_file, _without_keys(config).to_json())
    key = config.router.instance_key
    kill_after = kill_after_s if kill_after_s is not None else config.longest_drain_s() + 10.0
    signals = ShutdownSignals("talaria serve", config.longest_drain_s())
    children: list[InstanceProcess] = []
    try:
        for entry in config.instances:
            children.append(_spawn(entry.id, config_file, workdir, key, entry.id in reserved,
                                   log_level))
        with asyncio.Runner(loop_factory=new_live_loop) as runner:
            return runner.run(_run(
                config, children, router_factory, start_timeout_s,
                lambda iid: _restart(iid, config, config_file, workdir, key, iid in reserved,
                                     log_level), signals))
    finally:
        _stop_children(children, kill_after, hurry=signals.hurry.is_set())
        for sock in reserved.values():
            sock.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run_router(config: ServeConfig, router_factory: RouterFactory) -> int:
    """`talaria router`: the router alone, over instances already running at fixed ports."""
    urls = instance_urls(config)
    config.convert_gguf_models()

    async def main() -> int:
        signals = ShutdownSignals("talaria router", config.longest_drain_s()).install()
        app = router_factory(config, urls)
        signals.attach(app)
        runner = await _start_router(config, app)
        try:
            await signals.stop.wait()
        finally:
            await runner.cleanup()
        return 0

    with asyncio.Runner(loop_factory=new_live_loop) as runner:
        return runner.run(main())


# internals --------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (mode 0600 from its creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _without_keys(config: ServeConfig) -> ServeConfig:
    """The config the instances read: the router's API key and the instance key left out."""
    return dataclasses.replace(
        config, router=dataclasses.replace(config.router, api_key=None, instance_key=None)
    )


def instance_command(
    instance_id: str, config_file: Path, ready: Path, reuse_port: bool = False,
    log_level: str = "info",
) -> list[str]:
    """How an instance process is started: ``-P`` keeps the working directory off its
    import path; ``reuse_port``: its port is one this process holds."""
    return [
        sys.executable, "-P", "-m", "talaria.cli", "instance",
        "--config", str(config_file), "--id", instance_id,
        "--ready-file", str(ready), "--parent-pid", str(os.getpid()), "--log-level", log_level,
        *(["--reuse-port"] if reuse_port else []),
    ]


def _spawn(
    instance_id: str, config_file: Path, workdir: Path, key: str | None, reuse_port: bool,
    log_level: str,
) -> InstanceProcess:
    ready = workdir / f"{instance_id}.ready"
    ready.unlink(missing_ok=True)  # a restart: the dead process's file
    env = {**os.environ, INSTANCE_KEY_ENV: key or ""}
    proc = subprocess.Popen(instance_command(instance_id, config_file, ready, reuse_port, log_level),
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    log.info("serve.instance_started", instance=instance_id, pid=proc.pid)
    return InstanceProcess(instance_id, proc, ready)


def _restart(
    instance_id: str, config: ServeConfig, config_file: Path, workdir: Path, key: str | None,
    reuse_port: bool, log_level: str,
) -> InstanceProcess:
    """A fresh process for a dead instance, on the port its predecessor had."""
    child = _spawn(instance_id, config_file, workdir, key, reuse_port, log_level)
    entry = config.instance(instance_id)
    child.url = http_url(entry.host, entry.port)
    return child


def _check_router_address(host: str, port: int) -> None:
    """ValueError now when the router could not listen at ``host:port`` (a port another
    process holds, a host that is not here): it listens only once every instance is up,
    which takes as long as loading every model. Each address bound and let go at once, as
    asyncio binds them (SO_REUSEADDR: a port left in TIME_WAIT is no obstacle)."""
    try:
        for family, kind, proto, _name, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as exc:
        raise ValueError(f"the router cannot listen on {host}:{port}: {exc}") from exc


def _reserve_ports(config: ServeConfig) -> dict[str, socket.socket]:
    """Give each instance asking for port 0 a free port now, so the router can be built
    while the instances start; returns the sockets that hold them (by instance id), to
    close once the instances are gone. Where SO_REUSEPORT is missing the port is only
    picked (one taken meanwhile fails that instance's start-up)."""
    reuse = getattr(socket, "SO_REUSEPORT", None)
    reserved: dict[str, socket.socket] = {}
    for entry in config.instances:
        if entry.port == 0:
            sock = socket.socket(socket_family(entry.host), socket.SOCK_STREAM)
            if reuse is not None:
                sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
                reserved[entry.id] = sock
            sock.bind((entry.host, 0))
            entry.port = int(sock.getsockname()[1])
            if reuse is None:
                sock.close()
    return reserved


async def _run(
    config: ServeConfig,
    children: list[InstanceProcess],
    router_factory: RouterFactory,
    start_timeout_s: float,
    restart: Callable[[str], InstanceProcess],
    signals: ShutdownSignals,
) -> int:
    stop = signals.install().stop
    urls = {e.id: http_url(e.host, e.port) for e in config.instances}
    # Build the router (tokenizers load) while the instances start.
    app_future = asyncio.get_running_loop().run_in_executor(None, router_factory, config, urls)
    key = config.router.instance_key or ""
    ready = await _wait_ready(children, stop, start_timeout_s, key, app_future)
    if _failed(app_future):
        await app_future  # the router's error now, not once every model has loaded
    if not ready:
        with contextlib.suppress(Exception):  # the instances' failure is the one to report
            await app_future
        return 1 if not stop.is_set() else 130
    app = await app_future
    signals.attach(app)
    runner = await _start_router(config, app)
    try:
        for child in children:
            print(f"INSTANCE {child.id} {child.pid} {child.url}", flush=True)
        restartable = {e.id for e in config.instances if e.restart}
        await Supervisor(children, restart, restartable=restartable).run(stop)
        log.info("serve.stopping")
    finally:
        await runner.cleanup()
    return 0


def _failed(future: asyncio.Future[web.Application]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


async def _wait_ready(
    children: list[InstanceProcess], stop: asyncio.Event, timeout_s: float, key: str,
    router: asyncio.Future[web.Application] | None = None,
) -> bool:
    """Until every instance wrote its ready file and answers /health; False on a child
    that exits, a signal, the timeout, or a ``router`` (built meanwhile) that failed."""
    loop = asyncio.get_running_loop()
    start = last = loop.time()
    async with aiohttp.ClientSession() as http:
        while True:
            if stop.is_set() or (router is not None and _failed(router)):
                return False
            for child in children:
                code = child.proc.poll()
                if code is not None:
                    print(f"talaria serve: instance {child.id} exited with code {code} "
                          "while starting (see its log above)", file=sys.stderr, flush=True)
                    return False
                if child.url is None and child.ready_file.is_file():
                    url = orjson.loads(child.ready_file.read_bytes())["url"]
                    if await _healthy(http, url, key):
                        child.url = url
            waiting = [c.id for c in children if c.url is None]
            if not waiting:
                return True
            now = loop.time()
            if now - start > timeout_s:
                print(f"talaria serve: instances {waiting} not ready after {timeout_s:.0f} s",
                      file=sys.stderr, flush=True)
                return False
            if now - last >= _PROGRESS_EVERY_S:
                last = now
                ready = len(children) - len(waiting)
                print(f"talaria serve: waiting for instances ({ready}/{len(children)} ready, "
                      f"{now - start:.0f} s): {', '.join(waiting)}", file=sys.stderr, flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def _healthy(http: aiohttp.ClientSession, url: str, key: str) -> bool:
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with http.get(f"{url}/health", headers=headers,
                            timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _start_router(config: ServeConfig, app: web.Application) -> web.AppRunner:
    # Draining is the app's (on_shutdown, bounded by the instances' drain_timeout_s); aiohttp
    # only waits a little for handlers that are still writing their last event.
    runner = JsonErrorRunner(app, shutdown_timeout=5.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.router.host, config.router.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ValueError(
            f"the router cannot listen on {config.router.host}:{config.router.port}: {exc}"
        ) from exc
    port = int(runner.addresses[-1][1])
    url = http_url(config.router.host, port)
    log.info("serve.router_ready", url=url)
    print(f"ROUTER_READY {url}/v1", flush=True)
    return runner


def _stop_children(children: list[InstanceProcess], kill_after_s: float, hurry: bool = False) -> None:
    """SIGTERM each child, and SIGINT after it when ``hurry`` (a second signal: the instance
    then cuts its drain short, as serve's own second signal did its router's; a second
    SIGTERM sent at once could merge with the first, a standard signal pending being not
    queued twice); SIGKILL those left after ``kill_after_s``. A signal to serve meanwhile
    (its event loop gone) hurries them too, and one after the hurry SIGKILLs them now,
    rather than ending serve's clean-up half done."""
    hurried = False

    def hurry_children(*_args: object) -> None:
        # Marked before the children are signalled: a signal to serve while this runs (a child
        # answering the hurry at once, its operator pressing Ctrl-C again) runs this handler
        # again inside it, and must find the hurry sent and kill.
        nonlocal hurried
        sig, hurried = (signal.SIGKILL if hurried else signal.SIGINT), True
        _signal_children(children, sig)

    with _signals_calling(hurry_children):
        _signal_children(children, signal.SIGTERM)
        if hurry:
            hurry_children()
        deadline = time.monotonic() + kill_after_s
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("serve.instance_killed", instance=child.id, pid=child.pid)
                child.proc.kill()
                child.proc.wait()


def _signal_children(children: list[InstanceProcess], sig: signal.Signals) -> None:
    for child in children:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(sig)


@contextlib.contextmanager
def _signals_calling(handler: Callable[..., None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler`` within (in the main thread; elsewhere none can be
    set, and nothing changes); then their handlers are what they were."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
