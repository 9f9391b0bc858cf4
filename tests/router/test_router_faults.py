"""Every hop has a deadline and every failure is accounted for: a hung or stalling instance
(first-token and stall deadlines, abort there, retry before the first token), health from call
outcomes that a healthy poll cannot override, polls that do not wait on each other, a
malformed or version-skewed instance stream, the placement counters, and a client that leaves
while its call waits for its first token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from api_helpers import chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.core import RouterCore
from router.instances.health import HealthPoller
from router.instances.http import HttpInstanceClient
from router.tokenization import ModelTokenizer
from talaria.protocol import (
    CallEvent,
    CallRequest,
    InstanceState,
    ModelState,
    SamplingParams,
    to_json,
)

REPLY = [10, 11, 12, 13, 14]


def fast() -> Any:
    """Short deadlines (imported here: the tests below that need none run on any router)."""
    from router.instances.deadlines import Deadlines

    return Deadlines(first_token_s=0.2, stall_s=0.2, state_s=0.2)


def rules(**kw: Any) -> Any:
    from router.instances.call_health import HealthRules

    return HealthRules(**kw)


class Hung(FakeInstance):
    """Answers its state, never a call's first event (or, with ``after`` set, stalls after
    that many events)."""

    def __init__(self, instance_id: str, after: int | None = None) -> None:
        super().__init__(instance_id, REPLY)
        self.after = after

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        for i, token in enumerate(REPLY):
            if self.after is None or i == self.after:
                await asyncio.Event().wait()
            yield CallEvent(call.call_id, [token])


class HungState(FakeInstance):
    async def state(self) -> InstanceState:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def request(i: int) -> CallRequest:
    return CallRequest(f"c{i}", f"s{i}", "m", list(range(40)), SamplingParams(max_tokens=5))


async def test_a_hung_instance_misses_the_first_token_deadline_and_the_call_moves() -> None:
    now = [0.0]
    hung, good = Hung("a"), FakeInstance("b", REPLY)
    core = RouterCore({"a": hung, "b": good}, "load", deadlines=fast(), refresh_after_call=False,
                      health_rules=rules(failures_to_down=2, cooldown_s=30.0),
                      clock=lambda: now[0])
    done = []
    for i in range(2):
        events = [e async for e in core.submit(request(i))]
        done.append(events[-1])
    assert all(e.finished and e.instance_id == "b" for e in done)
    assert hung.aborted == ["c0", "c1"]  # each timed-out call was aborted where it hung
    assert core.metrics.call_failures.get(instance="a", kind="deadline") == 2
    assert core.metrics.retries.get(model="m") == 2
    assert core.healthy == {"b"}  # two failures in a row: down for the cooldown
    await core.refresh("a")  # its /state still answers healthy...
    assert core.healthy == {"b"}  # ...but the cooldown holds
    now[0] = 31.0
    await core.refresh("a")
    assert core.healthy == {"a", "b"}  # back on probation after the cooldown


async def test_a_stall_after_the_first_token_ends_in_an_error_event_and_an_abort() -> None:
    stalls = Hung("a", after=2)
    core = RouterCore({"a": stalls}, "load", deadlines=fast(), refresh_after_call=False)
    events = [e async for e in core.submit(request(0))]
    assert [e.token_ids for e in events[:2]] == [[10], [11]]
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert "no event after the last within 0.2 s" in (events[-1].error or "")
    assert stalls.aborted == ["c0"]
    assert core.metrics.call_failures.get(instance="a", kind="deadline") == 1


async def test_a_call_that_finishes_clears_the_failure_count() -> None:
    a = FakeInstance("a", REPLY)
    core = RouterCore({"a": a}, "load", refresh_after_call=False,
                      health_rules=rules(failures_to_down=2))
    core.call_failed("a", TimeoutError("one"))
    [e async for e in core.submit(request(0))]
    core.call_failed("a", TimeoutError("two"))
    assert core.healthy == {"a"}  # not two in a row


async def test_polls_do_not_wait_on_each_other() -> None:
    stuck, fine = HungState("a", REPLY), FakeInstance("b", REPLY)
    core = RouterCore({"a": stuck, "b": fine}, "load", deadlines=fast())
    poller = HealthPoller(core, interval_s=0.05)
    ctx = poller.context()
    await anext(ctx)
    try:
        for _ in range(100):
            if fine.state_polls >= 5:
                break
            await asyncio.sleep(0.02)
    finally:
        await ctx.aclose()
    assert fine.state_polls >= 5  # b polled every interval while a's /state hangs
    assert core.healthy == {"b"}  # a's poll missed the state deadline
    assert await asyncio.wait_for(poller.poll_once(), 1.0) == {"a": False, "b": True}


class Gated(FakeInstance):
    """Holds each call named in ``gates`` before its first event until its gate is set."""

    def __init__(self, instance_id: str, gates: dict[str, asyncio.Event]) -> None:
        super().__init__(instance_id, REPLY)
        self.gates = gates

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        if call.call_id in self.gates:
            await self.gates[call.call_id].wait()
        async for event in super().submit(call):
            yield event


async def test_prefill_leaves_the_placement_counters_once() -> None:
    gate = asyncio.Event()
    a = Gated("a", {"c2": gate})
    core = RouterCore({"a": a}, "load", refresh_after_call=False)
    second = core.submit(CallRequest("c2", "s2", "m", list(range(30)), SamplingParams(max_tokens=5)))
    second_first = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0.01)  # placed and sent: its 30 prompt tokens are outstanding prefill
    assert core.context.outstanding_prefill["a"] == 30
    first = [e async for e in core.submit(request(1))]  # another call runs start to finish
    assert first[-1].finished
    assert core.context.outstanding_prefill["a"] == 30  # the waiting call's prefill still counts
    gate.set()
    await second_first
    [e async for e in second]
    assert core.context.outstanding_prefill["a"] == 0
    assert core.context.outstanding_tokens["a"] == 0


async def test_a_downed_instance_leaves_the_prefix_index() -> None:
    a, b = FakeInstance("a", REPLY), FakeInstance("b", REPLY)
    core = RouterCore({"a": a, "b": b}, "load", refresh_after_call=False)
    [e async for e in core.submit(request(1))]
    placed = core.sessions.get("s1").instance_id
    hashes = core.placement_call(request(1)).block_hashes
    assert core.context.prefix_index.match_blocks(placed, "m", hashes) == len(hashes)
    core.mark_down(placed, "test")
    assert core.context.prefix_index.match_blocks(placed, "m", hashes) == 0


def skewed_instance(lines: list[bytes]) -> web.Application:
    """An instance whose stream is given line by line (``{id}`` becomes the call id)."""

    async def calls(request: web.Request) -> web.StreamResponse:
        call_id = orjson.loads(await request.read())["call_id"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in lines:
            await resp.write(line.replace(b"{id}", call_id.encode()) + b"\n")
        await resp.write_eof()
        return resp

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=to_json(InstanceState("a")), content_type="application/json")

    app = web.Application()
    app.router.add_post("/internal/v1/calls", calls)
    app.router.add_get("/internal/v1/state", state)
    app.router.add_post("/internal/v1/state", state)  # the router polls by POST
    app.router.add_post("/internal/v1/calls/{call_id}/abort", state)
    return app


async def _through_router(tokenizer: ModelTokenizer, lines: list[bytes]) -> list:
    server = TestServer(skewed_instance(lines))
    await server.start_server()
    client = HttpInstanceClient("a", str(server.make_url("/")))
    try:
        async with serve(tokenizer, {"a": client}) as router:
            return await sse(await router.post("/v1/chat/completions", json=chat_body(stream=True)))
    finally:
        await client.close()
        await server.close()


async def test_a_malformed_line_mid_stream_ends_in_an_error_event_then_done(
    tokenizer: ModelTokenizer,
) -> None:
    token = reply(tokenizer)[0]
    first = b'{"call_id": "{id}", "token_ids": [%d]}' % token
    events = await _through_router(tokenizer, [first, b"{garbage", first])
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "instance_failed"


async def test_unknown_fields_in_an_instance_event_are_ignored(tokenizer: ModelTokenizer) -> None:
    token = reply(tokenizer)[0]
    lines = [
        b'{"call_id": "{id}", "token_ids": [%d], "new_field": 1}' % token,
        b'{"call_id": "{id}", "token_ids": [%d], "finished": true, "finish_reason": "length",'
        b' "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0,'
        b' "restored_tokens": 0, "speculated_tokens": 7}}' % token,
    ]
    events = await _through_router(tokenizer, lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("cancel_handlers", [False, True], ids=["served", "handler-cancelled"])
async def test_a_client_that_leaves_before_the_first_token_aborts_its_call(
    tokenizer: ModelTokenizer, cancel_handlers: bool
) -> None:
    """As ``talaria serve`` runs it (handlers are not cancelled: the router notices the client
    left while it waits) and with handler cancellation (aiohttp's test server)."""
    hung = Hung("a")
    config = RouterConfig(models={"tiny": "/unused"}, instances={"a": ""}, poll_interval_s=None)
    runner = web.AppRunner(create_app(config, {"a": hung}, tokenizers={"tiny": tokenizer}),
                           handler_cancellation=cancel_handlers)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as http:
            task = asyncio.ensure_future(http.post(url, json=chat_body()))
            for _ in range(200):
                if hung.calls:
                    break
                await asyncio.sleep(0.01)
            task.cancel()  # the client goes away while its call waits in the instance's queue
        for _ in range(300):
            if hung.aborted:
                break
            await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert hung.aborted == [hung.calls[0].call_id]


def test_one_burst_of_failures_costs_one_cooldown_and_probation_doubles_it() -> None:
    from router.instances.call_health import CallHealth

    health = CallHealth(rules(failures_to_down=3, cooldown_s=5.0))
    assert [health.failure("a", 0.0) for _ in range(3)] == [False, False, True]
    assert all(health.failure("a", 1.0) for _ in range(20))  # the same episode
    assert not health.may_come_back("a", 4.9) and health.may_come_back("a", 5.0)
    assert health.failure("a", 6.0)  # on probation: one failure starts the next cooldown
    assert not health.may_come_back("a", 15.9) and health.may_come_back("a", 16.0)
    health.success("a")
    assert not health.failure("a", 20.0)  # a good call clears everything


async def test_with_no_healthy_instance_calls_go_to_one_cooling_down() -> None:
    now = [0.0]
    a, b = FakeInstance("a", REPLY), FakeInstance("b", REPLY)
    core = RouterCore({"a": a, "b": b}, "load", refresh_after_call=False, clock=lambda: now[0],
                      health_rules=rules(failures_to_down=1, cooldown_s=60.0))
    core.call_failed("a", TimeoutError("slow"))  # a cools down
    await core.refresh("a")  # its polls still answer
    assert core.healthy == {"b"} and core.suspect == {"a"}
    [e async for e in core.submit(request(1))]
    assert len(b.calls) == 1 and not a.calls  # b is healthy: a is not used
    b.unavailable = True
    await core.refresh("b")  # b is gone
    events = [e async for e in core.submit(request(2))]
    assert events[-1].finished and events[-1].instance_id == "a"  # better than a 503


class Slow(FakeInstance):
    """Answers a call's first event only after ``delay_s`` (a call waiting its turn)."""

    def __init__(self, instance_id: str, delay_s: float, wait_s: float) -> None:
        state = InstanceState(instance_id=instance_id,
                              models={"m": ModelState(name="m", wait_s=wait_s)})
        super().__init__(instance_id, REPLY, state=state)
        self.delay_s = delay_s
        self.received: list[str] = []

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.received.append(call.call_id)
        await asyncio.sleep(self.delay_s)
        async for event in super().submit(call):
            yield event


@pytest.mark.parametrize(("reported_wait_s", "cut"), [(0.0, True), (0.5, False)])
async def test_the_first_token_deadline_counts_the_wait_the_instance_reported(
    reported_wait_s: float, cut: bool
) -> None:
    """0.4 s to a first token against a 0.2 s deadline: cut (and retried elsewhere) when the
    instance said the model was ready, kept when it said the call would wait 0.5 s."""
    slow, spare = Slow("a", 0.4, reported_wait_s), FakeInstance("b", REPLY)
    core = RouterCore({"a": slow, "b": spare}, "load", deadlines=fast(), refresh_after_call=False)
    await core.refresh("a")
    await core.refresh("b")
    core.policy.choose = lambda *args: ["a", "b"]  # type: ignore[method-assign]
    events = [e async for e in core.submit(request(0))]
    assert slow.received == ["c0"]
    assert events[-1].finished and events[-1].error is None
    assert events[-1].instance_id == ("b" if cut else "a")
    assert slow.aborted == (["c0"] if cut else [])


async def test_a_restarted_instance_leaves_its_call_failure_cooldown() -> None:
    """An instance restarted during a cooldown (its report's epoch changed) is a new process:
    the old one's failures no longer hold it out (it stayed out for up to 120 s)."""
    now = [0.0]
    a, b = FakeInstance("a", REPLY), FakeInstance("b", REPLY)
    a.state_obj.epoch = "first"
    core = RouterCore({"a": a, "b": b}, "load", refresh_after_call=False, clock=lambda: now[0],
                      health_rules=rules(failures_to_down=1, cooldown_s=60.0))
    await core.refresh("a")
    core.call_failed("a", TimeoutError("slow"))
    await core.refresh("a")
    assert core.healthy == {"b"}  # the same process: the cooldown holds
    a.state_obj.epoch = "second"
    await core.refresh("a")
    assert core.healthy == {"a", "b"} and not core.suspect
    core.call_failed("a", TimeoutError("slow"))
    assert core.healthy == {"b"}  # a new record: one failure is a first cooldown again


def test_a_report_carries_the_epoch_of_its_sessions() -> None:
    from talaria.protocol.state_delta import parse_report

    state, _ = parse_report({"instance_id": "a", "sessions_epoch": "e1", "sessions_version": 0,
                             "sessions_full": True, "sessions_removed": []})
    assert state.epoch == "e1"
    assert parse_report({"instance_id": "a"})[0].epoch is None  # a plain report has none
