"""What reaches the servers as raw bytes: a key that is not UTF-8 is a wrong key (401, never a
500), and a request aiohttp itself cannot parse (a header over its limit, a bad request line)
gets the APIs' JSON error, not text/plain. On the router's app and on the instance API's
stack (its key middleware and error middleware), each served as ``talaria serve`` serves them
(``JsonErrorRunner``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest
from aiohttp import web
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer
from talaria.protocol.errors import error_middleware
from talaria.protocol.http import JsonErrorRunner, key_middleware

KEY = "k" * 24


@asynccontextmanager
async def listening(app: web.Application) -> AsyncIterator[int]:
    runner = JsonErrorRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


async def raw(port: int, head: bytes) -> tuple[int, str, bytes]:
    """Send ``head`` (a request line and headers, no body) as is; (status, content type, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10.0)
    writer.close()
    header, _, body = data.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), fields.get("Content-Type", ""), body


def router_app(tokenizer: ModelTokenizer) -> web.Application:
    config = RouterConfig(models={"tiny": "/unused"}, instances={"a": ""}, poll_interval_s=None,
                          api_key=KEY)
    return create_app(config, {"a": FakeInstance("a", [1])}, tokenizers={"tiny": tokenizer})


def instance_stack() -> web.Application:
    """The instance API's middlewares (``create_instance_app``) over one route."""

    async def state(request: web.Request) -> web.Response:
        return web.json_response({"instance_id": "a"})

    app = web.Application(middlewares=[error_middleware, key_middleware(KEY, lambda _p: True)])
    app.router.add_get("/internal/v1/state", state)
    return app


@pytest.mark.parametrize("server", ["router", "instance"])
async def test_key_bytes_that_are_not_utf8_are_a_401(tokenizer: ModelTokenizer, server: str) -> None:
    app = router_app(tokenizer) if server == "router" else instance_stack()
    path = b"/v1/models" if server == "router" else b"/internal/v1/state"
    headers = [b"Authorization: Bearer \xff\xfe" + KEY.encode()]
    if server == "router":
        headers.append(b"x-api-key: \xc3\x28")
    async with listening(app) as port:
        for header in headers:
            status, kind, body = await raw(
                port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header + b"\r\n")
            assert status == 401, body
            assert kind.startswith("application/json")
            assert orjson.loads(body)["error"]["code"] == "invalid_api_key"
        good = b"Authorization: Bearer " + KEY.encode()
        status, _, _ = await raw(
            port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + good + b"\r\n")
        assert status == 200


@pytest.mark.parametrize("server", ["router", "instance"])
@pytest.mark.parametrize("request_head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n",
    b"THIS IS NOT HTTP\r\n",
], ids=["header-over-8190-bytes", "bad-request-line"])
async def test_what_aiohttp_cannot_parse_gets_a_json_error(
    tokenizer: ModelTokenizer, server: str, request_head: bytes
) -> None:
    app = router_app(tokenizer) if server == "router" else instance_stack()
    async with listening(app) as port:
        status, kind, body = await raw(port, request_head)
    assert status == 400
    assert kind.startswith("application/json"), (kind, body)
    error = orjson.loads(body)["error"]
    assert error["code"] == "bad_http_request" and error["type"] == "invalid_request_error"
