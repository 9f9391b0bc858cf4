"""RouterCore with fake instances: placement, retry, failures, aborts, session books."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
from router_fakes import FakeInstance, model_state

from router.core import CallRejected, NoHealthyInstance, RouterCore
from router.instances.inprocess import InProcessClient
from talaria.protocol import (
    CallEvent,
    CallRequest,
    InstanceState,
    Overloaded,
    SamplingParams,
    SessionKV,
)

REPLY = [10, 11, 12, 13, 14]


def request(session: str = "s", prompt: list[int] | None = None, max_tokens: int = 5, last: bool = False) -> CallRequest:
    prompt = prompt or list(range(40))
    return CallRequest(f"c{len(prompt)}-{session}", session, "m", prompt, SamplingParams(max_tokens=max_tokens),
                       last_call=last)


async def drain(core: RouterCore, call: CallRequest) -> list:
    return [e async for e in core.submit(call)]


async def test_streams_events_tagged_with_instance_and_updates_books() -> None:
    a = FakeInstance("a", REPLY, cached_tokens=7)
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False)
    events = await drain(core, request())
    assert [t for e in events for t in e.token_ids] == REPLY
    assert all(e.instance_id == "a" for e in events)
    assert events[-1].finished and events[-1].usage.cached_tokens == 7
    rec = core.sessions.get("s")
    assert rec is not None and rec.instance_id == "a" and rec.main.kv_tokens == 45
    assert rec.main.kv.blocks == 45 // 16
    assert core.context.outstanding_tokens["a"] == 0
    assert core.metrics.requests.get(model="m", instance="a", outcome="ok") == 1
    assert core.metrics.completion_tokens.get(model="m") == 5
    assert core.metrics.cached_tokens.get(model="m") == 7
    assert core.metrics.ttft.count(model="m") == 1


async def test_retries_once_on_next_best_before_first_token() -> None:
    down = FakeInstance("a", REPLY, unavailable=True)
    up = FakeInstance("b", REPLY)
    core = RouterCore({"a": down, "b": up}, "load", refresh_after_call=False)
    events = await drain(core, request())
    assert len(down.calls) == 1 and len(up.calls) == 1
    assert events[-1].instance_id == "b"
    assert "a" not in core.healthy
    assert core.metrics.retries.get(model="m") == 1


async def test_only_one_retry() -> None:
    clients = {i: FakeInstance(i, REPLY, unavailable=True) for i in "abc"}
    core = RouterCore(clients, "load", refresh_after_call=False)
    with pytest.raises(NoHealthyInstance):
        await drain(core, request())
    assert sum(len(c.calls) for c in clients.values()) == 2
    assert core.sessions.get("s") is not None  # the session remains, with no instance
    assert core.metrics.requests.get(model="m", instance="none", outcome="error") == 1


async def test_no_healthy_instance() -> None:
    a = FakeInstance("a", REPLY)
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False)
    core.mark_down("a", "test")
    with pytest.raises(NoHealthyInstance, match="no healthy instance"):
        await drain(core, request())
    assert a.calls == []


async def test_overloaded_everywhere_raises_overloaded_with_shortest_retry() -> None:
    core = RouterCore({"a": FakeInstance("a", REPLY, overloaded=True),
                       "b": FakeInstance("b", REPLY, overloaded=True)}, "load", refresh_after_call=False)
    with pytest.raises(Overloaded) as info:
        await drain(core, request())
    assert info.value.retry_after_s == 2.5
    assert core.healthy == {"a", "b"}  # overloaded is not down


async def test_failure_after_first_token_ends_with_error_event() -> None:
    a = FakeInstance("a", REPLY, fail_after=2)
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False)
    events = await drain(core, request())
    assert [t for e in events for t in e.token_ids] == REPLY[:2]
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert "died mid-call" in events[-1].error
    assert len(a.calls) == 1  # no retry after the first token
    assert core.metrics.requests.get(model="m", instance="a", outcome="error") == 1


async def test_consumer_closing_early_aborts_on_instance() -> None:
    hold = asyncio.Event()
    a = FakeInstance("a", REPLY, hold=hold)
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False)
    call = request()
    stream = core.submit(call)
    async with contextlib.aclosing(stream):
        first = await anext(stream)
        assert first.token_ids == REPLY[:1]
    assert a.aborted == [call.call_id]
    assert core.metrics.requests.get(model="m", instance="a", outcome="aborted") == 1
    assert core.context.outstanding_tokens["a"] == 0


async def test_session_sticks_with_its_kv_until_its_instance_fails() -> None:
    """End to end through the core: a session's calls return to the instance that reports
    its KV, even when that instance's queue grows; when it is unhealthy, the next call goes
    elsewhere."""
    a = FakeInstance("a", REPLY)
    b = FakeInstance("b", REPLY)
    core = RouterCore({"a": a, "b": b}, "talaria", refresh_after_call=False)
    ms = {"prefill_tokens_per_s": 1000.0}
    core.update_state(InstanceState("a", models={"m": model_state("m", **ms)}))
    core.update_state(InstanceState("b", models={"m": model_state("m", **ms)}))
    await drain(core, request(prompt=list(range(400))))
    first = core.sessions.get("s").instance_id
    other = "b" if first == "a" else "a"
    core.update_state(InstanceState(first, models={"m": model_state("m", **ms)},
                                    sessions={"s": SessionKV("s", "m", device_tokens=405)}))
    await drain(core, request(prompt=list(range(600))))
    assert core.sessions.get("s").instance_id == first
    assert core.metrics.placements.get(instance=first, returning="yes") == 1
    core.update_state(InstanceState(first, models={"m": model_state("m", queued_tokens=2000, **ms)},
                                    sessions={"s": SessionKV("s", "m", device_tokens=605)}))
    await drain(core, request(prompt=list(range(800))))
    assert core.metrics.placements.get(instance=first, returning="yes") == 2
    assert len({"a": a, "b": b}[other].calls) == 0
    core.mark_down(first, "test")
    await drain(core, request(prompt=list(range(900)), last=True))
    assert core.sessions.get("s") is None  # last_call ended it
    assert len({"a": a, "b": b}[other].calls) == 1
    assert core.metrics.sct.count(model="m") == 1


async def test_state_refreshed_after_call() -> None:
    a = FakeInstance("a", REPLY, state=InstanceState("a", switches=3))
    core = RouterCore({"a": a}, "talaria")
    await drain(core, request())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert a.state_polls == 1 and core.states["a"].switches == 3
    await core.close()


async def test_injected_clock_times_the_session() -> None:
    now = [100.0]
    core = RouterCore({"a": FakeInstance("a", REPLY)}, "talaria", clock=lambda: now[0],
                      refresh_after_call=False)
    await drain(core, request())
    now[0] = 103.0
    await drain(core, request(last=True))
    assert core.metrics.sct.count(model="m") == 1
    assert core.metrics.sct.series[(("model", "m"),)][1] == [3.0]  # first call sent -> last done


class DuckInstance:
    """Shaped like talaria's in-process Instance: sync submit checks, async stream, sync
    abort and state."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def stream(self, call: CallRequest):  # type: ignore[no-untyped-def]
        if call.model != "m":
            raise ValueError(f"model {call.model!r} is not served here")
        for i, tok in enumerate(REPLY):
            yield CallEvent(call.call_id, [tok], finished=i == len(REPLY) - 1, finish_reason="stop")

    def abort(self, call_id: str, answered: bool = False) -> bool:
        self.aborted.append(call_id)
        return True

    def state(self) -> InstanceState:
        return InstanceState("d", switches=9)


async def test_in_process_client_adapts_an_instance_object() -> None:
    duck = DuckInstance()
    core = RouterCore({"d": InProcessClient("d", duck)}, "talaria")
    events = await drain(core, request())
    assert [t for e in events for t in e.token_ids] == REPLY
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert core.states["d"].switches == 9
    stream = core.submit(request(session="t"))
    async with contextlib.aclosing(stream):
        await anext(stream)
    assert len(duck.aborted) == 1
    bad = CallRequest("x", "s", "zz", [1], SamplingParams())
    with pytest.raises(CallRejected, match="not served here"):
        await drain(core, bad)
    with pytest.raises(TypeError, match="no stream"):
        InProcessClient("e", object())
    await core.close()


class CountedState(FakeInstance):
    """Counts its state polls, how many ran at once, and what each one saw; a poll waits
    for ``gate`` while it is cleared."""

    def __init__(self, instance_id: str, seen: Callable[[], int]) -> None:
        super().__init__(instance_id, REPLY)
        self.gate = asyncio.Event()
        self.gate.set()
        self.seen = seen
        self.saw: list[int] = []
        self.running = 0
        self.most_at_once = 0

    async def state(self) -> InstanceState:
        self.saw.append(self.seen())
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await self.gate.wait()
            return await super().state()
        finally:
            self.running -= 1


async def settle(core: RouterCore) -> None:
    for _ in range(1000):
        if core._polls.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the state polls never settled")


async def test_a_burst_of_call_ends_costs_one_or_two_polls_and_the_last_sees_them_all() -> None:
    core: RouterCore
    a = CountedState("a", lambda: int(core.metrics.requests.get(model="m", instance="a", outcome="ok")))
    core = RouterCore({"a": a}, "load")
    await asyncio.gather(*(drain(core, request(session=f"s{i}")) for i in range(20)))
    await settle(core)
    assert 1 <= len(a.saw) <= 2 and a.saw[-1] == 20
    await drain(core, request(session="late"))
    await settle(core)
    assert a.saw[-1] == 21
    await core.close()


async def test_polls_of_one_instance_join_the_one_in_flight() -> None:
    a = CountedState("a", lambda: 0)
    core = RouterCore({"a": a}, "load")
    a.gate.clear()
    polls = [asyncio.ensure_future(core.refresh("a")) for _ in range(5)]
    for _ in range(100):
        if len(a.saw):
            break
        await asyncio.sleep(0)
    await drain(core, request())  # ends while the poll is in flight: one more poll after it
    await asyncio.sleep(0.1)
    assert len(a.saw) == 1
    a.gate.set()
    assert await asyncio.gather(*polls) == [True] * 5
    await settle(core)
    assert len(a.saw) == 2 and a.most_at_once == 1
    await core.close()
