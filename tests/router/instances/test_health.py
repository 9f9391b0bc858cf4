"""The background poller marks instances down and up and expires sessions."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from router_fakes import FakeInstance, book_call

from router.core import RouterCore
from router.instances.health import HealthPoller
from router.sessions.table import SessionTable
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
    book_call(core.sessions, "s", [1] * 10, 0.0, 1.0, instance="b")
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


async def test_an_unexpected_error_in_one_round_does_not_stop_the_polls() -> None:
    a = FakeInstance("a", [1])
    core = RouterCore({"a": a}, "load")
    poller = HealthPoller(core, interval_s=0.01)
    failures = {"update": 2, "cleanup": 2}
    update, cleanup = core.update_state, core.cleanup_sessions

    def flaky_update(state: InstanceState) -> None:
        if failures["update"]:
            failures["update"] -= 1
            raise RuntimeError("a bug in applying a state")
        update(state)

    def flaky_cleanup() -> int:
        if failures["cleanup"]:
            failures["cleanup"] -= 1
            raise RuntimeError("a bug in cleaning sessions")
        return cleanup()

    core.update_state = flaky_update  # type: ignore[method-assign]
    core.cleanup_sessions = flaky_cleanup  # type: ignore[method-assign]
    run = asyncio.ensure_future(poller.run())
    for _ in range(500):
        if a.state_polls >= 5 and poller.polls >= 5:
            break
        await asyncio.sleep(0.01)
    assert not run.done() and a.state_polls >= 5 and poller.polls >= 5
    assert failures == {"update": 0, "cleanup": 0} and "a" in core.states
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    await core.close()
