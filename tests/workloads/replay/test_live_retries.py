"""The live replay client re-sends a call as an agent would: after a broken connection, a 502
or 503, or a stream that ends in an error event (and after a 429's Retry-After), counting
each re-send; a 4xx other than 429 is final, and so is a stream it cannot read."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from talaria.protocol import CallRequest, SamplingParams
from workloads.replay import live
from workloads.replay.live import LiveTarget
from workloads.replay.prompts import SessionTokens

USAGE = {"prompt_tokens": 3, "completion_tokens": 2,
         "prompt_tokens_details": {"cached_tokens": 2, "restored_tokens": 1}}


MALFORMED = {"garbled": b"data: {not json\n\n", "list": b"data: [1, 2]\n\n",
             "no-counts": b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'}


RETRY_AFTER = {"429": "0", "429-date": "Wed, 21 Oct 2015 07:28:00 GMT", "429-text": "soon"}


def router(script: list[str]) -> web.Application:
    """Answers each request with the next step of ``script``: "502", "503", "429" (its
    Retry-After in seconds, an HTTP date, or neither: ``RETRY_AFTER``), "400",
    "error" (a 200 stream ending in an error event), "drop" (the connection closes mid-stream),
    a stream with a line that is not JSON ("garbled"), not an object ("list"), or with usage
    missing its counts ("no-counts"), or "ok"."""
    seen: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        step = script[len(seen)]
        seen.append(step)
        if step in ("502", "503", "400"):
            return web.json_response({"error": {"message": step}}, status=int(step))
        if step.startswith("429"):
            return web.json_response({"error": {"message": "busy"}}, status=429,
                                     headers={"Retry-After": RETRY_AFTER[step]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if step == "drop":
            assert request.transport is not None
            request.transport.close()
            return resp
        if step == "error":
            await resp.write(b'data: {"error": {"message": "failed"}}\n\n')
        elif step in MALFORMED:
            await resp.write(MALFORMED[step])
        else:
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def send(script: list[str]) -> tuple[object, int]:
    server = TestServer(router(script))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            target = LiveTarget(http, str(server.make_url("/v1")))
            call = CallRequest("c", "s", "m", [1, 2, 3], SamplingParams(max_tokens=2))
            outcome = await target.call(call, SessionTokens("s", 0, 100))
            return outcome, target.retries
    finally:
        await server.close()


async def test_failures_an_agent_would_retry_are_re_sent_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live, "RETRY_WAIT_S", 0.0)
    outcome, retries = await send(["502", "503", "error", "drop", "429", "ok"])
    assert outcome.error is None and len(outcome.output_token_ids) == 2  # type: ignore[attr-defined]
    assert retries == 5
    # the usage's host-restored tokens reach the replay's records, as the simulator's do
    assert (outcome.cached_tokens, outcome.restored_tokens) == (2, 1)  # type: ignore[attr-defined]


async def test_a_retry_after_that_is_a_date_or_unreadable_is_waited_not_fatal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HTTP allows Retry-After as a date; it used to end the replay (a float() of it)."""
    monkeypatch.setattr(live, "BUSY_WAIT_S", 0.0)
    outcome, retries = await send(["429-date", "429-text", "ok"])
    assert outcome.error is None and retries == 2  # type: ignore[attr-defined]


def test_retry_after_reads_seconds_or_a_date_else_the_clients_own_wait() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert live.retry_after_s("7", now) == 7.0
    assert live.retry_after_s("Wed, 01 Jan 2025 12:00:30 GMT", now) == 30.0
    assert live.retry_after_s("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0  # past: at once
    for unreadable in (None, "", "soon", "-3", "nan", "inf", "Wed, 99 Foo 2025"):
        assert live.retry_after_s(unreadable, now) == live.BUSY_WAIT_S


async def test_a_client_error_is_final() -> None:
    outcome, retries = await send(["400", "ok"])
    assert outcome.error is not None and "HTTP 400" in outcome.error  # type: ignore[attr-defined]
    assert retries == 0


@pytest.mark.parametrize("step", sorted(MALFORMED))
async def test_a_stream_it_cannot_read_fails_that_call_not_the_replay(step: str) -> None:
    """A line of the stream that is not a JSON object (or usage without its counts) used to
    raise out of the call and end the whole replay: it is that call's failure, not re-sent."""
    outcome, retries = await send([step, "ok"])
    assert outcome.error is not None and "malformed" in outcome.error  # type: ignore[attr-defined]
    assert outcome.output_token_ids == [] and retries == 0  # type: ignore[attr-defined]


async def test_a_call_past_the_client_timeout_is_a_failed_call_not_the_end_of_the_replay() -> None:
    """A stream that stalls until the replay's per-call timeout (``live_replay``'s
    ``timeout_s``) ends that call with an error; the replay goes on to report it."""
    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await asyncio.sleep(30.0)
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
            target = LiveTarget(http, str(server.make_url("/v1")))
            call = CallRequest("c", "s", "m", [1, 2, 3], SamplingParams(max_tokens=2))
            outcome = await asyncio.wait_for(target.call(call, SessionTokens("s", 0, 100)), 20.0)
    finally:
        await server.close()
    assert outcome.error is not None and "timed out" in outcome.error
    assert outcome.first_token_s is not None and outcome.output_token_ids == []
    assert target.retries == 0


async def test_a_router_with_an_api_key_is_replayed_with_it() -> None:
    """``api_key`` reaches every request of the replay, the model list included: the router
    answers ``/v1/models`` with 401 without it, as it does every ``/v1/`` path."""
    from workloads.replay.live import live_replay
    from workloads.traces.trace import Call, Session

    def authorized(request: web.Request) -> bool:
        return request.headers.get("Authorization") == "Bearer secret-key"

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        if not authorized(request):
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app)
    await server.start_server()
    try:
        result, info = await live_replay(
            [Session("s", "m", (Call(8, 2, None),))], str(server.make_url("/v1")),
            api_key="secret-key", progress=False, timeout_s=20.0,
        )
    finally:
        await server.close()
    assert result.failed_calls == 0 and len(result.calls) == 1
    assert info["retries"] == 0
