"""Calls waiting on an instance that is marked down for not answering are cut within the
grace: re-placed before their first event, ended with an error event after it; a stream that
flows, or an instance that answers but fails calls, is not cut. How calls that raise are
counted (a client that left is not an error)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fault_fakes import FaultyInstance

from router.core import CallRejected, RouterCore
from router.instances.call_health import HealthRules
from router.instances.deadlines import Deadlines
from talaria.protocol import CallEvent, CallRequest, InstanceUnavailable, SamplingParams

# Call deadlines far beyond anything a test waits for: only a mark down can end a wait.
LONG = Deadlines(first_token_s=300.0, stall_s=60.0, state_s=0.1, down_grace_s=0.1)


def call(i: int = 0, max_tokens: int = 6) -> CallRequest:
    return CallRequest(f"c{i}", f"s{i}", "m", list(range(40)), SamplingParams(max_tokens=max_tokens))


def core_over(*instances: FaultyInstance, **kw: Any) -> RouterCore:
    core = RouterCore({i.instance_id: i for i in instances}, "load", refresh_after_call=False,
                      deadlines=kw.pop("deadlines", LONG), **kw)
    order = [i.instance_id for i in instances]
    core.policy.choose = lambda *args: [i for i in order if i in args[-1]]  # type: ignore[method-assign]
    return core


async def collect(events: AsyncIterator[CallEvent]) -> list[CallEvent]:
    return [e async for e in events]


async def test_a_call_waiting_for_its_first_token_moves_when_its_instance_is_marked_down() -> None:
    a, b = FaultyInstance("a"), FaultyInstance("b")
    core = core_over(a, b)
    a.stopped = True  # SIGSTOP: the call is sent and nothing comes back
    task = asyncio.ensure_future(collect(core.submit(call())))
    await asyncio.sleep(0.05)
    assert core.waits.waiting("a") == 1
    assert not await core.refresh("a")  # its poll times out: marked down
    events = await asyncio.wait_for(task, 5.0)  # not its 300 s first-token deadline
    assert events[-1].finished and events[-1].error is None
    assert {e.instance_id for e in events} == {"b"}
    assert core.metrics.call_failures.get(instance="a", kind="marked_down") == 1
    assert core.metrics.call_failures.get(instance="a", kind="deadline") == 0
    assert core.metrics.requests.get(model="m", instance="b", outcome="ok") == 1


async def test_a_call_with_tokens_sent_ends_in_an_error_event_when_its_instance_is_marked_down() -> None:
    a = FaultyInstance("a", tokens=6, step_s=0.01)
    core = core_over(a)
    events: list[CallEvent] = []
    stream = core.submit(call())
    async for event in stream:
        events.append(event)
        if len(events) == 2:
            a.stopped = True
            core.mark_down("a", "its poll timed out")
    assert [e.token_ids for e in events[:2]] == [[100], [101]]
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert "marked down" in (events[-1].error or "")
    assert len(events) == 3


async def test_a_stream_that_flows_is_not_cut_by_a_mark_down() -> None:
    a = FaultyInstance("a", tokens=20, step_s=0.02)  # 0.4 s of events, 0.02 s apart
    core = core_over(a, deadlines=Deadlines(first_token_s=300.0, stall_s=60.0, down_grace_s=0.2))
    events: list[CallEvent] = []
    async for event in core.submit(call(max_tokens=20)):
        events.append(event)
        if len(events) == 1:
            core.mark_down("a", "one poll missed")
    assert len(events) == 20 and events[-1].error is None
    assert core.metrics.call_failures.get(instance="a", kind="marked_down") == 0


async def test_a_cooldown_from_failed_calls_does_not_cut_the_calls_waiting_there() -> None:
    a = FaultyInstance("a", tokens=3)
    a.slow_s = 0.3  # the first token comes after 0.3 s, three times the grace
    core = core_over(a, health_rules=HealthRules(failures_to_down=1))
    task = asyncio.ensure_future(collect(core.submit(call())))
    await asyncio.sleep(0.05)
    core.call_failed("a", InstanceUnavailable("another call failed"))  # a cooldown starts
    assert core.healthy == set()
    events = await asyncio.wait_for(task, 5.0)
    assert events[-1].finished and events[-1].error is None


async def test_a_client_that_leaves_before_its_first_token_is_not_counted_as_an_error() -> None:
    a = FaultyInstance("a")
    a.stopped = True
    core = core_over(a)
    events = core.submit(call())
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.05)
    first.cancel()  # what the router's handler does when its client goes away
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()
    assert core.metrics.requests.get(model="m", instance="a", outcome="client_left") == 1
    assert core.metrics.requests.get(model="m", instance="none", outcome="error") == 0


class Refusing(FaultyInstance):
    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        raise CallRejected(400, "max_tokens does not fit")
        yield  # an async generator


async def test_a_call_the_instance_refuses_counts_as_rejected() -> None:
    core = core_over(Refusing("a"))
    try:
        await collect(core.submit(call()))
    except CallRejected:
        pass
    assert core.metrics.requests.get(model="m", instance="a", outcome="rejected") == 1
    assert core.metrics.requests.get(model="m", instance="none", outcome="error") == 0
