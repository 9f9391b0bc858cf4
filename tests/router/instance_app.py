"""A small aiohttp server speaking the instance's internal API (calls, abort, state, health),
each call answered as ``mode["calls"]`` says: streamed tokens, overloaded, an error, a line
too long or never ending."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from talaria.protocol import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceState,
    ModelState,
    Residency,
    SessionKV,
    to_json,
)

ABORTED = web.AppKey("aborted", list[str])
RECEIVED = web.AppKey("received", list[CallRequest])


def fake_instance_app(mode: dict[str, str], model: str = "m") -> web.Application:
    aborted: list[str] = []
    received: list[CallRequest] = []

    async def calls(request: web.Request) -> web.StreamResponse:
        call = CallRequest.from_dict(orjson.loads(await request.read()))
        received.append(call)
        if mode["calls"] == "overloaded":
            return web.json_response({"error": "queue full", "retry_after_s": 4.0}, status=429,
                                     headers={"Retry-After": "4"})
        if mode["calls"] == "bad retry":  # neither says a number of seconds: 1 s
            return web.json_response({"error": "queue full", "retry_after_s": "soon"}, status=429,
                                     headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
        if mode["calls"] == "header retry":
            return web.json_response({"error": "queue full", "retry_after_s": True}, status=429,
                                     headers={"Retry-After": "inf"} if mode.get("inf") else {"Retry-After": "7"})
        if mode["calls"] == "bad":
            return web.json_response({"error": {"message": "model not here", "type": "x"}}, status=404)
        if mode["calls"] == "crash":
            return web.json_response({"error": {"message": "boom", "type": "x"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        if mode["calls"] == "endless":  # a line that never ends
            await resp.write(b'{"call_id": "' + b"x" * (2 << 20))
            await asyncio.sleep(3600)
        if mode["calls"] == "big":  # one event far above aiohttp's readline limit
            event = CallEvent(call.call_id, list(range(40_000)), finished=True, finish_reason="length")
            await resp.write(to_json(event))  # and no trailing newline
            await resp.write_eof()
            return resp
        for i, tok in enumerate([7, 8, 9]):
            last = i == 2
            event = CallEvent(call.call_id, [tok], finished=last, finish_reason="length" if last else None,
                              usage=CallUsage(len(call.prompt_token_ids), 3, 1) if last else None)
            await resp.write(to_json(event) + b"\n")
        await resp.write_eof()
        return resp

    async def abort(request: web.Request) -> web.Response:
        aborted.append(request.match_info["call_id"])
        return web.json_response({"aborted": True})

    async def state(request: web.Request) -> web.Response:
        st = InstanceState("i0", active_model=model, switches=2,
                           sessions={"s": SessionKV("s", model, device_tokens=5)})
        st.models[model] = ModelState(model, residency=Residency.ACTIVE, queued_calls=1)
        return web.Response(body=to_json(st), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app[ABORTED] = aborted
    app[RECEIVED] = received
    app.router.add_post("/internal/v1/calls", calls)
    app.router.add_post("/internal/v1/calls/{call_id}/abort", abort)
    app.router.add_get("/internal/v1/state", state)
    app.router.add_post("/internal/v1/state", state)  # the router polls by POST
    app.router.add_get("/health", health)
    return app
