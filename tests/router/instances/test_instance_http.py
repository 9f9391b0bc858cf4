"""HttpInstanceClient against a small aiohttp server speaking the instance's internal API."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from instance_app import ABORTED, RECEIVED, fake_instance_app

from router.core import CallRejected, RouterCore
from router.instances.deadlines import Deadlines
from router.instances.http import HttpInstanceClient
from talaria.protocol import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceState,
    InstanceUnavailable,
    ModelState,
    Overloaded,
    Residency,
    SamplingParams,
    SessionKV,
    to_json,
)


def call() -> CallRequest:
    return CallRequest("c1", "s", "m", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0),
                       expected_gap_s=1.5)


async def retry_after(client: HttpInstanceClient) -> float:
    """The retry hint of the Overloaded a call to ``client`` must raise."""
    with pytest.raises(Overloaded) as info:
        [e async for e in client.submit(call())]
    return info.value.retry_after_s


async def test_stream_state_abort_health() -> None:
    mode = {"calls": "ok"}
    app = fake_instance_app(mode)
    async with TestServer(app) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        events = [e async for e in client.submit(call())]
        assert [e.token_ids for e in events] == [[7], [8], [9]]
        assert events[-1].finished and events[-1].usage == CallUsage(4, 3, 1)
        sent = app[RECEIVED][0]
        assert sent == call()  # the request crossed intact, sampling params included
        state = await client.state()
        assert state.models["m"].residency == Residency.ACTIVE and state.switches == 2
        assert state.sessions["s"].device_tokens == 5
        await client.abort("c1")
        assert app[ABORTED] == ["c1"]
        assert await client.health()

        mode["calls"] = "big"
        events = [e async for e in client.submit(call())]
        assert len(events) == 1 and events[0].token_ids == list(range(40_000))

        mode["calls"] = "overloaded"
        assert await retry_after(client) == 4.0
        mode["calls"] = "bad"
        with pytest.raises(CallRejected) as rejected:
            [e async for e in client.submit(call())]
        assert rejected.value.status == 404 and "model not here" in rejected.value.message
        mode["calls"] = "crash"
        with pytest.raises(InstanceUnavailable, match="HTTP 500"):
            [e async for e in client.submit(call())]
        await client.close()


async def test_unreachable_instance() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HttpInstanceClient("gone", f"http://127.0.0.1:{port}", connect_timeout_s=1.0)
    with pytest.raises(InstanceUnavailable, match="cannot reach"):
        [e async for e in client.submit(call())]
    with pytest.raises(InstanceUnavailable):
        await client.state()
    assert not await client.health()
    await client.close()


def held_streams_app(release: asyncio.Event, opened: list[str]) -> web.Application:
    """An instance whose calls send one token, then hold their stream open until ``release``."""

    async def calls(request: web.Request) -> web.StreamResponse:
        call = CallRequest.from_dict(orjson.loads(await request.read()))
        opened.append(call.call_id)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(to_json(CallEvent(call.call_id, [7])) + b"\n")
        await release.wait()
        await resp.write(to_json(CallEvent(call.call_id, [8], finished=True, finish_reason="stop")) + b"\n")
        await resp.write_eof()
        return resp

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=to_json(InstanceState("i0")), content_type="application/json")

    async def abort(request: web.Request) -> web.Response:
        return web.json_response({"aborted": True})

    app = web.Application()
    app.router.add_post("/internal/v1/calls", calls)
    app.router.add_get("/internal/v1/state", state)
    app.router.add_post("/internal/v1/state", state)  # the router polls by POST
    app.router.add_post("/internal/v1/calls/{call_id}/abort", abort)
    app.router.add_get("/health", lambda _r: web.json_response({"status": "ok"}))  # type: ignore[arg-type, return-value]
    return app


async def test_polls_and_aborts_do_not_wait_behind_many_open_streams() -> None:
    """More open call streams than aiohttp's default pool (100): every call reaches the
    instance, and its state poll, an abort and a health check still answer in time."""
    release = asyncio.Event()
    opened: list[str] = []
    n = 130
    async with TestServer(held_streams_app(release, opened)) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        core = RouterCore({"i0": client}, "load", refresh_after_call=False,
                          deadlines=Deadlines(state_s=2.0))
        streams = [core.submit(CallRequest(f"c{i}", f"s{i}", "m", [1, 2, 3], SamplingParams(max_tokens=2)))
                   for i in range(n)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        for _ in range(500):
            if len(opened) == n:
                break
            await asyncio.sleep(0.01)
        assert len(opened) == n  # none waits for a connection in the router
        await asyncio.wait_for(asyncio.gather(*firsts), 10)
        assert await core.refresh("i0") and "i0" in core.healthy
        async with asyncio.timeout(2.0):
            await client.abort("c0")
            assert await client.health()
        release.set()
        for stream in streams:
            assert [e.token_ids async for e in stream] == [[8]]
        await core.close()
        await client.close()


def state_dict(**changes: object) -> dict:
    st = InstanceState("i0", active_model="m", sessions={"s": SessionKV("s", "m", device_tokens=5)})
    st.models["m"] = ModelState("m", residency=Residency.ACTIVE, wait_s=1.5, prefill_tokens_per_s=900.0)
    data = orjson.loads(to_json(st))
    data.update(changes)
    return data


def test_a_state_with_fields_this_router_does_not_know_parses() -> None:
    """Version skew: a newer instance's extra fields (and residencies) are ignored, an older
    one's missing fields take their defaults."""
    data = state_dict(future_field=[1, 2], now=12.5)
    data["models"]["m"]["speculative"] = True
    data["models"]["n"] = {"name": "n", "residency": "hibernating"}
    data["sessions"]["s"]["priority"] = "high"
    del data["switches"]
    st = InstanceState.from_dict(data)
    assert st.instance_id == "i0" and st.now == 12.5 and st.switches == 0
    assert st.models["m"].wait_s == 1.5 and st.models["m"].residency == Residency.ACTIVE
    assert st.models["n"].residency == Residency.ABSENT
    assert st.sessions["s"] == SessionKV("s", "m", device_tokens=5)
    assert InstanceState.from_dict(orjson.loads(to_json(st))) == st


@pytest.mark.parametrize(
    "where, field, value",
    [
        ("models", "wait_s", "1.5"),
        ("models", "prefill_tokens_per_s", -3.0),
        ("models", "queued_calls", True),
        ("models", "residency", 3),
        ("sessions", "device_tokens", 2.5),
        ("sessions", "reserved_until", "soon"),
        ("state", "free_kv_blocks", None),
        ("state", "healthy", "yes"),
        ("state", "models", []),
        ("state", "instance_id", 7),
    ],
)
def test_a_wrongly_typed_state_field_is_refused(where: str, field: str, value: object) -> None:
    data = state_dict()
    target = {"models": data["models"]["m"], "sessions": data["sessions"]["s"], "state": data}[where]
    target[field] = value
    with pytest.raises(ValueError, match=field):
        InstanceState.from_dict(data)


async def test_a_bad_state_is_a_failed_poll_and_a_state_naming_another_instance_too() -> None:
    report: dict = {"state": state_dict()}

    async def state(request: web.Request) -> web.Response:
        return web.json_response(report["state"])

    app = web.Application()
    app.router.add_get("/internal/v1/state", state)
    app.router.add_post("/internal/v1/state", state)  # the router polls by POST
    async with TestServer(app) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")))
        core = RouterCore({"i0": client}, "load", refresh_after_call=False)
        assert await core.refresh("i0")
        report["state"] = state_dict(models={"m": {"name": "m", "residency": "active", "wait_s": "x"}})
        with pytest.raises(InstanceUnavailable, match="wait_s"):
            await client.state()
        assert not await core.refresh("i0") and "i0" not in core.healthy
        report["state"] = state_dict(instance_id="i1")
        assert not await core.refresh("i0") and "i0" not in core.healthy
        assert set(core.states) == {"i0"} and core.states["i0"].models["m"].wait_s == 1.5
        report["state"] = state_dict()
        assert await core.refresh("i0") and "i0" in core.healthy
        await client.close()



async def test_bad_retry_hints_and_an_endless_event_fail_cleanly() -> None:
    mode = {"calls": "bad retry"}
    async with TestServer(fake_instance_app(mode)) as server:
        client = HttpInstanceClient("i0", str(server.make_url("/")), max_event_bytes=1 << 20)
        assert await retry_after(client) == 1.0
        mode["calls"] = "header retry"
        assert await retry_after(client) == 7.0
        mode["inf"] = "yes"
        assert await retry_after(client) == 1.0
        mode["calls"] = "endless"
        with pytest.raises(InstanceUnavailable, match="longer than"):
            await asyncio.wait_for(anext(client.submit(call())), 30)
        await client.close()


def test_an_overloaded_answer_clamps_its_retry_after() -> None:
    from talaria.protocol.errors import MAX_RETRY_AFTER_S, overloaded

    assert overloaded("busy", float("inf")).headers["Retry-After"] == str(int(MAX_RETRY_AFTER_S))
    assert overloaded("busy", float("nan")).headers["Retry-After"] == "1"
    assert overloaded("busy", 2.5).headers["Retry-After"] == "3"
