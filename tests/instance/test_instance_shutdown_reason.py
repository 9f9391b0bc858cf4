"""An instance server that shuts down on its own says so: a call still running past its drain
ends with an abort whose ``abort_reason`` is ``shutting_down`` (it read as a plain abort, which
the router told its client as a failure of the instance), and a call sent once it stopped
taking calls is refused with a 503 whose code says so, which the router's client raises as
``InstanceShuttingDown``. A call that finishes within the drain ends as ever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.instances.http import HttpInstanceClient
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import SHUTTING_DOWN, CallEvent, InstanceShuttingDown
from talaria.serving.instance_server import (
    INFLIGHT_KEY,
    InstanceServerSettings,
    create_instance_app,
)


async def _served(drain_timeout_s: float) -> tuple[TestServer, HttpInstanceClient]:
    instance = Instance("i", FakeEngine(["m"], num_blocks=1024, step_s=0.01), PolicyConfig())
    app = create_instance_app(instance, InstanceServerSettings(drain_timeout_s=drain_timeout_s))
    server = TestServer(app)
    await server.start_server()
    return server, HttpInstanceClient("i", str(server.make_url("/")))


async def _rest(stream: AsyncIterator[CallEvent]) -> list[CallEvent]:
    return [event async for event in stream]


async def test_a_call_past_the_drain_ends_with_the_shutdown_reason() -> None:
    server, client = await _served(drain_timeout_s=0.1)
    try:
        stream = client.submit(call("long", "s", "m", 40, max_tokens=3000))
        first = await anext(stream)
        assert first.token_ids and not first.finished
        rest = asyncio.ensure_future(_rest(stream))
        await asyncio.sleep(0)
        await server.close()  # drains for 0.1 s, then aborts what is left
        last = (await rest)[-1]
    finally:
        await client.close()
    assert last.finished and last.finish_reason == "abort"
    assert last.abort_reason == SHUTTING_DOWN
    assert last.error is not None and "shutting down" in last.error


async def test_a_call_done_within_the_drain_has_no_shutdown_reason() -> None:
    server, client = await _served(drain_timeout_s=30.0)
    try:
        stream = client.submit(call("short", "s", "m", 40, max_tokens=20))
        await anext(stream)
        rest = asyncio.ensure_future(_rest(stream))
        await asyncio.sleep(0)
        await server.close()
        last = (await rest)[-1]
    finally:
        await client.close()
    assert last.finish_reason == "length" and last.abort_reason is None and last.error is None


async def test_a_call_sent_while_it_shuts_down_is_refused_as_shutting_down() -> None:
    server, client = await _served(drain_timeout_s=0.1)
    try:
        server.app[INFLIGHT_KEY].accepting = False  # as its shut-down sets it first
        with pytest.raises(InstanceShuttingDown, match="shutting down"):
            await anext(client.submit(call("late", "s", "m", 40)))
    finally:
        await client.close()
        await server.close()
