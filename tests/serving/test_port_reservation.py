"""`talaria serve` keeps the free port it picks for an instance (port 0) reserved for as long
as it runs: nothing else can bind it between the pick and the instance's bind, nor while the
instance restarts, and the instance binds it beside the reservation (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import errno
import socket
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from talaria.cli import build_parser
from talaria.serving import serve
from talaria.serving.config import ServeConfig
from talaria.serving.instance_main import _serve
from talaria.serving.signals import ShutdownSignals


def _config() -> ServeConfig:
    return ServeConfig.from_dict({"instances": [{"id": "a"}, {"id": "b", "port": 9905}]})


def test_a_picked_port_is_held_until_released() -> None:
    config = _config()
    reserved = serve._reserve_ports(config)
    try:
        a, b = config.instances
        assert set(reserved) == {"a"} and a.port != 0 and b.port == 9905
        for option in (None, socket.SO_REUSEADDR):
            with socket.socket() as other, pytest.raises(OSError) as info:
                if option is not None:
                    other.setsockopt(socket.SOL_SOCKET, option, 1)
                other.bind((a.host, a.port))
            assert info.value.errno == errno.EADDRINUSE
    finally:
        for sock in reserved.values():
            sock.close()


class _Instance:
    """What ``_serve`` waits on: a loop that ends once ``stop`` is set."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hung = asyncio.Event()

    async def wait_until_stopped(self) -> None:
        await self.stop.wait()


async def test_an_instance_serves_on_its_reserved_port_again_and_again(tmp_path: Path) -> None:
    """Started with ``--reuse-port`` (as `serve` starts it), an instance binds the port held
    for it, and so does its restart."""
    config = _config()
    reserved = serve._reserve_ports(config)
    entry = config.instance("a")
    ready = tmp_path / "a.ready"
    try:
        for start in ("first", "restart"):
            app = web.Application()
            app.router.add_get("/ping", lambda _r, start=start: web.Response(text=start))
            instance = _Instance()
            running = asyncio.ensure_future(
                _serve(app, entry, ready, instance, reuse_port=True))  # type: ignore[arg-type]
            while not ready.is_file():
                await asyncio.sleep(0.01)
            url = orjson.loads(ready.read_bytes())["url"]
            assert url == f"http://{entry.host}:{entry.port}"
            async with aiohttp.ClientSession() as http, http.get(f"{url}/ping") as resp:
                assert await resp.text() == start
            instance.stop.set()
            assert await running is True  # its loop ended
            ready.unlink()
    finally:
        for sock in reserved.values():
            sock.close()


def test_serve_starts_reserved_instances_with_reuse_port(tmp_path: Path) -> None:
    cmd = serve.instance_command("a", tmp_path / "c.json", tmp_path / "ready", reuse_port=True)
    assert "--reuse-port" in cmd
    assert "--reuse-port" not in serve.instance_command("a", tmp_path / "c.json", tmp_path / "r")
    args = build_parser().parse_args(cmd[cmd.index("instance"):])
    assert args.reuse_port is True


class _Starting:
    """An instance process that is still loading its models (no ready file yet)."""

    def poll(self) -> None:
        return None


async def test_a_router_that_cannot_be_built_ends_serve_at_once_not_after_the_instances(
    tmp_path: Path,
) -> None:
    """The router is built (its tokenizers loaded, its config checked: a tool format, a
    session id bound) while the instances load their models. A router that cannot be built
    was reported only once every instance was ready, minutes with large models, or never
    (the instances' start-up timeout swallowed it): its error ends `serve` when it happens."""
    config = _config()
    children = [serve.InstanceProcess(e.id, _Starting(), tmp_path / f"{e.id}.ready")  # type: ignore[arg-type]
                for e in config.instances]

    def broken_router(_config: ServeConfig, _urls: dict[str, str]) -> web.Application:
        raise ValueError("unknown tool-call formats {'m': 'hermse'}")

    run = serve._run(config, children, broken_router, 60.0, lambda _id: children[0],
                     ShutdownSignals("talaria serve", 0.0, announce=False))
    with pytest.raises(ValueError, match="hermse"):
        await asyncio.wait_for(run, 5.0)


def test_a_router_port_in_use_is_refused_before_any_instance_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router listens once every instance is up; a router port another process holds
    (a `talaria serve` already running) was found only then, after every model had loaded.
    ``serve`` checks it can listen there before it starts an instance."""
    def spawn(instance_id: str, *_args: object) -> None:
        raise AssertionError(f"instance {instance_id} started")

    monkeypatch.setattr(serve, "_spawn", spawn)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = ServeConfig.from_dict({"router": {"port": port}, "instances": [{"id": "a"}]})
        with pytest.raises(ValueError, match=f"the router cannot listen on 127.0.0.1:{port}"):
            serve.serve(config, lambda _c, _u: web.Application())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["::1", "::", "0.0.0.0", ""])
async def test_an_instance_on_an_ipv6_or_wildcard_host_is_reached_at_its_url(
    tmp_path: Path, host: str
) -> None:
    """An instance on host ``::1`` (or ``""``) got the URL ``http://::1:PORT``
    (``http://:PORT``), which nothing connects to: `talaria serve` waited its whole start-up
    timeout (600 s) for an instance that was serving, and at port 0 it failed at once with
    'Address family for hostname not supported' (its port was picked over IPv4)."""
    if ":" in host and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    config = ServeConfig.from_dict({"instances": [{"id": "a", "host": host}]})
    reserved = serve._reserve_ports(config)
    entry = config.instance("a")
    ready = tmp_path / "a.ready"
    try:
        app = web.Application()
        app.router.add_get("/ping", lambda _r: web.Response(text="up"))
        instance = _Instance()
        running = asyncio.ensure_future(
            _serve(app, entry, ready, instance, reuse_port="a" in reserved))  # type: ignore[arg-type]
        while not ready.is_file() and not running.done():
            await asyncio.sleep(0.01)
        url = orjson.loads(ready.read_bytes())["url"]
        assert url == serve.instance_urls(config)["a"]
        async with aiohttp.ClientSession() as http, http.get(f"{url}/ping") as resp:
            assert await resp.text() == "up"
        instance.stop.set()
        await running
    finally:
        for sock in reserved.values():
            sock.close()
