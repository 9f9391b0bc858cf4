"""The background poller marks instances down and up and expires sessions."""

from __future__ import annotations

import asyncio

import pytest
from router_fakes import FakeInstance

from router.core import RouterCore
from router.health import HealthPoller
from router.prefix_chain import ChainSample
from router.sessions import SessionTable
from talaria.protocol import InstanceState


async def test_poll_marks_down_and_up_and_cleans_sessions() -> None:
    now = [0.0]
    a = FakeInstance("a", [1])
    b = FakeInstance("b", [1], state=InstanceState("b", healthy=False))
    core = RouterCore({"a": a, "b": b}, "load", sessions=SessionTable(ttl_s=10.0), clock=lambda: now[0])
    poller = HealthPoller(core, interval_s=1.0)
    assert await poller.poll_once() == {"a": True, "b": False}
    assert core.healthy == {"a"}
    a.unavailable = True
    b.state_obj = InstanceState("b")
    await poller.poll_once()
    assert core.healthy == {"b"}
    core.sessions.start_call("s", "m", 0.0, 10)
    core.sessions.end_call("s", "b", 1.0, ChainSample.of([]), 10)
    now[0] = 20.0
    await poller.poll_once()
    assert "s" not in core.sessions
    assert core.metrics.sct.count(model="m") == 1


async def test_poller_context_runs_in_background() -> None:
    a = FakeInstance("a", [1])
    poller = HealthPoller(RouterCore({"a": a}, "load"), interval_s=0.01)
    ctx = poller.context()
    await anext(ctx)
    for _ in range(200):
        if poller.polls >= 3:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(StopAsyncIteration):
        await anext(ctx)
    polls = poller.polls
    assert polls >= 3
    await asyncio.sleep(0.05)
    assert poller.polls == polls  # stopped
    with pytest.raises(ValueError, match="interval"):
        HealthPoller(poller.core, 0)
