"""An instance server that shuts down on its own says so: a call still running past its drain
ends with an abort whose ``abort_reason`` is ``shutting_down`` (it read as a plain abort, which
the router told its client as a failure of the instance), and a call sent once it stopped
taking calls is refused with a 503 whose code says so, which the router's client raises as
``InstanceShuttingDown``. A call that finishes within the drain ends as ever. Over HTTP, the
router re-places a call the shut-down cut before its first event and ends one cut mid-answer
with the error its API tells as the instance shutting down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.core import RouterCore
from router.instances.http import HttpInstanceClient
from router.outcomes import INSTANCE_SHUTDOWN_ERROR
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import SHUTTING_DOWN, CallEvent, InstanceShuttingDown
from talaria.serving.instance_server import (
    INFLIGHT_KEY,
    InstanceServerSettings,
    create_instance_app,
)


async def _served(
    drain_timeout_s: float, instance_id: str = "i", **policy: Any
) -> tuple[TestServer, HttpInstanceClient]:
    engine = FakeEngine(["m"], num_blocks=1024, step_s=0.01)
    instance = Instance(instance_id, engine, PolicyConfig(**policy))
    app = create_instance_app(instance, InstanceServerSettings(drain_timeout_s=drain_timeout_s))
    server = TestServer(app)
    await server.start_server()
    return server, HttpInstanceClient(instance_id, str(server.make_url("/")))


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


class _InOrder:
    """Ranks the instances in one fixed order."""

    name = "in_order"

    def __init__(self, *order: str) -> None:
        self.order = order

    def choose(self, call: Any, session: Any, states: Any, healthy: Collection[str]) -> list[str]:
        return [i for i in self.order if i in healthy]


async def test_the_router_re_places_a_queued_call_and_tells_a_running_one() -> None:
    """``a`` runs one call at a time: the second waits in its queue when ``a`` shuts down."""
    a_server, a = await _served(drain_timeout_s=0.1, instance_id="a", max_running_calls=1)
    b_server, b = await _served(drain_timeout_s=30.0, instance_id="b")
    core = RouterCore({"a": a, "b": b}, _InOrder("a", "b"), refresh_after_call=False)
    try:
        running = core.submit(call("long", "s1", "m", 40, max_tokens=3000))
        assert (await anext(running)).instance_id == "a"
        queued = asyncio.ensure_future(_rest(core.submit(call("queued", "s2", "m", 40, max_tokens=20))))
        for _ in range(200):
            if "queued" in a_server.app[INFLIGHT_KEY].handles:
                break
            await asyncio.sleep(0.01)
        rest = asyncio.ensure_future(_rest(running))
        await a_server.close()  # drains for 0.1 s, then aborts both
        cut, moved = (await rest)[-1], await queued
    finally:
        await core.close()
        for client in (a, b):
            await client.close()
        await b_server.close()
    assert cut.instance_id == "a" and cut.error == INSTANCE_SHUTDOWN_ERROR
    assert moved[-1].instance_id == "b" and moved[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in moved) == 20
    assert core.metrics.call_failures.get(instance="a", kind="instance_shutdown") == 2
    assert core.healthy == {"b"}
