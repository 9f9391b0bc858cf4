"""A call that uses a session id again withdraws the let-go pending for it on the instance
it is sent to (the session is current there again). A call that instance refuses (429, 400,
unreachable) never ran there: the let-go stands, so a release or forget meant for it still
reaches it at the next poll (before, the refused call withdrew it, and the instance kept the
session's reservation until it expired). In-process (the simulated replay's) and over HTTP."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.instances.http import HttpInstanceClient
from router.instances.inprocess import InProcessClient
from router.instances.let_go import PendingLetGo
from talaria.protocol import CallEvent, CallRequest, InstanceState, SamplingParams, to_json
from talaria.protocol.errors import overloaded


def _call(session: str, call_id: str | None = None) -> CallRequest:
    return CallRequest(call_id=call_id or f"{session}-c", session_id=session, model="m",
                       prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1))


class Target:
    """A simulated instance: refuses the calls of ``refused`` sessions at once (a full queue),
    and call ``gated`` once ``gate`` opens (it waited in the queue); records what polls carry."""

    def __init__(self, refused: set[str], gated: str | None = None) -> None:
        self.refused, self.gated = refused, gated
        self.gate = asyncio.Event()
        self.asked: list[str] = []

    async def stream(self, call: CallRequest):  # type: ignore[no-untyped-def]
        if call.call_id == self.gated:
            await self.gate.wait()
        if call.session_id in self.refused or call.call_id == self.gated:
            raise overloaded("queue full", 1.0)
        yield CallEvent(call_id=call.call_id, token_ids=[5], finished=True, finish_reason="length")

    def abort(self, call_id: str, answered: bool = False) -> None:
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


# One session's parallel calls on one instance, one accepted and one refused:
# A refused call restores the let-go it withdrew only when no other call of its session came
# to that instance meanwhile: one session's parallel calls (an agent's) on one instance, one
# accepted and one refused (a full queue), leave the session current there. Before, the refused
# one put back the release (or forget) it had withdrawn while its sibling ran, and the next
# poll released the reservation (or forgot the KV) the sibling had just left.


async def _drain(client: InProcessClient, call: CallRequest) -> list[CallEvent]:
    return [e async for e in client.submit(call)]


@pytest.mark.parametrize("let_go", ["release", "forget"])
async def test_a_refused_call_restores_nothing_when_a_sibling_ran_meanwhile(let_go: str) -> None:
    target = Target(refused=set(), gated="refused")
    client = InProcessClient("i0", target)
    getattr(client, f"{let_go}_{'reservations' if let_go == 'release' else 'sessions'}")(["s"])
    refused = asyncio.ensure_future(_drain(client, _call("s", "refused")))
    await asyncio.sleep(0)  # it withdrew the let-go and waits in the queue
    assert [e.finished for e in await _drain(client, _call("s", "ran"))] == [True]  # ran: current here
    target.gate.set()
    with pytest.raises(Exception, match="queue full"):
        await refused
    await client.state()
    assert target.asked == []


async def test_a_refused_call_restores_nothing_while_a_sibling_runs() -> None:
    """The sibling came first and still streams when the refused call ends."""
    held = PendingLetGo(bound=10)
    sibling = held.withdraw("s")  # nothing pending then
    held.add_release(["s"])  # the router let it go meanwhile (another call moved it)
    refused = held.withdraw("s")
    held.settle("s", refused, ran=False)  # the sibling is still open: the session is current
    assert held.batch(10) == ([], [])
    held.settle("s", sibling, ran=True)
    assert held.batch(10) == ([], [])


def test_a_refused_call_alone_restores_and_nothing_is_left_behind() -> None:
    held = PendingLetGo(bound=10)
    held.add_forget(["s"])
    first = held.withdraw("s")
    held.settle("s", first, ran=False)
    assert held.batch(10) == (["s"], [])
    second = held.withdraw("s")
    held.settle("s", second, ran=True)
    assert held.batch(10) == ([], []) and not held.open_calls
