"""Version skew, then an upgrade: the router's client stops sending releases to an instance
that refused them (older than the state ask's ``release``), and takes them up again once
that instance restarted (its report's epoch changed), as a rolling upgrade of the instances
behind a running router does; else the upgraded instance never hears of a release until the
router restarts."""

from __future__ import annotations

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.instances.http import HttpInstanceClient
from talaria.protocol import InstanceState, to_json


def _app(process: dict, asks: list[dict]) -> web.Application:
    async def state(request: web.Request) -> web.Response:
        ask = orjson.loads(await request.read())
        asks.append(ask)
        if process["old"] and "release" in ask:
            return web.json_response(
                {"error": {"message": "bad state ask: the state ask has unknown field(s): release"}},
                status=400)
        data = orjson.loads(to_json(InstanceState("i0", active_model="m")))
        data.update(sessions_epoch=process["epoch"], sessions_version=0, sessions_full=True,
                    sessions_removed=[])
        return web.json_response(data)

    app = web.Application()
    app.router.add_post("/internal/v1/state", state)
    return app


async def test_releases_resume_once_the_instance_restarted() -> None:
    process = {"old": True, "epoch": "e1"}
    asks: list[dict] = []
    async with TestServer(_app(process, asks)) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        try:
            await client.state()
            client.release_reservations(["s"])
            await client.state()  # refused, then polled without it
            client.release_reservations(["t"])
            await client.state()
            assert [a.get("release") for a in asks] == [None, ["s"], None, None]
            process.update(old=False, epoch="e2")  # upgraded: a new process
            await client.state()  # its new epoch: releases are taken up again
            client.release_reservations(["u"])
            await client.state()
            assert asks[-1].get("release") == ["u"]
        finally:
            await client.close()
