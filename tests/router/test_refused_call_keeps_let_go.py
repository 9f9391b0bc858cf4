"""A call that uses a session id again withdraws the let-go pending for it on the instance
it is sent to (the session is current there again). A call that instance refuses (429, 400,
unreachable) never ran there: the let-go stands, so a release or forget meant for it still
reaches it at the next poll (before, the refused call withdrew it, and the instance kept the
session's reservation until it expired). In-process (the simulated replay's) and over HTTP."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.instances.http import HttpInstanceClient
from router.instances.inprocess import InProcessClient
from talaria.protocol import CallEvent, CallRequest, InstanceState, SamplingParams, to_json
from talaria.protocol.errors import overloaded


def _call(session: str) -> CallRequest:
    return CallRequest(call_id=f"{session}-c", session_id=session, model="m",
                       prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1))


class Target:
    """A simulated instance: refuses the calls of ``refused`` sessions (a full queue) and
    records what polls carry."""

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused
        self.asked: list[str] = []

    async def stream(self, call: CallRequest):  # type: ignore[no-untyped-def]
        if call.session_id in self.refused:
            raise overloaded("queue full", 1.0)
        yield CallEvent(call_id=call.call_id, token_ids=[5], finished=True, finish_reason="length")

    def abort(self, call_id: str) -> None:
        pass

    def release_reservations(self, ids: list[str]) -> None:
        self.asked.append("release " + ",".join(ids))

    def forget_sessions(self, ids: list[str]) -> None:
        self.asked.append("forget " + ",".join(ids))

    def state(self) -> InstanceState:
        return InstanceState(instance_id="i0")


async def test_in_process_a_refused_call_leaves_the_let_go_pending() -> None:
    target = Target(refused={"moved", "ended"})
    client = InProcessClient("i0", target)
    client.release_reservations(["moved", "back"])
    client.forget_sessions(["ended"])
    for session in ("moved", "ended"):
        with pytest.raises(Exception, match="queue full"):
            [e async for e in client.submit(_call(session))]
    assert [e.finished async for e in client.submit(_call("back"))] == [True]  # it ran: current
    await client.state()
    assert target.asked == ["release moved", "forget ended"]


def _instance_app(asks: list[dict], refused: set[str]) -> web.Application:
    async def calls(request: web.Request) -> web.StreamResponse:
        call = orjson.loads(await request.read())
        if call["session_id"] in refused:
            return web.json_response({"error": {"message": "queue full"}, "retry_after_s": 1},
                                     status=429)
        resp = web.StreamResponse()
        await resp.prepare(request)
        event = CallEvent(call_id=call["call_id"], token_ids=[5], finished=True, finish_reason="length")
        await resp.write(to_json(event) + b"\n")
        return resp

    async def state(request: web.Request) -> web.Response:
        asks.append(orjson.loads(await request.read()))
        return web.Response(body=to_json(InstanceState("i0")), content_type="application/json")

    app = web.Application()
    app.router.add_post("/internal/v1/calls", calls)
    app.router.add_post("/internal/v1/state", state)
    return app


async def test_over_http_a_refused_call_leaves_the_let_go_pending() -> None:
    asks: list[dict] = []
    async with TestServer(_instance_app(asks, refused={"moved"})) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        try:
            await client.state()
            client.release_reservations(["moved", "back"])
            with pytest.raises(Exception, match="queue full"):
                [e async for e in client.submit(_call("moved"))]
            assert [e.finished async for e in client.submit(_call("back"))] == [True]
            await client.state()
        finally:
            await client.close()
    assert asks[-1].get("release") == ["moved"]
