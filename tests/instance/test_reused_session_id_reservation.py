"""A session id the router let go and a client uses again before the next state poll keeps
the new call's reservation: the forget still waiting for that poll is withdrawn when the id
is in use again, over HTTP as in process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.core import RouterCore
from router.instances.http import HttpInstanceClient
from router.instances.inprocess import InProcessClient
from router.sessions.table import SessionTable
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.serving.instance_server import InstanceServerSettings, create_instance_app


@asynccontextmanager
async def _client(instance: Instance, over_http: bool) -> AsyncIterator[object]:
    if not over_http:
        await instance.start()
        try:
            yield InProcessClient("i", instance)
        finally:
            await instance.stop(drain=False)
        return
    server = TestServer(create_instance_app(instance, InstanceServerSettings()))
    await server.start_server()
    client = HttpInstanceClient("i", str(server.make_url("/")))
    try:
        yield client
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize("over_http", [True, False], ids=["http", "in-process"])
async def test_a_session_id_used_again_before_the_poll_keeps_its_reservation(
        over_http: bool) -> None:
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.005)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=1.0))
    async with _client(instance, over_http) as client:
        core = RouterCore({"i": client}, "load", sessions=SessionTable(max_sessions=1),
                          refresh_after_call=False)
        try:
            for n, session in enumerate(("s0", "s1", "s0")):  # each evicts the one before
                events = [e async for e in core.submit(call(f"c{n}", session, "m", 40))]
                assert events[-1].finished and events[-1].error is None
            await core.refresh("i")  # carries the forgets: s1's only
            await core.refresh("i")
            assert {r.session_id for r in instance.sessions.reservations.all()} == {"s0"}
            assert instance.counters["sessions_dropped"] == 1
        finally:
            await core.close()
