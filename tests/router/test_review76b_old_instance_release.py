"""Version skew: an instance older than the state ask's ``release`` list answers an ask that
carries one with 400 (it reads the ask strictly). The router's client must not keep failing
its polls over it (the release was held until a poll carried it, so every later poll failed
too and the instance stayed down): it stops sending releases there and polls as before,
its forgets still delivered."""

from __future__ import annotations

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.instances.http import HttpInstanceClient
from talaria.protocol import InstanceState, to_json


def _old_instance_app(asks: list[dict]) -> web.Application:
    async def state(request: web.Request) -> web.Response:
        ask = orjson.loads(await request.read())
        asks.append(ask)
        unknown = sorted(k for k in ask if k not in ("epoch", "since", "forget"))
        if unknown:  # as talaria.protocol.state_delta.StateAsk read it before "release"
            return web.json_response(
                {"error": {"message": f"bad state ask: the state ask has unknown field(s): {', '.join(unknown)}"}},
                status=400)
        return web.Response(body=to_json(InstanceState("i0", active_model="m")),
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/internal/v1/state", state)
    return app


async def test_an_older_instance_keeps_answering_polls_after_a_release() -> None:
    asks: list[dict] = []
    async with TestServer(_old_instance_app(asks)) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        try:
            assert (await client.state()).instance_id == "i0"
            client.release_reservations(["s"])
            client.forget_sessions(["gone"])
            assert (await client.state()).instance_id == "i0"  # was: InstanceUnavailable (400)
            assert asks[-1]["forget"] == ["gone"] and "release" not in asks[-1]
            client.release_reservations(["t"])  # not sent there any more
            assert (await client.state()).instance_id == "i0"
            assert all("release" not in ask for ask in asks[-1:])
            assert sum("release" in ask for ask in asks) == 1  # tried once
        finally:
            await client.close()
